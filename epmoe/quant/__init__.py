"""Quantization schemes, the reference (de)quantization math and checkpoint conversion."""

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
