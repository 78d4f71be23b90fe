"""The layer's device work as ``torch.library`` custom ops (namespace ``epmoe``), for ``torch.compile``.

Dynamo cannot trace into a Triton launch, a CUTLASS extension call, DeepGEMM or DeepEP: registered
as custom ops with fake implementations (output shapes and dtypes from the input shapes and the
sizes passed along) they become single nodes of a compiled graph, and a CUDA graph of that graph
replays them. The kernels stay pure functions in :mod:`epmoe.kernels` (the CUTLASS / DeepGEMM
wrappers in :mod:`epmoe.experts`, DeepEP's calls in :mod:`epmoe.dispatch.deepep_dispatch.calls`);
this module only registers them. Every op allocates its outputs and writes nothing it is given
(``mutates_args=()``).

The functions below take the kernels' own arguments. While dynamo traces
(``torch.compiler.is_compiling()``) they call the registered op; in eager mode they call the kernel
directly: a custom op's Python dispatch costs about 10 us of host time per call on a CPU (measured:
docs/compile.md), which an eager, host-bound decode step would pay for each of its launches, and
the op's body is that same kernel call.
"""

from __future__ import annotations

import functools
import math

import torch
from torch.compiler import is_compiling

from .kernels.common import empty_scales, max_rows, mn_major_scales  # Triton-free: importing this module must not need Triton
from .quant.payload import PAYLOAD_FORMATS

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
    """``(activation, grouped_gemm, permute, quantize, topk, prep)``, imported on first use (Triton is
    needed only where they run) and kept: an import statement per call costs microseconds of host
    time."""
    global _KERNELS
    if not _KERNELS:
        from .kernels import activation, grouped_gemm, permute, prep, quantize, topk

        _KERNELS = (activation, grouped_gemm, permute, quantize, topk, prep)
    return _KERNELS


# -------------------------------------------------------------------------------------- routing
@_op("fused_topk")
def _fused_topk(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scoring_func: str,
    num_expert_group: int | None,
    topk_group: int | None,
    correction_bias: torch.Tensor | None,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _kernels()[4].fused_topk(router_logits, top_k, renormalize, scoring_func, num_expert_group, topk_group,
                                    correction_bias, routed_scaling_factor)  # fmt: skip


@_fused_topk.register_fake
def _(router_logits, top_k, renormalize, scoring_func, num_expert_group, topk_group, correction_bias,
      routed_scaling_factor):  # fmt: skip
    t = router_logits.shape[0]
    return (router_logits.new_empty((t, top_k), dtype=torch.int64),
            router_logits.new_empty((t, top_k), dtype=torch.float32))  # fmt: skip


def fused_topk(router_logits, top_k, *, renormalize=True, scoring_func="softmax", num_expert_group=None,
               topk_group=None, correction_bias=None, routed_scaling_factor=1.0):  # fmt: skip
    """:func:`epmoe.kernels.topk.fused_topk`."""
    return _fused_topk(router_logits, top_k, renormalize, scoring_func, num_expert_group, topk_group,
                       correction_bias, float(routed_scaling_factor))  # fmt: skip


# ------------------------------------------------------------------------------------- quantize
@_op("per_token_quant_int8")
def _per_token_quant_int8(
    x: torch.Tensor, x_scale: torch.Tensor | None, masked_m: torch.Tensor | None, expected_m: int | None,
    row_expert: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return _kernels()[3].per_token_quant_int8(x, x_scale, masked_m=masked_m, expected_m=expected_m,
                                              row_expert=row_expert)  # fmt: skip


@_per_token_quant_int8.register_fake
def _(x, x_scale, masked_m, expected_m, row_expert):
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


@_op("per_group_quant")
def _per_group_quant(
    x: torch.Tensor,
    group_size: int,
    dtype: torch.dtype,
    x_scale: torch.Tensor | None,
    masked_m: torch.Tensor | None,
    expected_m: int | None,
    row_expert: torch.Tensor | None,
    scale_mn_major: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _kernels()[3].per_group_quant(x, group_size, dtype, x_scale, masked_m=masked_m, expected_m=expected_m,
                                         row_expert=row_expert, scale_mn_major=scale_mn_major)  # fmt: skip


@_per_group_quant.register_fake
def _(x, group_size, dtype, x_scale, masked_m, expected_m, row_expert, scale_mn_major):
    groups = x.shape[-1] // group_size
    return x.new_empty(x.shape, dtype=dtype), _fake_scales(x.shape[:-1], groups, x, scale_mn_major)


def per_token_quant_int8(x, x_scale=None, *, masked_m=None, expected_m=None, row_expert=None):
    """:func:`epmoe.kernels.quantize.per_token_quant_int8`."""
    return _per_token_quant_int8(x, x_scale, masked_m, expected_m, row_expert)


def per_group_quant(x, group_size=128, dtype=torch.int8, x_scale=None, *, masked_m=None, expected_m=None,
                    row_expert=None, scale_mn_major=False):  # fmt: skip
    """:func:`epmoe.kernels.quantize.per_group_quant`."""
    return _per_group_quant(x, group_size, dtype, x_scale, masked_m, expected_m, row_expert, scale_mn_major)


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
    row_expert: torch.Tensor | None,
    scale_mn_major: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    act = _kernels()[0]
    return act.silu_and_mul_quant(gate_up, granularity, group_size, dtype, masked_m=masked_m, expected_m=expected_m,
                                  row_expert=row_expert, scale_mn_major=scale_mn_major)  # fmt: skip


@_silu_and_mul_quant.register_fake
def _(gate_up, granularity, group_size, dtype, masked_m, expected_m, row_expert, scale_mn_major):
    inter = gate_up.shape[-1] // 2
    cols = 1 if granularity == "token" else inter // group_size
    lead = gate_up.shape[:-1]
    return gate_up.new_empty((*lead, inter), dtype=dtype), _fake_scales(lead, cols, gate_up, scale_mn_major)


def silu_and_mul(gate_up, out_dtype=None, *, masked_m=None, expected_m=None):
    """:func:`epmoe.kernels.activation.silu_and_mul`."""
    return _silu_and_mul(gate_up, gate_up.dtype if out_dtype is None else out_dtype, masked_m, expected_m)


def silu_and_mul_quant(gate_up, granularity="token", group_size=128, dtype=torch.int8, *, masked_m=None,
                       expected_m=None, row_expert=None, scale_mn_major=False):  # fmt: skip
    """:func:`epmoe.kernels.activation.silu_and_mul_quant`."""
    return _silu_and_mul_quant(gate_up, granularity, group_size, dtype, masked_m, expected_m, row_expert,
                               scale_mn_major)  # fmt: skip


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
@_op("slot_layout_scatter")
def _slot_layout_scatter(
    topk_ids: torch.Tensor, num_experts: int, alignment: int, x: torch.Tensor, x_scale: torch.Tensor | None,
    scale_mn_major: bool,
) -> list[torch.Tensor]:  # fmt: skip
    out = _kernels()[2].slot_layout_scatter(topk_ids, num_experts, alignment, x, x_scale, scale_mn_major=scale_mn_major)
    return list(out[:5]) if out[5] is None else list(out)


def _fake_scales(lead, cols: int, like: torch.Tensor, mn_major: bool, dtype=torch.float32) -> torch.Tensor:
    """A kernel's output scales ``[*lead, cols]`` with its strides, for a fake implementation:
    MN-major (fp32, one buffer over the flattened rows, seen transposed) or row-major ``dtype``."""
    if mn_major:
        return mn_major_scales(math.prod(lead), cols, None, like=like).reshape(*lead, cols)
    return like.new_empty((*lead, cols), dtype=dtype)


@_slot_layout_scatter.register_fake
def _(topk_ids, num_experts, alignment, x, x_scale, scale_mn_major):
    r, k = topk_ids.shape
    rows = max_rows(r, k, num_experts, alignment)
    i32 = dict(dtype=torch.int32)
    out = [
        topk_ids.new_empty((num_experts + 1,), **i32), topk_ids.new_empty((r, k), dtype=torch.int64),
        topk_ids.new_empty((rows,), **i32), topk_ids.new_empty((num_experts,), **i32),
        x.new_empty((rows, x.shape[1])),
    ]  # fmt: skip
    if x_scale is not None:
        out.append(_fake_scales((rows,), x_scale.shape[1], x_scale, scale_mn_major, x_scale.dtype))
    return out


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
    x: torch.Tensor, slot_pos: torch.Tensor, num_out_rows: int, x_scale: torch.Tensor | None, fill_unused: bool,
    scale_mn_major: bool,
) -> list[torch.Tensor]:  # fmt: skip
    out, out_scale = _kernels()[2].scatter_rows(x, slot_pos, num_out_rows, x_scale, fill_unused=fill_unused,
                                                scale_mn_major=scale_mn_major)  # fmt: skip
    return [out] if out_scale is None else [out, out_scale]


@_scatter_rows.register_fake
def _(x, slot_pos, num_out_rows, x_scale, fill_unused, scale_mn_major):
    out = [x.new_empty((num_out_rows, x.shape[1]))]
    if x_scale is not None:
        out.append(_fake_scales((num_out_rows,), x_scale.shape[1], x_scale, scale_mn_major, x_scale.dtype))
    return out


@_op("gather_weighted")
def _gather_weighted(
    expert_out: torch.Tensor, slot_pos: torch.Tensor, topk_weights: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    return _kernels()[2].gather_weighted(expert_out, slot_pos, topk_weights, out_dtype)


@_gather_weighted.register_fake
def _(expert_out, slot_pos, topk_weights, out_dtype):
    return expert_out.new_empty((slot_pos.shape[0], expert_out.shape[1]), dtype=out_dtype)


def slot_layout_scatter(topk_ids, num_experts, alignment, x, x_scale=None, *, scale_mn_major=False):
    """:func:`epmoe.kernels.permute.slot_layout_scatter`."""
    out = _slot_layout_scatter(topk_ids, num_experts, alignment, x, x_scale, scale_mn_major)
    return (*out[:5], out[5] if len(out) > 5 else None)


def slot_positions(topk_ids, expert_offsets, num_rows):
    """:func:`epmoe.kernels.permute.slot_positions`."""
    return _slot_positions(topk_ids, expert_offsets, num_rows)


def scatter_rows(x, slot_pos, num_out_rows, x_scale=None, *, fill_unused=True, scale_mn_major=False):
    """:func:`epmoe.kernels.permute.scatter_rows`."""
    out = _scatter_rows(x, slot_pos, num_out_rows, x_scale, fill_unused, scale_mn_major)
    return out[0], (out[1] if len(out) > 1 else None)


def gather_weighted(expert_out, slot_pos, topk_weights, out_dtype=torch.float32):
    """:func:`epmoe.kernels.permute.gather_weighted`."""
    return _gather_weighted(expert_out, slot_pos, topk_weights, out_dtype)


# ------------------------------------------------------------------------------- decode prep
@_op("decode_prep")
def _decode_prep(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring_func: str, num_expert_group: int | None,
    topk_group: int | None, correction_bias: torch.Tensor | None, routed_scaling_factor: float, x: torch.Tensor,
    alignment: int, payload: str, scale_mn_major: bool,
) -> list[torch.Tensor]:  # fmt: skip
    out = _kernels()[5].decode_prep(router_logits, top_k, renormalize, scoring_func, num_expert_group, topk_group,
                                    correction_bias, routed_scaling_factor, x, alignment, payload, scale_mn_major)  # fmt: skip
    return list(out[:7]) if out[7] is None else list(out)


@_decode_prep.register_fake
def _(router_logits, top_k, renormalize, scoring_func, num_expert_group, topk_group, correction_bias,
      routed_scaling_factor, x, alignment, payload, scale_mn_major):  # fmt: skip
    t, e = router_logits.shape
    rows = max_rows(t, top_k, e, alignment)
    i32 = dict(dtype=torch.int32)
    i64 = dict(dtype=torch.int64)
    out = [
        x.new_empty((t, top_k), **i64), x.new_empty((t, top_k), dtype=torch.float32),
        x.new_empty((e + 1,), **i32), x.new_empty((t, top_k), **i64), x.new_empty((rows,), **i32),
        x.new_empty((e,), **i32),
    ]  # fmt: skip
    if payload == "float":
        return [*out, x.new_empty((rows, x.shape[1]))]
    dtype, _, group = PAYLOAD_FORMATS[payload]
    scales = empty_scales(rows, 1 if group is None else x.shape[1] // group, None, scale_mn_major, like=x)
    return [*out, x.new_empty((rows, x.shape[1]), dtype=dtype), scales]


def decode_prep(router_logits, top_k, x, *, alignment, payload, renormalize=True, scoring_func="softmax",
                num_expert_group=None, topk_group=None, correction_bias=None, routed_scaling_factor=1.0,
                scale_mn_major=False):  # fmt: skip
    """:func:`epmoe.kernels.prep.decode_prep`: ``(topk_ids, topk_weights, expert_offsets, slot_pos,
    m_indices, counts, out, out_scale or None)``."""
    out = _decode_prep(router_logits, top_k, renormalize, scoring_func, num_expert_group, topk_group,
                       correction_bias, float(routed_scaling_factor), x, alignment, payload, scale_mn_major)  # fmt: skip
    return (*out[:7], out[7] if len(out) > 7 else None)


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


def _with_schedule(kind: str, fn, schedule: str, impl: str = "auto"):
    """``fn`` with the INT8 block kernel's ``schedule`` or the FP8 GEMM's ``impl`` (the INT8
    channel kernel takes neither)."""
    if kind == "int8_block":
        return functools.partial(fn, schedule=schedule)
    return functools.partial(fn, impl=impl) if kind == "fp8_block" else fn


@_op("cutlass_grouped_gemm")
def _cutlass_grouped_gemm(
    kind: str, a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
    expert_offsets: torch.Tensor, schedule: str, impl: str = "auto",
) -> torch.Tensor:  # fmt: skip
    return _with_schedule(kind, _cutlass_fn(kind), schedule, impl)(a, a_scale, b, b_scale, expert_offsets)


@_cutlass_grouped_gemm.register_fake
def _(kind, a, a_scale, b, b_scale, expert_offsets, schedule, impl="auto"):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.bfloat16)


# The INT8 block kernel's default variant: cutlass_backend.DEFAULT_INT8_BLOCK_SCHEDULE, named here
# because that module needs Triton (tests/test_fp8_selection.py keeps the two equal).
DEFAULT_INT8_BLOCK_SCHEDULE = "n256_quarters_run4"


def cutlass_grouped_gemm(kind, a, a_scale, b, b_scale, expert_offsets, schedule=DEFAULT_INT8_BLOCK_SCHEDULE, impl="auto"):
    """One of the CUTLASS grouped GEMMs of :mod:`epmoe.experts.cutlass_backend` (``kind`` in
    :data:`CUTLASS_GEMMS`; ``schedule``: the INT8 block kernel's, ``impl``: the FP8 GEMM's
    (:func:`~epmoe.experts.cutlass_backend.grouped_gemm`), each ignored by the others);
    ``[M, N]`` bf16."""
    return _cutlass_grouped_gemm(kind, a, a_scale, b, b_scale, expert_offsets, schedule, impl)


@_op("cutlass_masked_gemm")
def _cutlass_masked_gemm(
    kind: str, a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
    masked_m: torch.Tensor, schedule: str,
) -> torch.Tensor:  # fmt: skip
    return _with_schedule(kind, _cutlass_fn(kind, masked=True), schedule)(a, a_scale, b, b_scale, masked_m)


@_cutlass_masked_gemm.register_fake
def _(kind, a, a_scale, b, b_scale, masked_m, schedule):
    return a.new_empty((*a.shape[:2], b.shape[1]), dtype=torch.bfloat16)


def cutlass_masked_gemm(kind, a, a_scale, b, b_scale, masked_m, schedule=DEFAULT_INT8_BLOCK_SCHEDULE):
    """One of the INT8 CUTLASS GEMMs on the masked layout (``kind``: ``int8_channel`` or
    ``int8_block``; ``a [E, max_m, K]``, ``max_m`` a multiple of 128); ``[E, max_m, N]`` bf16."""
    return _cutlass_masked_gemm(kind, a, a_scale, b, b_scale, masked_m, schedule)


@_op("cutlass_silu_gemm")
def _cutlass_silu_gemm(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, expert_offsets: torch.Tensor,
    schedule: str,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    from .experts import cutlass_backend as cb

    return cb.int8_block_silu_grouped_gemm(a, a_scale, b, b_scale, expert_offsets, schedule=schedule)


@_cutlass_silu_gemm.register_fake
def _(a, a_scale, b, b_scale, expert_offsets, schedule):
    cols = b.shape[1] // 2
    return a.new_empty((a.shape[0], cols), dtype=torch.int8), mn_major_scales(a.shape[0], cols // 128, None, like=a)


def cutlass_silu_gemm(a, a_scale, b, b_scale, expert_offsets, schedule):
    """:func:`epmoe.experts.cutlass_backend.int8_block_silu_grouped_gemm`: GEMM1 of an INT8 block
    pass with ``silu(gate) * up`` requantized in its epilogue (``schedule``: one of
    ``SILU_FUSED_SCHEDULES``); ``(q [M, N/2] int8, q_scale [M, N/256] fp32 MN-major)``."""
    return _cutlass_silu_gemm(a, a_scale, b, b_scale, expert_offsets, schedule)


@_op("cutlass_silu_masked_gemm")
def _cutlass_silu_masked_gemm(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, masked_m: torch.Tensor,
    schedule: str,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    from .experts import cutlass_backend as cb

    return cb.int8_block_silu_masked_gemm(a, a_scale, b, b_scale, masked_m, schedule=schedule)


@_cutlass_silu_masked_gemm.register_fake
def _(a, a_scale, b, b_scale, masked_m, schedule):
    cols = b.shape[1] // 2
    rows = a.shape[:2]
    return a.new_empty((*rows, cols), dtype=torch.int8), a.new_empty((*rows, cols // 128), dtype=torch.float32)


def cutlass_silu_masked_gemm(a, a_scale, b, b_scale, masked_m, schedule):
    """:func:`epmoe.experts.cutlass_backend.int8_block_silu_masked_gemm`: ``(q [E, max_m, N/2]
    int8, q_scale [E, max_m, N/256] fp32)``."""
    return _cutlass_silu_masked_gemm(a, a_scale, b, b_scale, masked_m, schedule)


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


# ------------------------------------------------------------------------------------- DeepEP
# DeepEP's send and combine (epmoe.dispatch.deepep_dispatch.calls): the buffer is reached by its
# owner's id, the handles travel as tensors. They mutate none of their arguments; DeepEP's own
# buffer is state the graph never sees, and every call is ordered by the data it consumes (a
# combine takes its dispatch's handle), so the same graph issues the same calls on every rank.
_DEEPEP: list = []


def _deepep():
    """:mod:`epmoe.dispatch.deepep_dispatch.calls`, imported on first use and kept (eager decode
    calls it twice per layer and step)."""
    if not _DEEPEP:
        from .dispatch.deepep_dispatch import calls

        _DEEPEP.append(calls)
    return _DEEPEP[0]


@_op("deepep_low_latency_dispatch")
def _deepep_low_latency_dispatch(
    buffer_id: int, x: torch.Tensor, topk_ids: torch.Tensor, num_max_tokens: int, num_experts: int, num_ranks: int,
    use_fp8: bool,
) -> list[torch.Tensor]:  # fmt: skip
    """``num_ranks`` sizes only the fake implementation's outputs (DeepEP knows its group)."""
    return _deepep().low_latency_dispatch(buffer_id, x, topk_ids, num_max_tokens, num_experts, use_fp8)


@_deepep_low_latency_dispatch.register_fake
def _(buffer_id, x, topk_ids, num_max_tokens, num_experts, num_ranks, use_fp8):
    e_loc, rows, h = num_experts // num_ranks, num_ranks * num_max_tokens, x.shape[1]
    out = [x.new_empty((e_loc, rows, h), dtype=torch.float8_e4m3fn if use_fp8 else torch.bfloat16)]
    if use_fp8:  # column-major in its last two dimensions, as DeepEP allocates it (for TMA)
        out.append(x.new_empty((e_loc, h // 128, rows), dtype=torch.float32).transpose(1, 2))
    i32 = dict(dtype=torch.int32)
    return [*out, x.new_empty((e_loc,), **i32), x.new_empty((e_loc, rows), **i32),
            x.new_empty((e_loc, num_ranks), dtype=torch.int64)]  # fmt: skip


@_op("deepep_low_latency_combine")
def _deepep_low_latency_combine(
    buffer_id: int, y: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, src_info: torch.Tensor,
    layout_range: torch.Tensor, num_max_tokens: int, num_experts: int,
) -> torch.Tensor:  # fmt: skip
    return _deepep().low_latency_combine(buffer_id, y, topk_ids, topk_weights, src_info, layout_range,
                                         num_max_tokens, num_experts)  # fmt: skip


@_deepep_low_latency_combine.register_fake
def _(buffer_id, y, topk_ids, topk_weights, src_info, layout_range, num_max_tokens, num_experts):
    return y.new_empty((topk_ids.shape[0], y.shape[-1]), dtype=torch.bfloat16)


@_op("deepep_normal_dispatch")
def _deepep_normal_dispatch(
    buffer_id: int, x: torch.Tensor, x_scale: torch.Tensor | None, topk_ids: torch.Tensor,
    topk_weights: torch.Tensor, num_experts: int, alignment: int, num_worst_tokens: int, num_ranks: int,
    num_channels: int,
) -> list[torch.Tensor]:  # fmt: skip
    """Bounded mode only (``num_worst_tokens`` > 0: output sizes known without a host sync);
    ``num_ranks`` and ``num_channels`` size only the fake implementation's outputs."""
    if num_worst_tokens < 1:
        raise ValueError(f"num_worst_tokens={num_worst_tokens}: the op takes the bounded mode only (>= 1)")
    return _deepep().normal_dispatch(buffer_id, x, x_scale, topk_ids, topk_weights, num_experts, alignment,
                                     num_worst_tokens)[0]  # fmt: skip


@_deepep_normal_dispatch.register_fake
def _(buffer_id, x, x_scale, topk_ids, topk_weights, num_experts, alignment, num_worst_tokens, num_ranks,
      num_channels):  # fmt: skip
    payload = _deepep().normal_payload(x, x_scale)  # its dtype checks, at trace time
    rows = list(payload) if isinstance(payload, tuple) else [payload]
    w, t, k = num_worst_tokens, topk_ids.shape[0], topk_ids.shape[1]
    i32 = dict(dtype=torch.int32)
    return [
        *(r.new_empty((w, r.shape[1])) for r in rows),
        topk_ids.new_empty((w, k), dtype=torch.int64), topk_weights.new_empty((w, k), dtype=torch.float32),
        x.new_empty((num_ranks, num_ranks), **i32), x.new_empty((num_ranks, num_channels), **i32),
        x.new_empty((num_ranks, num_channels), **i32), x.new_empty((w,), **i32),
        x.new_empty((t, num_ranks), dtype=torch.bool), x.new_empty((t, num_ranks), **i32),
    ]  # fmt: skip


@_op("deepep_normal_combine")
def _deepep_normal_combine(buffer_id: int, y: torch.Tensor, handle: list[torch.Tensor]) -> torch.Tensor:
    return _deepep().normal_combine(buffer_id, y, handle)


@_deepep_normal_combine.register_fake
def _(buffer_id, y, handle):
    return y.new_empty((handle[-1].shape[0], y.shape[1]), dtype=torch.bfloat16)  # send_head [T, R]


def deepep_low_latency_dispatch(buffer_id, x, topk_ids, *, num_max_tokens, num_experts, num_ranks, use_fp8):
    """:func:`epmoe.dispatch.deepep_dispatch.calls.low_latency_dispatch`."""
    return _deepep_low_latency_dispatch(buffer_id, x, topk_ids, num_max_tokens, num_experts, num_ranks, use_fp8)


def deepep_low_latency_combine(buffer_id, y, topk_ids, topk_weights, src_info, layout_range, *, num_max_tokens,
                               num_experts):  # fmt: skip
    """:func:`epmoe.dispatch.deepep_dispatch.calls.low_latency_combine`."""
    return _deepep_low_latency_combine(buffer_id, y, topk_ids, topk_weights, src_info, layout_range, num_max_tokens,
                                       num_experts)  # fmt: skip


def deepep_normal_dispatch(buffer_id, x, x_scale, topk_ids, topk_weights, *, num_experts, alignment,
                           num_worst_tokens, num_ranks, num_channels):  # fmt: skip
    """:func:`epmoe.dispatch.deepep_dispatch.calls.normal_dispatch` in bounded mode (its tensors)."""
    return _deepep_normal_dispatch(buffer_id, x, x_scale, topk_ids, topk_weights, num_experts, alignment,
                                   num_worst_tokens, num_ranks, num_channels)  # fmt: skip


def deepep_normal_combine(buffer_id, y, handle):
    """:func:`epmoe.dispatch.deepep_dispatch.calls.normal_combine`."""
    return _deepep_normal_combine(buffer_id, y, list(handle))
