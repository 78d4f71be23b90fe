"""Single-process dispatcher (EP = 1): every expert is local, nothing moves."""

from __future__ import annotations

import torch

from .base import PAYLOADS, DispatchConfig, Dispatched, Dispatcher


class LocalDispatcher(Dispatcher):
    name = "local"
    layouts = frozenset({"contiguous"})
    payloads = frozenset(PAYLOADS)

    @classmethod
    def available(cls, cfg: DispatchConfig) -> tuple[bool, str]:
        if cfg.world_size != 1:
            return False, f"runs one rank only; the group has {cfg.world_size}"
        return True, "available"

    def send(self, x, x_scale, topk_ids, topk_weights) -> Dispatched:
        return Dispatched(
            x=x,
            x_scale=x_scale,
            handle=None,
            num_tokens=x.shape[0],
            topk_ids=topk_ids,
            topk_weights=topk_weights,
        )

    def combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        return y
