"""Fused ``silu(gate) * up`` between the two expert GEMMs, optionally requantized.

The input is GEMM1's output ``[..., 2I]`` (gate = first I columns, up = last I). The product is
formed in fp32 and either stored in a float dtype or quantized straight from fp32 (never from a
rounded bf16 copy) with the rounding rule of :mod:`.quantize`: one INT8 scale per row
(``int8_channel``) or one scale per 1 x 128 group (``int8_block``; e4m3 also allowed).

A program owns a ``[BLOCK_M, BLOCK_K]`` tile of products (a :class:`.quantize.Launch`); per token
it holds whole rows in registers, so gate and up are read once (rows longer than
``quantize.SINGLE_PASS_MAX`` fall back to two passes that recompute the product). Both functions
take an explicit ``launch`` for sweeps. On Hopper each launch is a programmatic dependent of the
GEMM before it (:mod:`.pdl`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import next_pow2, row_plan
from .pdl import dependent, dependent_start
from .quantize import (
    Launch,
    _rows_per_prog,
    _warps,
    check_launch,
    group_quant,
    load_tile,
    row_block,
    row_segment,
    token_quant,
)

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _silu_mul_kernel(
    X, Y, MASKED_M, M, I, CAP, PROGS, stride_xm, stride_ym,
    HAS_MASK: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    dependent_start(PDL)
    base, n, first, step = row_segment(MASKED_M, M, CAP, PROGS, HAS_MASK)
    col0 = tl.program_id(1) * BLOCK_K
    for b in range(first, tl.cdiv(n, BLOCK_M), step):
        rows, row_ok = row_block(base, n, b, BLOCK_M)
        h, cols, mask = load_tile(
            X, X, rows, row_ok, col0, I, stride_xm, 0, False, 1, True, GROUP, BLOCK_K // GROUP
        )
        tl.store(Y + rows[:, None, None] * stride_ym + cols, h.to(Y.dtype.element_ty), mask=mask)


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
    expected_m: int | None = None,
    launch: Launch | None = None,
) -> torch.Tensor:
    """``silu(gate) * up`` in fp32, stored as ``out_dtype`` (default: the input's dtype).

    Args:
        gate_up: ``[..., 2I]`` (``[E, cap, 2I]`` with ``masked_m``).
        out_dtype: bf16, fp16 or fp32.
        masked_m: optional ``[E]`` valid rows per expert; other rows are left unwritten.
        expected_m: with ``masked_m``, rows per expert the batch is expected to fill (sizes the
            grid; see :func:`~epmoe.kernels.quantize.per_token_quant_int8`).
        launch: tile and warps of the kernel (checked); ``None``: :func:`silu_launch`.

    Returns:
        ``[..., I]``.
    """
    x2, inter = _rows(gate_up)
    out_dtype = gate_up.dtype if out_dtype is None else out_dtype
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype={out_dtype}; allowed: {list(OUT_DTYPES)}")
    rows = x2.shape[0]
    plan = row_plan(masked_m, gate_up.shape, gate_up.device, expected_m)
    y = torch.empty((rows, inter), dtype=out_dtype, device=gate_up.device)
    if rows and inter:
        if launch is None:
            launch = silu_launch(plan.rows, inter, gate_up.device)
        else:
            check_launch(launch)
        grid, progs = plan.grid(rows, launch.block_m)
        _silu_mul_kernel[(grid, triton.cdiv(inter, launch.block_k))](
            x2, y, plan.masked_m, rows, inter, plan.cap, progs, x2.stride(0), y.stride(0),
            HAS_MASK=plan.masked, GROUP=min(128, launch.block_k),
            BLOCK_M=launch.block_m, BLOCK_K=launch.block_k, num_warps=launch.num_warps, **dependent(x2.device),
        )
    return y.reshape(*gate_up.shape[:-1], inter)


def silu_and_mul_quant(
    gate_up: torch.Tensor,
    granularity: str = "token",
    group_size: int = 128,
    dtype: torch.dtype = torch.int8,
    *,
    masked_m: torch.Tensor | None = None,
    expected_m: int | None = None,
    row_expert: torch.Tensor | None = None,
    scale_mn_major: bool = False,
    launch: Launch | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu(gate) * up`` quantized for the second GEMM.

    Args:
        gate_up: ``[..., 2I]`` (``[E, cap, 2I]`` with ``masked_m``).
        granularity: ``"token"`` (one INT8 scale per row) or ``"group"`` (one per 1 x group_size).
        group_size: group length for ``"group"``; must divide I and be a power of two >= 16.
        dtype: ``torch.int8``, or ``torch.float8_e4m3fn`` with ``"group"``.
        masked_m: optional ``[E]`` valid rows per expert; other rows are left unwritten.
        expected_m: as in :func:`silu_and_mul`.
        row_expert: optional int32 expert of every row of ``gate_up`` (leading dims flattened; a
            contiguous layout's ``m_indices``): rows of -1 are skipped, their outputs unwritten.
        scale_mn_major: ``"group"`` only: the scales stored MN-major
            (:func:`~epmoe.kernels.common.mn_major_scales`: the CUTLASS kernels' layout).
        launch: tile and warps of the kernel (checked); ``None``: the quantizers' defaults
            (:func:`~epmoe.kernels.quantize.token_launch` / ``group_launch``).

    Returns:
        ``q [..., I]`` of ``dtype`` and fp32 ``scale [..., 1]`` or ``[..., I / group_size]``.
    """
    x2, inter = _rows(gate_up)
    if granularity not in ("token", "group"):
        raise ValueError(f"granularity={granularity!r}; allowed: 'token', 'group'")
    if granularity == "token" and dtype != torch.int8:
        raise TypeError(f"dtype={dtype} with granularity='token'; allowed: int8 (token), int8 or e4m3 (group)")
    plan = row_plan(masked_m, gate_up.shape, gate_up.device, expected_m, row_expert)
    if granularity == "token":
        if scale_mn_major:
            raise ValueError("scale_mn_major=True needs granularity='group' (one scale per row has no layout to choose)")
        return token_quant(x2, None, 1, gate_up.shape, plan, launch, silu=True, pdl=True)
    return group_quant(x2, None, 1, gate_up.shape, plan, group_size, dtype, launch, silu=True,
                       scale_mn_major=scale_mn_major, pdl=True)  # fmt: skip
