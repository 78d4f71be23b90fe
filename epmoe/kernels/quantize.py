"""Activation quantizers in Triton: per token (INT8) and per 1 x group (INT8 or FP8 e4m3).

Both follow the one rounding rule of :mod:`epmoe.quant.reference`: ``scale = max(amax, 1e-10) /
qmax`` in fp32, ``q = x / scale`` rounded to nearest with ties to even, clamped to ``+-qmax``.

Rounding is done with floor arithmetic instead of ``libdevice.rint`` because Triton's interpreter
(the CPU test path) has no libdevice; the same code then runs on the GPU, so both paths agree.
The division uses ``div_rn`` (IEEE round-to-nearest) because Triton's plain ``/`` on fp32 lowers
to an approximate divide on NVIDIA GPUs, which would break bit-exact agreement with torch.

A NaN or Inf in a row (group) makes that row's (group's) scale non-finite; other rows are
untouched because every program owns whole rows (groups).

Both quantizers also take an already quantized input with its scales (``x_scale``): they
dequantize on the fly, which is how FP8 1x128 activations from low-latency dispatch become INT8.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import check_scale_input, masked_row_args, next_pow2

AMAX_FLOOR = 1e-10
INT8_QMAX = 127.0
E4M3_QMAX = 448.0


@triton.jit
def round_half_even(y):
    """Round to nearest, ties to even, exact for ``|y| < 2**23`` (all this package needs).

    ``y - floor(y)`` is exact in fp32 in that range, unlike ``floor(y + 0.5)`` which double-rounds
    just below one half.
    """
    r = tl.floor(y)
    frac = y - r
    r = tl.where(frac > 0.5, r + 1.0, r)
    is_odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where((frac == 0.5) & is_odd, r + 1.0, r)


@triton.jit
def round_to_e4m3(y):
    """Round fp32 ``y`` (already clamped to +-448) to the nearest e4m3 value, ties to even.

    Done in fp32 arithmetic so the interpreter (whose fp8 cast is not round-to-nearest-even)
    and the GPU give the same codes; the final cast of an exactly representable value is exact.
    """
    bits = y.to(tl.int32, bitcast=True)
    biased_exp = (bits >> 23) & 0xFF
    # e4m3 keeps 3 mantissa bits; below 2**-6 the spacing is fixed at 2**-9 (subnormals).
    step_exp = tl.maximum(biased_exp, 127 - 6) - 3
    step = (step_exp << 23).to(tl.float32, bitcast=True)
    return round_half_even(y / step) * step


@triton.jit
def quantize_values(x, scale, QMAX: tl.constexpr, TO_E4M3: tl.constexpr):
    """Codes of ``x`` for ``scale`` (broadcast), as fp32 values on the target grid."""
    y = tl.div_rn(x, scale)
    # Non-finite rows are flagged by their scale; zero codes keep the casts below defined.
    y = tl.where(y == y, y, 0.0)
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if TO_E4M3:
        q = round_to_e4m3(y)
    else:
        q = tl.minimum(tl.maximum(round_half_even(y), -QMAX), QMAX)
    return q


@triton.jit
def scale_from_amax(amax, has_nan, QMAX: tl.constexpr):
    """``max(amax, floor) / qmax``; NaN when the row had a NaN (a GPU ``max`` drops NaNs)."""
    scale = tl.div_rn(tl.maximum(amax, 1e-10), QMAX)
    return tl.where(has_nan, float("nan"), scale)


@triton.jit
def _load_dequant(X, XS, row, offs, mask, stride_xm, stride_xsm, IN_GROUP, HAS_XS: tl.constexpr):
    x = tl.load(X + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_XS:
        s = tl.load(XS + row * stride_xsm + offs // IN_GROUP, mask=mask, other=1.0)
        x = x * s
    return x


@triton.jit
def row_valid(MASKED_M, row, CAP, HAS_MASK: tl.constexpr):
    """Whether flat row ``row`` of an ``[E, cap, K]`` operand is below ``masked_m``."""
    if HAS_MASK:
        ok = (row % CAP) < tl.load(MASKED_M + row // CAP)
    else:
        ok = row >= 0
    return ok


@triton.jit
def _per_token_kernel(
    X, XS, Q, S, MASKED_M,
    K, CAP, IN_GROUP,
    stride_xm, stride_xsm, stride_qm,
    QMAX: tl.constexpr, TO_E4M3: tl.constexpr, HAS_XS: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    if row_valid(MASKED_M, row, CAP, HAS_MASK):
        offs = tl.arange(0, BLOCK)
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        nans = tl.zeros([BLOCK], dtype=tl.int32)
        for k0 in range(0, K, BLOCK):
            mask = offs + k0 < K
            x = _load_dequant(X, XS, row, offs + k0, mask, stride_xm, stride_xsm, IN_GROUP, HAS_XS)
            amax = tl.maximum(amax, tl.abs(x))
            nans = tl.maximum(nans, (x != x).to(tl.int32))
        scale = scale_from_amax(tl.max(amax, 0), tl.max(nans, 0) > 0, QMAX)
        tl.store(S + row, scale)
        for k0 in range(0, K, BLOCK):
            mask = offs + k0 < K
            x = _load_dequant(X, XS, row, offs + k0, mask, stride_xm, stride_xsm, IN_GROUP, HAS_XS)
            q = quantize_values(x, scale, QMAX, TO_E4M3)
            tl.store(Q + row * stride_qm + offs + k0, q.to(Q.dtype.element_ty), mask=mask)


@triton.jit
def _per_group_kernel(
    X, XS, Q, S, MASKED_M,
    K, CAP, IN_GROUP,
    stride_xm, stride_xsm, stride_qm, stride_sm,
    QMAX: tl.constexpr, TO_E4M3: tl.constexpr, HAS_XS: tl.constexpr, HAS_MASK: tl.constexpr,
    GROUP: tl.constexpr, GROUPS_PER_PROG: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    if row_valid(MASKED_M, row, CAP, HAS_MASK):
        g = tl.program_id(1) * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)
        offs = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        mask = offs < K
        x = _load_dequant(X, XS, row, offs, mask, stride_xm, stride_xsm, IN_GROUP, HAS_XS)
        amax = tl.max(tl.abs(x), 1)
        has_nan = tl.max((x != x).to(tl.int32), 1) > 0
        scale = scale_from_amax(amax, has_nan, QMAX)
        tl.store(S + row * stride_sm + g, scale, mask=g * GROUP < K)
        q = quantize_values(x, scale[:, None], QMAX, TO_E4M3)
        tl.store(Q + row * stride_qm + offs, q.to(Q.dtype.element_ty), mask=mask)


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


def per_token_quant_int8(
    x: torch.Tensor,
    x_scale: torch.Tensor | None = None,
    *,
    masked_m: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One INT8 scale per row.

    Args:
        x: ``[..., K]`` float (or int8/e4m3 with ``x_scale``).
        x_scale: optional ``[..., S]`` fp32 scales of an already quantized ``x`` (``S`` divides K).
        masked_m: optional ``[E]`` int32 valid rows per expert when ``x`` is ``[E, cap, K]``;
            rows past it are skipped and their outputs left unwritten.

    Returns:
        ``q [..., K]`` int8 and ``scale [..., 1]`` fp32.
    """
    _check_input(x, x_scale)
    shape = x.shape
    x2 = _rows_view(x, "x")
    m, k = x2.shape
    q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        s.fill_(AMAX_FLOOR / INT8_QMAX)
        q.zero_()
        return q.reshape(shape), s.reshape(*shape[:-1], 1)
    xs2, in_group = _scale_view(x_scale, k, x.device)
    mm, cap = masked_row_args(masked_m, shape, x.device)
    _per_token_kernel[(m,)](
        x2, xs2, q, s, mm, k, cap, in_group,
        x2.stride(0), xs2.stride(0), q.stride(0),
        QMAX=INT8_QMAX, TO_E4M3=False, HAS_XS=x_scale is not None, HAS_MASK=masked_m is not None,
        BLOCK=min(next_pow2(k), 8192),
    )
    return q.reshape(shape), s.reshape(*shape[:-1], 1)


def per_group_quant(
    x: torch.Tensor,
    group_size: int = 128,
    dtype: torch.dtype = torch.int8,
    x_scale: torch.Tensor | None = None,
    *,
    masked_m: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per 1 x ``group_size`` group, INT8 (qmax 127) or FP8 e4m3 (qmax 448).

    Args:
        x: ``[..., K]`` float (or int8/e4m3 with ``x_scale``), ``K`` a multiple of ``group_size``.
        group_size: a power of two, at least 16.
        dtype: ``torch.int8`` or ``torch.float8_e4m3fn``.
        x_scale: optional ``[..., S]`` fp32 scales of an already quantized ``x``.
        masked_m: as in :func:`per_token_quant_int8`.

    Returns:
        ``q [..., K]`` of ``dtype`` and ``scale [..., K / group_size]`` fp32.
    """
    _check_input(x, x_scale)
    if dtype not in (torch.int8, torch.float8_e4m3fn):
        raise TypeError(f"dtype={dtype}; allowed: torch.int8, torch.float8_e4m3fn")
    if group_size < 16 or group_size & (group_size - 1):
        raise ValueError(f"group_size={group_size}; must be a power of two >= 16")
    shape = x.shape
    k = shape[-1] if x.dim() else 0
    if k % group_size:
        raise ValueError(f"x's last dim K={k} is not a multiple of group_size={group_size}")
    x2 = _rows_view(x, "x")
    m = x2.shape[0]
    groups = k // group_size
    q = torch.empty((m, k), dtype=dtype, device=x.device)
    s = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m and groups:
        xs2, in_group = _scale_view(x_scale, k, x.device)
        mm, cap = masked_row_args(masked_m, shape, x.device)
        per_prog = min(next_pow2(groups), max(1, 2048 // group_size))
        qmax = INT8_QMAX if dtype == torch.int8 else E4M3_QMAX
        _per_group_kernel[(m, triton.cdiv(groups, per_prog))](
            x2, xs2, q, s, mm, k, cap, in_group,
            x2.stride(0), xs2.stride(0), q.stride(0), s.stride(0),
            QMAX=qmax, TO_E4M3=dtype != torch.int8, HAS_XS=x_scale is not None,
            HAS_MASK=masked_m is not None, GROUP=group_size, GROUPS_PER_PROG=per_prog,
        )
    return q.reshape(shape), s.reshape(*shape[:-1], groups)


def _scale_view(
    x_scale: torch.Tensor | None, k: int, device: torch.device
) -> tuple[torch.Tensor, int]:
    """2-D fp32 view of input scales and how many columns each scale covers."""
    if x_scale is None:
        return torch.empty((1, 1), dtype=torch.float32, device=device), k
    xs = x_scale.reshape(-1, x_scale.shape[-1]).float().contiguous()
    return xs, k // xs.shape[1]
