"""Reference (de)quantization in plain torch: the one rounding rule of the project.

Rule: symmetric, ``scale = max(amax, AMAX_FLOOR) / qmax`` in fp32, ``q = x / scale`` rounded to
nearest with ties to even (``torch.round``; e4m3 conversion rounds the same way), clamped to
``[-qmax, qmax]``. A zero row gets the floor scale and quantizes to zeros, never 0/0.

Non-finite inputs: a NaN or Inf in a row (or 1x128 group) makes that row's (group's) scale
non-finite, so the dequantized row is NaN; nothing leaks into other rows.

Every faster kernel in the package is tested against these functions or against float64 math
that quantizes on its own; none of them calls into a kernel.
"""

from __future__ import annotations

import torch

from .schemes import BLOCK, QuantScheme

AMAX_FLOOR = 1e-10
"""Smallest amax used to form a scale; keeps all-zero rows finite."""


def _check_float(name: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{name} must be a floating-point tensor; got {got}")


def _round_clamp(y: torch.Tensor, qdtype: torch.dtype, qmax: float) -> torch.Tensor:
    if qdtype == torch.int8:
        return torch.round(y).clamp_(-qmax, qmax).to(torch.int8)
    return y.clamp(-qmax, qmax).to(qdtype)


def quantize_rows(
    x: torch.Tensor, qdtype: torch.dtype, qmax: float, group_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize activations per row (``group_size=None``) or per 1 x ``group_size`` group.

    Args:
        x: ``[..., K]`` floating point.
        qdtype: ``torch.int8`` or ``torch.float8_e4m3fn``.
        qmax: 127 for int8, 448 for e4m3.
        group_size: ``None`` for one scale per row, else a divisor of ``K``.

    Returns:
        ``q [..., K]`` of ``qdtype`` and ``scale [..., S]`` fp32 with ``S = 1`` or ``K / group_size``.
    """
    _check_float("x", x)
    k = x.shape[-1]
    g = k if group_size is None else group_size
    if g <= 0 or k % g:
        raise ValueError(f"group_size={group_size} must divide the last dimension {k} of x")
    xf = x.float().reshape(*x.shape[:-1], k // g if k else 0, g)
    amax = xf.abs().amax(dim=-1, keepdim=True) if xf.numel() else xf.new_zeros(*xf.shape[:-1], 1)
    # Divide by a tensor, not a Python float: CUDA turns division by a host scalar into a
    # multiplication by its reciprocal, which is not the correctly rounded quotient.
    scale = torch.where(torch.isnan(amax), amax, amax.clamp(min=AMAX_FLOOR)) / amax.new_tensor(qmax)
    q = _round_clamp(xf / scale, qdtype, qmax)
    return q.reshape(x.shape), scale.squeeze(-1)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_rows`: ``q [..., K]``, ``scale [..., S]`` -> ``dtype`` ``[..., K]``
    (float64: each code times its fp32 scale exactly, for references of the GEMMs)."""
    k, s = q.shape[-1], scale.shape[-1]
    if s == 0 or k % s:
        raise ValueError(f"scale has {s} columns, which does not divide K={k}")
    qf = q.to(dtype).reshape(*q.shape[:-1], s, k // s)
    return (qf * scale.to(dtype).unsqueeze(-1)).reshape(q.shape)


def quantize_weight(
    w: torch.Tensor, scheme: QuantScheme
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Quantize ``[E, N, K]`` (out x in) weights for ``scheme``.

    Returns ``(q, scale)``: for ``"channel"`` ``scale [E, N, 1]``; for ``"block"``
    ``scale [E, ceil(N/128), ceil(K/128)]`` (edge blocks cover what is left); for an unquantized
    scheme ``(w, None)``.
    """
    _check_float("w", w)
    if w.dim() != 3:
        raise ValueError(f"w must be [E, N, K]; got shape {tuple(w.shape)}")
    if scheme.weight_granularity == "none":
        return w, None
    if scheme.weight_granularity == "channel":
        return quantize_rows(w, scheme.qdtype, scheme.qmax)
    e, n, k = w.shape
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    wp = torch.zeros(e, nb * BLOCK, kb * BLOCK, dtype=torch.float32, device=w.device)
    wp[:, :n, :k] = w.float()
    blocks = wp.reshape(e, nb, BLOCK, kb, BLOCK).permute(0, 1, 3, 2, 4).reshape(e, nb, kb, -1)
    q, scale = quantize_rows(blocks, scheme.qdtype, scheme.qmax)
    q = q.reshape(e, nb, kb, BLOCK, BLOCK).permute(0, 1, 3, 2, 4).reshape(e, nb * BLOCK, kb * BLOCK)
    return q[:, :n, :k].contiguous(), scale.reshape(e, nb, kb)


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``dtype`` ``[E, N, K]`` from ``q`` and a channel ``[E, N, 1]`` or block scale (float64: each
    code times its fp32 scale exactly)."""
    if scale is None:
        return q.to(dtype)
    e, n, k = q.shape
    if scale.shape == (e, n, 1):
        return q.to(dtype) * scale.to(dtype)
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    if tuple(scale.shape) != (e, nb, kb):
        raise ValueError(
            f"weight scale shape {tuple(scale.shape)} fits neither channel [{e}, {n}, 1] "
            f"nor block [{e}, {nb}, {kb}] scales of a [{e}, {n}, {k}] weight"
        )
    full = scale.to(dtype).repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2)
    return q.to(dtype) * full[:, :n, :k]


def quantize_act(x: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Quantize activations ``[..., K]`` as ``scheme`` does on the way into a GEMM."""
    if scheme.act_granularity == "none":
        return x, None
    group = BLOCK if scheme.act_granularity == "group" else None
    return quantize_rows(x, scheme.qdtype, scheme.qmax, group)


def fake_quantize_act(x: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """Quantize then dequantize (fp32): the activation a GEMM of ``scheme`` actually sees."""
    if scheme.act_granularity == "none":
        return x.float()
    q, s = quantize_act(x, scheme)
    return dequantize_rows(q, s)
