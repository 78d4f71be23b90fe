"""A decode step's glue before the experts in one launch: routing, layout, scatter and quantization.

When every expert is local (one rank) and the batch is small, what the layer runs before GEMM1 is
four tiny launches: the fused routing (:func:`epmoe.kernels.topk.fused_topk`), the activation
quantizer (:mod:`epmoe.kernels.quantize`, none for BF16), and the one-launch layout and scatter
(:func:`epmoe.kernels.permute.slot_layout_scatter`). In a CUDA-graphed decode step each costs a
launch gap of a few microseconds, more than its work. :func:`decode_prep` writes what those
launches write, in one launch, for up to :data:`~epmoe.kernels.common.COPY_MAX_SLOTS` (token, slot) pairs.

Every program routes the whole batch and lays it out (the same result in each: a program cannot
wait for another's), then quantizes and copies its share of the rows: program ``(c, t)`` takes
columns ``[c * BLOCK_H, (c + 1) * BLOCK_H)`` of token ``t`` to the token's ``k`` rows. A per-token
scale needs the whole row, so each program reads its token's row once for the amax (from L2: every
program of the token reads it). Program ``(0, 0)`` stores the routing and the layout; all programs
share marking the padding rows.

At a decode step's size the work is tiny and its time is the chain of reductions, each a
shared-memory round trip and a barrier, so both halves count pairs instead of iterating: the
routing of a token or few ranks the experts in one compare (:func:`~epmoe.kernels.topk.route_rows`
by rank, where larger tiles take ``top_k`` arg-max rounds), and the layout places each slot by
comparing it with the other slots (:func:`~epmoe.kernels.permute.compared_rows`, no sort and no
scratch).

On Hopper the prep and the kernels after it (the grouped GEMMs, the activation, the gather) launch
as programmatic dependents (:mod:`.pdl`), each placed on the GPU while the one before runs.

The outputs are bit for bit those of the separate launches (the same routing rule, the slot order
of :mod:`epmoe.kernels.permute`'s sort, the quantizers' :func:`~epmoe.kernels.quantize.codes`),
but for the last bits of the routing weights: their fp32 sums (softmax, renormalizing) are reduced
in the order each kernel's tile and warps give.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import empty_scales, max_rows, next_pow2, prep_refusal
from .permute import SLOT_ROWS, SLOT_TILE, _slot_outputs, compared_rows, mark_unused_rows
from ..quant.payload import PAYLOAD_FORMATS
from ..quant.schemes import BLOCK
from .pdl import dependent, dependent_start
from .quantize import amax_bits, load_tile, scale_of, store_codes
from .topk import by_rank, route_operands, route_rows

PREP_PROGRAMS = 128
"""Programs to aim for, about one per SM of an H200: each repeats the routing and the layout, so
past one wave more programs add that work again instead of spreading the copy."""
PREP_MAX_BLOCK_H = 1024
"""Most columns one program quantizes and copies (it stores them to each of the token's rows)."""
PREP_WARPS = 4
"""Warps of a prep program. Read at each call (benchmarks/compile_decode.py ``--prep-warps``
times others): the routing's all-pairs compare (128 x 128 for one token of 128 experts) and a
token's amax want more threads, each reduction across warps one more shared-memory round trip."""
ROW_VALUES_PER_THREAD = 64
"""Most values of a token's row each thread holds for its amax (per-token payloads): with 4 warps
a row of up to 8192 (DeepSeek-V3's 7168) is one load; longer rows are read in chunks of that."""
INTERPRETER_BLOCK_H = 8192
"""The same on CPU, where Triton's interpreter pays per program."""

GROUP = BLOCK
"""Columns per scale of the group payloads (1 x 128)."""


def payload_quant(payload: str) -> tuple[int, torch.dtype | None, float]:
    """``(QUANT, output dtype, qmax)`` of the prep for a payload (:data:`epmoe.dispatch.base.PAYLOADS`:
    the scheme's GEMM1 input): QUANT 0 copies (the input's dtype: ``None``), 1 quantizes per token,
    2 per 1 x 128 group."""
    if payload == "float":
        return 0, None, 1.0
    if payload not in PAYLOAD_FORMATS:
        raise ValueError(f"payload={payload!r}; allowed: {['float', *PAYLOAD_FORMATS]}")
    dtype, qmax, group = PAYLOAD_FORMATS[payload]
    return (1 if group is None else 2), dtype, qmax


@triton.jit
def _decode_prep_kernel(
    LOGITS, BIAS, X, IDS, WEIGHTS, OFFS, POS, MIDX, COUNTS, Y, YS,
    T, H, M_ROWS, stride_l, stride_xm, stride_ym, stride_ysm, stride_ysc, scaling,
    E: tl.constexpr, E_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
    GROUPED: tl.constexpr, GROUPS: tl.constexpr, G_PAD: tl.constexpr, PER_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr, RANK: tl.constexpr,
    ALIGN: tl.constexpr, TILE_ROWS: tl.constexpr, ROW_STEP: tl.constexpr,
    QUANT: tl.constexpr, QMAX: tl.constexpr, TO_E4M3: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
    ROW_BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    dependent_start(PDL)
    c = tl.program_id(0)
    t = tl.program_id(1)
    pid = t * tl.num_programs(0) + c
    nprog = tl.num_programs(0) * tl.num_programs(1)
    owner = pid == 0

    # Token t's columns of this program (and, per token, its whole row for the amax) are loaded
    # first: their latency hides behind the routing and the layout, which need none of them.
    NG: tl.constexpr = BLOCK_H // GROUP
    col0 = c * BLOCK_H
    src = tl.full([1], 0, tl.int64) + t
    src_ok = src >= 0
    if QUANT == 0:
        cols = col0 + tl.arange(0, BLOCK_H)
        mask = cols < H
        x = tl.load(X + t.to(tl.int64) * stride_xm + cols, mask=mask)
    else:
        x, cols, mask = load_tile(X, X, src, src_ok, col0, H, stride_xm, 0, False, 1, False, GROUP, NG)
        if QUANT == 1:
            # Flat, not in groups: its amax is then one max in each thread and one across them
            # (a [1, groups, GROUP] tile would reduce every group across threads first).
            row_x = X + t.to(tl.int64) * stride_xm
            h = tl.arange(0, ROW_BLOCK)
            whole = tl.load(row_x + h, mask=h < H, other=0.0).to(tl.float32)

    # Routing of the whole batch, then its layout (slot t * K + j is entry (t, j) of the padded
    # [BLOCK_T, K_PAD] tile: the same order), both in registers: no scratch, no barrier.
    rows = tl.arange(0, BLOCK_T)
    row_ok = rows < T
    ids, weights = route_rows(
        LOGITS, BIAS, rows, row_ok, stride_l, scaling, E, E_PAD, K, K_PAD, BLOCK_T, SIGMOID, HAS_BIAS, RENORM,
        GROUPED, GROUPS, G_PAD, PER_GROUP, TOPK_GROUP, RANK,
    )  # fmt: skip
    j = tl.arange(0, K_PAD)
    slot = rows[:, None] * K + j[None, :]
    in_batch = row_ok[:, None] & (j[None, :] < K)
    tl.store(IDS + slot, ids.to(tl.int64), mask=in_batch & owner)
    tl.store(WEIGHTS + slot, weights, mask=in_batch & owner)
    SLOTS: tl.constexpr = BLOCK_T * K_PAD
    flat = tl.reshape(tl.where(in_batch, ids, E), [SLOTS])
    row, total, starts, ends, used = compared_rows(flat, E, SLOTS, E_PAD, ALIGN)
    row = tl.reshape(row, [BLOCK_T, K_PAD])
    bins = tl.arange(0, E_PAD)
    if pid == 0:
        tl.store(OFFS + bins, starts, mask=bins < E)
        tl.store(OFFS + E, used)
        tl.store(COUNTS + bins, total, mask=bins < E)
    # The routing picks K experts of [0, E) per token (distinct but with a -inf bias on the rounds
    # path); each slot gets its own row either way, so every slot is local and fits.
    tl.store(POS + slot, row.to(tl.int64), mask=in_batch & owner)
    tl.store(MIDX + row, ids, mask=in_batch & owner)
    # Token t's K rows.
    dsts = tl.where(j < K, tl.sum(tl.where(rows[:, None] == t, row, 0), 0), -1)
    mark_unused_rows(MIDX, starts, total, ends, used, M_ROWS, E, pid, nprog, E_PAD, TILE_ROWS, ROW_STEP, ALIGN > 1)

    # The columns in the scheme's format, stored to the token's K rows at once (a [K_PAD, ...]
    # store: no row number is taken out of the vector one slot at a time).
    dst = dsts.to(tl.int64)
    to = dst >= 0
    if QUANT == 0:
        tl.store(Y + dst[:, None] * stride_ym + cols[None, :], x[None, :], mask=to[:, None] & mask[None, :])
    elif QUANT == 1:
        # The row's amax (the per-token quantizer's, chunk by chunk past ROW_BLOCK columns: a max
        # is exact in any order), its scale, then this program's columns.
        amax = amax_bits(whole, 0)
        for h0 in range(ROW_BLOCK, H, ROW_BLOCK):
            part = tl.load(row_x + h0 + h, mask=h0 + h < H, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, amax_bits(part, 0))
        scale = scale_of(amax, QMAX)
        store_codes(Y, dst, cols, to[:, None, None] & mask, x, scale, stride_ym, QMAX, False)
        tl.store(YS + dst * stride_ysm, scale, mask=to & (c == 0))
    else:
        scale = scale_of(amax_bits(x, 2), QMAX)  # [1, NG]
        store_codes(Y, dst, cols, to[:, None, None] & mask, x, scale[:, :, None], stride_ym, QMAX, TO_E4M3)
        g = col0 // GROUP + tl.arange(0, NG)
        tl.store(YS + dst[:, None] * stride_ysm + g[None, :].to(tl.int64) * stride_ysc, scale,
                 mask=to[:, None] & (g[None, :] * GROUP < H))  # fmt: skip


def _block_h(tokens: int, hidden: int, device: torch.device) -> int:
    """Columns per program: from one group (128) up, doubled while more than
    :data:`PREP_PROGRAMS` programs would run; on CPU the widest."""
    if device.type == "cpu":
        return max(GROUP, min(next_pow2(hidden), INTERPRETER_BLOCK_H))
    block = GROUP
    while block < min(next_pow2(hidden), PREP_MAX_BLOCK_H) and tokens * triton.cdiv(hidden, block) > PREP_PROGRAMS:
        block *= 2
    return block


def decode_prep(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scoring_func: str,
    num_expert_group: int | None,
    topk_group: int | None,
    correction_bias: torch.Tensor | None,
    routed_scaling_factor: float,
    x: torch.Tensor,
    alignment: int,
    payload: str,
    scale_mn_major: bool = False,
) -> tuple[torch.Tensor, ...]:
    """:func:`~epmoe.kernels.topk.fused_topk`, the payload's quantizer and
    :func:`~epmoe.kernels.permute.slot_layout_scatter` in one launch, every expert local.

    Args:
        router_logits .. routed_scaling_factor: as :func:`~epmoe.kernels.topk.fused_topk` (checked
            by :func:`epmoe.routing.select_experts`'s rules); ``E`` is the logits' width.
        x: ``[T, H]`` float activations; ``T x top_k`` within :func:`prep_refusal`'s limits.
        alignment: segment granularity of the layout (>= 1).
        payload: GEMM1's input format (:func:`payload_quant`): ``"float"`` copies the rows,
            ``"int8_token"`` quantizes them per token, ``"int8_group"`` / ``"fp8_group"`` per 1x128
            group (``H`` a multiple of 128).
        scale_mn_major: the scales stored MN-major (:func:`~epmoe.kernels.common.mn_major_scales`).

    Returns:
        ``topk_ids [T, k]`` int64, ``topk_weights [T, k]`` fp32, then what
        :func:`~epmoe.kernels.permute.slot_layout_scatter` returns: ``expert_offsets [E + 1]``
        int32, ``slot_pos [T, k]`` int64, ``m_indices [max_rows]`` int32, ``counts [E]`` int32,
        ``out [max_rows, H]`` (the payload's dtype) and ``out_scale [max_rows, S]`` fp32 or ``None``
        (``"float"``). Rows no slot points to hold anything.
    """
    quant, qdtype, qmax = payload_quant(payload)
    if router_logits.dim() != 2 or x.dim() != 2 or x.shape[0] != router_logits.shape[0] or not x.is_floating_point():
        raise ValueError(
            f"x must be a floating-point [T, H] tensor with the T of router_logits {tuple(router_logits.shape)}; "
            f"got {x.dtype} {tuple(x.shape)}"
        )
    if alignment < 1:
        raise ValueError(f"alignment={alignment} must be >= 1")
    if x.shape[1] < 1:
        raise ValueError(f"x has hidden size {x.shape[1]}; the prep copies rows of at least one column")
    t, e = router_logits.shape
    h = x.shape[1]
    why = prep_refusal(t, top_k, e)
    if why:
        raise ValueError(why)
    if quant == 2 and (h % GROUP or h == 0):
        raise ValueError(f"payload={payload!r} needs a hidden size that is a multiple of {GROUP}; got {h}")
    device = x.device
    logits, bias, consts = route_operands(router_logits, top_k, renormalize, scoring_func, num_expert_group,
                                          topk_group, correction_bias)  # fmt: skip
    rows = max_rows(t, top_k, e, alignment)
    i32 = dict(dtype=torch.int32, device=device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=device)
    weights = torch.empty((t, top_k), dtype=torch.float32, device=device)
    offsets = torch.empty(e + 1, **i32)
    slot_pos, m_indices, counts = _slot_outputs(ids, e, rows)  # as the slot kernels allocate them
    xc = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty((rows, h), dtype=qdtype or x.dtype, device=device)
    out_scale = None
    if quant:
        out_scale = empty_scales(rows, 1 if quant == 1 else h // GROUP, device, scale_mn_major)
    block_h = _block_h(t, h, device)
    programs = (triton.cdiv(h, block_h), t)
    ys = out_scale if out_scale is not None else out  # never written without scales
    warps = PREP_WARPS
    _decode_prep_kernel[programs](
        logits, bias, xc, ids, weights, offsets, slot_pos, m_indices, counts,
        out, ys, t, h, rows, logits.stride(0), xc.stride(0), out.stride(0), ys.stride(0), ys.stride(1),
        float(routed_scaling_factor), BLOCK_T=next_pow2(t), RANK=by_rank(next_pow2(t), consts["E_PAD"], warps),
        ALIGN=alignment, TILE_ROWS=max(1, SLOT_TILE // consts["E_PAD"]), ROW_STEP=SLOT_ROWS,
        QUANT=quant, QMAX=qmax, TO_E4M3=qdtype == torch.float8_e4m3fn, GROUP=GROUP, BLOCK_H=block_h,
        ROW_BLOCK=max(GROUP, min(next_pow2(h), ROW_VALUES_PER_THREAD * 32 * warps)),
        num_warps=warps, **consts, **dependent(device),
    )  # fmt: skip
    return ids, weights, offsets, slot_pos, m_indices, counts, out, out_scale
