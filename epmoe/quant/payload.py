"""Quantizing activations into a wire payload before dispatch.

On CUDA the Triton kernels of :mod:`epmoe.kernels.quantize` do it (same rounding rule as the
reference); elsewhere :mod:`epmoe.quant.reference` does.
"""

from __future__ import annotations

import torch

from .reference import quantize_rows
from .schemes import BLOCK, QuantScheme

NATURAL_PAYLOAD = {
    "bf16": "float",
    "int8_channel": "int8_token",
    "int8_block": "int8_group",
    "fp8_block": "fp8_group",
}
"""The payload each scheme's GEMM1 consumes directly."""

_FORMATS = {
    "int8_token": (torch.int8, 127.0, None),
    "int8_group": (torch.int8, 127.0, BLOCK),
    "fp8_group": (torch.float8_e4m3fn, 448.0, BLOCK),
}


def choose_payload(scheme: QuantScheme, carried: frozenset[str], low_latency_int8: str) -> str:
    """The payload to dispatch: the scheme's own when the dispatcher carries it; for INT8 schemes
    over a dispatcher that carries only BF16/FP8 (DeepEP low-latency), ``low_latency_int8``
    (``"float"`` or ``"fp8_group"``) decides; otherwise the unquantized input."""
    natural = NATURAL_PAYLOAD[scheme.name]
    if natural in carried:
        return natural
    if low_latency_int8 == "fp8_group" and scheme.qdtype == torch.int8 and "fp8_group" in carried:
        return "fp8_group"
    return "float"


def quantize_payload(x: torch.Tensor, payload: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x [T, H]`` -> ``(q [T, H], scale [T, S] fp32)``, or ``(x, None)`` for ``"float"``."""
    if payload == "float":
        return x, None
    qdtype, qmax, group = _FORMATS[payload]
    if x.is_cuda:
        from ..kernels import quantize as kq  # Triton is needed only on a GPU

        if group is None:
            return kq.per_token_quant_int8(x)
        return kq.per_group_quant(x, group_size=group, dtype=qdtype)
    return quantize_rows(x, qdtype, qmax, group)
