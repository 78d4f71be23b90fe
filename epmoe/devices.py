"""Properties of CUDA devices, read from the driver once per device: kernels and backends look
them up on every call, where a fresh ``torch.cuda.get_device_properties`` costs host time."""

from __future__ import annotations

import functools

import torch


def cuda_index(device: torch.device | str | int | None = None) -> int:
    """The index of a CUDA device; ``None`` or an index-less ``"cuda"`` is the current device."""
    if isinstance(device, int):
        return device
    d = torch.device("cuda") if device is None else torch.device(device)
    return d.index if d.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _properties(index: int):
    return torch.cuda.get_device_properties(index)


def properties(device: torch.device | str | int | None = None):
    """``torch.cuda.get_device_properties`` of ``device``, cached per index."""
    return _properties(cuda_index(device))


def sm_count(device: torch.device | str | int | None = None) -> int:
    return properties(device).multi_processor_count


def capability(device: torch.device | str | int | None = None) -> tuple[int, int]:
    p = properties(device)
    return p.major, p.minor


def name(device: torch.device | str | int | None = None) -> str:
    return properties(device).name


def shared_memory_optin(device: torch.device | str | int | None = None) -> int:
    """Shared memory a block may opt in to (0 when torch does not report it)."""
    return getattr(properties(device), "shared_memory_per_block_optin", 0) or 0
