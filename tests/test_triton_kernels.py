"""Triton kernels against independent float64 references (interpreter on CPU, compiled on GPU).

Every reference here quantizes on its own in float64; none calls a kernel's quantizer. Outputs
are poisoned with NaN before a run so a kernel that skips a valid element fails.
Interpreter caveat: it truncates when converting to bf16, so inputs are fp16/fp32.
"""

from __future__ import annotations

import contextvars
import dataclasses
import json
import logging
import math
import os
import re

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from epmoe.kernels import activation, configs, grouped_gemm, permute, quantize  # noqa: E402
from epmoe.layouts import gather_weighted as torch_gather_weighted  # noqa: E402
from epmoe.layouts import to_contiguous  # noqa: E402
from epmoe.quant import reference  # noqa: E402
from reference import gather_reference  # noqa: E402

# Several tests feed NaN and Inf rows on purpose; Triton's interpreter computes with NumPy, which
# warns about the resulting invalid operations (a compiled kernel computes the same, silently).
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

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


@pytest.mark.parametrize("granularity", ["token", "group"])
def test_quant_skips_padding_rows_of_a_contiguous_layout(granularity):
    """row_expert -1 rows (padding, here poisoned with NaN) are skipped; the others come out as
    without it (what GEMM1's input quantizer gets over a padded layout: stages.padding_rows)."""
    x = torch.randn(6, 256)
    experts = torch.tensor([0, 0, -1, 1, -1, -1], dtype=torch.int32)
    x[experts < 0] = float("nan")
    x, experts = x.to(DEVICE), experts.to(DEVICE)
    quant = (quantize.per_token_quant_int8 if granularity == "token"
             else lambda t, **kw: quantize.per_group_quant(t, 128, torch.float8_e4m3fn, **kw))  # fmt: skip
    q, s = quant(x, row_expert=experts)
    full_q, full_s = quant(x)
    keep = (experts >= 0).cpu()
    assert torch.equal(q.cpu()[keep].view(torch.uint8), full_q.cpu()[keep].view(torch.uint8))
    assert torch.equal(s.cpu()[keep], full_s.cpu()[keep]) and torch.isfinite(s.cpu()[keep]).all()
    with pytest.raises(ValueError, match="row_expert must be an int32 \\[6\\]"):
        quant(x, row_expert=experts[:5])


def test_quant_argument_errors():
    with pytest.raises(ValueError, match="group_size=128"):
        quantize.per_group_quant(torch.randn(2, 200, device=DEVICE), 128)
    with pytest.raises(TypeError, match="dtype"):
        quantize.per_group_quant(torch.randn(2, 128, device=DEVICE), 128, torch.float16)
    with pytest.raises(TypeError, match="x_scale"):
        quantize.per_token_quant_int8(torch.zeros(2, 128, dtype=torch.int8, device=DEVICE))


Launch = quantize.Launch
NAN_ROW, INF_ROW = 5, 6


def _special_rows(m: int, k: int, seed: int) -> torch.Tensor:
    """Rows over five decades with a zero row, an exact-tie row and a NaN row beside an Inf row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 2, m).unsqueeze(1)
    x[1] = 0.0
    x[2] = 0.0
    x[2, :6] = torch.tensor([127.0, 0.5, 1.5, -2.5, 3.5, -126.5])  # scale 1: exact ties
    # A NaN whose low mantissa byte is not 0: an int8 code taken from a NaN's bits would show.
    x[NAN_ROW, k // 2] = torch.tensor([0x7FC00055], dtype=torch.int32).view(torch.float32)[0]
    x[INF_ROW, 3] = float("inf")
    return x


# Several rows a program (19 rows: the last program is partial), K=200 inside one block, two
# passes over 64- or 128-column chunks (the last one partial), a block wider than K.
TOKEN_LAUNCHES = [Launch(4, 256, 4), Launch(1, 64, 2), Launch(8, 128, 4), Launch(2, 512, 8)]


@pytest.mark.parametrize("launch", TOKEN_LAUNCHES, ids=lambda l: f"m{l.block_m}k{l.block_k}w{l.num_warps}")
def test_per_token_launches_match_float64(launch):
    m, k = 19, 200
    x = _special_rows(m, k, seed=11)
    q, s = quantize.per_token_quant_int8(x.to(DEVICE), launch=launch)
    q, s = q.cpu(), s.cpu()
    finite = [r for r in range(m) if r not in (NAN_ROW, INF_ROW)]
    rq, rs = ref_quant(x[finite], None)
    assert torch.equal(q[finite].double(), rq) and torch.equal(s[finite].double(), rs)
    assert q[2, :6].tolist() == [127, 0, 2, -2, 4, -126] and torch.all(q[1] == 0)
    # A NaN makes its row's scale NaN, an Inf makes it Inf; their codes are 0, other rows of the
    # same program are untouched (checked above).
    assert math.isnan(float(s[NAN_ROW])) and float(s[INF_ROW]) == float("inf")
    assert torch.all(q[NAN_ROW] == 0) and torch.all(q[INF_ROW] == 0)


GROUP_LAUNCHES = [Launch(4, 128, 4), Launch(2, 512, 4), Launch(8, 256, 8), Launch(16, 1024, 4)]


@pytest.mark.parametrize("dtype,qmax", [(torch.int8, 127.0), (torch.float8_e4m3fn, 448.0)])
@pytest.mark.parametrize("launch", GROUP_LAUNCHES, ids=lambda l: f"m{l.block_m}k{l.block_k}w{l.num_warps}")
def test_per_group_launches_match_float64(launch, dtype, qmax):
    m, k = 11, 384  # 3 groups: a 512/1024-column block masks a group; 11 rows leave partial programs
    x = _special_rows(m, k, seed=12)
    x[NAN_ROW, 150] = float("nan")  # a second group of the NaN row; its third stays finite
    q, s = quantize.per_group_quant(x.to(DEVICE), 128, dtype, launch=launch)
    q, s = q.cpu().double(), s.cpu()
    bad = {(NAN_ROW, 1), (INF_ROW, 0)}
    rq, rs = ref_quant(torch.nan_to_num(x, nan=0.0, posinf=0.0), 128, qmax, e4m3=dtype != torch.int8)
    for r in range(m):
        for gi in range(3):
            cols = slice(128 * gi, 128 * (gi + 1))
            if (r, gi) in bad:
                assert not math.isfinite(float(s[r, gi])) and torch.all(q[r, cols] == 0)
            else:
                assert float(s[r, gi]) == float(rs[r, gi]) and torch.equal(q[r, cols], rq[r, cols]), (r, gi)
    assert math.isnan(float(s[NAN_ROW, 1])) and float(s[INF_ROW, 0]) == float("inf")


def _boundary_inputs(m: int, groups: int, e4m3: bool, seed: int):
    """Groups of 128 whose elements sit on, or one ulp beside, a rounding boundary of their code.

    Element 0 of a group is its amax (a random power-of-ten-ish magnitude, so the scale's
    mantissa is arbitrary); the others are ``boundary * scale`` rounded to fp32 and nudged by
    -1, 0 or +1 ulp. Only a correctly rounded ``x / scale`` gets every code right.
    """
    g = torch.Generator().manual_seed(seed)
    qmax = 448.0 if e4m3 else 127.0
    amax = torch.exp(torch.empty(m, groups, 1).uniform_(-18, 18, generator=g)).float()
    scale = (amax.double() / qmax).float().double()
    if e4m3:
        grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).double()
        grid = torch.unique(grid[torch.isfinite(grid) & (grid >= 0) & (grid <= 448)])
        mids = (grid[1:] + grid[:-1]) / 2
        pick = mids[torch.randint(0, len(mids), (m, groups, 127), generator=g)]
    else:
        pick = torch.randint(-127, 127, (m, groups, 127), generator=g).double() + 0.5
    sign = torch.where(torch.rand(m, groups, 127, generator=g) < 0.5, -1.0, 1.0).double()
    x = (pick * sign * scale).float()
    nudge = torch.randint(-1, 2, x.shape, generator=g)
    inf = torch.full_like(x, float("inf"))
    x = torch.where(nudge > 0, torch.nextafter(x, inf), torch.where(nudge < 0, torch.nextafter(x, -inf), x))
    return torch.cat([amax, x], -1).reshape(m, groups * 128)


@pytest.mark.parametrize("kind", ["token", "group_int8", "group_e4m3"])
def test_quant_division_is_correctly_rounded(kind):
    e4m3 = kind == "group_e4m3"
    x = _boundary_inputs(16, 2, e4m3, seed=len(kind))
    if kind == "token":
        x = x.reshape(32, 128)  # one 128-element group per row
        q, s = quantize.per_token_quant_int8(x.to(DEVICE))
        rq, rs = ref_quant(x, None)
    else:
        dtype = torch.float8_e4m3fn if e4m3 else torch.int8
        q, s = quantize.per_group_quant(x.to(DEVICE), 128, dtype)
        rq, rs = ref_quant(x, 128, 448.0 if e4m3 else 127.0, e4m3=e4m3)
    assert torch.equal(s.cpu().double(), rs)
    assert torch.equal(q.cpu().double(), rq)


def test_e4m3_keeps_the_sign_of_zero():
    """e4m3 zeros carry the sign of ``x / scale``: -0 for x = -0, and in an Inf group (scale Inf)
    -0 for every finite x < 0 and +0 for the Inf itself (as the division-based kernel gave)."""
    x = torch.zeros(3, 128)
    x[:, 0] = 1.0
    x[0, 5] = -0.0
    x[2, 1:4] = torch.tensor([-2.0, 3.0, float("-inf")])
    q, s = quantize.per_group_quant(x.to(DEVICE), 128, torch.float8_e4m3fn)
    bits = q.cpu().view(torch.uint8)
    assert int(bits[0, 5]) == 0x80 and int(bits[0, 6]) == 0 and int(bits[1, 5]) == 0
    assert float(s[2, 0]) == float("inf")
    assert bits[2, :4].tolist() == [0, 0x80, 0, 0] and torch.all(bits[2, 4:] == 0)


# Input scales of 96 columns (gathered per element), 128 (one per 128-column chunk) and 384 (one
# per row), each with the default and two explicit launches.
@pytest.mark.parametrize("in_cols", [4, 3, 1])
@pytest.mark.parametrize(
    "token_launch,group_launch",
    [(None, None), (Launch(2, 64, 4), Launch(2, 128, 4)), (Launch(4, 512, 4), Launch(4, 512, 8))],
    ids=["default", "small", "wide"],
)
def test_requantize_scale_layouts(in_cols, token_launch, group_launch):
    torch.manual_seed(in_cols)
    x = torch.randn(9, 384) * 3
    xq, xs = reference.quantize_rows(x, torch.float8_e4m3fn, 448.0, 384 // in_cols)
    deq = (xq.double() * xs.double().repeat_interleave(384 // in_cols, 1)).float()
    q, s = quantize.per_token_quant_int8(xq.to(DEVICE), xs.to(DEVICE), launch=token_launch)
    rq, rs = ref_quant(deq, None)
    assert torch.equal(q.cpu().double(), rq) and torch.equal(s.cpu().double(), rs)
    gq, gs = quantize.per_group_quant(xq.to(DEVICE), 128, torch.int8, xs.to(DEVICE), launch=group_launch)
    rq, rs = ref_quant(deq, 128)
    assert torch.equal(gq.cpu().double(), rq) and torch.equal(gs.cpu().double(), rs)


class _PoisonedTorch:
    """``torch`` for the kernel wrappers, whose ``empty`` outputs hold values no quantizer
    writes (int8 -128, floats -1.0), so a test can tell which rows a kernel wrote."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*shape, dtype=None, device=None, **kw):
        size = shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape
        return torch.full(size, -128 if dtype == torch.int8 else -1.0, dtype=dtype, device=device)


def _poisoned_empty(monkeypatch):
    for module in (quantize, activation):
        monkeypatch.setattr(module, "torch", _PoisonedTorch())


# expected_m below the valid rows: one program per expert loops over its row blocks; a masked_m
# above cap (7 > 5) is clamped to it.
MASKED_HINTS = [(None, [2, 0, 5]), (1, [2, 0, 5]), (2, [2, 0, 7]), (9, [2, 0, 7])]


@pytest.mark.parametrize("expected_m,masked", MASKED_HINTS, ids=str)
@pytest.mark.parametrize("launch", [Launch(4, 128, 4), Launch(2, 64, 4)], ids=["4rows", "two_pass"])
def test_quant_masked_rows_across_experts(launch, expected_m, masked, monkeypatch):
    """Rows past masked_m are neither read nor written, whatever the grid the hint sizes."""
    x = torch.randn(3, 5, 128)
    masked = torch.tensor(masked, dtype=torch.int32)
    x[0, 2:] = float("nan")
    x[1] = float("inf")
    xd, md = x.to(DEVICE), masked.to(DEVICE)
    _poisoned_empty(monkeypatch)
    q, s = quantize.per_token_quant_int8(xd, masked_m=md, expected_m=expected_m, launch=launch)
    gq, gs = quantize.per_group_quant(xd, 64, torch.int8, masked_m=md, expected_m=expected_m,
                                      launch=Launch(launch.block_m, 64, 4))  # fmt: skip
    monkeypatch.undo()
    for e, n in enumerate(masked.tolist()):
        assert torch.all(q[e, n:] == -128) and torch.all(s[e, n:] == -1.0), "a row past masked_m was written"
        assert torch.all(gq[e, n:] == -128) and torch.all(gs[e, n:] == -1.0), "a row past masked_m was written"
        rq, rs = ref_quant(x[e, :n], None)
        assert torch.equal(q[e, :n].cpu().double(), rq) and torch.equal(s[e, :n].cpu().double(), rs)
        rq, rs = ref_quant(x[e, :n], 64)
        assert torch.equal(gq[e, :n].cpu().double(), rq) and torch.equal(gs[e, :n].cpu().double(), rs)


def test_launch_defaults_and_checks():
    for m, k in [(1, 7168), (4096, 7168), (262144, 7168), (19, 200), (3, 40000)]:
        launch = quantize.token_launch(m, k, "cuda")
        quantize.check_launch(launch)
        assert launch.block_k >= k or k > quantize.SINGLE_PASS_MAX
    # the measured bandwidth-best launches (see quantize.STREAM_M and LARGE_M)
    assert quantize.token_launch(262144, 7168, "cuda") == Launch(1, 8192, 4)
    assert quantize.token_launch(4096, 7168, "cuda") == Launch(1, 8192, 4)
    assert quantize.token_launch(1024, 7168, "cuda") == Launch(1, 8192, 4)
    assert quantize.token_launch(4096, 1536, "cuda") == Launch(4, 2048, 4)
    assert quantize.token_launch(1024, 1536, "cuda") == Launch(4, 2048, 16)
    assert quantize.token_launch(4096, 16384, "cuda") == Launch(1, 16384, 8)
    assert quantize.token_launch(1024, 18432, "cuda") == Launch(1, 4096, 8)
    # row lengths the measurement did not cover keep the tile rule
    assert quantize.token_launch(4096, 3000, "cuda") == Launch(2, 4096, 16)
    assert quantize.token_launch(4096, 16, "cuda") == quantize.token_launch(4096, 16, "cuda", silu=True)
    # the fused SiLU variant keeps the tile rule below LARGE_M (not measured with these)
    assert quantize.token_launch(4096, 2048, "cuda", silu=True) == Launch(4, 2048, 16)
    assert quantize.group_launch(262144, 7168, 128, "cuda") == Launch(2, 1024, 4)
    assert quantize.group_launch(32768, 2048, 128, "cuda") == Launch(1, 2048, 4)
    for m in (4096, 262144):
        launch = quantize.group_launch(m, 7168, 128, "cuda")
        assert 56 % (launch.block_k // 128) == 0  # whole groups, no half-empty program
    with pytest.raises(ValueError, match="power of two"):
        quantize.per_token_quant_int8(torch.randn(4, 128, device=DEVICE), launch=Launch(3, 128, 4))
    with pytest.raises(ValueError, match="multiple of group_size"):
        quantize.per_group_quant(torch.randn(4, 256, device=DEVICE), 128, torch.int8, launch=Launch(1, 64, 4))


def test_interpreter_fma_is_fused():
    """The interpreter's fma (patched by the tests) rounds once, like the GPU's (the quantizers'
    division relies on it)."""
    np = pytest.importorskip("numpy")
    from interpreter_patches import exact_fma

    # x*y + z lies just below the midpoint of 1 + 2**-23 and 1 + 2**-22: a float64 sum rounds
    # onto the midpoint and then (ties to even) up; the fused result rounds down.
    x = np.array([2.0**-24 * (1 + 2.0**-23)], np.float32)
    y = np.array([1 - 2.0**-23], np.float32)
    z = np.array([1 + 2.0**-23], np.float32)
    assert float(exact_fma(x, y, z)[0]) == 1 + 2.0**-23
    # The residual of a rounded product is exact: x*y - RN(x*y).
    a = np.array([1 + 2.0**-20], np.float32)
    p = (a * a).astype(np.float32)
    assert float(exact_fma(a, a, -p)[0]) == (1 + 2.0**-20) ** 2 - float(p[0])


@triton.jit
def _to_bf16(X, Y, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, tl.load(X + offs).to(tl.bfloat16))


def test_kernel_bf16_conversion_rounds_to_nearest_even():
    """A kernel's float32 -> bfloat16 conversion equals torch's (round to nearest, ties to even),
    as the GPU's does; under the interpreter through the tests' patch (Triton 3.6 truncates):
    ties both ways, overflow to Inf, subnormals, signed zero, NaN, and random values over a wide
    range."""
    ties = [1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-8), 1 + 2.0**-8 + 2.0**-20]
    special = [3.4e38, -3.4e38, float("inf"), -float("inf"), -0.0, 0.0, 1e-40, -1e-39, float("nan")]
    g = torch.Generator().manual_seed(3)
    n = 4096 - len(ties) - len(special)
    rand = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 20)
    x = torch.cat([torch.tensor(ties + special), rand]).float().to(DEVICE)
    y = torch.empty(4096, dtype=torch.bfloat16, device=DEVICE)
    _to_bf16[(1,)](x, y, N=4096)
    want = x.to(torch.bfloat16)
    assert torch.equal(y.isnan(), want.isnan())
    keep = ~want.isnan()
    assert torch.equal(y[keep].view(torch.int16), want[keep].view(torch.int16))


@triton.jit
def _sort_rows(X, Y, DESCENDING: tl.constexpr):
    offs = tl.arange(0, 4)[:, None] * 128 + tl.arange(0, 128)[None, :]
    tl.store(Y + offs, tl.sort(tl.load(X + offs), descending=DESCENDING))


def test_sort_sorts_along_the_last_dimension():
    """tl.sort, which the slot kernel ranks with (NumPy's sort in the interpreter, where the
    bitonic network would take seconds), against torch.sort."""
    x = torch.randint(-1000, 1000, (4, 128), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    for descending in (False, True):
        y = torch.empty_like(x, device=DEVICE)
        _sort_rows[(1,)](x.to(DEVICE), y, DESCENDING=descending)
        assert torch.equal(y.cpu(), torch.sort(x, dim=1, descending=descending).values)


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
    for e, n in enumerate(masked.clamp(0, cap).tolist()):
        ref = a64[e * cap : e * cap + n] @ b64[e].t()
        assert torch.allclose(res[e, :n], ref, rtol=2e-3, atol=2e-3 * max(1.0, float(ref.abs().max())) if ref.numel() else 1.0)
        assert torch.isnan(res[e, n:]).all(), "rows past masked_m must not be written"


@pytest.mark.parametrize("cfg", [*CONFIGS, configs.GemmConfig(16, 32, 128, 1, tma=True, persistent=True, num_stages=2)],
                         ids=["default", "bm16", "swap_ab", "wide_n", "tma"])
def test_int8_block_reads_mn_major_activation_scales_in_place(monkeypatch, cfg):
    """int8_block ``a_scale`` stored MN-major (what the layer's scatter writes for the CUTLASS
    backend, whose Triton pass below the INT8 crossover takes the same batch): the kernel reads it
    through its strides, no copy, and gives the same bits as from row-major scales."""
    from epmoe.kernels.common import mn_major_scales

    offsets_t, offsets = _segments(COUNTS)
    m = offsets[-1]  # 45 rows: the MN-major buffer's rows are padded to 48
    a, b, sa, sb, _, _ = _operands("int8_block", m)
    mn = mn_major_scales(m, sa.shape[1], DEVICE).copy_(sa.to(DEVICE))
    assert mn.stride() == (1, -(-m // 4) * 4)
    handed = []
    real = grouped_gemm._scale_rows
    monkeypatch.setattr(grouped_gemm, "_scale_rows", lambda s, rows: handed.append(real(s, rows)) or handed[-1])
    run = lambda scales: grouped_gemm.grouped_gemm_contiguous(  # noqa: E731
        a.to(DEVICE), b.to(DEVICE), offsets_t.to(DEVICE), mode="int8_block", a_scale=scales, b_scale=sb.to(DEVICE),
        out_dtype=torch.float32, config=cfg,
    ).cpu()
    want = run(sa.to(DEVICE).contiguous())
    got = run(mn)
    assert handed[-1].data_ptr() == mn.data_ptr() and handed[-1].stride() == mn.stride()
    assert torch.equal(got, want)


@pytest.mark.parametrize("mode", ["int8_channel", "int8_block"])
def test_int8_k_step_exact_at_the_extremes(mode):
    """Int8 extremes (-128, 127) over a 256-wide K give int32 tile products of 2**22 and
    -256*128*127; with unit scales the fp32 output must equal the int64 product exactly."""
    k, n = 256, 32
    a = torch.tensor([[-128] * k, [127] * k, [-128] * k, [5] * k], dtype=torch.int8)
    b = torch.full((1, n, k), -128, dtype=torch.int8)
    b[0, 1::2] = 127
    sa = torch.ones(4, 1 if mode == "int8_channel" else k // 128)
    sb = torch.ones((1, n, 1) if mode == "int8_channel" else (1, 1, k // 128))
    res = grouped_gemm.grouped_gemm_contiguous(
        a.to(DEVICE), b.to(DEVICE), torch.tensor([0, 4], dtype=torch.int32, device=DEVICE), mode=mode,
        a_scale=sa.to(DEVICE), b_scale=sb.to(DEVICE), out_dtype=torch.float32,
        config=configs.GemmConfig(16, 32, 256 if mode == "int8_channel" else 128, 1, False, 4, 2),
    ).cpu()
    exact = a.long() @ b[0].long().t()
    assert int(exact.abs().max()) == 2**22
    assert torch.equal(res.double(), exact.double())


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


# ---------------------------------------------------------------- grouped GEMM, TMA variant

TMA_CONFIGS = [
    configs.GemmConfig(16, 32, 64, 2, tma=True, num_stages=2),
    configs.GemmConfig(16, 64, 64, 2, tma=True, persistent=True, num_stages=2),
    # N tile spans two 128-wide weight blocks
    configs.GemmConfig(32, 256, 64, 1, tma=True, persistent=True, num_stages=2),
    configs.GemmConfig(16, 128, 128, 4, tma=True, persistent=True, flatten=True, num_stages=2),
]
TMA_IDS = ["plain", "persistent", "persistent_wide_n", "persistent_flatten"]


def _pointer_twin(cfg: configs.GemmConfig) -> configs.GemmConfig:
    return configs.GemmConfig(cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m, False, cfg.num_warps, cfg.num_stages)


def _contiguous_run(mode, acc, counts, cfg, n=N, k=K, align=8, out_dtype=torch.float32):
    offsets_t, offsets = _segments(counts, align=align)
    m = offsets[-1]
    e = len(counts)
    a, b, sa, sb, a64, b64 = _operands(mode, m, n=n, k=k, e=e)
    to = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    # A silent fallback to the pointer kernel would pass every comparison below.
    assert not cfg.tma or grouped_gemm.tma_fallback_reason(a, b, cfg) is None

    def run(config):
        out = torch.full((m, n), float("nan"), dtype=out_dtype, device=DEVICE)
        grouped_gemm.grouped_gemm_contiguous(
            a.to(DEVICE), b.to(DEVICE), offsets_t.to(DEVICE), mode=mode, a_scale=to(sa), b_scale=to(sb),
            accumulator=acc, out_dtype=out_dtype, config=config, out=out,
        )
        return out.cpu()

    return run, offsets, a64, b64


@pytest.mark.parametrize("mode,acc", MODE_ACC)
@pytest.mark.parametrize("cfg", TMA_CONFIGS, ids=TMA_IDS)
def test_grouped_gemm_tma_contiguous(mode, acc, cfg):
    run, offsets, a64, b64 = _contiguous_run(mode, acc, COUNTS, cfg)
    res = run(cfg)
    assert torch.isfinite(res).all(), "a row inside an expert segment was not written"
    res64 = res.double()
    for e in range(E):
        rows = slice(offsets[e], offsets[e + 1])
        ref = a64[rows] @ b64[e].t()
        assert torch.allclose(res64[rows], ref, rtol=1e-5, atol=1e-5 * max(1.0, float(ref.abs().max())) if ref.numel() else 1.0)
    old = run(_pointer_twin(cfg))
    if acc == "int32":
        assert torch.equal(res, old), "int32 accumulation is exact: TMA and pointer kernels must agree bit for bit"
    else:
        assert torch.allclose(res, old, rtol=1e-5, atol=1e-5 * float(old.abs().max()))


@pytest.mark.parametrize("mode,acc", MODE_ACC)
@pytest.mark.parametrize("cfg", TMA_CONFIGS[:3], ids=TMA_IDS[:3])
# In-range counts with the default grid; clamped counts (over the capacity, negative) with both
# grids, so the TMA kernel's loop over the rows past a one-row hint runs (and stops at a clamped
# count). In-range counts under a one-row hint: test_grouped_gemm_masked (pointer kernel, both
# hints); the full cross product cost 16 more interpreter launches of ~0.5-1 s.
@pytest.mark.parametrize(
    "expected_m,counts", [(None, [5, 0, 40, 17]), (None, [50, -3, 40, 17]), (1, [50, -3, 40, 17])],
    ids=["in_range-None", "clamped-None", "clamped-1"],
)
def test_grouped_gemm_tma_masked(mode, acc, expected_m, cfg, counts):
    """Counts above the capacity are clamped to it and negative ones are empty: the A descriptor
    of a tile ends at the clamped count, inside the expert's slab."""
    cap = 40
    masked = torch.tensor(counts, dtype=torch.int32)
    a, b, sa, sb, a64, b64 = _operands(mode, E * cap)
    a3 = a.reshape(E, cap, K)
    sa3 = None if sa is None else sa.reshape(E, cap, -1)
    assert grouped_gemm.tma_fallback_reason(a, b, cfg) is None  # the TMA kernel runs, no fallback
    out = torch.full((E, cap, N), float("nan"), dtype=torch.float16, device=DEVICE)
    to = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    grouped_gemm.grouped_gemm_masked(
        a3.to(DEVICE), b.to(DEVICE), masked.to(DEVICE), mode=mode, a_scale=to(sa3), b_scale=to(sb),
        accumulator=acc, out_dtype=torch.float16, expected_m=expected_m, config=cfg, out=out,
    )
    res = out.cpu().double()
    for e, n in enumerate(masked.clamp(0, cap).tolist()):
        ref = a64[e * cap : e * cap + n] @ b64[e].t()
        assert torch.allclose(res[e, :n], ref, rtol=2e-3, atol=2e-3 * max(1.0, float(ref.abs().max())) if ref.numel() else 1.0)
        assert torch.isnan(res[e, n:]).all(), "rows past masked_m must not be written"


@pytest.mark.parametrize("persistent", [False, True], ids=["plain", "persistent"])
def test_grouped_gemm_tma_many_experts(persistent):
    """20 experts (a 32-entry tile table): leading, inner and trailing empty experts, segments of
    one row, and experts spanning several tiles; every tile must find its expert."""
    counts = [0, 0, 1, 17, 0, 16, 33, 0, 0, 2, 5, 0, 31, 1, 0, 0, 9, 48, 0, 0]
    cfg = configs.GemmConfig(16, 64, 64, 4, tma=True, persistent=persistent, num_stages=2)
    run, offsets, a64, b64 = _contiguous_run("int8_channel", "int32", counts, cfg, n=64, k=128, align=1)
    res = run(cfg)
    assert torch.equal(res, run(_pointer_twin(cfg)))
    for e in range(len(counts)):
        rows = slice(offsets[e], offsets[e + 1])
        assert torch.allclose(res[rows].double(), a64[rows] @ b64[e].t(), rtol=1e-5, atol=1e-5)


def test_grouped_gemm_tma_all_empty():
    cfg = configs.GemmConfig(16, 64, 64, 1, tma=True, persistent=True, num_stages=2)
    a = torch.randint(-127, 128, (8, 128), dtype=torch.int8)
    b = torch.randint(-127, 128, (3, 64, 128), dtype=torch.int8)
    out = torch.full((8, 64), float("nan"), device=DEVICE)
    offsets = torch.zeros(4, dtype=torch.int32)  # every expert empty: rows belong to none
    grouped_gemm.grouped_gemm_contiguous(
        a.to(DEVICE), b.to(DEVICE), offsets.to(DEVICE), mode="int8_channel", a_scale=torch.ones(8, 1, device=DEVICE),
        b_scale=torch.ones(3, 64, 1, device=DEVICE), accumulator="int32", out_dtype=torch.float32, config=cfg, out=out,
    )
    assert torch.isnan(out).all()


def test_grouped_gemm_tma_ragged_k_fp32():
    """K tail past the last BLOCK_K comes from TMA's zero fill; fp32 operands (16-byte rows)."""
    counts = [3, 20]
    offsets_t, offsets = _segments(counts)
    a = torch.randn(offsets[-1], 96)
    b = torch.randn(2, 50, 96)
    cfg = configs.GemmConfig(16, 32, 64, 1, tma=True, persistent=True, num_stages=2)
    assert grouped_gemm.tma_fallback_reason(a, b, cfg) is None
    res = grouped_gemm.grouped_gemm_contiguous(
        a.to(DEVICE), b.to(DEVICE), offsets_t.to(DEVICE), mode="bf16", out_dtype=torch.float32, config=cfg,
    ).cpu().double()
    for e in range(2):
        rows = slice(offsets[e], offsets[e + 1])
        assert torch.allclose(res[rows], a[rows].double() @ b[e].double().t(), rtol=1e-4, atol=1e-4)


def test_tma_fallback_decisions():
    cfg = configs.GemmConfig(16, 64, 64, 1, tma=True)
    ok_a = torch.zeros(40, 128, dtype=torch.int8)
    ok_b = torch.zeros(2, 64, 128, dtype=torch.int8)
    assert grouped_gemm.tma_fallback_reason(ok_a, ok_b, cfg) is None
    assert "TMA off" in grouped_gemm.tma_fallback_reason(ok_a, ok_b, _pointer_twin(cfg))
    # int8 rows of 200 bytes are not 16-byte aligned; fp16 rows of 400 bytes are
    assert "multiple of 16" in grouped_gemm.tma_fallback_reason(torch.zeros(4, 200, dtype=torch.int8), torch.zeros(2, 8, 200, dtype=torch.int8), cfg)
    assert grouped_gemm.tma_fallback_reason(torch.zeros(4, 200).half(), torch.zeros(2, 8, 200).half(), cfg) is None
    # a contiguous view whose base is 8 bytes past an aligned allocation
    shifted = torch.zeros(8 + 9 * 32, dtype=torch.int8)[8:].view(9, 32)
    assert shifted.is_contiguous()
    assert "aligned" in grouped_gemm.tma_fallback_reason(shifted, torch.zeros(2, 8, 32, dtype=torch.int8), cfg)
    assert "contiguous" in grouped_gemm.tma_fallback_reason(ok_a.t().contiguous().t()[:, :64], ok_b, cfg)


@pytest.mark.parametrize("k,shift", [(200, 0), (48, 8)], ids=["k_unaligned", "base_unaligned"])
def test_grouped_gemm_tma_falls_back(k, shift, caplog):
    """A TMA config on operands TMA cannot read runs the pointer kernel, with the same result, and
    says so (once per reason)."""
    grouped_gemm._log_tma_fallback.cache_clear()
    counts = [3, 0, 21]
    offsets_t, offsets = _segments(counts)
    m = offsets[-1]
    g = torch.Generator().manual_seed(k)
    a_host = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
    a = torch.zeros(shift + m * k, dtype=torch.int8, device=DEVICE)[shift:].view(m, k)
    a.copy_(a_host.to(DEVICE))
    b = torch.randint(-127, 128, (3, 40, k), generator=g, dtype=torch.int8)
    sa = torch.rand(m, 1, generator=g) + 0.5
    sb = torch.rand(3, 40, 1, generator=g) / 100
    cfg = configs.GemmConfig(16, 32, 64, 1, tma=True, persistent=True, num_stages=2)
    reason = grouped_gemm.tma_fallback_reason(a, b.to(DEVICE), cfg)
    assert reason is not None
    with caplog.at_level(logging.INFO, logger="epmoe"):
        res = grouped_gemm.grouped_gemm_contiguous(
            a, b.to(DEVICE), offsets_t.to(DEVICE), mode="int8_channel", a_scale=sa.to(DEVICE), b_scale=sb.to(DEVICE),
            accumulator="int32", out_dtype=torch.float32, config=cfg,
        ).cpu().double()
    assert f"grouped GEMM config with TMA=True runs the pointer kernel: {reason}" in caplog.text
    a64 = a_host.double() * sa.double()
    for e in range(3):
        rows = slice(offsets[e], offsets[e + 1])
        assert torch.allclose(res[rows], a64[rows] @ (b[e].double() * sb[e].double()).t(), rtol=1e-5, atol=1e-5)


def test_gemm_config_tma_fields_round_trip():
    old = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 256, "GROUP_M": 8, "SWAP_AB": False, "num_warps": 8, "num_stages": 3}
    cfg = configs.GemmConfig.from_dict(old)
    assert not (cfg.tma or cfg.persistent or cfg.flatten)
    assert cfg.to_dict() == old, "entries without the TMA keys must round-trip unchanged"
    new = dict(old, TMA=True, PERSISTENT=True, num_warps=4)
    cfg = configs.GemmConfig.from_dict(new)
    assert cfg.tma and cfg.persistent and not cfg.flatten
    assert cfg.to_dict() == new and configs.GemmConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="need TMA"):
        configs.GemmConfig.from_dict(dict(old, PERSISTENT=True))
    with pytest.raises(ValueError, match="need TMA"):
        configs.GemmConfig.from_dict(dict(old, FLATTEN=True))
    with pytest.raises(ValueError, match="unknown config keys"):  # hung on an H200: not offered
        configs.GemmConfig.from_dict(dict(old, TMA=True, WARP_SPECIALIZE=True))
    with pytest.raises(ValueError, match="SWAP_AB"):
        configs.GemmConfig.from_dict(dict(old, TMA=True, SWAP_AB=True))
    with pytest.raises(ValueError, match="unknown config keys"):
        configs.GemmConfig.from_dict(dict(old, TMA_STORE=True))
    with pytest.raises(ValueError, match="SWAP_AB"):
        grouped_gemm.grouped_gemm_contiguous(
            torch.zeros(4, 64, device=DEVICE).half(), torch.zeros(1, 32, 64, device=DEVICE).half(),
            torch.tensor([0, 4], dtype=torch.int32, device=DEVICE), mode="bf16",
            config=configs.GemmConfig(16, 32, 64, swap_ab=True, tma=True),
        )


def test_tune_candidates_with_tma():
    from benchmarks import tune

    for mode in (*tune.MODES, *tune.EXTRA_MODES):
        kmode, _ = tune.kernel_mode(mode)
        for m in (8, 32, 128, 512, 2048):
            cands = tune.candidates(mode, m)
            assert len(cands) == len(set(cands)) <= 24
            assert not any(c.tma for c in tune.candidates(mode, m, tma=False))
            assert any(c.tma and c.persistent for c in cands) == (m > 64)
            for c in cands:
                configs.GemmConfig.from_dict(c.to_dict())  # validates
                assert c.smem_bytes(2 if kmode == "bf16" else 1) <= tune.SMEM_BYTES
                assert kmode != "int8_block" or 128 % c.block_k == 0
    # benchmarks/tune.py can regenerate every shipped H200 TMA entry of the tuned buckets.
    table = _shipped_table()["configs"]
    checked = 0
    for mode, shapes in table.items():
        for buckets in shapes.values():
            for bucket, entry in buckets.items():
                cfg = configs.GemmConfig.from_dict(entry)
                if cfg.tma:
                    assert cfg in tune.candidates(mode, int(bucket)), (mode, bucket, entry)
                    checked += 1
    assert checked >= 6


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    """A config table directory for this device: write ``{"configs": ...}`` (or a whole table)
    through the returned function; the table cache is cleared before and after."""

    def write(data):
        name = configs.device_name(DEVICE)
        (tmp_path / configs.config_filename(name)).write_text(json.dumps(dict(data, device=name)))

    monkeypatch.setenv("EPMOE_CONFIG_DIR", str(tmp_path))
    configs.load_table.cache_clear()
    yield write
    monkeypatch.delenv("EPMOE_CONFIG_DIR")
    configs.load_table.cache_clear()


def _shipped_table() -> dict:
    return json.loads((configs.PACKAGE_DIR / "NVIDIA_H200.json").read_text())


def test_get_config_reads_tma_entries(config_dir):
    entry = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 3,
             "TMA": True, "PERSISTENT": True}
    config_dir({"configs": {"int8_channel_int32": {"N=4096,K=7168": {"512": entry}}}})
    cfg = configs.get_config("int8_channel", 4096, 7168, 300, device=DEVICE, accumulator="int32")
    assert cfg.tma and cfg.persistent and cfg.to_dict() == dict(entry, SWAP_AB=False)
    # the fp32-accumulator lookup does not see the int32 entry
    assert not configs.get_config("int8_channel", 4096, 7168, 300, device=DEVICE, accumulator="fp32").tma


def test_int8_block_entry_with_a_long_k_step_is_refused(config_dir):
    entry = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 256, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
    config_dir({"configs": {"int8_block": {"N=4096,K=7168": {"512": entry}}}})
    path = configs.find_config_file(configs.config_filename(configs.device_name(DEVICE)))
    assert str(path).startswith(os.environ["EPMOE_CONFIG_DIR"])  # the user's table, named by its path
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: int8_block N=4096,K=7168 bucket 512: BLOCK_K=256; "
                                         r"allowed: a BLOCK_K dividing 128 \(the scale block\)$"):
        configs.get_config("int8_block", 4096, 7168, 300, device=DEVICE)


def test_int32_entries_override_bucket_by_bucket(config_dir):
    small = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "GROUP_M": 1, "SWAP_AB": True, "num_warps": 4, "num_stages": 4}
    big = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 256, "GROUP_M": 8, "SWAP_AB": False, "num_warps": 8, "num_stages": 3}
    big32 = dict(big, BLOCK_N=256, BLOCK_K=128, num_stages=4, TMA=True)
    config_dir({"configs": {
        "int8_channel": {"N=4096,K=7168": {"8": small, "2048": big}},
        "int8_channel_int32": {"N=4096,K=7168": {"2048": big32}},  # only the large bucket tuned
    }})
    get = lambda m, acc: configs.get_config("int8_channel", 4096, 7168, m, device=DEVICE, accumulator=acc).to_dict()  # noqa: E731
    assert get(8, "int32") == small  # not the int32 table's only (large) bucket
    assert get(2048, "int32") == big32
    assert get(2048, "fp32") == big


def test_get_config_picks_the_bucket_pick_bucket_picks(config_dir):
    """get_config's pre-sorted lookup gives, at every bucket edge and between, the entry
    pick_bucket chooses from the raw table (the shipped H200 file, under this device's name)."""
    shipped = _shipped_table()
    config_dir(shipped)
    checked = 0
    for mode, shapes in shipped["configs"].items():
        if mode == configs.INT32_ACC_MODE:
            continue
        for shape, buckets in shapes.items():
            n, k = (int(p.split("=")[1]) for p in shape.split(","))
            edges = sorted(int(b) for b in buckets)
            for m in {0.5, *edges, *(b + 0.5 for b in edges), *(b - 1 for b in edges), 10 * edges[-1]}:
                want = configs.GemmConfig.from_dict(configs.pick_bucket(buckets, m))
                if mode == "int8_block" and 128 % want.block_k:
                    want = dataclasses.replace(want, block_k=128)
                assert configs.get_config(mode, n, k, m, device=DEVICE) == want, (mode, shape, m)
                checked += 1
    assert checked > 50


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


@pytest.mark.parametrize("granularity,dtype", [("token", torch.int8), ("group", torch.int8), ("group", torch.float8_e4m3fn)])
@pytest.mark.parametrize("slab", [False, True], ids=["flat", "spare_slab"])
def test_activation_skips_rows_of_no_expert(granularity, dtype, slab, monkeypatch):
    """``row_expert``: rows of expert -1 (a padded layout's padding) are neither read nor written
    (their outputs keep what the allocator left: a poison value here); the other rows equal the
    unmasked call's bit for bit. Over the spare-row slab ([1, M, 2I] with a row bound) as the
    CUTLASS backend runs it, too."""
    x = torch.randn(12, 256).half().to(DEVICE)
    row_expert = torch.tensor([0, -1, -1, -1, 1, 1, -1, -1, 3, -1, -1, -1], dtype=torch.int32, device=DEVICE)
    x[row_expert < 0] = float("nan")  # would reach the masked rows' outputs if they were computed
    want_q, want_s = activation.silu_and_mul_quant(x, granularity, 128, dtype)
    real_empty = torch.empty

    def poisoned_empty(*shape, dtype=None, device=None, **kw):
        out = real_empty(*shape, dtype=dtype, device=device, **kw)
        return out.fill_(7 if dtype == torch.int8 else 1234.0) if dtype in (torch.int8, torch.float32) else out

    monkeypatch.setattr(quantize.torch, "empty", poisoned_empty)
    kw = dict(masked_m=torch.tensor([9], dtype=torch.int32, device=DEVICE), expected_m=2) if slab else {}
    q, s = activation.silu_and_mul_quant(x.unsqueeze(0) if slab else x, granularity, 128, dtype, row_expert=row_expert, **kw)
    q, s = (q[0], s[0]) if slab else (q, s)
    keep = (row_expert >= 0).cpu()
    if slab:
        keep[9:] = False  # past the slab's bound
    assert torch.equal(q.cpu()[keep].view(torch.uint8), want_q.cpu()[keep].view(torch.uint8))
    assert torch.equal(s.cpu()[keep], want_s.cpu()[keep])
    assert (s.cpu()[~keep] == 1234.0).all()
    if dtype == torch.int8:
        assert (q.cpu()[~keep] == 7).all()


@pytest.mark.parametrize("lead", [(12,), (1, 12)], ids=["flat", "slab"])
def test_activation_scales_mn_major(lead):
    """``scale_mn_major``: the same scales, stored as the CUTLASS kernels read them (the first M
    columns of a [groups, M rounded up to 4] buffer, seen transposed); token scales refuse it."""
    x = torch.randn(*lead, 512).half().to(DEVICE)
    want_q, want_s = activation.silu_and_mul_quant(x, "group", 128, torch.float8_e4m3fn)
    q, s = activation.silu_and_mul_quant(x, "group", 128, torch.float8_e4m3fn, scale_mn_major=True)
    assert s.shape == want_s.shape and s.stride()[-2:] == (1, 12)
    assert torch.equal(s, want_s) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    with pytest.raises(ValueError, match="scale_mn_major=True needs granularity='group'"):
        activation.silu_and_mul_quant(x, "token", scale_mn_major=True)


@pytest.mark.parametrize("lead", [(10,), (1, 10)], ids=["flat", "slab"])
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "e4m3"])
def test_group_quant_scales_mn_major(lead, dtype):
    """``per_group_quant(scale_mn_major=True)``: the same codes and scales, stored as the CUTLASS
    block-scaled GEMMs read them (a [groups, M rounded up to 4] buffer seen transposed), so they
    need no transposing copy per GEMM; the requantizing path (int8 codes with scales in) too."""
    x = torch.randn(*lead, 384).to(DEVICE)
    want_q, want_s = quantize.per_group_quant(x, 128, dtype)
    q, s = quantize.per_group_quant(x, 128, dtype, scale_mn_major=True)
    assert s.shape == want_s.shape and s.stride()[-2:] == (1, 12)
    assert torch.equal(s, want_s) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    xq, xs = quantize.per_token_quant_int8(x)
    want_q, want_s = quantize.per_group_quant(xq, 128, dtype, xs)
    q, s = quantize.per_group_quant(xq, 128, dtype, xs, scale_mn_major=True)
    assert s.stride()[-2:] == (1, 12) and torch.equal(s, want_s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_row_expert_must_match_the_rows():
    x = torch.randn(4, 256, device=DEVICE)
    with pytest.raises(ValueError, match=r"row_expert must be an int32 \[4\] tensor"):
        activation.silu_and_mul_quant(x, "group", row_expert=torch.zeros(4, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match=r"row_expert must be an int32 \[4\] tensor"):
        activation.silu_and_mul_quant(x, "group", row_expert=torch.zeros(3, dtype=torch.int32, device=DEVICE))


ACT_LAUNCHES = [None, Launch(4, 512, 4), Launch(1, 128, 4), Launch(8, 256, 8)]


@pytest.mark.parametrize("launch", ACT_LAUNCHES, ids=["default", "4rows", "two_pass", "8rows"])
@pytest.mark.parametrize("granularity,dtype", [("token", torch.int8), ("group", torch.int8), ("group", torch.float8_e4m3fn)])
def test_silu_and_mul_quant_launches_exact(launch, granularity, dtype):
    """Codes and scales are exactly the rule applied to the kernel's own fp32 product.

    ``silu_and_mul(.., float32)`` returns that product (same expression, same device), so this
    pins the quantization bit for bit whatever exp's last ulp does. I=384 with 128-column blocks
    takes three passes per row for "token"; 33 rows leave partial programs.
    """
    torch.manual_seed(6)
    x = (torch.randn(33, 2 * 384) * 2).half()
    x[4, 10] = float("nan")  # gate of row 4
    x[9, 384 + 200] = float("inf")  # up of row 9 (group 1)
    x[9, 200] = 1.0  # silu(1) * inf = inf, not NaN
    h = activation.silu_and_mul(x.to(DEVICE), torch.float32).cpu()
    q, s = activation.silu_and_mul_quant(x.to(DEVICE), granularity, 128, dtype, launch=launch)
    q, s = q.cpu().double(), s.cpu()
    group = None if granularity == "token" else 128
    qmax = 127.0 if dtype == torch.int8 else 448.0
    finite = [r for r in range(33) if r not in (4, 9)]
    rq, rs = ref_quant(h[finite], group, qmax, e4m3=dtype != torch.int8)
    assert torch.equal(q[finite], rq) and torch.equal(s[finite].double(), rs.reshape(len(finite), -1))
    if granularity == "token":
        assert math.isnan(float(s[4, 0])) and float(s[9, 0]) == float("inf")
        assert torch.all(q[4] == 0) and torch.all(q[9] == 0)
    else:
        assert math.isnan(float(s[4, 0])) and torch.isfinite(s[4, 1:]).all()
        assert float(s[9, 1]) == float("inf") and torch.isfinite(s[9, [0, 2]]).all()
        rq9, rs9 = ref_quant(h[9:10, 256:], 128, qmax, e4m3=dtype != torch.int8)
        assert torch.equal(q[9, 256:], rq9[0]) and torch.all(q[9, 128:256] == 0)


@pytest.mark.parametrize("launch", [Launch(4, 128, 4), Launch(1, 512, 4), Launch(2, 64, 2)], ids=str)
def test_silu_and_mul_launches(launch):
    x = (torch.randn(7, 5, 2 * 160) * 3).half()
    y = activation.silu_and_mul(x.to(DEVICE), torch.float32, launch=launch)
    assert y.shape == (7, 5, 160)
    assert torch.allclose(y.cpu().double(), _silu_mul64(x), rtol=1e-5, atol=1e-5)
    assert torch.equal(y, activation.silu_and_mul(x.to(DEVICE), torch.float32))


@pytest.mark.parametrize("expected_m,masked", MASKED_HINTS, ids=str)
@pytest.mark.parametrize("granularity", ["token", "group"])
def test_activation_masked_rows_across_experts(granularity, expected_m, masked, monkeypatch):
    x = torch.randn(3, 5, 256).half()
    x[0, 2:] = float("nan")
    masked = torch.tensor(masked, dtype=torch.int32)
    h = activation.silu_and_mul(x.to(DEVICE), torch.float32).cpu()
    xd, md = x.to(DEVICE), masked.to(DEVICE)
    _poisoned_empty(monkeypatch)
    hint = dict(masked_m=md, expected_m=expected_m)
    q, s = activation.silu_and_mul_quant(xd, granularity, 128, torch.int8, **hint, launch=Launch(4, 128, 4))
    y = activation.silu_and_mul(xd, torch.float32, **hint, launch=Launch(2, 64, 4))
    monkeypatch.undo()
    group = None if granularity == "token" else 128
    for e, n in enumerate(masked.tolist()):
        assert torch.all(q[e, n:] == -128) and torch.all(s[e, n:] == -1.0), "a row past masked_m was written"
        assert torch.all(y[e, n:] == -1.0) and torch.equal(y[e, :n].cpu(), h[e, :n])
        rq, rs = ref_quant(h[e, :n], group)
        assert torch.equal(q[e, :n].cpu().double(), rq) and torch.equal(s[e, :n].cpu().double(), rs.reshape(s[e, :n].shape))


@pytest.mark.parametrize("call", ["token", "group", "silu", "silu_quant"])
def test_expected_m_needs_masked_m_and_a_positive_int(call):
    x = torch.randn(2, 4, 256, device=DEVICE)
    run = {
        "token": lambda **kw: quantize.per_token_quant_int8(x, **kw),
        "group": lambda **kw: quantize.per_group_quant(x, 128, **kw),
        "silu": lambda **kw: activation.silu_and_mul(x, **kw),
        "silu_quant": lambda **kw: activation.silu_and_mul_quant(x, **kw),
    }[call]
    with pytest.raises(ValueError, match="expected_m=3 sizes the grid of a masked batch; pass masked_m with it"):
        run(expected_m=3)
    with pytest.raises(ValueError, match="expected_m=0 must be a positive integer"):
        run(masked_m=torch.tensor([1, 2], dtype=torch.int32, device=DEVICE), expected_m=0)


@pytest.mark.parametrize(
    "kw,err,match",
    [
        (dict(granularity="block"), ValueError, "granularity='block'; allowed: 'token', 'group'"),
        (dict(granularity="token", dtype=torch.float8_e4m3fn), TypeError, "with granularity='token'; allowed: int8"),
        (dict(granularity="group", dtype=torch.float16), TypeError, "dtype=torch.float16; allowed: torch.int8"),
        (dict(granularity="group", group_size=100), ValueError, "group_size=100; must be a power of two >= 16"),
        (dict(granularity="group", group_size=256), ValueError, "I=128 is not a multiple of group_size=256"),
    ],
)
def test_silu_and_mul_quant_argument_errors(kw, err, match):
    with pytest.raises(err, match=match):
        activation.silu_and_mul_quant(torch.randn(3, 256, device=DEVICE), **kw)


def test_row_grid_follows_the_hint():
    from epmoe.kernels.common import row_plan

    md = torch.tensor([3, 0, 9], dtype=torch.int32)
    shape = torch.Size([3, 256, 64])
    assert row_plan(None, shape, "cpu").grid(768, 4) == (192, 1)
    assert row_plan(md, shape, "cpu").grid(768, 4) == (192, 64)  # no hint: the capacity
    plan = row_plan(md, shape, "cpu", expected_m=8)
    assert plan.rows == 24 and plan.grid(768, 4) == (6, 2)  # two programs per expert
    assert row_plan(md, shape, "cpu", expected_m=1000).grid(768, 1) == (768, 256)


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
    ref = gather_reference(expert_out, batch.slot_pos, w)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert torch.allclose(got.double(), ref, rtol=1e-6, atol=1e-6)
    assert torch.all(got[0] == 0)
    assert torch.allclose(got, torch_gather_weighted(expert_out, batch.slot_pos, w))


# ---------------------------------------------------------------- configs


def test_shipped_config_files_are_valid():
    # The folder also holds the cutlass backend's data (int8_crossover.json, int8_block_schedule.json)
    # and the dense INT8 tables (dense_int8_<device>.json), each with its own tests
    # (test_fp8_selection.py, test_dense_configs.py).
    others = {"int8_crossover.json", "int8_block_schedule.json"}
    files = sorted(p for p in configs.PACKAGE_DIR.glob("*.json") if p.name not in others and not p.name.startswith("dense_int8_"))
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


def test_grouped_gemm_tma_leaves_the_callers_triton_allocator():
    """The TMA kernel builds its A descriptors on the device, in global scratch from an allocator
    set for the launch only: it runs with no allocator set (Triton's default raises) and with one
    the caller set, which it neither calls nor replaces."""
    from triton.runtime import _allocation

    counts = [5, 0, 19]
    cfg = configs.GemmConfig(16, 32, 64, 1, tma=True, persistent=True, num_stages=2)
    calls = []

    def callers_allocator(size, alignment, stream):
        calls.append(size)
        raise RuntimeError("the caller's allocator was used")

    def body():
        run, offsets, a64, b64 = _contiguous_run("int8_channel", "int32", counts, cfg, n=32, k=64, align=1)
        plain = run(cfg)
        triton.set_allocator(callers_allocator)
        again = run(cfg)
        assert _allocation._allocator.get() is callers_allocator
        return plain, again, offsets, a64, b64

    plain, again, offsets, a64, b64 = contextvars.copy_context().run(body)
    assert calls == []
    assert torch.equal(plain, again)
    for e in range(len(counts)):
        rows = slice(offsets[e], offsets[e + 1])
        assert torch.allclose(plain[rows].double(), a64[rows] @ b64[e].t(), rtol=1e-5, atol=1e-5)


def test_tma_launch_runs_under_the_scratch_allocator(monkeypatch):
    """The interpreter never asks for global scratch, so on CPU this checks the launcher itself:
    the kernel is launched while a torch allocator is set, and the caller's is back after."""
    from triton.runtime import _allocation

    seen = []

    class Stub:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(_allocation._allocator.get()(256, 128, None))
            return launch

    monkeypatch.setattr(grouped_gemm, "_grouped_gemm_tma_kernel", Stub())
    before = _allocation._allocator.get()
    cfg = configs.GemmConfig(16, 32, 64, 1, tma=True, persistent=True, num_stages=2)
    a = torch.randint(-127, 128, (24, 64), dtype=torch.int8, device=DEVICE)
    b = torch.randint(-127, 128, (2, 32, 64), dtype=torch.int8, device=DEVICE)
    grouped_gemm.grouped_gemm_contiguous(
        a, b, torch.tensor([0, 10, 24], dtype=torch.int32, device=DEVICE), mode="int8_channel",
        a_scale=torch.ones(24, 1, device=DEVICE), b_scale=torch.ones(2, 32, 1, device=DEVICE),
        accumulator="int32", config=cfg,
    )
    assert len(seen) == 1 and seen[0].dtype == torch.int8 and seen[0].numel() == 256
    assert seen[0].device.type == DEVICE.type
    assert _allocation._allocator.get() is before


def test_with_scratch_allocator_sets_a_torch_allocator_for_the_launch_only():
    from triton.runtime import _allocation

    def launch():
        buf = _allocation._allocator.get()(384, 128, None)
        return buf

    before = _allocation._allocator.get()
    buf = grouped_gemm.with_scratch_allocator(DEVICE, launch)
    assert isinstance(buf, torch.Tensor) and buf.numel() == 384 and buf.dtype == torch.int8
    assert buf.device.type == DEVICE.type
    assert _allocation._allocator.get() is before


def test_dependent_launch_switch(monkeypatch):
    """``EPMOE_PDL``: unset or ``1`` is on where supported (never on CPU), ``0`` is off everywhere,
    anything else is refused naming the variable, the value and what is allowed."""
    from epmoe.kernels.pdl import dependent, pdl_enabled

    cpu = torch.device("cpu")
    monkeypatch.delenv("EPMOE_PDL", raising=False)
    assert not pdl_enabled(cpu) and dependent(cpu) == {"PDL": False}
    monkeypatch.setenv("EPMOE_PDL", "0")
    assert not pdl_enabled(cpu)
    monkeypatch.setenv("EPMOE_PDL", "yes")
    with pytest.raises(ValueError, match=r"EPMOE_PDL='yes'.*allowed: '0'.*'1'"):
        pdl_enabled(cpu)
    # Where the device supports it: the kernel's flag and the launch option go together; never
    # under Triton's interpreter, which cannot run the device calls.
    monkeypatch.setattr("epmoe.kernels.pdl.pdl_supported", lambda device: True)
    for interpret, value, pdl, on in (("0", "1", True, True), ("0", "1", False, False), ("0", "0", True, False),
                                      ("1", "1", True, False)):  # fmt: skip
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        monkeypatch.setenv("EPMOE_PDL", value)
        assert dependent(cpu, pdl) == ({"PDL": True, "launch_pdl": True} if on else {"PDL": False})
