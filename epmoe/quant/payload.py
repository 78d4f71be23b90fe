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

PAYLOAD_FORMATS = {
    "int8_token": (torch.int8, 127.0, None),
    "int8_group": (torch.int8, 127.0, BLOCK),
    "fp8_group": (torch.float8_e4m3fn, 448.0, BLOCK),
}
"""``(dtype, qmax, columns per scale or None for one per token)`` of each quantized payload."""


def choose_payloads(
    scheme: QuantScheme, carried: frozenset[str], low_latency_int8: str
) -> tuple[str, str]:
    """``(payload, low_latency_payload)`` for a dispatcher that carries ``carried``.

    ``payload``: the scheme's own format when the dispatcher carries it (half the bytes of BF16
    for the 1-byte formats), else the unquantized input. ``low_latency_payload``: DeepEP
    low-latency casts BF16 to FP8 1x128 inside its kernel, so FP8 schemes use that; INT8 schemes
    use ``low_latency_int8`` (``"float"``: quantize after dispatch; ``"fp8_group"``: requantize
    from FP8); BF16 sends BF16.
    """
    natural = NATURAL_PAYLOAD[scheme.name]
    payload = natural if natural in carried else "float"
    # Low-latency mode carries BF16, and FP8 by its in-kernel cast; INT8 formats need the choice.
    low_latency = natural if natural in ("float", "fp8_group") else low_latency_int8
    return payload, low_latency


def quantize_payload(x: torch.Tensor, payload: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x [T, H]`` -> ``(q [T, H], scale [T, S] fp32)``, or ``(x, None)`` for ``"float"``."""
    if payload == "float":
        return x, None
    qdtype, qmax, group = PAYLOAD_FORMATS[payload]
    if x.is_cuda:
        from .. import ops as kq  # here, not at the top: epmoe.ops imports this module

        if group is None:
            return kq.per_token_quant_int8(x)
        return kq.per_group_quant(x, group_size=group, dtype=qdtype)
    return quantize_rows(x, qdtype, qmax, group)
