"""The Triton experts backend: INT8 channel-wise, INT8 block-wise and BF16 grouped GEMMs.

One forward is four launches (five with input quantization):

    quantize x -> GEMM1 (w13) -> silu(gate) * up (+ requantize) -> GEMM2 (w2)

on either layout, with no host synchronisation, so it can be captured in a CUDA graph.
GEMM1's output (the only intermediate in memory) is kept in ``out_dtype`` when that is 16-bit,
else fp32; the requantization reads it and quantizes the fp32 product directly.

Input activations may arrive floating (quantized here), already in the scheme's format (used as
they are), or quantized in another format such as FP8 e4m3 with 1x128 scales from low-latency
dispatch (dequantized inside the quantize kernel and requantized in one pass).
"""

from __future__ import annotations

import os

import torch

from .. import ops
from ..layouts import ContiguousBatch, MaskedBatch
from ..timing import phase
from . import stages
from .base import ExpertsBackend, ExpertWeights, check_weights
from .stages import spare_row_slab


class TritonBackend(ExpertsBackend):
    name = "triton"
    schemes = frozenset({"bf16", "int8_channel", "int8_block"})
    layouts = frozenset({"contiguous", "masked"})
    device_segments = True

    # alignment: the base's 1. The kernels tile each expert's segment on their own.

    @classmethod
    def available(cls, device: torch.device) -> tuple[bool, str]:
        device = torch.device(device)
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            return False, f"triton is not importable ({exc})"
        if device.type == "cuda":
            if not torch.cuda.is_available():
                return False, "CUDA is not available"
            return True, "triton on CUDA"
        if device.type == "cpu":
            if os.environ.get("TRITON_INTERPRET") == "1":
                return True, "triton interpreter (TRITON_INTERPRET=1) on CPU"
            return False, "on CPU the triton backend needs TRITON_INTERPRET=1 (interpreter, slow)"
        return False, f"triton kernels do not run on device type {device.type!r}"

    def run_contiguous(
        self, batch: ContiguousBatch, weights: ExpertWeights, out_dtype: torch.dtype
    ) -> torch.Tensor:
        if batch.expected_m is None:
            return self._run(batch.x, batch.x_scale, weights, out_dtype, expert_offsets=batch.expert_offsets)
        # Spare rows past the last segment: the GEMMs walk the device-side segments and size
        # their grids from the hint; the row-wise kernels skip the spare rows (spare_row_slab).
        bound, lift, drop = spare_row_slab(batch)
        out = self._run(
            lift(batch.x), lift(batch.x_scale), weights, out_dtype, rows_bound=bound,
            expert_offsets=batch.expert_offsets, expected_m=batch.expected_m,
        )
        return drop(out)

    def run_masked(
        self, batch: MaskedBatch, weights: ExpertWeights, out_dtype: torch.dtype
    ) -> torch.Tensor:
        masked_m = batch.masked_m.to(device=batch.x.device, dtype=torch.int32)
        # A hint is only a hint: any integer-like value is taken, at least 1 (as DeepGEMM does).
        hint = None if batch.expected_m is None else max(1, int(batch.expected_m))
        return self._run(
            batch.x, batch.x_scale, weights, out_dtype, rows_bound=(masked_m, hint),
            masked_m=masked_m, expected_m=hint,
        )  # fmt: skip

    def _run(
        self, x, x_scale, weights: ExpertWeights, out_dtype: torch.dtype, rows_bound=(None, None), **segments
    ) -> torch.Tensor:
        """``rows_bound``: ``(masked_m, expected_m)`` of the row-wise kernels (see
        :meth:`gemm1_input`); ``segments``: the GEMMs' (:meth:`gemm`)."""
        check_weights(weights, self.scheme)
        with phase("epmoe.quantize"):
            a, a_scale = self.gemm1_input(x, x_scale, weights, *rows_bound)
        with phase("epmoe.gemm1"):
            gate_up = self.gemm(a, a_scale, weights, 1, self.mid_dtype(weights, out_dtype), **segments)
        with phase("epmoe.activation"):
            h, h_scale = self.activation(gate_up, weights, *rows_bound)
        with phase("epmoe.gemm2"):
            return self.gemm(h, h_scale, weights, 2, out_dtype, **segments)

    # The stages of a forward, public so that benchmarks time exactly what the backend runs.
    def gemm(
        self,
        a: torch.Tensor,
        a_scale: torch.Tensor | None,
        weights: ExpertWeights,
        which: int,
        out_dtype: torch.dtype,
        *,
        expert_offsets: torch.Tensor | None = None,
        masked_m: torch.Tensor | None = None,
        expected_m: int | None = None,
    ) -> torch.Tensor:
        """GEMM1 (``which=1``: ``w13``) or GEMM2 (``which=2``: ``w2``), on the contiguous layout
        (``expert_offsets``; ``a`` may be a ``[1, M, K]`` slab with spare rows, ``expected_m``
        then the rows-per-expert hint) or, given ``masked_m``, the masked one."""
        w, w_scale = (weights.w13, weights.w13_scale) if which == 1 else (weights.w2, weights.w2_scale)
        kw = dict(mode=self.scheme.name, a_scale=a_scale, b_scale=w_scale, accumulator=self.accumulator,
                  out_dtype=out_dtype, expected_m=expected_m)  # fmt: skip
        if masked_m is not None:
            return ops.grouped_gemm_masked(a, w, masked_m, **kw)
        if a.dim() == 2:
            return ops.grouped_gemm_contiguous(a, w, expert_offsets, **kw)
        # The [1, M, K] slab of a batch with spare rows: the GEMM runs on its rows.
        flat = (lambda t: None if t is None else t.reshape(-1, t.shape[-1]))  # noqa: E731
        out = ops.grouped_gemm_contiguous(flat(a), w, expert_offsets, **{**kw, "a_scale": flat(a_scale)})
        return out.view(*a.shape[:-1], out.shape[-1])

    def gemm1_input(
        self,
        x: torch.Tensor,
        x_scale: torch.Tensor | None,
        weights: ExpertWeights,
        masked_m: torch.Tensor | None,
        expected_m: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """GEMM1's operand in the scheme's format (:func:`epmoe.experts.stages.gemm1_input`).

        ``masked_m``: ``[E]`` valid rows per segment of an ``[E, cap, H]`` ``x``;
        ``expected_m``: the rows per segment the row-wise kernels' grid is sized for."""
        return stages.gemm1_input(self.scheme, x, x_scale, weights, masked_m, expected_m)

    def activation(
        self,
        gate_up: torch.Tensor,
        weights: ExpertWeights,
        masked_m: torch.Tensor | None,
        expected_m: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``silu(gate) * up``, requantized for a quantized scheme
        (:func:`epmoe.experts.stages.activation`); rows as in :meth:`gemm1_input`."""
        return stages.activation(self.scheme, gate_up, weights, masked_m, expected_m)

    def mid_dtype(self, weights: ExpertWeights, out_dtype: torch.dtype) -> torch.dtype:
        """GEMM1's output dtype: 16-bit when the layer's output is, else fp32."""
        if not self.scheme.quantized and weights.w13.dtype == torch.float32:
            return torch.float32
        return out_dtype if out_dtype in (torch.bfloat16, torch.float16) else torch.float32
