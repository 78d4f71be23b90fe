"""The row-wise Triton stages of an experts pass, shared by the Triton and the CUTLASS backends.

Both backends run the same row-wise kernels around their own grouped GEMMs: GEMM1's input in the
scheme's format (quantize, pass through, or requantize) and ``silu(gate) * up`` (requantized for
a quantized scheme). They live here, as pure functions of the scheme and tensors, so that neither
backend reaches into the other for them.
"""

from __future__ import annotations

import torch

from .. import ops  # the Triton kernels as registered ops (Triton imported where they run)
from ..layouts import ContiguousBatch
from ..quant.reference import dequantize_rows
from ..quant.schemes import BLOCK, QuantScheme
from ..tensors import as_contiguous
from .base import ExpertWeights


def spare_row_slab(batch: ContiguousBatch):
    """``(rows_bound, lift, drop)`` for the row-wise kernels over a contiguous batch: with spare
    rows past the last segment (``batch.expected_m``) they see one ``[1, M]`` masked slab whose row
    count is ``expert_offsets[-1]`` (skipping the spare rows without a host round trip) and a grid
    for the rows all experts are expected to fill; ``lift`` makes that slab of a tensor (or
    ``None``), ``drop`` takes it back. Without spare rows: no bound, and both are identities."""
    if batch.expected_m is None:
        return (None, None), (lambda t: t), (lambda t: t)
    bound = (batch.valid_rows, max(1, batch.expected_m * batch.num_experts))
    return bound, (lambda t: None if t is None else t.unsqueeze(0)), (lambda t: t.squeeze(0))


def row_args(masked_m: torch.Tensor | None, expected_m: int | None) -> dict:
    """The row-wise kernels' ``masked_m`` / ``expected_m`` (a rows-per-segment hint sizes their
    grid only over a masked batch, so it is dropped without one)."""
    return dict(masked_m=masked_m, expected_m=expected_m if masked_m is not None else None)


def gemm1_input(
    scheme: QuantScheme,
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    weights: ExpertWeights,
    masked_m: torch.Tensor | None,
    expected_m: int | None = None,
    row_expert: torch.Tensor | None = None,
    scale_mn_major: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GEMM1's operand in ``scheme``'s format (quantize, pass through, or requantize).

    ``x``: ``[M, H]``, or ``[E, cap, H]`` with ``masked_m``; floating, in the scheme's format, or
    quantized in another (``x_scale`` then its scales). ``masked_m``: ``[E]`` valid rows per
    segment of an ``[E, cap, H]`` ``x``; ``expected_m``: the rows per segment the row-wise kernels'
    grid is sized for; ``row_expert``: skip the rows of expert -1 when quantizing (see
    :func:`padding_rows`); ``scale_mn_major``: per-group scales it writes are stored MN-major
    (:func:`~epmoe.kernels.common.mn_major_scales`: what the project's CUTLASS block-scaled GEMMs read
    without a transposing copy; scales that arrived are passed on as they are). Returns the operand
    and its fp32 scales (``None`` for BF16)."""
    hidden = x.shape[-1]
    if hidden != weights.hidden_size:
        raise ValueError(f"x has hidden size {hidden} but w13 {tuple(weights.w13.shape)} expects {weights.hidden_size}")
    if not scheme.quantized:
        xf = x if x_scale is None else dequantize_rows(x, x_scale)
        return xf.to(weights.w13.dtype), None
    if x_scale is None and not x.is_floating_point():
        raise TypeError(f"x of dtype {x.dtype} arrived without x_scale; quantized inputs need their scales")
    native = (
        x_scale is not None
        and x.dtype == scheme.qdtype
        and x_scale.shape[-1] == scheme.act_scale_cols(hidden)
    )
    if native:
        return x, x_scale.float()
    rows = row_args(masked_m, expected_m)
    if scheme.act_granularity == "token":
        return ops.per_token_quant_int8(x, x_scale, row_expert=row_expert, **rows)
    return ops.per_group_quant(x, BLOCK, torch.int8, x_scale, row_expert=row_expert, scale_mn_major=scale_mn_major,
                               **rows)  # fmt: skip


def activation(
    scheme: QuantScheme,
    gate_up: torch.Tensor,
    weights: ExpertWeights,
    masked_m: torch.Tensor | None,
    expected_m: int | None = None,
    row_expert: torch.Tensor | None = None,
    scale_mn_major: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``silu(gate) * up`` of GEMM1's output ``gate_up`` (``[..., 2I]``), requantized for a
    quantized ``scheme`` (per token or per 1x128 group, as its activations); rows as in
    :func:`gemm1_input`; ``row_expert`` (quantized schemes): skip the rows of expert -1 (see
    :func:`padding_rows`); ``scale_mn_major``: per-group scales stored MN-major (as in
    :func:`gemm1_input`). Returns GEMM2's operand and its scales (``None`` for BF16)."""
    rows = row_args(masked_m, expected_m)
    if not scheme.quantized:
        return ops.silu_and_mul(gate_up, weights.w2.dtype, **rows), None
    granularity = "token" if scheme.act_granularity == "token" else "group"
    return ops.silu_and_mul_quant(gate_up, granularity, BLOCK, torch.int8, row_expert=row_expert,
                                  scale_mn_major=scale_mn_major and granularity == "group", **rows)  # fmt: skip


def padding_rows(batch: ContiguousBatch) -> torch.Tensor | None:
    """The ``row_expert`` of the row-wise stages over ``batch``: its ``m_indices`` when its segments
    are padded (``alignment`` above 1, or not recorded), so that the stages skip the padding rows
    (a decode step's 128-row segments hold a row or two each); ``None`` without padding."""
    return None if batch.alignment == 1 else as_contiguous(batch.m_indices, torch.int32)
