"""The decode prep compiled on a GPU (issue 26): one launch of routing, layout, scatter and
activation quantization against the float64 / float32 reference and, bit for bit, against the
separate kernels it replaces (tests/test_decode_prep.py's checks, at DeepSeek-V3's hidden size);
the layer with and without it (Triton backends, CUTLASS FP8 where it runs), eager and replayed
from a CUDA graph with new inputs. Its opcheck on CUDA is tests/gpu/test_compile_gpu.py's (every
case of tests/test_compile.py)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HIDDEN = 7168  # DeepSeek-V3: 56 groups, 56 programs of 128 columns for one token


@pytest.mark.parametrize("payload", ["float", "int8_token", "int8_group", "fp8_group"])
@pytest.mark.parametrize("route", ["E256_grouped", "E128_flat", "E64_grouped_tied"])
@pytest.mark.parametrize("t", [1, 7, 16])
def test_prep_compiled_matches_the_reference(t, route, payload):
    from test_decode_prep import check_against_reference

    check_against_reference(t, route, payload, "cuda", HIDDEN)


@pytest.mark.parametrize("payload", ["float", "int8_token", "int8_group", "fp8_group"])
@pytest.mark.parametrize("t, route", [(1, "E256_grouped"), (9, "E128_flat"), (16, "E256_grouped")])
def test_prep_compiled_writes_what_the_separate_kernels_write(t, route, payload):
    from test_decode_prep import check_against_separate_kernels

    check_against_separate_kernels(t, route, payload, "cuda", HIDDEN)


@pytest.mark.parametrize("payload", ["float", "int8_token", "int8_group", "fp8_group"])
def test_prep_compiled_routes_as_the_routing_kernel_over_a_large_batch(payload):
    from test_decode_prep import check_rank_against_rounds

    check_rank_against_rounds(payload, "cuda", HIDDEN)


CASES = [("bf16", "triton"), ("int8_channel", "triton"), ("int8_block", "triton"), ("fp8_block", "cutlass")]


def _layers(quant, backend):
    """The same layer (E=16, top-4, grouped sigmoid routing with a bias) with the prep (the
    default on CUDA) and without it."""
    from epmoe import DeepEPMoELayer
    from helpers import make_weights

    layers = []
    for prep in (None, False):
        try:
            layer = DeepEPMoELayer(16, 4, 512, 256, quant=quant, backend=backend, dispatch="local", device="cuda",
                                   scoring_func="sigmoid", num_expert_group=4, topk_group=2, routed_scaling_factor=2.5,
                                   use_correction_bias=True, decode_prep=prep, validate=False)  # fmt: skip
        except (ValueError, RuntimeError) as exc:
            if backend == "cutlass":
                pytest.skip(f"cutlass cannot run {quant} here: {exc}")
            raise
        stored, _ = make_weights(16, 512, 256, quant, seed=1)
        layer.load_experts(*(None if w is None else w.cuda() for w in stored))
        with torch.no_grad():
            layer.e_score_correction_bias.copy_(torch.randn(16, generator=torch.Generator().manual_seed(2)) * 0.1)
        layers.append(layer)
    return layers


def _inputs(t, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, 512, device="cuda", generator=g).bfloat16()
    return x, torch.randn(t, 16, device="cuda", generator=g) * 3


@pytest.mark.parametrize("quant,backend", CASES)
@pytest.mark.parametrize("t", [1, 8, 32])  # 32 x top-4 = 128 slots: the prep's limit
def test_layer_with_the_prep_matches_the_layer_without(quant, backend, t, monkeypatch):
    from epmoe import ops

    fused, separate = _layers(quant, backend)
    calls = []
    real = ops._decode_prep.fn
    monkeypatch.setattr(ops._decode_prep, "fn", lambda *a: calls.append(1) or real(*a))
    x, logits = _inputs(t, t)
    with torch.no_grad():
        got, want = fused(x, logits), separate(x, logits)
    assert calls == [1]
    assert torch.isfinite(want).all() and want.float().abs().max() > 0
    # The same batch reaches the experts pass (rows, scales, layout bit for bit); the routing
    # weights may differ in their last bit (fp32 sums reduced in another order), so the bf16
    # outputs may differ by a rounding.
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-3 * float(want.float().abs().max()))


def _graphed(layer, seeds):
    """The layer's outputs for a batch of 2 tokens captured once in a CUDA graph and replayed with
    the inputs of each seed, with the eager outputs of the same inputs."""
    x, logits = _inputs(2, 10)
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            layer(x, logits)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x, logits)
        replayed, eager = [], []
        for seed in seeds:
            new_x, new_logits = _inputs(2, seed)
            x.copy_(new_x)
            logits.copy_(new_logits)
            graph.replay()
            replayed.append(out.clone())
            eager.append(layer(new_x, new_logits))
    return replayed, eager


@pytest.mark.parametrize("quant,backend", CASES)
def test_layer_with_the_prep_replays_from_a_cuda_graph_with_new_inputs(quant, backend):
    fused, _ = _layers(quant, backend)
    replayed, eager = _graphed(fused, (11, 12))
    for got, want in zip(replayed, eager):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("quant,backend", CASES)
def test_dependent_launches_compute_what_plain_launches_do(quant, backend, monkeypatch):
    """Programmatic dependent launch (on by default where supported: the prep, the Triton GEMMs,
    the activation and the gather) changes when each kernel starts, never what it reads: the
    graphed and the eager step equal the same steps with ``EPMOE_PDL=0``, bit for bit."""
    from epmoe.kernels.pdl import dependent, pdl_enabled

    if not pdl_enabled(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs compute capability 9.0+, Triton's grid dependency control "
                    "and EPMOE_PDL not 0")  # fmt: skip
    assert dependent(torch.device("cuda")) == {"PDL": True, "launch_pdl": True}
    fused, _ = _layers(quant, backend)
    seeds = (21, 22, 23)
    dependent = _graphed(fused, seeds)
    monkeypatch.setenv("EPMOE_PDL", "0")
    plain = _graphed(fused, seeds)
    for got, want in zip(dependent[0] + dependent[1], plain[0] + plain[1]):
        assert torch.isfinite(want).all() and want.float().abs().max() > 0
        assert torch.equal(got, want)
