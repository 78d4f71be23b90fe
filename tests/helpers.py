"""Shared test fixtures: synthetic expert weights and multi-process launching."""

from __future__ import annotations

import os
import socket

import torch

from epmoe.quant import dequantize_weight, get_scheme, quantize_weight

SCHEME_NAMES = ("bf16", "int8_channel", "int8_block", "fp8_block")


def make_weights(num_experts: int, hidden: int, inter: int, scheme: str, seed: int = 0):
    """Random global weights for ``scheme``.

    Returns ``(stored, dequantized)``: ``stored = (w13, w2, w13_scale, w2_scale)`` as the layer
    loads them, ``dequantized = (w13, w2)`` float32 for the float64 reference.
    """
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    s = get_scheme(scheme)
    if not s.quantized:
        return (w13, w2, None, None), (w13, w2)
    q13, s13 = quantize_weight(w13, s)
    q2, s2 = quantize_weight(w2, s)
    return (q13, q2, s13, s2), (dequantize_weight(q13, s13), dequantize_weight(q2, s2))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world: int, port: int, timeout_s: float = 120.0) -> None:
    import datetime

    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
