"""Fused ``silu(gate) * up`` between the two expert GEMMs, optionally requantized.

The input is GEMM1's output ``[..., 2I]`` (gate = first I columns, up = last I). The product is
formed in fp32 and either stored in a float dtype or quantized straight from fp32 (never from a
rounded bf16 copy) with the rounding rule of :mod:`.quantize`: one INT8 scale per row
(``int8_channel``) or one scale per 1 x 128 group (``int8_block``; e4m3 also allowed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import masked_row_args, next_pow2
from .quantize import E4M3_QMAX, INT8_QMAX, quantize_values, row_valid, scale_from_amax

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _silu_mul(X, row, cols, mask, I, stride_xm):
    base = X + row * stride_xm
    gate = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(base + I + cols, mask=mask, other=0.0).to(tl.float32)
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _silu_mul_kernel(X, Y, MASKED_M, I, CAP, stride_xm, stride_ym, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if row_valid(MASKED_M, row, CAP, HAS_MASK):
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < I
        h = _silu_mul(X, row, cols, mask, I, stride_xm)
        tl.store(Y + row * stride_ym + cols, h.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_token_quant_kernel(
    X, Q, S, MASKED_M, I, CAP, stride_xm, stride_qm,
    HAS_MASK: tl.constexpr, QMAX: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    if row_valid(MASKED_M, row, CAP, HAS_MASK):
        offs = tl.arange(0, BLOCK)
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        nans = tl.zeros([BLOCK], dtype=tl.int32)
        for c0 in range(0, I, BLOCK):
            mask = offs + c0 < I
            h = _silu_mul(X, row, offs + c0, mask, I, stride_xm)
            amax = tl.maximum(amax, tl.abs(h))
            nans = tl.maximum(nans, (h != h).to(tl.int32))
        scale = scale_from_amax(tl.max(amax, 0), tl.max(nans, 0) > 0, QMAX)
        tl.store(S + row, scale)
        # Recomputing the product is cheaper than holding a long row in registers; the second
        # read hits L2.
        for c0 in range(0, I, BLOCK):
            mask = offs + c0 < I
            h = _silu_mul(X, row, offs + c0, mask, I, stride_xm)
            q = quantize_values(h, scale, QMAX, False)
            tl.store(Q + row * stride_qm + offs + c0, q.to(Q.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_group_quant_kernel(
    X, Q, S, MASKED_M, I, CAP, stride_xm, stride_qm, stride_sm,
    HAS_MASK: tl.constexpr, QMAX: tl.constexpr, TO_E4M3: tl.constexpr,
    GROUP: tl.constexpr, GROUPS_PER_PROG: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    if row_valid(MASKED_M, row, CAP, HAS_MASK):
        g = tl.program_id(1) * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)
        cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        mask = cols < I
        h = _silu_mul(X, row, cols, mask, I, stride_xm)
        amax = tl.max(tl.abs(h), 1)
        has_nan = tl.max((h != h).to(tl.int32), 1) > 0
        scale = scale_from_amax(amax, has_nan, QMAX)
        tl.store(S + row * stride_sm + g, scale, mask=g * GROUP < I)
        q = quantize_values(h, scale[:, None], QMAX, TO_E4M3)
        tl.store(Q + row * stride_qm + cols, q.to(Q.dtype.element_ty), mask=mask)


def _rows(gate_up: torch.Tensor) -> tuple[torch.Tensor, int]:
    if not isinstance(gate_up, torch.Tensor) or not gate_up.is_floating_point():
        got = gate_up.dtype if isinstance(gate_up, torch.Tensor) else type(gate_up).__name__
        raise TypeError(f"gate_up must be a floating-point tensor; got {got}")
    if gate_up.dim() < 2 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up must be [..., 2I] with an even last dim; got {tuple(gate_up.shape)}")
    return gate_up.reshape(-1, gate_up.shape[-1]).contiguous(), gate_up.shape[-1] // 2


def silu_and_mul(
    gate_up: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    *,
    masked_m: torch.Tensor | None = None,
) -> torch.Tensor:
    """``silu(gate) * up`` in fp32, stored as ``out_dtype`` (default: the input's dtype).

    Args:
        gate_up: ``[..., 2I]`` (``[E, cap, 2I]`` with ``masked_m``).
        out_dtype: bf16, fp16 or fp32.
        masked_m: optional ``[E]`` valid rows per expert; other rows are left unwritten.

    Returns:
        ``[..., I]``.
    """
    x2, inter = _rows(gate_up)
    out_dtype = gate_up.dtype if out_dtype is None else out_dtype
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype={out_dtype}; allowed: {list(OUT_DTYPES)}")
    rows = x2.shape[0]
    y = torch.empty((rows, inter), dtype=out_dtype, device=gate_up.device)
    if rows and inter:
        mm, cap = masked_row_args(masked_m, gate_up.shape, gate_up.device)
        block = min(next_pow2(inter), 1024)
        _silu_mul_kernel[(rows, triton.cdiv(inter, block))](
            x2, y, mm, inter, cap, x2.stride(0), y.stride(0), HAS_MASK=masked_m is not None, BLOCK=block
        )
    return y.reshape(*gate_up.shape[:-1], inter)


def silu_and_mul_quant(
    gate_up: torch.Tensor,
    granularity: str = "token",
    group_size: int = 128,
    dtype: torch.dtype = torch.int8,
    *,
    masked_m: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu(gate) * up`` quantized for the second GEMM.

    Args:
        gate_up: ``[..., 2I]`` (``[E, cap, 2I]`` with ``masked_m``).
        granularity: ``"token"`` (one INT8 scale per row) or ``"group"`` (one per 1 x group_size).
        group_size: group length for ``"group"``; must divide I and be a power of two >= 16.
        dtype: ``torch.int8``, or ``torch.float8_e4m3fn`` with ``"group"``.
        masked_m: optional ``[E]`` valid rows per expert; other rows are left unwritten.

    Returns:
        ``q [..., I]`` of ``dtype`` and fp32 ``scale [..., 1]`` or ``[..., I / group_size]``.
    """
    x2, inter = _rows(gate_up)
    if granularity not in ("token", "group"):
        raise ValueError(f"granularity={granularity!r}; allowed: 'token', 'group'")
    if dtype not in (torch.int8, torch.float8_e4m3fn) or (granularity == "token" and dtype != torch.int8):
        raise TypeError(f"dtype={dtype} with granularity={granularity!r}; allowed: int8 (token), int8 or e4m3 (group)")
    rows = x2.shape[0]
    lead = gate_up.shape[:-1]
    mm, cap = masked_row_args(masked_m, gate_up.shape, gate_up.device)
    q = torch.empty((rows, inter), dtype=dtype, device=gate_up.device)
    if granularity == "token":
        s = torch.empty((rows, 1), dtype=torch.float32, device=gate_up.device)
        if rows and inter:
            _silu_mul_token_quant_kernel[(rows,)](
                x2, q, s, mm, inter, cap, x2.stride(0), q.stride(0),
                HAS_MASK=masked_m is not None, QMAX=INT8_QMAX, BLOCK=min(next_pow2(inter), 4096),
            )
        return q.reshape(*lead, inter), s.reshape(*lead, 1)
    if group_size < 16 or group_size & (group_size - 1) or inter % group_size:
        raise ValueError(f"group_size={group_size} must be a power of two >= 16 dividing I={inter}")
    groups = inter // group_size
    s = torch.empty((rows, groups), dtype=torch.float32, device=gate_up.device)
    if rows and groups:
        per_prog = min(next_pow2(groups), max(1, 1024 // group_size))
        _silu_mul_group_quant_kernel[(rows, triton.cdiv(groups, per_prog))](
            x2, q, s, mm, inter, cap, x2.stride(0), q.stride(0), s.stride(0),
            HAS_MASK=masked_m is not None, QMAX=INT8_QMAX if dtype == torch.int8 else E4M3_QMAX,
            TO_E4M3=dtype != torch.int8, GROUP=group_size, GROUPS_PER_PROG=per_prog,
        )
    return q.reshape(*lead, inter), s.reshape(*lead, groups)
