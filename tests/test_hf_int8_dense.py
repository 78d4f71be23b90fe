"""``from_pretrained(..., int8_dense=True)``: the INT8 linears of an ``epmoe convert`` output run
as ``Int8Linear`` modules with the stored weights and scales (a small random DeepSeek-V3 model,
CPU, torch backends)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402
from transformers import DeepseekV3ForCausalLM  # noqa: E402

from benchmarks import tiny_lm  # noqa: E402
from epmoe.checkpoint.convert import convert_checkpoint  # noqa: E402
from epmoe.integrations import transformers as et  # noqa: E402
from epmoe.linear import Int8Linear  # noqa: E402

ATTENTION = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("int8dense")
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(tiny_lm.model_config("tiny")).to(torch.bfloat16)
    model.save_pretrained(root / "bf16")
    tiny_lm.write_fp8_copy(root / "bf16", root / "fp8")
    return root / "fp8"


def _stored(path, name):
    files = sorted(path.glob("*.safetensors"))
    for f in files:
        with safe_open(f, "pt") as s:
            if name in s.keys():
                return s.get_tensor(name)
    raise KeyError(name)


def _ids():
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("target,accumulator", [("int8_channel", "int32"), ("int8_block", None)])
@torch.no_grad()
def test_dense_linears_run_as_int8linear_with_the_stored_weights(fp8_dir, tmp_path, target, accumulator):
    dst = tmp_path / target
    convert_checkpoint(fp8_dir, dst, target, dense=True, progress=False)
    kw = {"accumulator": accumulator} if accumulator else {}
    model = et.from_pretrained(dst, backend="torch", device="cpu", int8_dense=True, dense_backend="torch", **kw)
    int8 = {n: m for n, m in model.named_modules() if isinstance(m, Int8Linear)}
    # Every attention projection, the dense MLP of layer 0 and each shared expert; not the head.
    want = {f"model.layers.{i}.self_attn.{p}" for i in range(3) for p in ATTENTION}
    want |= {f"model.layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")}
    want |= {f"model.layers.{i}.mlp.shared_experts.{p}" for i in (1, 2) for p in ("gate_proj", "up_proj", "down_proj")}
    assert set(int8) == want
    suffix = "weight_scale" if target == "int8_channel" else "weight_scale_inv"
    for name, m in int8.items():
        assert m.scheme == target and m.backend_name == "torch"
        assert m.accumulator == (accumulator or "fp32")
        assert torch.equal(m.weight, _stored(dst, name + ".weight"))
        assert torch.equal(m.weight_scale, _stored(dst, f"{name}.{suffix}"))
    assert isinstance(model.lm_head, torch.nn.Linear) and model.lm_head.weight.dtype == torch.bfloat16

    # The same model built by hand: loaded dequantized, then each linear replaced by an Int8Linear
    # given the stored tensors. Bitwise the same logits.
    ref = et.from_pretrained(dst, backend="torch", device="cpu", **kw)
    for name in want:
        parent, _, attr = name.rpartition(".")
        lin = getattr(ref.get_submodule(parent), attr)
        mod = Int8Linear(lin.in_features, lin.out_features, False, target, accumulator if target == "int8_channel" else None,
                         "torch")  # fmt: skip
        mod.load_weights({"weight": _stored(dst, name + ".weight"), suffix: _stored(dst, f"{name}.{suffix}")})
        setattr(ref.get_submodule(parent), attr, mod)
    ids = _ids()
    assert torch.equal(model(ids).logits, ref(ids).logits)
    # and close to the model with its linears dequantized (INT8 activations are the only change):
    # per position, since a position whose routing flips on a near-tie (this random model has
    # many) moves its logits by 15-25 % and would dominate one norm over all positions.
    deq = et.from_pretrained(dst, backend="torch", device="cpu", **kw)(ids).logits.float()
    got = model(ids).logits.float()
    per_position = ((got - deq).norm(dim=-1) / deq.norm(dim=-1)).flatten()
    assert float(per_position.median()) < 3e-2
    assert float((per_position > 5e-2).float().mean()) <= 0.25


@torch.no_grad()
def test_without_dense_only_the_shared_experts_are_int8(fp8_dir, tmp_path):
    dst = tmp_path / "ch"
    convert_checkpoint(fp8_dir, dst, "int8_channel", progress=False)
    model = et.from_pretrained(dst, backend="torch", device="cpu", int8_dense=True, dense_backend="torch")
    int8 = {n: m for n, m in model.named_modules() if isinstance(m, Int8Linear)}
    assert {m.accumulator for m in int8.values()} == {"fp32"}  # the layer's default accumulator
    names = set(int8)
    assert names == {f"model.layers.{i}.mlp.shared_experts.{p}" for i in (1, 2) for p in ("gate_proj", "up_proj", "down_proj")}
    assert torch.isfinite(model(_ids()).logits).all()


def test_int8_dense_needs_an_int8_checkpoint(fp8_dir):
    with pytest.raises(ValueError, match="int8_dense=True needs INT8 linear weights.*epmoe convert --dense"):
        et.from_pretrained(fp8_dir, backend="torch", device="cpu", int8_dense=True)


@pytest.mark.parametrize("int8_dense", [True, False])
def test_bad_dense_backend_is_refused_before_anything_is_read(fp8_dir, int8_dense):
    # Refused by its own name and up front, also where no INT8 linear would be built.
    with pytest.raises(ValueError, match=r"^dense_backend='bogus'; allowed: \['auto', 'cutlass', 'triton', 'torch'\]$"):
        et.from_pretrained(fp8_dir, backend="torch", device="cpu", int8_dense=int8_dense, dense_backend="bogus")
