"""torch.compile and CUDA graphs on one GPU: the custom ops opchecked on CUDA (the CUTLASS ones
where the extension runs), a decoder block (attention stand-in, MoE with a shared expert) compiled
with ``fullgraph=True`` by Inductor against the same block on the reference (torch) backend,
``mode="reduce-overhead"`` and a manual ``torch.cuda.CUDAGraph`` of a decode step against eager
with new inputs, and a tiny transformers model decoding with a StaticCache, compiled with CUDA
graphs, against its eager decode.

CUTLASS cases need ``SGLANG_CUTLASS_MOE=1`` and the CUTLASS headers (skipped otherwise, with the
reason); DeepGEMM ones need ``deep_gemm`` (skipped without it).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SIZES = dict(hidden=512, inter=256, experts=16, top_k=4, shared_inter=256)
CASES = [("bf16", "triton"), ("int8_channel", "triton"), ("int8_block", "triton"), ("fp8_block", "cutlass"),
         ("int8_channel", "cutlass"), ("int8_block", "cutlass")]  # fmt: skip
REDUCE_OVERHEAD = {("int8_channel", "triton"), ("fp8_block", "cutlass")}
# Relative error (norm) of a block on a GPU backend against the same block on the torch backend:
# the layer's own bounds, plus bf16 rounding of the dense parts that Inductor fuses differently.
BOUNDS = {"bf16": 2e-2, "int8_channel": 5e-2, "int8_block": 5e-2, "fp8_block": 8e-2}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _block(quant, backend, seed=0):
    from benchmarks.compile_decode import DecoderBlock, fill_random

    kw = {"accumulator": "int32"} if (quant, backend) == ("int8_channel", "cutlass") else {}
    try:
        block = DecoderBlock(**SIZES, quant=quant, backend=backend, device="cuda", **kw).eval()
    except (ValueError, RuntimeError) as exc:
        if backend in ("cutlass", "deepgemm"):
            pytest.skip(f"{backend} cannot run {quant} here: {exc}")
        raise
    fill_random(block, seed)
    # Well separated router logits: a bf16 rounding that Inductor fuses differently from eager must
    # not flip a token's top-k choice (that would be a different computation, not an error).
    block.gate.weight.data.mul_(30)
    return block


def _reference(block, quant):
    """The same weights on the torch backend (dequantized weights, emulated activation quantization)."""
    from benchmarks.compile_decode import DecoderBlock

    ref = DecoderBlock(**SIZES, quant=quant, backend="torch", device="cuda").eval()
    ref.load_state_dict(block.state_dict())
    return ref


def _x(t, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(t, SIZES["hidden"], device="cuda", generator=g).bfloat16()


# ---------------------------------------------------------------------------------- opcheck
def test_opcheck_triton_ops_on_cuda():
    from test_compile import _op_cases

    for name, (args, kwargs) in _op_cases().items():
        moved = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)
        torch.library.opcheck(getattr(torch.ops.epmoe, name.split("::")[1].split("[")[0]).default, moved, kwargs)


def _cutlass_or_skip(scheme):
    from epmoe.experts.cutlass_backend import CutlassBackend
    from epmoe.quant import get_scheme

    ok, reason = CutlassBackend.supports(get_scheme(scheme), "contiguous", torch.device("cuda"), 256, 256,
                                         accumulator="int32" if scheme == "int8_channel" else "fp32")  # fmt: skip
    if not ok:
        pytest.skip(f"cutlass {scheme}: {reason}")


def cutlass_operands(kind, m=256, k=256, n=256, e=2):
    """Random ``(a, a_scale, b, b_scale)`` of a CUTLASS grouped GEMM of ``kind`` on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(0)
    dev = dict(device="cuda")
    if kind == "fp8_block":
        a = (torch.randn(m, k, generator=g, **dev) * 8).to(torch.float8_e4m3fn)
        b = (torch.randn(e, n, k, generator=g, **dev) * 8).to(torch.float8_e4m3fn)
        return a, torch.rand(m, k // 128, generator=g, **dev), b, torch.rand(e, n // 128, k // 128, generator=g, **dev)
    a = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8, **dev)
    b = torch.randint(-127, 128, (e, n, k), generator=g, dtype=torch.int8, **dev)
    cols = 1 if kind == "int8_channel" else k // 128
    a_scale = torch.rand(m, cols, generator=g, **dev) * 1e-3
    b_scale = torch.rand(*((e, n, 1) if kind == "int8_channel" else (e, n // 128, k // 128)), generator=g, **dev) * 1e-3
    return a, a_scale, b, b_scale


@pytest.mark.parametrize("kind", ["fp8_block", "int8_channel", "int8_block"])
def test_opcheck_cutlass(kind):
    _cutlass_or_skip(kind)
    a, a_scale, b, b_scale = cutlass_operands(kind)
    offsets = torch.tensor([0, 128, 256], dtype=torch.int32, device="cuda")  # every row in a segment: all written
    from epmoe import ops

    # The op object itself: on the H200 (torch 2.11) a lookup through torch.ops.epmoe once found no
    # cutlass_grouped_gemm after the Triton ops' opchecks (not reproduced on CPU).
    args = (kind, a, a_scale, b, b_scale, offsets, "n256_quarters_run2")
    if kind != "fp8_block":
        torch.library.opcheck(ops._cutlass_grouped_gemm.op, args)
        # The masked layout: the same rows as two experts' slabs of 128, 100 and 7 of them valid.
        (m, k), e = a.shape, b.shape[0]
        masked = (kind, a.view(e, m // e, k), a_scale.view(e, m // e, -1), b, b_scale,
                  torch.tensor([100, 7], dtype=torch.int32, device="cuda"), "n256_quarters_i2f_s4")  # fmt: skip
        torch.library.opcheck(ops._cutlass_masked_gemm.op, masked)
        if kind == "int8_block":  # GEMM1 with the activation fused (b's rows read as gate/up pairs)
            torch.library.opcheck(ops._cutlass_silu_gemm.op, (a, a_scale, b, b_scale, offsets, "n256_quarters_run4"))
            torch.library.opcheck(ops._cutlass_silu_masked_gemm.op, (*masked[1:6], "n256_quarters_run2"))
        return
    # torch's schema check compares inputs before and after with arithmetic that has no CUDA
    # float8 kernel ("mul_cuda" not implemented for 'Float8_e4m3fn'), so the FP8 case runs the
    # other checks, and the no-mutation part of the schema is checked here on the bytes.
    utils = tuple(u for u in torch.library.opcheck.__kwdefaults__["test_utils"] if u != "test_schema")
    torch.library.opcheck(ops._cutlass_grouped_gemm.op, args, test_utils=utils)
    before = [t.view(torch.uint8).clone() if t.dtype == torch.float8_e4m3fn else t.clone() for t in args[1:-1]]
    ops._cutlass_grouped_gemm.op(*args)
    for old, new in zip(before, args[1:-1]):
        assert torch.equal(old, new.view(torch.uint8) if new.dtype == torch.float8_e4m3fn else new)


def test_opcheck_deepgemm():
    from epmoe.experts.deepgemm_backend import DeepGemmBackend

    ok, reason = DeepGemmBackend.available(torch.device("cuda"))
    if not ok:
        pytest.skip(f"deepgemm: {reason}")
    from epmoe.quant.reference import quantize_rows

    g = torch.Generator(device="cuda").manual_seed(0)
    m, k, n, e = 256, 256, 256, 2
    a, a_scale = quantize_rows(torch.randn(m, k, generator=g, device="cuda"), torch.float8_e4m3fn, 448.0, 128)
    b = (torch.randn(e, n, k, generator=g, device="cuda") * 8).to(torch.float8_e4m3fn)
    b_scale = torch.rand(e, n // 128, k // 128, generator=g, device="cuda")
    m_indices = torch.arange(m, device="cuda", dtype=torch.int32) // 128
    torch.library.opcheck(torch.ops.epmoe.deepgemm_contiguous.default, (a, a_scale, b, b_scale, m_indices))
    masked_m = torch.full((e,), 128, dtype=torch.int32, device="cuda")
    args = (a.view(e, 128, k), a_scale.view(e, 128, -1), b, b_scale, masked_m, 128)
    torch.library.opcheck(torch.ops.epmoe.deepgemm_masked.default, args)


# ----------------------------------------------------------------------- compiled decoder block
@pytest.mark.parametrize("quant,backend", CASES)
@torch.no_grad()
def test_compiled_block_fullgraph_matches_eager_and_reference(quant, backend):
    block = _block(quant, backend)
    assert block.experts.backend.name == backend
    ref_block = _reference(block, quant)
    compiled = torch.compile(block, fullgraph=True, dynamic=False)  # one compile per case: GPU time is scarce
    x = _x(4, 14)
    eager, ref, got = block(x), ref_block(x), compiled(x)
    assert torch.isfinite(got).all()
    assert rel(got, eager) < 2e-2, (quant, backend, rel(got, eager))
    assert rel(got, ref) < BOUNDS[quant], (quant, backend, rel(got, ref))


# CUTLASS INT8 picks its GEMMs by the host's row counts in eager mode and runs device-sized in a
# graph (docs/compile.md): eager and a manual capture take different kernels, compared above.
@pytest.mark.parametrize("quant,backend", CASES[:4])
@torch.no_grad()
def test_reduce_overhead_and_manual_graph_replay_new_inputs(quant, backend):
    """Both CUDA-graph routes replay a decode step with new tokens (new routing) into the same
    buffers and give what eager gives for them."""
    from benchmarks.compile_decode import captured

    block = _block(quant, backend)
    t = 8
    if (quant, backend) in REDUCE_OVERHEAD:  # a compile each: two cases cover both backends
        from torch._dynamo.utils import counters

        skips = counters["inductor"]["cudagraph_skips"]
        fn = torch.compile(block, fullgraph=True, dynamic=False, mode="reduce-overhead")
        for i in range(3):  # warm-up, record, replay
            fn(_x(t, 100 + i))
        x = _x(t, 200)
        assert rel(fn(x).clone(), block(x)) < 2e-2
        assert counters["inductor"]["cudagraph_skips"] == skips, "Inductor did not use a CUDA graph (see its log)"

    static = _x(t, 300)
    graph, out = captured(lambda: block(static), torch.device("cuda"))
    for seed in (301, 302):
        new = _x(t, seed)
        static.copy_(new)
        graph.replay()
        # The same kernels on the same data as eager: equal up to any non-deterministic summation.
        assert rel(out, block(new)) < 1e-3, (quant, backend, seed, rel(out, block(new)))


# ---------------------------------------------------------------------- a transformers model
@torch.no_grad()
def test_hf_model_decode_compiled_with_cuda_graphs_matches_eager():
    """A tiny Qwen3-MoE model (fp32: eager and Inductor then agree to rounding, no top-k flips)
    with its experts in the layer: prefill eagerly into a StaticCache, then decode steps through
    ``torch.compile(model.forward, fullgraph=True, mode="reduce-overhead")``, fed the tokens the
    eager decode chose, against the eager decode's logits."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, StaticCache

    from epmoe.integrations import transformers as et

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(et.tiny_config("qwen3_moe"), dtype=torch.float32).eval()
    et.enable(model, "bf16")
    ids = torch.randint(0, 96, (2, 5), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    length, steps = ids.shape[1], 6

    def decode(forward, tokens=None):
        cache = StaticCache(config=model.config, max_cache_len=32)
        out = model(ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(length, device="cuda"))
        tok = out.logits[:, -1:].argmax(-1)
        chosen, logits = [tok], []
        for i in range(steps):
            if tokens is not None:
                tok = tokens[:, i : i + 1]
            pos = torch.tensor([length + i], device="cuda")
            lg = forward(tok, past_key_values=cache, use_cache=True, cache_position=pos).logits[:, -1].float().clone()
            logits.append(lg)
            tok = lg.argmax(-1, keepdim=True)
            chosen.append(tok)
        return torch.cat(chosen, 1), torch.stack(logits)

    ref_tokens, ref_logits = decode(model.forward)
    from torch._dynamo.utils import counters

    skips = counters["inductor"]["cudagraph_skips"]
    step = torch.compile(model.forward, fullgraph=True, dynamic=False, mode="reduce-overhead")
    _, logits = decode(step, ref_tokens)
    assert counters["inductor"]["cudagraph_skips"] == skips, "Inductor did not use a CUDA graph (see its log)"
    for i in range(steps):
        assert rel(logits[i], ref_logits[i]) < 5e-3, (i, rel(logits[i], ref_logits[i]))
