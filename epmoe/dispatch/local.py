"""Single-process dispatcher (EP = 1): every expert is local, nothing moves.

It never waits for the rows per expert: it hands over a rows-per-expert hint (``expected_m``, the
uniform-routing mean), so a backend that keeps segment sizes on the device (``device_segments``)
runs the batch with no host synchronisation, and a decode step can be captured in a CUDA graph;
backends that need host-side sizes get them from the layer's count read-back as before.
"""

from __future__ import annotations

import torch

from .base import PAYLOADS, DispatchConfig, Dispatched, Dispatcher
from .deepep_dispatch.sizing import expected_rows_per_expert


class LocalDispatcher(Dispatcher):
    name = "local"
    layouts = frozenset({"contiguous"})
    payloads = frozenset(PAYLOADS)
    keeps_rows = True

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
            expected_m=expected_rows_per_expert(topk_ids.shape[0], 1, topk_ids.shape[1], self.cfg.num_experts),
        )

    def combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        return y
