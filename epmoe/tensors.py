"""Small tensor helpers shared by the seams."""

from __future__ import annotations

import torch


def as_contiguous(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` as a contiguous tensor of ``dtype`` (default: its own), without a torch call when it
    already is one: each no-op ``.to()`` / ``.contiguous()`` costs microseconds of host time,
    which an eager decode step or the host-synchronised prefill path pays in full."""
    if (dtype is None or t.dtype == dtype) and t.is_contiguous():
        return t
    return (t if dtype is None else t.to(dtype)).contiguous()
