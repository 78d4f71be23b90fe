"""The layer's device work as ``torch.library`` custom ops (namespace ``epmoe``), for ``torch.compile``.

Dynamo cannot trace into a Triton launch, a CUTLASS extension call or DeepGEMM: registered as
custom ops with fake implementations (output shapes and dtypes from the input shapes alone) they
become single nodes of a compiled graph, and a CUDA graph of that graph replays them. The kernels
stay pure functions in :mod:`epmoe.kernels` (and the CUTLASS / DeepGEMM wrappers in
:mod:`epmoe.experts`); this module only registers them. Every op allocates its outputs and writes
nothing it is given (``mutates_args=()``).

The functions below take the kernels' own arguments. While dynamo traces
(``torch.compiler.is_compiling()``) they call the registered op; in eager mode they call the kernel
directly: a custom op's Python dispatch costs about 10 us of host time per call on a CPU (measured:
docs/compile.md), which an eager, host-bound decode step would pay for each of its launches, and
the op's body is that same kernel call.
"""

from __future__ import annotations

import functools

import torch
from torch.compiler import is_compiling

NAMESPACE = "epmoe"

OPS: list[str] = []
"""Qualified names of every op registered here (what the opcheck tests walk)."""


class _Op:
    """A kernel entry point registered as the custom op ``epmoe::name`` (no mutated arguments).
    Calls go through the op only while dynamo traces; eager calls run the same function directly,
    since an op call costs about 10 us of host time, which eager decode pays per launch."""

    def __init__(self, name: str, fn) -> None:
        OPS.append(f"{NAMESPACE}::{name}")
        self.fn = fn
        self.op = torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=())(fn)
        self.register_fake = self.op.register_fake

    def __call__(self, *args):
        return self.op(*args) if is_compiling() else self.fn(*args)


def _op(name: str):
    """Register the decorated function as ``epmoe::name`` (:class:`_Op`)."""
    return lambda fn: _Op(name, fn)


_KERNELS: tuple = ()


def _kernels():
    """``(activation, grouped_gemm, permute, quantize)``, imported on first use (Triton is needed
    only where they run) and kept: an import statement per call costs microseconds of host time."""
    global _KERNELS
    if not _KERNELS:
        from .kernels import activation, grouped_gemm, permute, quantize

        _KERNELS = (activation, grouped_gemm, permute, quantize)
    return _KERNELS


# ------------------------------------------------------------------------------------- quantize
@_op("per_token_quant_int8")
def _per_token_quant_int8(
    x: torch.Tensor, x_scale: torch.Tensor | None, masked_m: torch.Tensor | None, expected_m: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    return _kernels()[3].per_token_quant_int8(x, x_scale, masked_m=masked_m, expected_m=expected_m)


@_per_token_quant_int8.register_fake
def _(x, x_scale, masked_m, expected_m):
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


@_op("per_group_quant")
def _per_group_quant(
    x: torch.Tensor,
    group_size: int,
    dtype: torch.dtype,
    x_scale: torch.Tensor | None,
    masked_m: torch.Tensor | None,
    expected_m: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _kernels()[3].per_group_quant(x, group_size, dtype, x_scale, masked_m=masked_m, expected_m=expected_m)


@_per_group_quant.register_fake
def _(x, group_size, dtype, x_scale, masked_m, expected_m):
    groups = x.shape[-1] // group_size
    return x.new_empty(x.shape, dtype=dtype), x.new_empty((*x.shape[:-1], groups), dtype=torch.float32)


def per_token_quant_int8(x, x_scale=None, *, masked_m=None, expected_m=None):
    """:func:`epmoe.kernels.quantize.per_token_quant_int8`."""
    return _per_token_quant_int8(x, x_scale, masked_m, expected_m)


def per_group_quant(x, group_size=128, dtype=torch.int8, x_scale=None, *, masked_m=None, expected_m=None):
    """:func:`epmoe.kernels.quantize.per_group_quant`."""
    return _per_group_quant(x, group_size, dtype, x_scale, masked_m, expected_m)


# ----------------------------------------------------------------------------------- activation
@_op("silu_and_mul")
def _silu_and_mul(
    gate_up: torch.Tensor, out_dtype: torch.dtype, masked_m: torch.Tensor | None, expected_m: int | None
) -> torch.Tensor:
    return _kernels()[0].silu_and_mul(gate_up, out_dtype, masked_m=masked_m, expected_m=expected_m)


@_silu_and_mul.register_fake
def _(gate_up, out_dtype, masked_m, expected_m):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2), dtype=out_dtype)


@_op("silu_and_mul_quant")
def _silu_and_mul_quant(
    gate_up: torch.Tensor,
    granularity: str,
    group_size: int,
    dtype: torch.dtype,
    masked_m: torch.Tensor | None,
    expected_m: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    act = _kernels()[0]
    return act.silu_and_mul_quant(gate_up, granularity, group_size, dtype, masked_m=masked_m, expected_m=expected_m)


@_silu_and_mul_quant.register_fake
def _(gate_up, granularity, group_size, dtype, masked_m, expected_m):
    inter = gate_up.shape[-1] // 2
    cols = 1 if granularity == "token" else inter // group_size
    lead = gate_up.shape[:-1]
    return gate_up.new_empty((*lead, inter), dtype=dtype), gate_up.new_empty((*lead, cols), dtype=torch.float32)


def silu_and_mul(gate_up, out_dtype=None, *, masked_m=None, expected_m=None):
    """:func:`epmoe.kernels.activation.silu_and_mul`."""
    return _silu_and_mul(gate_up, gate_up.dtype if out_dtype is None else out_dtype, masked_m, expected_m)


def silu_and_mul_quant(gate_up, granularity="token", group_size=128, dtype=torch.int8, *, masked_m=None,
                       expected_m=None):  # fmt: skip
    """:func:`epmoe.kernels.activation.silu_and_mul_quant`."""
    return _silu_and_mul_quant(gate_up, granularity, group_size, dtype, masked_m, expected_m)


# --------------------------------------------------------------------------------- grouped GEMM
@_op("grouped_gemm")
def _grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    segments: torch.Tensor,
    masked: bool,
    mode: str,
    a_scale: torch.Tensor | None,
    b_scale: torch.Tensor | None,
    accumulator: str,
    out_dtype: torch.dtype,
    expected_m: int | None,
) -> torch.Tensor:
    """``segments``: the contiguous layout's ``expert_offsets``, or ``masked_m`` when ``masked``."""
    return _gemm(masked)(a, b, segments, mode=mode, a_scale=a_scale, b_scale=b_scale, accumulator=accumulator,
                         out_dtype=out_dtype, expected_m=expected_m)  # fmt: skip


@_grouped_gemm.register_fake
def _(a, b, segments, masked, mode, a_scale, b_scale, accumulator, out_dtype, expected_m):
    return a.new_empty((*a.shape[:-1], b.shape[1]), dtype=out_dtype)  # [M, N] or [E, cap, N]


def _gemm(masked: bool):
    gg = _kernels()[1]
    return gg.grouped_gemm_masked if masked else gg.grouped_gemm_contiguous


def _grouped(masked, a, b, segments, *, mode, a_scale=None, b_scale=None, accumulator="fp32",
             out_dtype=torch.bfloat16, expected_m=None):  # fmt: skip
    return _grouped_gemm(a, b, segments, masked, mode, a_scale, b_scale, accumulator, out_dtype, expected_m)


def grouped_gemm_contiguous(a, b, expert_offsets, **kwargs):
    """:func:`epmoe.kernels.grouped_gemm.grouped_gemm_contiguous` (tile config looked up)."""
    return _grouped(False, a, b, expert_offsets, **kwargs)


def grouped_gemm_masked(a, b, masked_m, **kwargs):
    """:func:`epmoe.kernels.grouped_gemm.grouped_gemm_masked` (tile config looked up)."""
    return _grouped(True, a, b, masked_m, **kwargs)


# ------------------------------------------------------------------------------- row movement
@_op("slot_layout")
def _slot_layout(
    topk_ids: torch.Tensor, num_experts: int, alignment: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _kernels()[2].slot_layout(topk_ids, num_experts, alignment)


@_slot_layout.register_fake
def _(topk_ids, num_experts, alignment):
    r, k = topk_ids.shape
    rows = r * k + num_experts * (alignment - 1)  # permute.max_rows
    i32 = dict(dtype=torch.int32)
    return (
        topk_ids.new_empty((num_experts + 1,), **i32), topk_ids.new_empty((r, k), dtype=torch.int64),
        topk_ids.new_empty((rows,), **i32), topk_ids.new_empty((num_experts,), **i32),
    )  # fmt: skip


@_op("slot_positions")
def _slot_positions(
    topk_ids: torch.Tensor, expert_offsets: torch.Tensor, num_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _kernels()[2].slot_positions(topk_ids, expert_offsets, num_rows)


@_slot_positions.register_fake
def _(topk_ids, expert_offsets, num_rows):
    return (
        topk_ids.new_empty(topk_ids.shape, dtype=torch.int64), topk_ids.new_empty((num_rows,), dtype=torch.int32),
        topk_ids.new_empty((expert_offsets.shape[0] - 1,), dtype=torch.int32),
    )  # fmt: skip


@_op("scatter_rows")
def _scatter_rows(
    x: torch.Tensor, slot_pos: torch.Tensor, num_out_rows: int, x_scale: torch.Tensor | None, fill_unused: bool
) -> list[torch.Tensor]:
    out, out_scale = _kernels()[2].scatter_rows(x, slot_pos, num_out_rows, x_scale, fill_unused=fill_unused)
    return [out] if out_scale is None else [out, out_scale]


@_scatter_rows.register_fake
def _(x, slot_pos, num_out_rows, x_scale, fill_unused):
    out = [x.new_empty((num_out_rows, x.shape[1]))]
    if x_scale is not None:
        out.append(x_scale.new_empty((num_out_rows, x_scale.shape[1])))
    return out


@_op("gather_weighted")
def _gather_weighted(
    expert_out: torch.Tensor, slot_pos: torch.Tensor, topk_weights: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    return _kernels()[2].gather_weighted(expert_out, slot_pos, topk_weights, out_dtype)


@_gather_weighted.register_fake
def _(expert_out, slot_pos, topk_weights, out_dtype):
    return expert_out.new_empty((slot_pos.shape[0], expert_out.shape[1]), dtype=out_dtype)


def slot_layout(topk_ids, num_experts, alignment=1):
    """:func:`epmoe.kernels.permute.slot_layout`."""
    return _slot_layout(topk_ids, num_experts, alignment)


def slot_positions(topk_ids, expert_offsets, num_rows):
    """:func:`epmoe.kernels.permute.slot_positions`."""
    return _slot_positions(topk_ids, expert_offsets, num_rows)


def scatter_rows(x, slot_pos, num_out_rows, x_scale=None, *, fill_unused=True):
    """:func:`epmoe.kernels.permute.scatter_rows`."""
    out = _scatter_rows(x, slot_pos, num_out_rows, x_scale, fill_unused)
    return out[0], (out[1] if len(out) > 1 else None)


def gather_weighted(expert_out, slot_pos, topk_weights, out_dtype=torch.float32):
    """:func:`epmoe.kernels.permute.gather_weighted`."""
    return _gather_weighted(expert_out, slot_pos, topk_weights, out_dtype)


# ------------------------------------------------------------------------ CUTLASS and DeepGEMM
CUTLASS_GEMMS = ("fp8_block", "int8_channel", "int8_block")
"""``kind`` of :func:`cutlass_grouped_gemm`: which of the CUTLASS grouped GEMMs runs."""


def _cutlass_fn(kind: str, masked: bool = False):
    from .experts import cutlass_backend as cb

    if masked:
        fns = {"int8_channel": cb.int8_masked_gemm, "int8_block": cb.int8_block_masked_gemm}
    else:
        fns = {"fp8_block": cb.grouped_gemm, "int8_channel": cb.int8_grouped_gemm, "int8_block": cb.int8_block_grouped_gemm}
    if kind not in fns:
        raise ValueError(f"kind={kind!r}; allowed{' on the masked layout' if masked else ''}: {list(fns)}")
    return fns[kind]


def _with_schedule(kind: str, fn, schedule: str):
    """``fn`` with the INT8 block kernel's ``schedule`` (the other kernels have one each)."""
    return functools.partial(fn, schedule=schedule) if kind == "int8_block" else fn


@_op("cutlass_grouped_gemm")
def _cutlass_grouped_gemm(
    kind: str, a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
    expert_offsets: torch.Tensor, schedule: str,
) -> torch.Tensor:  # fmt: skip
    return _with_schedule(kind, _cutlass_fn(kind), schedule)(a, a_scale, b, b_scale, expert_offsets)


@_cutlass_grouped_gemm.register_fake
def _(kind, a, a_scale, b, b_scale, expert_offsets, schedule):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.bfloat16)


def cutlass_grouped_gemm(kind, a, a_scale, b, b_scale, expert_offsets, schedule="lockstep"):
    """One of the CUTLASS grouped GEMMs of :mod:`epmoe.experts.cutlass_backend` (``kind`` in
    :data:`CUTLASS_GEMMS`; ``schedule``: the INT8 block kernel's, ignored by the others);
    ``[M, N]`` bf16."""
    return _cutlass_grouped_gemm(kind, a, a_scale, b, b_scale, expert_offsets, schedule)


@_op("cutlass_masked_gemm")
def _cutlass_masked_gemm(
    kind: str, a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
    masked_m: torch.Tensor, schedule: str,
) -> torch.Tensor:  # fmt: skip
    return _with_schedule(kind, _cutlass_fn(kind, masked=True), schedule)(a, a_scale, b, b_scale, masked_m)


@_cutlass_masked_gemm.register_fake
def _(kind, a, a_scale, b, b_scale, masked_m, schedule):
    return a.new_empty((*a.shape[:2], b.shape[1]), dtype=torch.bfloat16)


def cutlass_masked_gemm(kind, a, a_scale, b, b_scale, masked_m, schedule="lockstep"):
    """One of the INT8 CUTLASS GEMMs on the masked layout (``kind``: ``int8_channel`` or
    ``int8_block``; ``a [E, max_m, K]``, ``max_m`` a multiple of 128); ``[E, max_m, N]`` bf16."""
    return _cutlass_masked_gemm(kind, a, a_scale, b, b_scale, masked_m, schedule)


def _deepgemm():
    from .experts import deepgemm_backend

    return deepgemm_backend


@_op("deepgemm_contiguous")
def _deepgemm_contiguous(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, m_indices: torch.Tensor
) -> torch.Tensor:
    return _deepgemm().gemm_contiguous(a, a_scale, b, b_scale, m_indices)


@_deepgemm_contiguous.register_fake
def _(a, a_scale, b, b_scale, m_indices):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.bfloat16)


@_op("deepgemm_masked")
def _deepgemm_masked(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, masked_m: torch.Tensor,
    expected_m: int,
) -> torch.Tensor:  # fmt: skip
    return _deepgemm().gemm_masked(a, a_scale, b, b_scale, masked_m, expected_m)


@_deepgemm_masked.register_fake
def _(a, a_scale, b, b_scale, masked_m, expected_m):
    return a.new_empty((a.shape[0], a.shape[1], b.shape[1]), dtype=torch.bfloat16)


def deepgemm_contiguous(a, a_scale, b, b_scale, m_indices):
    """:func:`epmoe.experts.deepgemm_backend.gemm_contiguous`."""
    return _deepgemm_contiguous(a, a_scale, b, b_scale, m_indices)


def deepgemm_masked(a, a_scale, b, b_scale, masked_m, expected_m):
    """:func:`epmoe.experts.deepgemm_backend.gemm_masked`."""
    return _deepgemm_masked(a, a_scale, b, b_scale, masked_m, expected_m)
