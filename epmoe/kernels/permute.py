"""Row movement between received tokens and per-expert rows, in Triton.

Same semantics as the torch functions in :mod:`epmoe.layouts`:

* :func:`scatter_rows` copies each received token's row to every row position ``slot_pos[r, j]``
  (the data movement of ``to_contiguous`` / ``to_masked``); untouched rows are zero (scale 1).
* :func:`gather_weighted` sums, per received token, its valid slots' rows times the top-k weights
  in fp32, in slot order ``j = 0 .. k-1`` (the order the torch reference adds them). Rows of
  invalid slots (``-1``) are never read, so padding holding NaN cannot leak.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import next_pow2


@triton.jit
def _scatter_rows_kernel(
    X, XS, Y, YS, POS, H, S, TOPK, stride_xm, stride_xsm, stride_ym, stride_ysm,
    HAS_SCALE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    x = tl.load(X + r * stride_xm + cols, mask=col_ok)
    for j in range(0, TOPK):
        dst = tl.load(POS + r * TOPK + j)
        if dst >= 0:
            tl.store(Y + dst * stride_ym + cols, x, mask=col_ok)
            if HAS_SCALE:
                if tl.program_id(1) == 0:
                    sc = tl.arange(0, BLOCK_S)
                    s = tl.load(XS + r * stride_xsm + sc, mask=sc < S)
                    tl.store(YS + dst * stride_ysm + sc, s, mask=sc < S)


@triton.jit
def _gather_weighted_kernel(
    X, POS, W, OUT, H, TOPK, stride_xm, stride_om, BLOCK_H: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in range(0, TOPK):
        src = tl.load(POS + r * TOPK + j)
        w = tl.load(W + r * TOPK + j)
        # A masked load of an invalid slot reads nothing; its zeros add nothing.
        row = tl.load(X + tl.maximum(src, 0) * stride_xm + cols, mask=col_ok & (src >= 0), other=0.0)
        acc += tl.where(src >= 0, row.to(tl.float32) * w, 0.0)
    tl.store(OUT + r * stride_om + cols, acc, mask=col_ok)


def scatter_rows(
    x: torch.Tensor,
    slot_pos: torch.Tensor,
    num_out_rows: int,
    x_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Copy received rows to their per-expert positions.

    Args:
        x: ``[R, H]`` received rows (any dtype, float or quantized).
        slot_pos: ``[R, k]`` int64 destination row of each (token, top-k slot), ``-1`` = none.
        num_out_rows: rows of the output (``M`` of the contiguous layout, ``E * cap`` masked).
        x_scale: optional ``[R, S]`` fp32 scales, moved with their rows.

    Returns:
        ``out [num_out_rows, H]`` (rows no slot points to are zero) and ``out_scale
        [num_out_rows, S]`` (ones there) or ``None``.
    """
    _check_slot_pos(slot_pos, x.shape[0] if isinstance(x, torch.Tensor) and x.dim() == 2 else None, "x")
    if x.dim() != 2:
        raise ValueError(f"x must be [R, H]; got shape {tuple(x.shape)}")
    if num_out_rows < 0:
        raise ValueError(f"num_out_rows={num_out_rows} must be >= 0")
    r, h = x.shape
    out = torch.zeros((num_out_rows, h), dtype=x.dtype, device=x.device)
    out_scale = None
    if x_scale is not None:
        if x_scale.dim() != 2 or x_scale.shape[0] != r:
            raise ValueError(f"x_scale must be [R={r}, S]; got shape {tuple(x_scale.shape)}")
        out_scale = torch.ones((num_out_rows, x_scale.shape[1]), dtype=x_scale.dtype, device=x.device)
    k = slot_pos.shape[1]
    if r == 0 or k == 0 or h == 0 or num_out_rows == 0:
        return out, out_scale
    xc = x.contiguous()
    pos = slot_pos.to(torch.int64).contiguous()
    # Without scales the scale pointers are never dereferenced; any tensor of the device does.
    xs = pos if x_scale is None else x_scale.contiguous()
    ys = pos if out_scale is None else out_scale
    s = 1 if x_scale is None else x_scale.shape[1]
    _scatter(xc, xs, out, ys, pos, s, k, x_scale is not None, min(next_pow2(h), 1024))
    return out, out_scale


def _scatter(xc, xs, out, ys, pos, s, k, has_scale, block_h) -> None:
    r, h = xc.shape
    _scatter_rows_kernel[(r, triton.cdiv(h, block_h))](
        _as_copyable(xc), xs, _as_copyable(out), ys, pos, h, s, k,
        xc.stride(0), xs.stride(0), out.stride(0), ys.stride(0),
        HAS_SCALE=has_scale, BLOCK_H=block_h, BLOCK_S=max(16, next_pow2(s)),
    )


def _as_copyable(t: torch.Tensor) -> torch.Tensor:
    """Same bytes under a dtype every Triton backend can load and store (fp8 -> uint8)."""
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8)
    return t


def gather_weighted(
    expert_out: torch.Tensor, slot_pos: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """Per received token, the top-k weighted sum of its local experts' rows, in fp32.

    Args:
        expert_out: ``[M, H]`` backend output (any float dtype; a masked output is passed as
            ``[E * cap, H]``).
        slot_pos: ``[R, k]`` int64 rows (``-1`` = not local).
        topk_weights: ``[R, k]`` fp32.

    Returns:
        ``[R, H]`` fp32; tokens with no local slot get zeros.
    """
    if not isinstance(expert_out, torch.Tensor) or expert_out.dim() != 2 or not expert_out.is_floating_point():
        raise ValueError("expert_out must be a floating-point [M, H] tensor")
    _check_slot_pos(slot_pos, None, "expert_out")
    if tuple(topk_weights.shape) != tuple(slot_pos.shape):
        raise ValueError(
            f"topk_weights shape {tuple(topk_weights.shape)} must equal slot_pos shape {tuple(slot_pos.shape)}"
        )
    r, k = slot_pos.shape
    h = expert_out.shape[1]
    out = torch.empty((r, h), dtype=torch.float32, device=expert_out.device)
    if r == 0 or h == 0:
        return out
    if k == 0:
        return out.zero_()
    xc = expert_out.contiguous()
    block_h = min(next_pow2(h), 1024)
    _gather_weighted_kernel[(r, triton.cdiv(h, block_h))](
        xc, slot_pos.to(torch.int64).contiguous(), topk_weights.float().contiguous(), out, h, k,
        xc.stride(0), out.stride(0), BLOCK_H=block_h,
    )
    return out


def _check_slot_pos(slot_pos: torch.Tensor, rows: int | None, other: str) -> None:
    if not isinstance(slot_pos, torch.Tensor) or slot_pos.dtype not in (torch.int32, torch.int64):
        got = slot_pos.dtype if isinstance(slot_pos, torch.Tensor) else type(slot_pos).__name__
        raise TypeError(f"slot_pos must be an int64 (or int32) tensor; got {got}")
    if slot_pos.dim() != 2:
        raise ValueError(f"slot_pos must be [R, k]; got shape {tuple(slot_pos.shape)}")
    if rows is not None and slot_pos.shape[0] != rows:
        raise ValueError(f"slot_pos has {slot_pos.shape[0]} rows but {other} has {rows}")
