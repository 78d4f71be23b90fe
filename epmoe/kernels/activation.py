"""Fused ``silu(gate) * up`` between the two expert GEMMs, optionally requantized.

The input is GEMM1's output ``[..., 2I]`` (gate = first I columns, up = last I). The product is
formed in fp32 and either stored in a float dtype or quantized straight from fp32 (never from a
rounded bf16 copy) with the rounding rule of :mod:`.quantize`: one INT8 scale per row
(``int8_channel``) or one scale per 1 x 128 group (``int8_block``; e4m3 also allowed).

A program owns a ``[BLOCK_M, BLOCK_K]`` tile of products (a :class:`.quantize.Launch`); per token
it holds whole rows in registers, so gate and up are read once (rows longer than
``quantize.SINGLE_PASS_MAX`` fall back to two passes that recompute the product). Both functions
take an explicit ``launch`` for sweeps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import masked_row_args, next_pow2
from .quantize import (
    E4M3_QMAX,
    INT8_QMAX,
    Launch,
    _rows_per_prog,
    _warps,
    amax_bits,
    check_launch,
    group_launch,
    rows_valid,
    scale_of,
    store_codes,
    token_launch,
)

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _silu_mul_tile(X, rows, row_ok, col0, I, stride_xm, GROUP: tl.constexpr, NG: tl.constexpr):
    """``silu(gate) * up`` in fp32 for a ``[BLOCK_M, NG, GROUP]`` tile from column ``col0``."""
    g = col0 // GROUP + tl.arange(0, NG)
    cols = g[None, :, None] * GROUP + tl.arange(0, GROUP)[None, None, :]
    mask = row_ok[:, None, None] & (cols < I)
    base = X + rows[:, None, None] * stride_xm + cols
    gate = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(base + I, mask=mask, other=0.0).to(tl.float32)
    return gate / (1.0 + tl.exp(-gate)) * up, cols, mask


@triton.jit
def _silu_mul_kernel(
    X, Y, MASKED_M, M, I, CAP, stride_xm, stride_ym,
    HAS_MASK: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows_valid(MASKED_M, rows, M, CAP, HAS_MASK)
    # Masked batches are mostly padding: a program with no valid row does nothing.
    if tl.max(row_ok.to(tl.int32), 0) > 0:
        h, cols, mask = _silu_mul_tile(
            X, rows, row_ok, tl.program_id(1) * BLOCK_K, I, stride_xm, GROUP, BLOCK_K // GROUP
        )
        tl.store(Y + rows[:, None, None] * stride_ym + cols, h.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_token_quant_kernel(
    X, Q, S, MASKED_M, M, I, CAP, stride_xm, stride_qm,
    HAS_MASK: tl.constexpr, QMAX: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SINGLE: tl.constexpr,
):
    NG: tl.constexpr = BLOCK_K // GROUP
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows_valid(MASKED_M, rows, M, CAP, HAS_MASK)
    # Masked batches are mostly padding: a program with no valid row does nothing.
    if tl.max(row_ok.to(tl.int32), 0) > 0:
        if SINGLE:
            h, cols, mask = _silu_mul_tile(X, rows, row_ok, 0, I, stride_xm, GROUP, NG)
            scale = scale_of(tl.max(amax_bits(h, 2), 1), QMAX)
            tl.store(S + rows, scale, mask=row_ok)
            store_codes(Q, rows, cols, mask, h, scale[:, None, None], stride_qm, QMAX, False)
        else:
            # Rows too long for registers: amax over chunks, then recompute the product (L2 reads).
            amax = tl.zeros([BLOCK_M], dtype=tl.int32)
            for c0 in range(0, I, BLOCK_K):
                h, cols, mask = _silu_mul_tile(X, rows, row_ok, c0, I, stride_xm, GROUP, NG)
                amax = tl.maximum(amax, tl.max(amax_bits(h, 2), 1))
            scale = scale_of(amax, QMAX)
            tl.store(S + rows, scale, mask=row_ok)
            for c0 in range(0, I, BLOCK_K):
                h, cols, mask = _silu_mul_tile(X, rows, row_ok, c0, I, stride_xm, GROUP, NG)
                store_codes(Q, rows, cols, mask, h, scale[:, None, None], stride_qm, QMAX, False)


@triton.jit
def _silu_mul_group_quant_kernel(
    X, Q, S, MASKED_M, M, I, CAP, stride_xm, stride_qm, stride_sm,
    HAS_MASK: tl.constexpr, QMAX: tl.constexpr, TO_E4M3: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    NG: tl.constexpr = BLOCK_K // GROUP
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows_valid(MASKED_M, rows, M, CAP, HAS_MASK)
    # Masked batches are mostly padding: a program with no valid row does nothing.
    if tl.max(row_ok.to(tl.int32), 0) > 0:
        col0 = tl.program_id(1) * BLOCK_K
        h, cols, mask = _silu_mul_tile(X, rows, row_ok, col0, I, stride_xm, GROUP, NG)
        scale = scale_of(amax_bits(h, 2), QMAX)  # [BLOCK_M, NG]
        g = col0 // GROUP + tl.arange(0, NG)
        tl.store(S + rows[:, None] * stride_sm + g[None, :], scale,
                 mask=row_ok[:, None] & (g[None, :] * GROUP < I))
        store_codes(Q, rows, cols, mask, h, scale[:, :, None], stride_qm, QMAX, TO_E4M3)


def silu_launch(m: int, inter: int, device: torch.device | str | None = None) -> Launch:
    """Default launch of :func:`silu_and_mul`: up to 4096 columns and ~8192 elements a program."""
    block_k = min(next_pow2(inter), 4096)
    block_m = _rows_per_prog(m, block_k, device)
    return Launch(block_m, block_k, _warps(block_m * block_k))


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
    launch: Launch | None = None,
) -> torch.Tensor:
    """``silu(gate) * up`` in fp32, stored as ``out_dtype`` (default: the input's dtype).

    Args:
        gate_up: ``[..., 2I]`` (``[E, cap, 2I]`` with ``masked_m``).
        out_dtype: bf16, fp16 or fp32.
        masked_m: optional ``[E]`` valid rows per expert; other rows are left unwritten.
        launch: tile and warps of the kernel (checked); ``None``: :func:`silu_launch`.

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
        if launch is None:
            launch = silu_launch(rows, inter, gate_up.device)
        else:
            check_launch(launch)
        _silu_mul_kernel[(triton.cdiv(rows, launch.block_m), triton.cdiv(inter, launch.block_k))](
            x2, y, mm, rows, inter, cap, x2.stride(0), y.stride(0),
            HAS_MASK=masked_m is not None, GROUP=min(128, launch.block_k),
            BLOCK_M=launch.block_m, BLOCK_K=launch.block_k, num_warps=launch.num_warps,
        )
    return y.reshape(*gate_up.shape[:-1], inter)


def silu_and_mul_quant(
    gate_up: torch.Tensor,
    granularity: str = "token",
    group_size: int = 128,
    dtype: torch.dtype = torch.int8,
    *,
    masked_m: torch.Tensor | None = None,
    launch: Launch | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu(gate) * up`` quantized for the second GEMM.

    Args:
        gate_up: ``[..., 2I]`` (``[E, cap, 2I]`` with ``masked_m``).
        granularity: ``"token"`` (one INT8 scale per row) or ``"group"`` (one per 1 x group_size).
        group_size: group length for ``"group"``; must divide I and be a power of two >= 16.
        dtype: ``torch.int8``, or ``torch.float8_e4m3fn`` with ``"group"``.
        masked_m: optional ``[E]`` valid rows per expert; other rows are left unwritten.
        launch: tile and warps of the kernel (checked); ``None``: the quantizers' defaults
            (:func:`~epmoe.kernels.quantize.token_launch` / ``group_launch``).

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
            if launch is None:
                launch = token_launch(rows, inter, gate_up.device)
            else:
                check_launch(launch)
            _silu_mul_token_quant_kernel[(triton.cdiv(rows, launch.block_m),)](
                x2, q, s, mm, rows, inter, cap, x2.stride(0), q.stride(0),
                HAS_MASK=masked_m is not None, QMAX=INT8_QMAX, GROUP=min(128, launch.block_k),
                BLOCK_M=launch.block_m, BLOCK_K=launch.block_k, SINGLE=launch.block_k >= inter,
                num_warps=launch.num_warps,
            )
        return q.reshape(*lead, inter), s.reshape(*lead, 1)
    if group_size < 16 or group_size & (group_size - 1) or inter % group_size:
        raise ValueError(f"group_size={group_size} must be a power of two >= 16 dividing I={inter}")
    groups = inter // group_size
    s = torch.empty((rows, groups), dtype=torch.float32, device=gate_up.device)
    if rows and groups:
        if launch is None:
            launch = group_launch(rows, inter, group_size, gate_up.device)
        else:
            check_launch(launch, group_size)
        _silu_mul_group_quant_kernel[(triton.cdiv(rows, launch.block_m), triton.cdiv(inter, launch.block_k))](
            x2, q, s, mm, rows, inter, cap, x2.stride(0), q.stride(0), s.stride(0),
            HAS_MASK=masked_m is not None, QMAX=INT8_QMAX if dtype == torch.int8 else E4M3_QMAX,
            TO_E4M3=dtype != torch.int8, GROUP=group_size, BLOCK_M=launch.block_m,
            BLOCK_K=launch.block_k, num_warps=launch.num_warps,
        )
    return q.reshape(*lead, inter), s.reshape(*lead, groups)
