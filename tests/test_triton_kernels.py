"""Triton kernels against independent float64 references (interpreter on CPU, compiled on GPU).

Every reference here quantizes on its own in float64; none calls a kernel's quantizer. Outputs
are poisoned with NaN before a run so a kernel that skips a valid element fails.
Interpreter caveat: it truncates when converting to bf16, so inputs are fp16/fp32.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from epmoe.kernels import activation, configs, grouped_gemm, permute, quantize  # noqa: E402
from epmoe.layouts import gather_weighted as torch_gather_weighted  # noqa: E402
from epmoe.layouts import to_contiguous  # noqa: E402
from epmoe.quant import reference  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


# ---------------------------------------------------------------- float64 reference quantizers


def _rne(y: torch.Tensor) -> torch.Tensor:
    """Round half to even in float64 (floor based, independent of torch.round)."""
    r = torch.floor(y)
    frac = y - r
    r = torch.where(frac > 0.5, r + 1, r)
    odd = torch.remainder(r, 2) != 0
    return torch.where((frac == 0.5) & odd, r + 1, r)


def _ref_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    # The rule forms the scale in fp32: fp32(max(amax, fp32(1e-10)) / qmax), a correctly rounded
    # divide (float64 then one rounding to fp32 gives the same bits).
    floor = float(torch.tensor(1e-10, dtype=torch.float32))
    return (torch.clamp(amax, min=floor) / qmax).float().double()


def _ref_e4m3(y: torch.Tensor) -> torch.Tensor:
    """Nearest e4m3 value (ties to even) of float64 ``y`` already within +-448."""
    mag = y.abs()
    exp = torch.floor(torch.log2(torch.where(mag > 0, mag, torch.ones_like(mag))))
    # Guard log2 rounding at exact powers of two.
    exp = torch.where(2.0**exp > mag, exp - 1, exp)
    exp = torch.where(2.0 ** (exp + 1) <= mag, exp + 1, exp)
    step = 2.0 ** (torch.clamp(exp, min=-6) - 3)
    return _rne(y / step) * step


def ref_quant(x: torch.Tensor, group: int | None, qmax: float = 127.0, e4m3: bool = False):
    """float64 codes and scales of the project's rule, per row or per 1 x group."""
    x64 = x.double()
    k = x64.shape[-1]
    g = k if group is None else group
    xg = x64.reshape(*x64.shape[:-1], k // g, g)
    scale = _ref_scale(xg.abs().amax(-1, keepdim=True), qmax)
    y = (xg / scale).float().double()  # the kernel divides in fp32
    y = y.clamp(-qmax, qmax)
    q = _ref_e4m3(y) if e4m3 else _rne(y).clamp(-qmax, qmax)
    return q.reshape(x.shape), scale.squeeze(-1)


def rel_mean_abs(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).abs().mean() / ref.abs().mean().clamp(min=1e-30))


# ---------------------------------------------------------------- quantize


@pytest.mark.parametrize("k", [128, 200, 384])
def test_per_token_quant_int8_matches_float64(k):
    torch.manual_seed(k)
    x = torch.randn(19, k) * torch.logspace(-3, 2, 19).unsqueeze(1)
    x[4] = 0.0
    # Exact ties: amax 127 gives scale 1 and these values sit on half-integers.
    x[7, :6] = torch.tensor([127.0, 0.5, 1.5, -2.5, 3.5, -126.5])
    x[7, 6:] = 0.0
    q, s = quantize.per_token_quant_int8(x.to(DEVICE))
    rq, rs = ref_quant(x, None)
    assert q.dtype == torch.int8 and s.shape == (19, 1) and s.dtype == torch.float32
    assert torch.equal(q.cpu().double(), rq)
    assert torch.equal(s.cpu().double(), rs)
    assert q[7, :6].tolist() == [127, 0, 2, -2, 4, -126]
    assert torch.all(q[4] == 0) and math.isfinite(float(s[4]))
    assert torch.equal(q.cpu(), reference.quantize_rows(x, torch.int8, 127.0)[0])


@pytest.mark.parametrize("dtype,qmax", [(torch.int8, 127.0), (torch.float8_e4m3fn, 448.0)])
def test_per_group_quant_matches_float64(dtype, qmax):
    torch.manual_seed(1)
    x = (torch.randn(3, 11, 256) * 4).half()
    x[0, 2, 128:] = 0.0
    q, s = quantize.per_group_quant(x.to(DEVICE), 128, dtype)
    rq, rs = ref_quant(x.float(), 128, qmax, e4m3=dtype != torch.int8)
    assert q.shape == x.shape and s.shape == (3, 11, 2) and q.dtype == dtype
    assert torch.equal(q.cpu().double(), rq)
    assert torch.equal(s.cpu().double(), rs)


def test_nan_row_does_not_leak():
    torch.manual_seed(2)
    x = torch.randn(6, 256)
    clean_q, clean_s = quantize.per_token_quant_int8(x.to(DEVICE))
    bad = x.clone()
    bad[2, 17] = float("nan")
    bad[4, 3] = float("inf")
    q, s = quantize.per_token_quant_int8(bad.to(DEVICE))
    assert not math.isfinite(float(s[2])) and not math.isfinite(float(s[4]))
    for r in (0, 1, 3, 5):
        assert torch.equal(q[r], clean_q[r]) and torch.equal(s[r], clean_s[r])
    gq, gs = quantize.per_group_quant(bad.to(DEVICE), 128, torch.int8)
    assert not math.isfinite(float(gs[2, 0])) and math.isfinite(float(gs[2, 1]))


def test_requantize_from_e4m3_groups():
    torch.manual_seed(3)
    x = torch.randn(9, 384) * 3
    xq, xs = reference.quantize_rows(x, torch.float8_e4m3fn, 448.0, 128)
    deq = xq.double() * xs.double().repeat_interleave(128, 1)
    q, s = quantize.per_token_quant_int8(xq.to(DEVICE), xs.to(DEVICE))
    rq, rs = ref_quant(deq.float(), None)
    assert torch.equal(q.cpu().double(), rq) and torch.equal(s.cpu().double(), rs)
    gq, gs = quantize.per_group_quant(xq.to(DEVICE), 128, torch.int8, xs.to(DEVICE))
    rq, rs = ref_quant(deq.float(), 128)
    assert torch.equal(gq.cpu().double(), rq) and torch.equal(gs.cpu().double(), rs)


def test_quant_masked_rows_only():
    x = torch.randn(3, 8, 128).to(DEVICE)
    masked_m = torch.tensor([2, 0, 8], dtype=torch.int32, device=DEVICE)
    q, s = quantize.per_token_quant_int8(x, masked_m=masked_m)
    full_q, full_s = quantize.per_token_quant_int8(x)
    for e, n in enumerate(masked_m.tolist()):
        assert torch.equal(q[e, :n], full_q[e, :n]) and torch.equal(s[e, :n], full_s[e, :n])


def test_quant_argument_errors():
    with pytest.raises(ValueError, match="group_size=128"):
        quantize.per_group_quant(torch.randn(2, 200, device=DEVICE), 128)
    with pytest.raises(TypeError, match="dtype"):
        quantize.per_group_quant(torch.randn(2, 128, device=DEVICE), 128, torch.float16)
    with pytest.raises(TypeError, match="x_scale"):
        quantize.per_token_quant_int8(torch.zeros(2, 128, dtype=torch.int8, device=DEVICE))


# ---------------------------------------------------------------- grouped GEMM

E, N, K = 4, 200, 256
COUNTS = [5, 0, 37, 3]  # an empty expert and an expert spanning several M tiles

CONFIGS = [
    None,
    configs.GemmConfig(16, 32, 64, 2, False, 4, 2),
    configs.GemmConfig(16, 32, 128, 1, True, 4, 2),
    configs.GemmConfig(32, 256, 64, 1, False, 4, 2),  # N tile spans two 128-wide weight blocks
]


def _segments(counts, align=1):
    padded = [-(-c // align) * align for c in counts]
    offsets = [0]
    for p in padded:
        offsets.append(offsets[-1] + p)
    return torch.tensor(offsets, dtype=torch.int32), offsets


def _operands(mode, m, n=N, k=K, e=E):
    g = torch.Generator().manual_seed(m * 7 + n + k)
    if mode == "bf16":
        a = torch.randn(m, k, generator=g).half()
        b = (torch.randn(e, n, k, generator=g) / 8).half()
        return a, b, None, None, a.double(), b.double()
    a = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
    b = torch.randint(-127, 128, (e, n, k), generator=g, dtype=torch.int8)
    if mode == "int8_channel":
        sa = torch.rand(m, 1, generator=g) + 0.5
        sb = torch.rand(e, n, 1, generator=g) / 100 + 1e-3
        return a, b, sa, sb, a.double() * sa.double(), b.double() * sb.double()
    sa = torch.rand(m, k // 128, generator=g) + 0.5
    sb = torch.rand(e, -(-n // 128), k // 128, generator=g) / 100 + 1e-3
    full_b = sb.double().repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :n, :k]
    return a, b, sa, sb, a.double() * sa.double().repeat_interleave(128, 1), b.double() * full_b


MODE_ACC = [("bf16", "fp32"), ("int8_channel", "fp32"), ("int8_channel", "int32"), ("int8_block", "fp32")]


@pytest.mark.parametrize("mode,acc", MODE_ACC)
@pytest.mark.parametrize("cfg", CONFIGS, ids=["default", "bm16", "swap_ab", "wide_n"])
def test_grouped_gemm_contiguous(mode, acc, cfg):
    offsets_t, offsets = _segments(COUNTS, align=8)
    m = offsets[-1]
    a, b, sa, sb, a64, b64 = _operands(mode, m)
    out = torch.full((m, N), float("nan"), dtype=torch.float32, device=DEVICE)
    to = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    res = grouped_gemm.grouped_gemm_contiguous(
        a.to(DEVICE), b.to(DEVICE), offsets_t.to(DEVICE), mode=mode, a_scale=to(sa), b_scale=to(sb),
        accumulator=acc, out_dtype=torch.float32, config=cfg, out=out,
    )
    assert res.data_ptr() == out.data_ptr()
    res = res.cpu().double()
    assert torch.isfinite(res).all(), "a row inside an expert segment was not written"
    for e in range(E):
        rows = slice(offsets[e], offsets[e + 1])
        ref = a64[rows] @ b64[e].t()
        assert torch.allclose(res[rows], ref, rtol=1e-5, atol=1e-5 * max(1.0, float(ref.abs().max())) if ref.numel() else 1.0)


@pytest.mark.parametrize("mode,acc", MODE_ACC)
@pytest.mark.parametrize("expected_m", [None, 1])
def test_grouped_gemm_masked(mode, acc, expected_m):
    cap = 40
    masked = torch.tensor([5, 0, 40, 17], dtype=torch.int32)
    a, b, sa, sb, a64, b64 = _operands(mode, E * cap)
    a3 = a.reshape(E, cap, K)
    sa3 = None if sa is None else sa.reshape(E, cap, -1)
    out = torch.full((E, cap, N), float("nan"), dtype=torch.float16, device=DEVICE)
    to = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    grouped_gemm.grouped_gemm_masked(
        a3.to(DEVICE), b.to(DEVICE), masked.to(DEVICE), mode=mode, a_scale=to(sa3), b_scale=to(sb),
        accumulator=acc, out_dtype=torch.float16, expected_m=expected_m,
        config=configs.GemmConfig(16, 64, 64, 4, False, 4, 2), out=out,
    )
    res = out.cpu().double()
    for e, n in enumerate(masked.tolist()):
        ref = a64[e * cap : e * cap + n] @ b64[e].t()
        assert torch.allclose(res[e, :n], ref, rtol=2e-3, atol=2e-3 * max(1.0, float(ref.abs().max())) if ref.numel() else 1.0)
        assert torch.isnan(res[e, n:]).all(), "rows past masked_m must not be written"


def test_grouped_gemm_ragged_k_and_fp32():
    counts = [3, 20]
    offsets_t, offsets = _segments(counts)
    a = torch.randn(offsets[-1], 96)
    b = torch.randn(2, 50, 96)
    res = grouped_gemm.grouped_gemm_contiguous(
        a.to(DEVICE), b.to(DEVICE), offsets_t.to(DEVICE), mode="bf16", out_dtype=torch.float32,
        config=configs.GemmConfig(16, 32, 64, 1, False, 4, 2),
    ).cpu().double()
    for e in range(2):
        rows = slice(offsets[e], offsets[e + 1])
        assert torch.allclose(res[rows], a[rows].double() @ b[e].double().t(), rtol=1e-4, atol=1e-4)


def test_grouped_gemm_argument_errors():
    a = torch.zeros(4, 200, dtype=torch.int8, device=DEVICE)
    b = torch.zeros(2, 64, 200, dtype=torch.int8, device=DEVICE)
    off = torch.tensor([0, 2, 4], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of 128"):
        grouped_gemm.grouped_gemm_contiguous(
            a, b, off, mode="int8_block", a_scale=torch.ones(4, 1, device=DEVICE),
            b_scale=torch.ones(2, 1, 2, device=DEVICE),
        )
    with pytest.raises(ValueError, match="b_scale shape"):
        grouped_gemm.grouped_gemm_contiguous(
            a, b, off, mode="int8_channel", a_scale=torch.ones(4, 1, device=DEVICE),
            b_scale=torch.ones(2, 64, device=DEVICE),
        )
    with pytest.raises(ValueError, match="accumulator='int32'"):
        grouped_gemm.grouped_gemm_contiguous(a.half(), b.half(), off, mode="bf16", accumulator="int32")
    with pytest.raises(TypeError, match="int8"):
        grouped_gemm.grouped_gemm_contiguous(
            a.half(), b, off, mode="int8_channel", a_scale=torch.ones(4, 1, device=DEVICE),
            b_scale=torch.ones(2, 64, 1, device=DEVICE),
        )
    with pytest.raises(ValueError, match="mode="):
        grouped_gemm.grouped_gemm_contiguous(a, b, off, mode="fp8")
    with pytest.raises(ValueError, match="expert_offsets"):
        grouped_gemm.grouped_gemm_contiguous(a.half(), b.half(), off[:2], mode="bf16")


# ---------------------------------------------------------------- activation


def _silu_mul64(x: torch.Tensor) -> torch.Tensor:
    x64 = x.double()
    i = x64.shape[-1] // 2
    gate, up = x64[..., :i], x64[..., i:]
    return gate / (1 + torch.exp(-gate)) * up


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])
def test_silu_and_mul(out_dtype):
    x = (torch.randn(7, 5, 2 * 160) * 3).half()
    y = activation.silu_and_mul(x.to(DEVICE), out_dtype)
    assert y.dtype == out_dtype and y.shape == (7, 5, 160)
    tol = 1e-3 if out_dtype == torch.float16 else 1e-5
    assert torch.allclose(y.cpu().double(), _silu_mul64(x), rtol=tol, atol=tol)


@pytest.mark.parametrize("granularity,dtype", [("token", torch.int8), ("group", torch.int8), ("group", torch.float8_e4m3fn)])
def test_silu_and_mul_quant(granularity, dtype):
    torch.manual_seed(5)
    x = (torch.randn(33, 2 * 384) * 2).half()
    q, s = activation.silu_and_mul_quant(x.to(DEVICE), granularity, 128, dtype)
    group = None if granularity == "token" else 128
    qmax = 127.0 if dtype == torch.int8 else 448.0
    rq, rs = ref_quant(_silu_mul64(x).float(), group, qmax, e4m3=dtype != torch.int8)
    assert s.shape == rs.shape
    # The kernel's fp32 exp may differ from float64 by an ulp: scales agree to ~1e-6 and at most a
    # few codes sit on the other side of a rounding boundary.
    assert torch.allclose(s.cpu().double(), rs, rtol=1e-5)
    q64 = q.cpu().double()
    step = 1.0 if dtype == torch.int8 else 0.125 * rq.abs().clamp(min=2**-6)
    assert torch.all((q64 - rq).abs() <= step)
    assert (q64 != rq).double().mean() < 0.01


def test_activation_masked_rows_only():
    x = torch.randn(3, 6, 256).half().to(DEVICE)
    masked_m = torch.tensor([6, 0, 2], dtype=torch.int32, device=DEVICE)
    q, s = activation.silu_and_mul_quant(x, "group", masked_m=masked_m)
    fq, fs = activation.silu_and_mul_quant(x, "group")
    for e, n in enumerate(masked_m.tolist()):
        assert torch.equal(q[e, :n], fq[e, :n]) and torch.equal(s[e, :n], fs[e, :n])


# ---------------------------------------------------------------- permute


def _routing(r=11, k=3, e=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, e, (r, k), generator=g)
    ids[0] = -1  # a token with no local slot
    ids[1] = torch.tensor([2, -1, 2])[:k]
    return ids


@pytest.mark.parametrize("dtype", [torch.float16, torch.int8, torch.float8_e4m3fn])
def test_scatter_rows_matches_to_contiguous(dtype):
    ids = _routing()
    x = (torch.randn(11, 136) * 20).to(dtype)
    xs = torch.rand(11, 2)
    ref = to_contiguous(x, xs, ids, 4, alignment=4)
    out, out_s = permute.scatter_rows(x.to(DEVICE), ref.slot_pos.to(DEVICE), ref.x.shape[0], xs.to(DEVICE))
    assert torch.equal(out.cpu().view(torch.uint8), ref.x.view(torch.uint8))
    assert torch.equal(out_s.cpu(), ref.x_scale)


def test_gather_weighted_skips_invalid_rows():
    ids = _routing()
    batch = to_contiguous(torch.randn(11, 8), None, ids, 4, alignment=4)
    expert_out = torch.randn(batch.x.shape[0], 72).half()
    expert_out[batch.m_indices < 0] = float("nan")  # padding rows must never be read
    w = torch.rand(11, 3)
    got = permute.gather_weighted(expert_out.to(DEVICE), batch.slot_pos.to(DEVICE), w.to(DEVICE)).cpu()
    ref = torch.zeros(11, 72, dtype=torch.float64)
    for r in range(11):
        for j in range(3):
            p = int(batch.slot_pos[r, j])
            if p >= 0:
                ref[r] += expert_out[p].double() * float(w[r, j])
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert torch.allclose(got.double(), ref, rtol=1e-6, atol=1e-6)
    assert torch.all(got[0] == 0)
    assert torch.allclose(got, torch_gather_weighted(expert_out, batch.slot_pos, w))


# ---------------------------------------------------------------- configs


def test_shipped_config_files_are_valid():
    files = sorted(configs.PACKAGE_DIR.glob("*.json"))
    assert files, "no config files ship in epmoe/configs"
    for path in files:
        data = json.loads(path.read_text())
        assert configs.config_filename(data["device"]) == path.name
        for mode, shapes in data["configs"].items():
            assert mode in (*grouped_gemm.MODES, configs.INT32_ACC_MODE)
            for buckets in shapes.values():
                for cfg in buckets.values():
                    parsed = configs.GemmConfig.from_dict(cfg)
                    if mode == "int8_block":
                        assert 128 % parsed.block_k == 0


def test_config_lookup_buckets():
    buckets = {"8": {"BLOCK_M": 16}, "128": {"BLOCK_M": 64}}
    assert configs.pick_bucket(buckets, 1) == {"BLOCK_M": 16}
    assert configs.pick_bucket(buckets, 9) == {"BLOCK_M": 64}
    assert configs.pick_bucket(buckets, 5000) == {"BLOCK_M": 64}
    cfg = configs.get_config("int8_block", 4096, 7168, 8, device="cpu")
    assert 128 % cfg.block_k == 0
    with pytest.raises(ValueError, match="BLOCK_M"):
        configs.GemmConfig.from_dict({"BLOCK_M": 24, "BLOCK_N": 64, "BLOCK_K": 64})
