"""A layer built on the meta device (how large models are built before loading) materializes like
any nn.Module and chooses its backend and dispatcher for the device it lands on (issue 22.9)."""

import logging
import re

import pytest
import torch

import epmoe

SIZES = dict(num_experts=4, top_k=2, hidden_size=16, intermediate_size=8)


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for e in range(SIZES["num_experts"]):
        p = f"experts.{e}."
        out[p + "gate_proj.weight"] = torch.randn(8, 16, generator=g).bfloat16()
        out[p + "up_proj.weight"] = torch.randn(8, 16, generator=g).bfloat16()
        out[p + "down_proj.weight"] = torch.randn(16, 8, generator=g).bfloat16()
    return out


@pytest.mark.parametrize("how", ["argument", "context"])
def test_build_on_meta_then_materialize_equals_a_cpu_built_layer(how, caplog):
    if how == "argument":
        layer = epmoe.DeepEPMoELayer(**SIZES, device="meta")
    else:
        with torch.device("meta"):
            layer = epmoe.DeepEPMoELayer(**SIZES)
    assert layer.w13_weight.device.type == "meta" and layer.backend is None
    with caplog.at_level(logging.INFO, logger="epmoe"):
        layer.to_empty(device="cpu")
    assert "experts backend 'torch' chosen for quant='bf16' on cpu" in caplog.text
    layer.load_weights(_weights().items())
    direct = epmoe.DeepEPMoELayer(**SIZES, device="cpu")
    direct.load_weights(_weights().items())
    assert (layer.backend.name, layer.dispatcher.name) == (direct.backend.name, direct.dispatcher.name)
    x = torch.randn(5, 16).bfloat16()
    logits = torch.randn(5, 4)
    out = layer(x, logits)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, direct(x, logits), rtol=0, atol=0)


def test_forward_on_meta_raises_naming_the_fix():
    layer = epmoe.DeepEPMoELayer(**SIZES, device="meta")
    x = torch.zeros(2, 16, dtype=torch.bfloat16, device="meta")
    with pytest.raises(RuntimeError, match=re.escape("on the meta device: materialize it first")):
        layer(x, torch.zeros(2, 4, device="meta"))


def test_forced_backend_that_cannot_run_on_the_landing_device_raises_then():
    layer = epmoe.DeepEPMoELayer(**SIZES, device="meta", backend="deepgemm")  # builds: nothing chosen yet
    with pytest.raises(epmoe.BackendUnavailableError, match=re.escape("backend='deepgemm' cannot run quant='bf16' on cpu")):
        layer.to_empty(device="cpu")
