"""Quantization at run time: the schemes, the dispatch payloads and the reference (de)quantization
math. Checkpoint reading and conversion live in :mod:`epmoe.checkpoint`."""

from .reference import (
    dequantize_rows,
    dequantize_weight,
    fake_quantize_act,
    quantize_act,
    quantize_rows,
    quantize_weight,
)
from .schemes import BLOCK, SCHEMES, QuantScheme, get_scheme

__all__ = [
    "BLOCK",
    "SCHEMES",
    "QuantScheme",
    "get_scheme",
    "quantize_rows",
    "dequantize_rows",
    "quantize_weight",
    "dequantize_weight",
    "quantize_act",
    "fake_quantize_act",
]
