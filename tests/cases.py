"""Routing cases shared by the single-process and the multi-process layer tests."""

from __future__ import annotations

import torch

from epmoe.routing import select_experts

CASE_NAMES = ("random", "one_expert", "empty_experts", "single_token", "no_tokens")


def make_case(name: str, rank: int, num_experts: int, top_k: int, hidden: int, seed: int = 0):
    """``(x [T,H] fp32, topk_ids [T,k], topk_weights [T,k])`` for ``name`` on ``rank``.

    Token counts differ per rank and are odd on purpose; ``no_tokens`` gives rank 1 (or the only
    rank) zero tokens while the other ranks still send to it.
    """
    g = torch.Generator().manual_seed(seed * 1000 + rank * 17 + CASE_NAMES.index(name))
    t = {"random": 37 + 6 * rank, "one_expert": 29, "empty_experts": 23 + rank, "single_token": 1}.get(name, 19)
    if name == "no_tokens" and rank == 1:
        t = 0
    x = torch.randn(t, hidden, generator=g)
    logits = torch.randn(t, num_experts, generator=g) * 2
    ids, w = select_experts(logits, top_k, renormalize=True)
    if name == "one_expert":
        # Every token picks the last expert (the hot expert); its other slots stay distinct, as a
        # real router's are (DeepEP low-latency dispatch relies on distinct experts per token).
        hot = num_experts - 1
        others = torch.stack([torch.randperm(hot, generator=g)[: top_k - 1] for _ in range(t)])
        ids = torch.cat([torch.full((t, 1), hot, dtype=ids.dtype), others.to(ids.dtype)], dim=1)
    elif name == "empty_experts":
        half = num_experts // 2  # only the first half of the experts get tokens
        ids = torch.stack([torch.randperm(half, generator=g)[:top_k] for _ in range(t)]) if t else ids
    return x, ids, w
