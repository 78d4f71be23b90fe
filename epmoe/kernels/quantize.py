"""Activation quantizers in Triton: per token (INT8) and per 1 x group (INT8 or FP8 e4m3).

Both follow the one rounding rule of :mod:`epmoe.quant.reference`: ``scale = max(amax, 1e-10) /
qmax`` in fp32, ``q = x / scale`` rounded to nearest with ties to even, clamped to ``+-qmax``.

The kernels are bound by memory bandwidth, so the per-element work is kept to a few instructions
while staying bit-exact:

- **One read.** A program owns a ``[BLOCK_M, BLOCK_K]`` tile (several rows, or several groups of
  several rows) and keeps it in registers between the amax and the quantization. Only rows longer
  than the single-pass limit are read twice (two passes over ``BLOCK_K`` chunks).
- **Division without a divide.** ``x / scale`` must be the correctly rounded quotient (torch
  divides in IEEE). Each row (group) forms ``rcp = div_rn(1, scale)`` once; each element then
  takes ``q = x * rcp`` and two residual corrections ``q += fma(-q, scale, x) * rcp`` (fused), which
  by Markstein's theorem give exactly ``div_rn(x, scale)`` (no underflow matters here: quotients
  small enough for it round to code 0).
- **Rounding by a magic number.** ``y + 1.5 * 2**23`` rounds ``y`` to an integer with ties to even
  (``|y| <= 128`` here) and the integer sits in the low bits of the sum, so the INT8 code is the
  sum's low byte. e4m3 uses the same trick with a magic number of the value's own binade, so the
  interpreter (whose fp8 cast is not round-to-nearest-even) and the GPU give the same codes.
- **No clamps.** ``|x| <= amax`` and ``scale = RN(amax / qmax)`` bound ``|x / scale|`` by
  ``qmax * (1 + 2**-23)``, which rounds to ``qmax``: clamping would never change a code.
- **NaN / Inf.** The amax is an integer max of the sign-cleared bits, which orders NaN above Inf
  above every finite value: a NaN in a row (group) makes its scale NaN and an Inf makes it Inf.
  Every code of such a row (group) is zero (e4m3 keeps the sign of ``x / inf``: -0 for x < 0);
  other rows are untouched because every program owns whole rows (groups).

Both quantizers also take an already quantized input with its scales (``x_scale``): they
dequantize on the fly, which is how FP8 1x128 activations from low-latency dispatch become INT8.

Launch parameters (rows per program, columns per program, warps) come from
:func:`token_launch` / :func:`group_launch`; both quantizers take an explicit ``launch``
(:class:`Launch`) so a GPU sweep can compare them (the sweep script is not part of the package).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..tensors import as_contiguous
from .common import INTERPRETER_TILE, RowPlan, check_scale_input, mn_major_scales, next_pow2, placeholder, row_plan
from .pdl import dependent, dependent_start

AMAX_FLOOR = 1e-10
INT8_QMAX = 127.0
E4M3_QMAX = 448.0

SINGLE_PASS_MAX = 16384
"""Longest row (elements, power of two) a per-token program holds in registers at once."""
TARGET_TILE = 8192
"""Elements per program the default launch aims at."""
VALUES_PER_THREAD = 16
"""Elements per thread the default launch aims at (num_warps = tile / (32 * this), 4..16)."""
MIN_PROGRAMS = 128
"""Below this many row blocks the default launch stops stacking rows (keeps SMs busy)."""


class Launch(NamedTuple):
    """Tile of one program: ``block_m`` rows x ``block_k`` columns, run by ``num_warps`` warps.

    Per token, ``block_k >= K`` quantizes from registers in one pass; a smaller ``block_k`` is
    the chunk of the two-pass loop. Per group, ``block_k`` is a multiple of the group size (the
    groups one program owns). All three are powers of two.
    """

    block_m: int
    block_k: int
    num_warps: int


def _warps(elements: int) -> int:
    return max(4, min(16, elements // (32 * VALUES_PER_THREAD)))


def _on_cpu(device) -> bool:
    return device is not None and torch.device(device).type == "cpu"


def _rows_per_prog(m: int, block_k: int, device: torch.device | str | None = None) -> int:
    """Rows that fill a ``TARGET_TILE`` tile, as long as ``MIN_PROGRAMS`` row blocks remain.

    On CPU (Triton's interpreter, which runs programs one after another) a few large programs
    are much faster: up to ``INTERPRETER_TILE`` elements, whatever the program count.
    """
    if _on_cpu(device):
        return max(1, min(next_pow2(m), INTERPRETER_TILE // block_k))
    rows = max(1, TARGET_TILE // block_k)
    while rows > 1 and m < rows * MIN_PROGRAMS:
        rows //= 2
    return rows


LARGE_M = 16384
"""Rows from which the measured bandwidth-best launches of the tile rule apply (H200, 2026-11-30:
2048 elements of whole groups, or one row of up to 8192 elements, on 4 warps per program reached
0.93-1.00 of copy bandwidth at 32768 and 262144 rows; 16 warps reached 0.8-0.85): the group
launch, and the per-token one where :data:`STREAM_M`'s measured launches do not apply (the fused
SiLU variant, and row lengths not measured there)."""
TWO_PASS_BLOCK = 4096
"""Chunk of a per-token row too long for one pass (``K > SINGLE_PASS_MAX``)."""
STREAM_M = 1024
"""Rows from which the per-token quantizer of plain rows is bound by memory bandwidth rather than
latency, and the launches measured for it on the H200 apply (2026-12-02: rows of K = 1536, 2048,
7168, 16384 and 18432 at 1024, 4096 and 16384 rows, CUDA graphs, every candidate in turns); see
:func:`token_launch`."""


def token_launch(m: int, k: int, device: torch.device | str | None = None, *, silu: bool = False) -> Launch:
    """Default launch of a per-token kernel over ``m`` rows of ``k`` elements (``silu``: the
    fused ``silu(gate) * up`` variant, which reads two such rows).

    From ``STREAM_M`` rows, for plain rows, the measured launches (H200), each for the class of
    row lengths (one tile shape) it was measured on: a row of 4097-8192 elements alone on 4 warps
    (K = 7168; 8 warps were 5-7 % slower); from 4096 rows, four rows of 1025-2048 elements on 4
    warps (K = 1536 and 2048; the tile rule's 16 warps were 30-34 % slower at 4096 rows, one row a
    program 8-10 % slower at 16384, and the tile rule stayed ahead at 1024 rows); a row too long
    for one pass in 4096-element chunks on 8 warps (K = 18432; two rows on 16 warps were 3-6 %
    slower, one row on 4 warps 23 % slower at 16384 rows). Everything else takes the tile rule: up to ``TARGET_TILE`` elements
    a program on 4 to 16 warps (a 16384-element row on 8 warps, which the measurement confirmed),
    and from ``LARGE_M`` rows one row of up to 8192 elements on 4 warps."""
    block_k = next_pow2(k) if next_pow2(k) <= SINGLE_PASS_MAX else TWO_PASS_BLOCK
    if m >= STREAM_M and not silu and not _on_cpu(device):
        if k > SINGLE_PASS_MAX:
            return Launch(1, TWO_PASS_BLOCK, 8)
        if block_k == TARGET_TILE or (block_k == TARGET_TILE // 4 and m >= 4 * STREAM_M):
            return Launch(TARGET_TILE // block_k, block_k, 4)
    if m >= LARGE_M and block_k <= TARGET_TILE and not _on_cpu(device):
        return Launch(1, block_k, 4)
    block_m = _rows_per_prog(m, block_k, device)
    warps = _warps(block_m * block_k)
    if block_m == 1 and not _on_cpu(device):
        warps = min(warps, 8)  # one row of 8192-16384 elements: 8 warps beat 16 (H200)
    return Launch(block_m, block_k, warps)


def group_launch(m: int, k: int, group: int, device: torch.device | str | None = None) -> Launch:
    """Default launch of a per-group kernel: ``m`` rows of ``k / group`` groups of ``group``.

    A program takes whole groups: the largest power-of-two count that divides the groups of a
    row (so no program is half empty), at most a ``TARGET_TILE`` worth, or all of a row's groups
    when none divides; then as many rows as fill the tile.
    """
    groups = max(1, k // group)
    if m >= LARGE_M and not _on_cpu(device):
        per_prog = 1
        while per_prog * 2 * group <= 2048 and groups % (per_prog * 2) == 0:
            per_prog *= 2
        return Launch(max(1, 2048 // (per_prog * group)), per_prog * group, 4)
    cap = max(1, TARGET_TILE // group)
    per_prog = 1
    while per_prog * 2 <= cap and groups % (per_prog * 2) == 0:
        per_prog *= 2
    if per_prog < 4:
        per_prog = min(next_pow2(groups), cap)
    block_k = per_prog * group
    block_m = _rows_per_prog(m, block_k, device)
    return Launch(block_m, block_k, _warps(block_m * block_k))


def check_launch(launch: Launch, group: int | None = None) -> None:
    """Launch values must be powers of two (``block_k`` a multiple of ``group`` when given)."""
    for name, v in zip(launch._fields, launch):
        if v < 1 or v & (v - 1):
            raise ValueError(f"launch {name}={v} must be a power of two")
    if launch.num_warps > 32:
        raise ValueError(f"launch num_warps={launch.num_warps} must be <= 32")
    if group is not None and launch.block_k % group:
        raise ValueError(f"launch block_k={launch.block_k} must be a multiple of group_size={group}")


# ---------------------------------------------------------------- shared device functions


@triton.jit
def amax_bits(x, axis: tl.constexpr):
    """Bit pattern (int32) of ``max |x|`` along ``axis``: any NaN > Inf > every finite value.

    Non-negative floats order like their bit patterns, so an integer max of the sign-cleared
    bits is a NaN-propagating amax (a float max on the GPU drops NaNs; a custom NaN-aware
    combine function would run element by element in the interpreter).
    """
    return tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis)


@triton.jit
def scale_of(amax_bits, QMAX: tl.constexpr):
    """``fp32(max(amax, 1e-10) / qmax)`` (IEEE divide) from :func:`amax_bits`; NaN when the
    amax is NaN, Inf when it is Inf."""
    amax = amax_bits.to(tl.float32, bitcast=True)
    scale = tl.div_rn(tl.maximum(amax, 1e-10), QMAX)
    return tl.where(amax == amax, scale, float("nan"))


@triton.jit
def codes(x, scale, rcp, ok, QMAX: tl.constexpr, TO_E4M3: tl.constexpr):
    """Codes of ``x`` for ``scale`` (broadcast), as int8 (low byte) or e4m3-grid fp32 values.

    ``rcp`` is ``div_rn(1, scale)``; ``ok`` is False for rows (groups) with a non-finite scale,
    whose int8 codes are all 0 (e4m3: +-0). Needs ``|x| <= ~qmax * scale`` (true for every
    element of the row). Bit for bit what ``div_rn``, round and clamp gave before.
    """
    # div_rn(x, scale): Markstein's correction of x * RN(1/scale), applied twice (the first
    # makes the quotient faithful, the second correctly rounded). fma keeps each residual exact.
    # (Negating the broadcast scale, not y: Triton's unary minus is ``0 - y``, one more op.)
    neg_scale = -scale
    y0 = x * rcp
    y = tl.fma(tl.fma(y0, neg_scale, x), rcp, y0)
    y = tl.fma(tl.fma(y, neg_scale, x), rcp, y)
    if TO_E4M3:
        # Nearest multiple of the e4m3 step of y's binade (2**-9 below 2**-6), ties to even:
        # adding 1.5 * 2**(e + 20), whose ulp is that step, rounds y onto it.
        bits = y.to(tl.int32, bitcast=True)
        magic = (tl.maximum(bits & 0x7F800000, (127 - 6) << 23) + ((20 << 23) | 0x400000)).to(
            tl.float32, bitcast=True
        )
        q = (y + magic) - magic
        # A zero quotient takes its sign from the product (x / scale is -0 for x = -0, and for
        # every finite x < 0 of an Inf group; the corrections would add +0 to it). What is left
        # NaN (NaN groups; Inf elements) gets code +0, as before.
        q = tl.where(y0 == 0.0, y0, q)
        q = tl.where(q == q, q, 0.0)
    else:
        # y + 1.5 * 2**23 rounds to an integer, ties to even; its low byte is the int8 code.
        y = tl.where(ok, y, 0.0)
        q = (y + 12582912.0).to(tl.int32, bitcast=True).to(tl.int8)
    return q


@triton.jit
def codes_for(x, scale, QMAX: tl.constexpr, TO_E4M3: tl.constexpr):
    """:func:`codes` of ``x`` for ``scale`` (broadcast to it), with one exact reciprocal per scale."""
    return codes(x, scale, tl.div_rn(1.0, scale), scale < float("inf"), QMAX, TO_E4M3)


@triton.jit
def store_codes(Q, rows, cols, mask, x, scale, stride_qm, QMAX: tl.constexpr, TO_E4M3: tl.constexpr):
    """Quantize the ``[BLOCK_M, NG, GROUP]`` tile ``x`` with ``scale`` (broadcast to it: one per
    row or per group) and store the codes."""
    q = codes_for(x, scale, QMAX, TO_E4M3)
    tl.store(Q + rows[:, None, None] * stride_qm + cols, q.to(Q.dtype.element_ty), mask=mask)


@triton.jit
def row_segment(MASKED_M, M, CAP, PROGS, HAS_MASK: tl.constexpr):
    """This program's share of the rows: ``(first row of its segment (int64), rows in the
    segment, its first block, block step)``; the program takes blocks ``first, first + step,
    ...`` below ``rows / BLOCK_M``.

    Without a mask the ``M`` rows are one segment shared by the whole grid. With ``masked_m``
    (``[E, CAP, K]`` rows) ``PROGS`` programs share each expert's first ``masked_m[e]`` rows
    (clamped to ``CAP``), so the grid can follow the expected rows instead of the capacity: a
    decode batch fills a few rows of each expert's ``CAP``, and launching a program per
    capacity row costs more than the work when each program needs many registers.
    """
    pid = tl.program_id(0)
    if HAS_MASK:
        seg = pid // PROGS
        rows = tl.minimum(tl.load(MASKED_M + seg), CAP)
        base = seg.to(tl.int64) * CAP
        first = pid % PROGS
        step = PROGS
    else:
        rows = M
        base = tl.zeros([], dtype=tl.int64)
        first = pid
        step = tl.num_programs(0)
    return base, rows, first, step


@triton.jit
def row_block(base, n, b, BLOCK_M: tl.constexpr):
    """Rows of block ``b`` of a segment of ``n`` rows starting at ``base`` (see
    :func:`row_segment`), and which of them exist."""
    local = b * BLOCK_M + tl.arange(0, BLOCK_M)
    return base + local, local < n


@triton.jit
def keep_rows(ROW_EXPERT, rows, row_ok, HAS_ROW_MASK: tl.constexpr):
    """``row_ok`` without the rows whose expert is -1 (a contiguous layout's padding, which no valid
    output reads): their loads and stores are masked off, so a decode step's 128-row segments
    cost the work of their few valid rows."""
    if HAS_ROW_MASK:
        row_ok = row_ok & (tl.load(ROW_EXPERT + rows, mask=row_ok, other=-1) >= 0)
    return row_ok


@triton.jit
def load_tile(
    X, XS, rows, row_ok, col0, K, stride_xm, stride_xsm,
    HAS_XS: tl.constexpr, IN_GROUP: tl.constexpr, SILU: tl.constexpr, GROUP: tl.constexpr,
    NG: tl.constexpr,
):
    """``[BLOCK_M, NG, GROUP]`` fp32 tile of rows ``rows`` from column ``col0`` (0 past ``K``).

    With ``HAS_XS`` the input is dequantized by its ``IN_GROUP``-column scales. With ``SILU``
    the rows are ``[gate | up]`` of ``2K`` columns and the tile is ``silu(gate) * up``.
    """
    g = col0 // GROUP + tl.arange(0, NG)
    cols = g[None, :, None] * GROUP + tl.arange(0, GROUP)[None, None, :]
    mask = row_ok[:, None, None] & (cols < K)
    base = X + rows[:, None, None] * stride_xm + cols
    x = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    if SILU:
        up = tl.load(base + K, mask=mask, other=0.0).to(tl.float32)
        x = x / (1.0 + tl.exp(-x)) * up
    elif HAS_XS:
        xs_row = XS + rows[:, None, None] * stride_xsm
        if IN_GROUP % GROUP == 0:
            # One input scale per GROUP-column chunk: load [BLOCK_M, NG, 1] and broadcast.
            g_ok = row_ok[:, None, None] & (g[None, :, None] * GROUP < K)
            s = tl.load(xs_row + (g[None, :, None] * GROUP) // IN_GROUP, mask=g_ok, other=1.0)
        else:
            s = tl.load(xs_row + cols // IN_GROUP, mask=mask, other=1.0)
        x = x * s
    return x, cols, mask


# ---------------------------------------------------------------- kernels


@triton.jit
def token_quant_kernel(
    X, XS, Q, S, MASKED_M, ROW_EXPERT,
    M, K, CAP, PROGS,
    stride_xm, stride_xsm, stride_qm,
    QMAX: tl.constexpr, HAS_XS: tl.constexpr, HAS_MASK: tl.constexpr, HAS_ROW_MASK: tl.constexpr,
    IN_GROUP: tl.constexpr,
    SILU: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    SINGLE: tl.constexpr, PDL: tl.constexpr,
):
    """One INT8 scale per row of ``X`` (``SILU``: of ``silu(gate) * up``); see :func:`load_tile`
    and, for ``PDL``, :func:`~epmoe.kernels.pdl.dependent_start`."""
    dependent_start(PDL)
    NG: tl.constexpr = BLOCK_K // GROUP
    base, n, first, step = row_segment(MASKED_M, M, CAP, PROGS, HAS_MASK)
    for b in range(first, tl.cdiv(n, BLOCK_M), step):
        rows, row_ok = row_block(base, n, b, BLOCK_M)
        row_ok = keep_rows(ROW_EXPERT, rows, row_ok, HAS_ROW_MASK)
        if SINGLE:
            x, cols, mask = load_tile(
                X, XS, rows, row_ok, 0, K, stride_xm, stride_xsm, HAS_XS, IN_GROUP, SILU, GROUP, NG
            )
            scale = scale_of(tl.max(amax_bits(x, 2), 1), QMAX)
            tl.store(S + rows, scale, mask=row_ok)
            store_codes(Q, rows, cols, mask, x, scale[:, None, None], stride_qm, QMAX, False)
        else:
            # Rows too long for registers: amax over BLOCK_K chunks, then a second read (from L2).
            amax = tl.zeros([BLOCK_M], dtype=tl.int32)
            for k0 in range(0, K, BLOCK_K):
                x, cols, mask = load_tile(
                    X, XS, rows, row_ok, k0, K, stride_xm, stride_xsm, HAS_XS, IN_GROUP, SILU, GROUP, NG
                )
                amax = tl.maximum(amax, tl.max(amax_bits(x, 2), 1))
            scale = scale_of(amax, QMAX)
            tl.store(S + rows, scale, mask=row_ok)
            for k0 in range(0, K, BLOCK_K):
                x, cols, mask = load_tile(
                    X, XS, rows, row_ok, k0, K, stride_xm, stride_xsm, HAS_XS, IN_GROUP, SILU, GROUP, NG
                )
                store_codes(Q, rows, cols, mask, x, scale[:, None, None], stride_qm, QMAX, False)


@triton.jit
def group_quant_kernel(
    X, XS, Q, S, MASKED_M, ROW_EXPERT,
    M, K, CAP, PROGS,
    stride_xm, stride_xsm, stride_qm, stride_sm, stride_sg,
    QMAX: tl.constexpr, TO_E4M3: tl.constexpr, HAS_XS: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_ROW_MASK: tl.constexpr, IN_GROUP: tl.constexpr, SILU: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    """One scale per 1 x ``GROUP`` of ``X`` (``SILU``: of ``silu(gate) * up``); ``PDL``: see
    :func:`~epmoe.kernels.pdl.dependent_start`."""
    dependent_start(PDL)
    NG: tl.constexpr = BLOCK_K // GROUP
    base, n, first, step = row_segment(MASKED_M, M, CAP, PROGS, HAS_MASK)
    col0 = tl.program_id(1) * BLOCK_K
    g = col0 // GROUP + tl.arange(0, NG)
    for b in range(first, tl.cdiv(n, BLOCK_M), step):
        rows, row_ok = row_block(base, n, b, BLOCK_M)
        row_ok = keep_rows(ROW_EXPERT, rows, row_ok, HAS_ROW_MASK)
        x, cols, mask = load_tile(
            X, XS, rows, row_ok, col0, K, stride_xm, stride_xsm, HAS_XS, IN_GROUP, SILU, GROUP, NG
        )
        scale = scale_of(amax_bits(x, 2), QMAX)  # [BLOCK_M, NG]
        tl.store(S + rows[:, None] * stride_sm + g[None, :] * stride_sg, scale,
                 mask=row_ok[:, None] & (g[None, :] * GROUP < K))
        store_codes(Q, rows, cols, mask, x, scale[:, :, None], stride_qm, QMAX, TO_E4M3)


# ---------------------------------------------------------------- wrappers


def _rows_view(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() < 2:
        raise ValueError(f"{name} must have at least 2 dims [..., K]; got shape {tuple(x.shape)}")
    return x.reshape(-1, x.shape[-1]).contiguous()


def _check_input(x: torch.Tensor, x_scale: torch.Tensor | None) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor; got {type(x).__name__}")
    if x_scale is None and not x.is_floating_point():
        raise TypeError(f"x of dtype {x.dtype} needs x_scale to be dequantized; pass x_scale")
    if x_scale is not None:
        check_scale_input(x, x_scale)


def _scale_view(x_scale: torch.Tensor | None, k: int) -> tuple[torch.Tensor | None, int]:
    """2-D fp32 view of input scales and how many columns each scale covers (``None``, 1
    without input scales)."""
    if x_scale is None:
        return None, 1
    xs = as_contiguous(x_scale.reshape(-1, x_scale.shape[-1]), torch.float32)
    return xs, k // xs.shape[1]


def _operands(x, x_scale, masked_m, expected_m, row_expert=None):
    """Checked ``(x2 [M, K], input scales [M, S] or None, columns per input scale, x.shape,
    row plan)`` of a quantizer call."""
    _check_input(x, x_scale)
    plan = row_plan(masked_m, x.shape, x.device, expected_m, row_expert)
    x2 = _rows_view(x, "x")
    xs2, in_group = _scale_view(x_scale, x2.shape[1])
    return x2, xs2, in_group, x.shape, plan


def per_token_quant_int8(
    x: torch.Tensor,
    x_scale: torch.Tensor | None = None,
    *,
    masked_m: torch.Tensor | None = None,
    expected_m: int | None = None,
    row_expert: torch.Tensor | None = None,
    launch: Launch | None = None,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One INT8 scale per row.

    Args:
        x: ``[..., K]`` float (or int8/e4m3 with ``x_scale``).
        x_scale: optional ``[..., S]`` fp32 scales of an already quantized ``x`` (``S`` divides K).
        masked_m: optional ``[E]`` int32 valid rows per expert when ``x`` is ``[E, cap, K]``;
            rows past it are skipped and their outputs left unwritten.
        expected_m: with ``masked_m``, the rows per expert the batch is expected to fill: the
            grid and the launch follow it instead of ``cap`` (any ``masked_m`` is still covered).
        row_expert: optional int32 expert of every row (leading dims flattened; a contiguous
            layout's ``m_indices``): rows of -1 (padding) are skipped, their outputs left unwritten.
        launch: tile and warps of the kernel (checked); ``None``: :func:`token_launch`.
        pdl: launch as a programmatic dependent (:func:`~epmoe.kernels.pdl.dependent_start`) where
            :func:`~epmoe.kernels.pdl.pdl_enabled` (compute capability 9.0+ and ``EPMOE_PDL`` not
            ``0``); elsewhere a plain launch.

    Returns:
        ``q [..., K]`` int8 and ``scale [..., 1]`` fp32.
    """
    return token_quant(*_operands(x, x_scale, masked_m, expected_m, row_expert), launch, silu=False, pdl=pdl)


def token_quant(
    x2, xs2, in_group: int, shape, plan: RowPlan, launch: Launch | None, *, silu: bool, out=None, pdl: bool = False
):
    """Launch :func:`token_quant_kernel` over the rows of ``x2`` (``[M, 2K]`` with ``silu``,
    else ``[M, K]``; input scales ``xs2`` or ``None``); returns ``q`` and ``scale`` with the
    leading dims of ``shape``. ``out``: optional ``(q [M, K] int8, scale [M, 1] fp32)``
    row-contiguous tensors to write into (the first rows of a padded buffer, for a GEMM that
    wants whole row blocks); ``pdl``: as in :func:`per_token_quant_int8`."""
    m = x2.shape[0]
    k = x2.shape[1] // 2 if silu else x2.shape[1]
    if out is None:
        q = torch.empty((m, k), dtype=torch.int8, device=x2.device)
        s = torch.empty((m, 1), dtype=torch.float32, device=x2.device)
    else:
        q, s = out
    out_shape = (*shape[:-1], k)
    if m == 0 or k == 0:
        s.fill_(AMAX_FLOOR / INT8_QMAX)
        q.zero_()
        return q.reshape(out_shape), s.reshape(*shape[:-1], 1)
    if launch is None:
        launch = token_launch(plan.rows, k, x2.device, silu=silu)
    else:
        check_launch(launch)
    grid, progs = plan.grid(m, launch.block_m)
    xs = placeholder(x2.device, torch.float32) if xs2 is None else xs2  # never read without scales
    token_quant_kernel[(grid,)](
        x2, xs, q, s, plan.masked_m, plan.row_mask, m, k, plan.cap, progs,
        x2.stride(0), xs.stride(0), q.stride(0),
        QMAX=INT8_QMAX, HAS_XS=xs2 is not None, HAS_MASK=plan.masked, HAS_ROW_MASK=plan.row_expert is not None,
        IN_GROUP=in_group, SILU=silu, GROUP=min(128, launch.block_k), BLOCK_M=launch.block_m,
        BLOCK_K=launch.block_k, SINGLE=launch.block_k >= k, num_warps=launch.num_warps,
        **dependent(x2.device, pdl),
    )  # fmt: skip
    return q.reshape(out_shape), s.reshape(*shape[:-1], 1)


def per_group_quant(
    x: torch.Tensor,
    group_size: int = 128,
    dtype: torch.dtype = torch.int8,
    x_scale: torch.Tensor | None = None,
    *,
    masked_m: torch.Tensor | None = None,
    expected_m: int | None = None,
    row_expert: torch.Tensor | None = None,
    launch: Launch | None = None,
    pdl: bool = False,
    scale_mn_major: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per 1 x ``group_size`` group, INT8 (qmax 127) or FP8 e4m3 (qmax 448).

    Args:
        x: ``[..., K]`` float (or int8/e4m3 with ``x_scale``), ``K`` a multiple of ``group_size``.
        group_size: a power of two, at least 16.
        dtype: ``torch.int8`` or ``torch.float8_e4m3fn``.
        x_scale: optional ``[..., S]`` fp32 scales of an already quantized ``x``.
        masked_m, expected_m, row_expert: as in :func:`per_token_quant_int8`.
        launch: tile and warps of the kernel (checked); ``None``: :func:`group_launch`.
        pdl: as in :func:`per_token_quant_int8`.
        scale_mn_major: the scales stored MN-major (:func:`~epmoe.kernels.common.mn_major_scales`:
            the layout the project's CUTLASS block-scaled GEMMs read without a transposing copy),
            over ``x``'s rows with the leading dims flattened.

    Returns:
        ``q [..., K]`` of ``dtype`` and ``scale [..., K / group_size]`` fp32.
    """
    x2, xs2, in_group, shape, plan = _operands(x, x_scale, masked_m, expected_m, row_expert)
    return group_quant(x2, xs2, in_group, shape, plan, group_size, dtype, launch, silu=False, pdl=pdl,
                       scale_mn_major=scale_mn_major)  # fmt: skip


def _check_group_args(k: int, group_size: int, dtype: torch.dtype, name: str = "x's last dim K") -> None:
    """A group quantizer's arguments: ``dtype`` int8 or e4m3, ``group_size`` a power of two
    >= 16 dividing ``k``."""
    if dtype not in (torch.int8, torch.float8_e4m3fn):
        raise TypeError(f"dtype={dtype}; allowed: torch.int8, torch.float8_e4m3fn")
    if group_size < 16 or group_size & (group_size - 1):
        raise ValueError(f"group_size={group_size}; must be a power of two >= 16")
    if k % group_size:
        raise ValueError(f"{name}={k} is not a multiple of group_size={group_size}")


def group_quant(
    x2, xs2, in_group: int, shape, plan: RowPlan, group_size: int, dtype: torch.dtype,
    launch: Launch | None, *, silu: bool, scale_mn_major: bool = False, pdl: bool = False,
):
    """Launch :func:`group_quant_kernel` over the rows of ``x2`` (as in :func:`token_quant`, ``pdl``
    too);
    ``scale_mn_major``: the scales stored MN-major (:func:`~epmoe.kernels.common.mn_major_scales`,
    rows ``x2``'s rows)."""
    m = x2.shape[0]
    k = x2.shape[1] // 2 if silu else x2.shape[1]
    _check_group_args(k, group_size, dtype, "I" if silu else "x's last dim K")
    groups = k // group_size
    q = torch.empty((m, k), dtype=dtype, device=x2.device)
    if scale_mn_major:
        s = mn_major_scales(m, groups, x2.device)
    else:
        s = torch.empty((m, groups), dtype=torch.float32, device=x2.device)
    if m and groups:
        if launch is None:
            launch = group_launch(plan.rows, k, group_size, x2.device)
        else:
            check_launch(launch, group_size)
        grid, progs = plan.grid(m, launch.block_m)
        xs = placeholder(x2.device, torch.float32) if xs2 is None else xs2  # never read without scales
        group_quant_kernel[(grid, triton.cdiv(k, launch.block_k))](
            x2, xs, q, s, plan.masked_m, plan.row_mask, m, k, plan.cap, progs,
            x2.stride(0), xs.stride(0), q.stride(0), s.stride(0), s.stride(1),
            QMAX=INT8_QMAX if dtype == torch.int8 else E4M3_QMAX, TO_E4M3=dtype != torch.int8,
            HAS_XS=xs2 is not None, HAS_MASK=plan.masked, HAS_ROW_MASK=plan.row_expert is not None, IN_GROUP=in_group,
            SILU=silu, GROUP=group_size, BLOCK_M=launch.block_m, BLOCK_K=launch.block_k,
            num_warps=launch.num_warps, **dependent(x2.device, pdl),
        )  # fmt: skip
    return q.reshape(*shape[:-1], k), s.reshape(*shape[:-1], groups)
