"""The reference experts backend: dequantized weights, emulated activation quantization, fp32.

It runs on any device and every scheme, one expert at a time, and is what every faster backend is
tested against. It quantizes activations with :mod:`epmoe.quant.reference` and then computes in
fp32, so its only differences from an exact integer/e4m3 kernel are fp32 summation order. For the
same reason ``accumulator="int32"`` changes nothing here: exact int32 sums and fp32 sums of the
dequantized products agree up to that rounding (docs/fidelity.md measures both kernels' rules).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..layouts import ContiguousBatch, MaskedBatch
from ..quant.reference import dequantize_rows, dequantize_weight, fake_quantize_act
from ..quant.schemes import QuantScheme
from .base import ExpertsBackend, ExpertWeights


def gemm_input(x: torch.Tensor, x_scale: torch.Tensor | None, scheme: QuantScheme) -> torch.Tensor:
    """The fp32 activation a GEMM of ``scheme`` sees for input ``x`` (float or quantized)."""
    if x_scale is None:
        return fake_quantize_act(x, scheme)
    xf = dequantize_rows(x, x_scale)
    same_format = x.dtype == scheme.qdtype and x_scale.shape[-1] == scheme.act_scale_cols(x.shape[-1])
    return xf if same_format else fake_quantize_act(xf, scheme)


def expert_mlp(xq: torch.Tensor, weights: ExpertWeights, e: int) -> torch.Tensor:
    """``w2[e] . fq(silu(gate) * up)`` in fp32 for the fp32 GEMM input ``xq [m, H]``."""
    w13 = dequantize_weight(weights.w13[e : e + 1], _slice(weights.w13_scale, e))[0]
    w2 = dequantize_weight(weights.w2[e : e + 1], _slice(weights.w2_scale, e))[0]
    gate_up = xq @ w13.t()
    gate, up = gate_up.chunk(2, dim=-1)
    act = fake_quantize_act(F.silu(gate) * up, weights.scheme)
    return act @ w2.t()


def _slice(scale: torch.Tensor | None, e: int) -> torch.Tensor | None:
    return None if scale is None else scale[e : e + 1]


def _each_expert_over_all_rows(xq: torch.Tensor, weights: ExpertWeights, row_expert: torch.Tensor,
                               out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """``[M, H]``: each row through the MLP of its expert ``row_expert [M]`` (``-1``: zeros), with
    static shapes: every expert runs over all ``M`` rows and keeps its own (``E`` times the FLOPs
    of the segment slices; the traceable form of the host-sliced loop, for ``torch.compile``).
    The activation quantizers work row by row, so a row's result is the one its segment gives."""
    out = torch.zeros(xq.shape[0], weights.hidden_size, dtype=out_dtype, device=xq.device)
    for e in range(weights.num_experts):
        y = expert_mlp(xq, weights, e).to(out_dtype)
        out = torch.where((row_expert == e).unsqueeze(1), y, out)
    return out


class TorchBackend(ExpertsBackend):
    """The reference. In eager mode each expert runs on its own rows (host-side segment sizes: one
    read-back per batch). While ``torch.compile`` traces (``compile_segments``) it takes
    device-sized batches and runs every expert over every row, keeping each row's own expert's
    result: the same per-row arithmetic with static shapes, at ``E`` times the FLOPs (tests and
    small models; the Triton and CUTLASS backends are the compiled fast paths)."""

    name = "torch"
    schemes = frozenset({"bf16", "int8_channel", "int8_block", "fp8_block"})
    layouts = frozenset({"contiguous", "masked"})
    compile_segments = True

    def run_contiguous(
        self, batch: ContiguousBatch, weights: ExpertWeights, out_dtype: torch.dtype
    ) -> torch.Tensor:
        if torch.compiler.is_compiling():
            xq = gemm_input(batch.x, batch.x_scale, self.scheme)
            return _each_expert_over_all_rows(xq, weights, batch.m_indices, out_dtype)
        out = torch.zeros(batch.x.shape[0], weights.hidden_size, dtype=out_dtype, device=batch.x.device)
        offsets = batch.expert_offsets.tolist()
        for e, n in enumerate(batch.rows_per_expert()):
            if n == 0:
                continue
            rows = slice(offsets[e], offsets[e] + n)
            scale = None if batch.x_scale is None else batch.x_scale[rows]
            xq = gemm_input(batch.x[rows], scale, self.scheme)
            out[rows] = expert_mlp(xq, weights, e).to(out_dtype)
        return out

    def run_masked(
        self, batch: MaskedBatch, weights: ExpertWeights, out_dtype: torch.dtype
    ) -> torch.Tensor:
        e_loc, cap, _ = batch.x.shape
        if torch.compiler.is_compiling():
            # Static shapes: each expert over its whole slab, rows past masked_m set to zero.
            valid = torch.arange(cap, device=batch.x.device) < batch.masked_m.to(batch.x.device).unsqueeze(1)
            outs = []
            for e in range(e_loc):
                scale = None if batch.x_scale is None else batch.x_scale[e]
                y = expert_mlp(gemm_input(batch.x[e], scale, self.scheme), weights, e).to(out_dtype)
                outs.append(torch.where(valid[e].unsqueeze(1), y, 0))
            return torch.stack(outs)
        out = torch.zeros(e_loc, cap, weights.hidden_size, dtype=out_dtype, device=batch.x.device)
        for e, n in enumerate(batch.masked_m.tolist()):
            if n == 0:
                continue
            scale = None if batch.x_scale is None else batch.x_scale[e, :n]
            xq = gemm_input(batch.x[e, :n], scale, self.scheme)
            out[e, :n] = expert_mlp(xq, weights, e).to(out_dtype)
        return out
