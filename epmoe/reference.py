"""Exact float64 MoE math, for the demo, benchmarks and fidelity reports (not a kernel)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def expert_mlp_float64(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert in float64: ``w2 . (silu(gate) * up)`` with ``[gate; up] = w13 . x``.

    Args:
        x: ``[m, H]``; w13: ``[2I, H]`` (gate rows, then up rows); w2: ``[H, I]``.

    Returns:
        ``[m, H]`` float64 on ``x``'s device.
    """
    gate, up = (x.double() @ w13.double().t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w2.double().t()


def moe_float64(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    """``sum_j w[t, j] * W2[e] . (silu(gate) * up)`` with ``[gate; up] = W13[e] . x[t]``, float64.

    Args:
        x: ``[T, H]``; topk_ids: ``[T, k]`` global ids; topk_weights: ``[T, k]``;
        w13: ``[E, 2I, H]`` and w2: ``[E, H, I]`` float weights over all experts.

    Returns:
        ``[T, H]`` float64 on the CPU.
    """
    x, ids, tw = x.double().cpu(), topk_ids.cpu(), topk_weights.double().cpu()
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        y = expert_mlp_float64(x[tok], w13[e], w2[e])
        out.index_add_(0, tok, y * tw[tok, slot].unsqueeze(1))
    return out
