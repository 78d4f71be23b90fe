"""The four quantization schemes and the facts every seam needs about them.

A scheme says how expert weights are stored, how activations are quantized on the way into each
GEMM, and how large the layer-output error against a float64 reference may be. The bounds are
the ones the tests and ``epmoe demo`` hold the library to (see docs/quantization.md for the
derivation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 128
"""Edge of a weight block and length of an activation group for the block schemes."""


@dataclass(frozen=True)
class QuantScheme:
    """What a scheme stores and how it quantizes.

    Attributes:
        name: ``"bf16" | "int8_channel" | "int8_block" | "fp8_block"``.
        qdtype: storage dtype of quantized weights and activations (``None`` for bf16).
        qmax: largest representable magnitude of ``qdtype`` used for scaling (127 or 448).
        weight_granularity: ``"none"`` (plain weights), ``"channel"`` (one fp32 scale per output
            channel, shape ``[E, N, 1]``) or ``"block"`` (one per 128x128 block,
            ``[E, ceil(N/128), ceil(K/128)]``).
        act_granularity: ``"none"``, ``"token"`` (one scale per row, ``[M, 1]``) or ``"group"``
            (one per 1x128 group, ``[M, K/128]``).
        rel_error_bound: bound on ``||out - ref||_F / ||ref||_F`` of the layer output against a
            float64 reference on Gaussian inputs (tests and the demo enforce it).
    """

    name: str
    qdtype: torch.dtype | None
    qmax: float
    weight_granularity: str
    act_granularity: str
    rel_error_bound: float

    @property
    def quantized(self) -> bool:
        return self.qdtype is not None

    @property
    def needs_block_alignment(self) -> bool:
        """Block schemes need hidden and intermediate sizes that are multiples of 128."""
        return self.weight_granularity == "block"

    def act_scale_cols(self, k: int) -> int:
        """Columns of the activation scale for a row of length ``k`` (0 when unquantized)."""
        if self.act_granularity == "token":
            return 1
        if self.act_granularity == "group":
            return k // BLOCK
        return 0

    def weight_scale_shape(self, e: int, n: int, k: int) -> tuple[int, ...] | None:
        """Shape of the fp32 scale of an ``[e, n, k]`` weight, or ``None`` when unquantized."""
        if self.weight_granularity == "channel":
            return (e, n, 1)
        if self.weight_granularity == "block":
            return (e, -(-n // BLOCK), -(-k // BLOCK))
        return None


SCHEMES: dict[str, QuantScheme] = {
    # bf16 operands, fp32 accumulation: the error is bf16 rounding of inputs and weights.
    "bf16": QuantScheme("bf16", None, 0.0, "none", "none", 1e-2),
    # int8 rounding error is uniform with rms step/sqrt(12) = amax/(127*3.46): ~0.8% of the rms of
    # a Gaussian row (amax ~3.5 sigma), ~2% for the heavy-tailed SiLU*up output. Four quantized
    # operands (x, w13, act, w2) add in quadrature to ~2.3% (measured 2.0-2.3%): bound 5%.
    "int8_channel": QuantScheme("int8_channel", torch.int8, 127.0, "channel", "token", 5e-2),
    "int8_block": QuantScheme("int8_block", torch.int8, 127.0, "block", "group", 5e-2),
    # e4m3 keeps 3 mantissa bits: relative rounding error up to 1/16, rms ~3.6% per operand; four
    # operands give ~7% (measured 6.3%): bound 10%.
    "fp8_block": QuantScheme("fp8_block", torch.float8_e4m3fn, 448.0, "block", "group", 1e-1),
}


def get_scheme(name: str) -> QuantScheme:
    """Look up a scheme by name; raises ``ValueError`` naming the allowed values."""
    if isinstance(name, QuantScheme):
        return name
    try:
        return SCHEMES[name]
    except (KeyError, TypeError):
        raise ValueError(f"quant={name!r} is not a known scheme; allowed: {sorted(SCHEMES)}") from None
