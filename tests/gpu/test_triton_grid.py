"""GPU acceptance grid of the Triton INT8 MoE (H200 test machine; skipped without CUDA).

A full MoE built from the kernels (quantize -> GEMM1 -> silu*up + requantize -> GEMM2 -> weighted
top-k sum) against float64 math that quantizes on its own, over
M {1, 33, 64, 222} x N {128, 1024} x K {256, 4096} x E {8, 24} x top-k {2, 6}, bf16 and fp16
inputs: relative mean absolute error < 0.05 channel-wise, < 0.02 block-wise. Here N is the
intermediate size (w13 [E, 2N, K], w2 [E, K, N]) and K the hidden size, as in SGLang's INT8 tests.
Also exact-rounding checks of the quantizers against epmoe.quant.reference, which only hold
compiled (the interpreter's fp8 and bf16 conversions differ), and the TMA grouped GEMM (plain,
persistent, flattened) against the pointer kernel: bit for bit with the int32
accumulator, both layouts, uneven routing with empty experts, a DeepSeek-V3 GEMM1 shape, CUDA-graph
replay with new routing, and the fallback for unaligned operands.
"""

from __future__ import annotations

import itertools

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from epmoe.kernels import activation, grouped_gemm, permute, quantize  # noqa: E402
from epmoe.kernels.configs import GemmConfig  # noqa: E402
from epmoe.layouts import to_contiguous, to_masked  # noqa: E402
from epmoe.quant import reference  # noqa: E402

DEV = torch.device("cuda")
BOUND = {"int8_channel": 0.05, "int8_block": 0.02}


# ------------------------------------------------------------------ float64 reference


def _rne(y):
    r = torch.floor(y)
    frac = y - r
    r = torch.where(frac > 0.5, r + 1, r)
    return torch.where((frac == 0.5) & (torch.remainder(r, 2) != 0), r + 1, r)


def _fq64(x, group):
    """float64 fake-quantization of activations (per row or per 1 x group), the project's rule."""
    k = x.shape[-1]
    g = k if group is None else group
    xg = x.reshape(*x.shape[:-1], k // g, g)
    scale = (xg.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 127.0).float().double()
    q = _rne((xg / scale).float().double()).clamp(-127, 127)
    return (q * scale).reshape(x.shape)


def _quant_weight64(w, scheme):
    """int8 codes and fp32 scales of ``[E, N, K]`` weights, computed in float64."""
    e, n, k = w.shape
    w64 = w.double()
    if scheme == "int8_channel":
        scale = (w64.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 127).float()
        q = _rne(w64 / scale.double()).clamp(-127, 127)
        return q.to(torch.int8), scale
    nb, kb = -(-n // 128), k // 128
    wp = torch.zeros(e, nb * 128, k, dtype=torch.float64, device=w.device)
    wp[:, :n] = w64
    blocks = wp.reshape(e, nb, 128, kb, 128)
    scale = (blocks.abs().amax(dim=(2, 4)).clamp(min=1e-10) / 127).float()
    full = scale.double()[:, :, None, :, None]
    q = _rne(blocks / full).clamp(-127, 127).reshape(e, nb * 128, k)[:, :n]
    return q.to(torch.int8).contiguous(), scale


def _dequant64(q, scale):
    e, n, k = q.shape
    if tuple(scale.shape) == (e, n, 1):
        return q.double() * scale.double()
    full = scale.double().repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :n, :k]
    return q.double() * full


def _moe64(x, ids, w, w13q, s13, w2q, s2, group):
    """The quantized MoE in float64 math, token by token slot."""
    w13 = _dequant64(w13q, s13)
    w2 = _dequant64(w2q, s2)
    xq = _fq64(x.double(), group)
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64, device=x.device)
    inter = w2.shape[2]
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        gu = xq[tok] @ w13[e].t()
        h = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        y = _fq64(h, group) @ w2[e].t()
        out.index_add_(0, tok, y * w[tok, slot].double().unsqueeze(1))
    return out


# ------------------------------------------------------------------ the MoE from kernels


def _moe_kernels(x, ids, w, w13q, s13, w2q, s2, scheme, accumulator):
    e = w13q.shape[0]
    batch = to_contiguous(x, None, ids, e, alignment=1)
    if scheme == "int8_channel":
        xq, xs = quantize.per_token_quant_int8(batch.x)
    else:
        xq, xs = quantize.per_group_quant(batch.x, 128, torch.int8)
    gate_up = grouped_gemm.grouped_gemm_contiguous(
        xq, w13q, batch.expert_offsets, mode=scheme, a_scale=xs, b_scale=s13,
        accumulator=accumulator, out_dtype=x.dtype,
    )
    granularity = "token" if scheme == "int8_channel" else "group"
    hq, hs = activation.silu_and_mul_quant(gate_up, granularity, 128)
    y = grouped_gemm.grouped_gemm_contiguous(
        hq, w2q, batch.expert_offsets, mode=scheme, a_scale=hs, b_scale=s2,
        accumulator=accumulator, out_dtype=x.dtype,
    )
    return permute.gather_weighted(y, batch.slot_pos, w)


def _problem(m, n, k, e, topk, dtype, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, k, device=DEV, generator=g).to(dtype)
    w13 = torch.randn(e, 2 * n, k, device=DEV, generator=g) / k**0.5
    w2 = torch.randn(e, k, n, device=DEV, generator=g) / n**0.5
    scores = torch.randn(m, e, device=DEV, generator=g).softmax(-1)
    w, ids = scores.topk(topk, dim=-1)
    return x, ids, w, w13, w2


GRID = list(itertools.product([1, 33, 64, 222], [128, 1024], [256, 4096], [8, 24], [2, 6]))
CASES = [("int8_channel", "fp32"), ("int8_block", "fp32"), ("int8_channel", "int32")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("scheme,accumulator", CASES, ids=["channel", "block", "channel_int32"])
def test_int8_moe_grid(scheme, accumulator, dtype):
    if accumulator == "int32" and dtype == torch.float16:
        pytest.skip("the int32 accumulator is checked with bf16 inputs only (keeps the run short)")
    failures, worst = [], 0.0
    weights = {}
    for i, (m, n, k, e, topk) in enumerate(GRID):
        x, ids, w, w13, w2 = _problem(m, n, k, e, topk, dtype, seed=i)
        key = (n, k, e)
        if key not in weights:
            weights[key] = (*_quant_weight64(w13, scheme), *_quant_weight64(w2, scheme))
        w13q, s13, w2q, s2 = weights[key]
        out = _moe_kernels(x, ids, w, w13q, s13, w2q, s2, scheme, accumulator)
        group = None if scheme == "int8_channel" else 128
        ref = _moe64(x, ids, w, w13q, s13, w2q, s2, group)
        err = float((out.double() - ref).abs().mean() / ref.abs().mean())
        worst = max(worst, err)
        if not err < BOUND[scheme]:
            failures.append(((m, n, k, e, topk), err))
    print(f"{scheme}/{accumulator}/{dtype}: worst rel. mean abs error {worst:.2e} over {len(GRID)} points")
    assert not failures, f"rel. mean abs error over {BOUND[scheme]}: {failures}"


@pytest.mark.parametrize("scheme", ["int8_channel", "int8_block"])
def test_int8_moe_masked_layout(scheme):
    """The masked layout gives the same numbers as the contiguous one, uneven routing included."""
    x, ids, w, w13, w2 = _problem(64, 1024, 4096, 8, 6, torch.bfloat16, seed=99)
    ids[:, 0] = 3  # one hot expert; others stay random, some may be empty
    w13q, s13 = _quant_weight64(w13, scheme)
    w2q, s2 = _quant_weight64(w2, scheme)
    batch, slot_pos = to_masked(x, None, ids, 8, capacity=96)
    if scheme == "int8_channel":
        xq, xs = quantize.per_token_quant_int8(batch.x, masked_m=batch.masked_m)
    else:
        xq, xs = quantize.per_group_quant(batch.x, 128, torch.int8, masked_m=batch.masked_m)
    gu = grouped_gemm.grouped_gemm_masked(
        xq, w13q, batch.masked_m, mode=scheme, a_scale=xs, b_scale=s13,
        out_dtype=torch.bfloat16, expected_m=batch.expected_m,
    )
    gran = "token" if scheme == "int8_channel" else "group"
    hq, hs = activation.silu_and_mul_quant(gu, gran, 128, masked_m=batch.masked_m)
    y = grouped_gemm.grouped_gemm_masked(
        hq, w2q, batch.masked_m, mode=scheme, a_scale=hs, b_scale=s2,
        out_dtype=torch.bfloat16, expected_m=batch.expected_m,
    )
    out = permute.gather_weighted(y.reshape(-1, y.shape[-1]), slot_pos, w)
    ref = _moe64(x, ids, w, w13q, s13, w2q, s2, None if scheme == "int8_channel" else 128)
    err = float((out.double() - ref).abs().mean() / ref.abs().mean())
    assert err < BOUND[scheme], err


# ------------------------------------------------------------------ exact rounding (compiled only)


def _tricky_rows(dtype):
    g = torch.Generator(device=DEV).manual_seed(7)
    x = torch.randn(64, 1024, device=DEV, generator=g) * torch.logspace(-4, 3, 64, device=DEV)[:, None]
    x[5] = 0.0
    # amax 127 -> scale exactly 1: half-integers are exact ties.
    x[9] = torch.arange(1024, device=DEV) % 256 / 2 - 64
    x[9, 0] = 127.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantizers_bit_exact(dtype):
    x = _tricky_rows(dtype)
    q, s = quantize.per_token_quant_int8(x)
    rq, rs = reference.quantize_rows(x, torch.int8, 127.0)
    assert torch.equal(q, rq) and torch.equal(s, rs)
    for qdtype, qmax in ((torch.int8, 127.0), (torch.float8_e4m3fn, 448.0)):
        q, s = quantize.per_group_quant(x, 128, qdtype)
        rq, rs = reference.quantize_rows(x, qdtype, qmax, 128)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), qdtype
        assert torch.equal(s, rs), qdtype


def test_activation_quant_bit_exact():
    g = torch.Generator(device=DEV).manual_seed(8)
    gu = (torch.randn(77, 2 * 2048, device=DEV, generator=g) * 3).to(torch.bfloat16)
    h = torch.nn.functional.silu(gu[:, :2048].float()) * gu[:, 2048:].float()
    for gran, group in (("token", None), ("group", 128)):
        q, s = activation.silu_and_mul_quant(gu, gran, 128)
        rq, rs = reference.quantize_rows(h, torch.int8, 127.0, group)
        # exp() may differ from torch's by an ulp: codes agree except at rounding boundaries.
        assert (q.int() - rq.int()).abs().max() <= 1
        assert (q != rq).float().mean() < 1e-3
        assert torch.allclose(s, rs, rtol=1e-6, atol=0)


# ------------------------------------------------------------------ TMA grouped GEMM vs the pointer kernel

TMA_VARIANTS = {
    "plain": dict(tma=True, num_warps=8, num_stages=3),
    "persistent": dict(tma=True, persistent=True, num_warps=8, num_stages=3),
    "persistent_w4": dict(tma=True, persistent=True, num_warps=4, num_stages=3),
    "persistent_flatten": dict(tma=True, persistent=True, flatten=True, num_warps=8, num_stages=3),
}
MODE_ACC = [("int8_channel", "int32"), ("int8_channel", "fp32"), ("int8_block", "fp32"), ("bf16", "fp32")]


def _tma_cfg(mode, variant):
    # Tiles that fit registers and shared memory per mode (int8_block and the fp32 accumulator
    # hold two [BM, BN] fp32/int32 tiles; bf16 has twice the bytes per element).
    bm, bn, bk = {"int8_channel_int32": (128, 256, 128), "bf16": (128, 128, 64)}.get(mode, (128, 128, 128))
    return GemmConfig(bm, bn, bk, 8, **TMA_VARIANTS[variant])


def _gemm_operands(mode, rows, e, n, k, g):
    if mode == "bf16":
        a = torch.randn(rows, k, device=DEV, generator=g).bfloat16()
        b = (torch.randn(e, n, k, device=DEV, generator=g) / k**0.5).bfloat16()
        return a, b, None, None
    a = torch.randint(-127, 128, (rows, k), device=DEV, generator=g, dtype=torch.int8)
    b = torch.randint(-127, 128, (e, n, k), device=DEV, generator=g, dtype=torch.int8)
    if mode == "int8_channel":
        return a, b, torch.rand(rows, 1, device=DEV, generator=g) + 0.5, torch.rand(e, n, 1, device=DEV, generator=g) / 1e4
    return (a, b, torch.rand(rows, k // 128, device=DEV, generator=g) + 0.5,
            torch.rand(e, -(-n // 128), k // 128, device=DEV, generator=g) / 1e4)


def _assert_same(tma_out, ptr_out, exact):
    if exact:
        assert torch.equal(tma_out, ptr_out), "int32 accumulation is exact: the kernels must agree bit for bit"
    else:
        scale = float(ptr_out.float().abs().max())
        torch.testing.assert_close(tma_out.float(), ptr_out.float(), rtol=2e-2, atol=1e-3 * scale)


@pytest.mark.parametrize("variant", list(TMA_VARIANTS))
@pytest.mark.parametrize("mode,acc", MODE_ACC, ids=[f"{m}-{a}" for m, a in MODE_ACC])
def test_tma_grouped_gemm_contiguous(mode, acc, variant):
    e, n, k = 12, 512, 1024
    counts = [0, 300, 1, 0, 129, 128, 77, 0, 0, 513, 5, 0]  # empty, single-row, tile-aligned, ragged
    offsets = torch.tensor([0] + list(itertools.accumulate(counts)), dtype=torch.int32, device=DEV)
    rows = int(offsets[-1])
    g = torch.Generator(device=DEV).manual_seed(11)
    a, b, sa, sb = _gemm_operands(mode, rows, e, n, k, g)
    key = f"{mode}_{acc}" if acc == "int32" else mode
    cfg = _tma_cfg(key, variant)
    twin = GemmConfig(cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m, False, 8, 3)
    outs = []
    for c in (cfg, twin):
        out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device=DEV)
        grouped_gemm.grouped_gemm_contiguous(
            a, b, offsets, mode=mode, a_scale=sa, b_scale=sb, accumulator=acc, out_dtype=torch.bfloat16,
            config=c, out=out,
        )
        outs.append(out)
    assert grouped_gemm.tma_fallback_reason(a, b, cfg) is None
    assert torch.isfinite(outs[0]).all()
    _assert_same(outs[0], outs[1], exact=acc == "int32")


@pytest.mark.parametrize("variant", ["plain", "persistent_w4"])
@pytest.mark.parametrize("mode,acc", MODE_ACC[:3], ids=[f"{m}-{a}" for m, a in MODE_ACC[:3]])
def test_tma_grouped_gemm_masked(mode, acc, variant):
    e, cap, n, k = 6, 256, 384, 512
    masked_m = torch.tensor([0, 256, 3, 130, 0, 64], dtype=torch.int32, device=DEV)
    g = torch.Generator(device=DEV).manual_seed(12)
    a, b, sa, sb = _gemm_operands(mode, e * cap, e, n, k, g)
    a3 = a.view(e, cap, k)
    sa3 = sa.view(e, cap, -1)
    cfg = _tma_cfg(f"{mode}_{acc}" if acc == "int32" else mode, variant)
    twin = GemmConfig(cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m, False, 8, 3)
    outs = []
    for c in (cfg, twin):
        out = torch.full((e, cap, n), float("nan"), dtype=torch.bfloat16, device=DEV)
        grouped_gemm.grouped_gemm_masked(
            a3, b, masked_m, mode=mode, a_scale=sa3, b_scale=sb, accumulator=acc, out_dtype=torch.bfloat16,
            expected_m=64, config=c, out=out,
        )
        outs.append(out)
    for i, mm in enumerate(masked_m.tolist()):
        assert torch.isnan(outs[0][i, mm:]).all(), "rows past masked_m must not be written"
        if mm:
            _assert_same(outs[0][i, :mm], outs[1][i, :mm], exact=acc == "int32")


@pytest.mark.parametrize("variant", ["persistent", "persistent_w4"])
def test_tma_grouped_gemm_deepseek_shape(variant):
    """GEMM1 of DeepSeek-V3 (N=4096, K=7168) with uneven routing over 8 experts."""
    e, n, k = 8, 4096, 7168
    counts = [700, 0, 129, 1, 256, 0, 1000, 33]
    offsets = torch.tensor([0] + list(itertools.accumulate(counts)), dtype=torch.int32, device=DEV)
    rows = int(offsets[-1])
    g = torch.Generator(device=DEV).manual_seed(13)
    a, b, sa, sb = _gemm_operands("int8_channel", rows, e, n, k, g)
    cfg = GemmConfig(128, 256, 128, 8, **TMA_VARIANTS[variant])
    twin = GemmConfig(128, 128, 256, 8, False, 8, 3)
    res = [grouped_gemm.grouped_gemm_contiguous(a, b, offsets, mode="int8_channel", a_scale=sa, b_scale=sb,
                                                accumulator="int32", config=c) for c in (cfg, twin)]
    _assert_same(res[0], res[1], exact=True)


def test_tma_grouped_gemm_cuda_graph():
    """A captured persistent TMA GEMM replays with new routing and new values in the same buffers."""
    e, n, k, rows = 8, 512, 1024, 1024
    g = torch.Generator(device=DEV).manual_seed(14)
    a, b, sa, sb = _gemm_operands("int8_channel", rows, e, n, k, g)
    offsets = torch.tensor([0, 100, 100, 400, 401, 700, 900, 1000, 1024], dtype=torch.int32, device=DEV)
    out = torch.empty(rows, n, dtype=torch.bfloat16, device=DEV)
    cfg = GemmConfig(128, 256, 128, 8, **TMA_VARIANTS["persistent_w4"])

    def call():
        grouped_gemm.grouped_gemm_contiguous(a, b, offsets, mode="int8_channel", a_scale=sa, b_scale=sb,
                                             accumulator="int32", config=cfg, out=out)

    call()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    offsets.copy_(torch.tensor([0, 0, 512, 512, 513, 800, 800, 1024, 1024], dtype=torch.int32, device=DEV))
    a.copy_(torch.randint(-127, 128, a.shape, device=DEV, generator=g, dtype=torch.int8))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = grouped_gemm.grouped_gemm_contiguous(a, b, offsets, mode="int8_channel", a_scale=sa, b_scale=sb,
                                               accumulator="int32", config=GemmConfig(128, 128, 128, 8, False, 8, 3))
    assert torch.equal(out, ref)


def test_tma_grouped_gemm_unaligned_falls_back():
    e, n, k = 4, 256, 512
    counts = [10, 0, 130, 60]
    offsets = torch.tensor([0] + list(itertools.accumulate(counts)), dtype=torch.int32, device=DEV)
    rows = int(offsets[-1])
    g = torch.Generator(device=DEV).manual_seed(15)
    a, b, sa, sb = _gemm_operands("int8_channel", rows, e, n, k, g)
    shifted = torch.empty(8 + rows * k, dtype=torch.int8, device=DEV)[8:].view(rows, k)
    shifted.copy_(a)
    cfg = GemmConfig(128, 256, 128, 8, **TMA_VARIANTS["persistent_w4"])
    assert "aligned" in grouped_gemm.tma_fallback_reason(shifted, b, cfg)
    res = grouped_gemm.grouped_gemm_contiguous(shifted, b, offsets, mode="int8_channel", a_scale=sa, b_scale=sb,
                                               accumulator="int32", config=cfg)
    ref = grouped_gemm.grouped_gemm_contiguous(a, b, offsets, mode="int8_channel", a_scale=sa, b_scale=sb,
                                               accumulator="int32", config=cfg)
    assert torch.equal(res, ref)
