"""Row movement between received tokens and per-expert rows, in Triton.

Same semantics as the torch functions in :mod:`epmoe.layouts`:

* :func:`slot_positions` gives every (token, top-k slot) its row in the contiguous layout, in
  token order inside each expert's segment (what the torch path's stable sort gives), and the
  expert of every row (``-1`` on padding) — no host synchronisation when the segment sizes are
  already known on the host (DeepEP reports them); :func:`slot_layout` does the same with the
  sizes counted on the device, for a layout sized for the worst case when nobody waited for the
  counts. Both are two launches over blocks of slots: each block's expert histogram, then each
  block sorts its slots by expert and places them after those of the blocks before it; up to
  ``SLOT_STEP`` slots one launch (the one block counts its own experts);
* :func:`scatter_rows` copies each received token's row to every row position ``slot_pos[r, j]``
  (the data movement of ``to_contiguous`` / ``to_masked``); untouched rows are zero (scale 1)
  unless ``fill_unused=False``;
* :func:`slot_layout_scatter` is :func:`slot_layout` and :func:`scatter_rows` together, in one
  launch up to :data:`COPY_MAX_SLOTS` slots (a decode step's): what a CUDA-graphed step pays per
  launch is a gap of its own.
* :func:`gather_weighted` sums, per received token, its valid slots' rows times the top-k weights
  in fp32, in slot order ``j = 0 .. k-1`` (the order the torch reference adds them). Rows of
  invalid slots (``-1``) are never read, so padding holding NaN cannot leak.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..tensors import as_contiguous, check_positive_int
from .common import COPY_MAX_SLOTS, INTERPRETER_TILE, max_rows, mn_major_scales, next_pow2
from .pdl import dependent, dependent_start

SLOT_STEP = 512
"""Slots a program sorts at once: a power of two >= 128, so that each of the 4 warps' threads
holds its own ids (older Tritons' tl.histogram counts an element once per thread holding it)."""

SLOT_PROGRAMS = 128
"""Blocks of slots (programs of each slot kernel) to aim for, about one per SM: every program reads
the whole ``[blocks, E]`` histogram table, so past this a block takes more steps instead."""

SLOT_TILE = 4096
"""Elements of the ``[rows, E]`` tiles a program handles at once: reads of the histogram table,
marks of padding rows."""

SLOT_ROWS = 1024
"""Spare rows of ``m_indices`` (past the last segment) one store marks unused."""


@triton.jit
def _local_ids(ids, E, E_PAD: tl.constexpr):
    """``(int32 expert of each local id, else E_PAD; slots per local expert)``.

    Locality is tested on the ids' own dtype (a wide id must not wrap into range) and the int32
    conversion comes after it (a narrow dtype cannot hold E_PAD). Foreign ids are counted in bin 0
    and taken out again: tl.histogram's mask argument is newer than the oldest Triton this package
    supports, and on the GPU a value past the bins lands in the bin of its low bits."""
    local = (ids >= 0) & (ids < E)
    expert = tl.where(local, ids.to(tl.int32), 0)
    hist = tl.histogram(expert, E_PAD)
    hist = tl.where(tl.arange(0, E_PAD) == 0, hist - tl.sum(tl.where(local, 0, 1), 0), hist)
    return tl.where(local, expert, E_PAD), hist


@triton.jit
def _slot_histogram_kernel(IDS, HIST, N_SLOTS, E, BLOCK, STEP: tl.constexpr, E_PAD: tl.constexpr):
    # Row b of HIST: the slots of block b per expert.
    b = tl.program_id(0)
    hist = tl.zeros([E_PAD], dtype=tl.int32)
    for s in range(b * BLOCK, b * BLOCK + BLOCK, STEP):
        slot = s + tl.arange(0, STEP)
        hist += _local_ids(tl.load(IDS + slot, mask=slot < N_SLOTS, other=-1), E, E_PAD)[1]
    tl.store(HIST + b * E_PAD + tl.arange(0, E_PAD), hist)


@triton.jit
def _slot_positions_kernel(
    IDS, HIST, SHIFT, OFFS, POS, MIDX, COUNTS, N_SLOTS, E, M_ROWS, NUM_BLOCKS, BLOCK,
    X, XS, Y, YS, H, S, stride_xm, stride_xsm, stride_ym, stride_ysm, stride_ysc,
    STEP: tl.constexpr, TILE_ROWS: tl.constexpr, ROW_STEP: tl.constexpr,
    SIZES_ON_DEVICE: tl.constexpr, ALIGN: tl.constexpr, E_PAD: tl.constexpr, ONE_BLOCK: tl.constexpr,
    COPY: tl.constexpr, TOPK: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    # Program b places the slots of block b. Each program sums the whole histogram table itself
    # (tens of KB from L2) instead of waiting for a third launch: the expert totals give the
    # segments, the blocks before b where b's slots start inside them. Counts fit int32.
    #
    # COPY (one block of one step, a decode step's few slots): the scatter rides along. Every
    # program lays out the whole block (a few hundred instructions, the same result in each),
    # program 0 stores the layout, and program p copies columns [p * BLOCK_H, (p + 1) * BLOCK_H)
    # of every slot's row (and of its scales), so the layout and the scatter are one launch.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if COPY:
        b = 0
        owner = pid == 0
    else:
        b = pid
        owner = pid >= 0
    bins = tl.arange(0, E_PAD)
    expert = bins < E
    lane = tl.arange(0, STEP)
    # The first step's ids are loaded first: their latency hides behind the table's.
    ids = tl.load(IDS + b * BLOCK + lane, mask=b * BLOCK + lane < N_SLOTS, other=-1)
    total = tl.zeros([E_PAD], dtype=tl.int32)
    before = tl.zeros([E_PAD], dtype=tl.int32)
    if ONE_BLOCK:
        # Every slot is in this block's one step: its histogram is the total, so the histogram
        # launch is skipped (a decode step's layout is one launch; in a CUDA graph a launch
        # costs more than this program's work).
        total = _local_ids(ids, E, E_PAD)[1]
    else:
        for t0 in range(0, NUM_BLOCKS, TILE_ROWS):
            blk = (t0 + tl.arange(0, TILE_ROWS))[:, None]
            h = tl.load(HIST + blk * E_PAD + bins[None, :], mask=blk < NUM_BLOCKS, other=0)
            total += tl.sum(h, 0)
            before += tl.sum(tl.where(blk < b, h, 0), 0)
    if SIZES_ON_DEVICE:
        starts, ends, used = aligned_segments(total, ALIGN)
        if pid == 0:
            tl.store(OFFS + bins, starts, mask=expert)
            tl.store(OFFS + E, used)
    else:
        starts = tl.load(OFFS + bins, mask=expert, other=0)
        ends = tl.load(OFFS + 1 + bins, mask=expert, other=0)
        used = tl.load(OFFS + E)
    if pid == 0:
        tl.store(COUNTS + bins, total, mask=expert)

    # STEP slots at a time (sorted_rows), each expert's next free row carried from step to step.
    nxt = starts + before
    for s in range(b * BLOCK, b * BLOCK + BLOCK, STEP):
        step_ids = ids
        # The next step's ids are loaded now, so their latency hides behind this step's work.
        ids = tl.load(IDS + s + STEP + lane, mask=s + STEP + lane < N_SLOTS, other=-1)
        e, lane_of, row, fits, hist = sorted_rows(step_ids, nxt, SHIFT + pid * E_PAD, E, E_PAD, STEP)
        # A segment shorter than its slots (inconsistent offsets) must not be written past its
        # end; the slots that do not fit get -1 (not local), so no later kernel follows a stale
        # row. Counted segments always fit.
        if not SIZES_ON_DEVICE:
            fits &= (row < tl.load(OFFS + 1 + e, mask=fits, other=0)) & (row < M_ROWS)
        slot = s + lane_of
        tl.store(POS + slot, tl.where(fits, row, -1), mask=(slot < N_SLOTS) & owner)
        tl.store(MIDX + row, e, mask=fits & owner)
        if COPY:
            cols = (pid * BLOCK_H + tl.arange(0, BLOCK_H))[None, :]
            src = (slot // TOPK).to(tl.int64)[:, None]
            dst = row.to(tl.int64)[:, None]
            take = fits[:, None] & (cols < H)
            tl.store(Y + dst * stride_ym + cols, tl.load(X + src * stride_xm + cols, mask=take), mask=take)
            if HAS_SCALE:
                take = fits[:, None] & (cols < S)
                scale = tl.load(XS + src * stride_xsm + cols, mask=take)
                tl.store(YS + dst * stride_ysm + cols * stride_ysc, scale, mask=take)
        nxt += hist

    mark_unused_rows(MIDX, starts, total, ends, used, M_ROWS, E, pid, nprog, E_PAD, TILE_ROWS, ROW_STEP,
                     ALIGN > 1 or not SIZES_ON_DEVICE)  # fmt: skip


@triton.jit
def aligned_segments(total, ALIGN: tl.constexpr):
    """``(starts, ends, used)`` of the segments of ``total`` slots per expert, each rounded up to
    a multiple of ``ALIGN`` rows, laid out one after another from row 0."""
    room = (total + ALIGN - 1) // ALIGN * ALIGN
    ends = tl.cumsum(room, 0)
    return ends - room, ends, tl.sum(room, 0)


@triton.jit
def sorted_rows(ids, nxt, SHIFT_ROW, E, E_PAD: tl.constexpr, STEP: tl.constexpr):
    """One step of ``STEP`` slots placed: ``(expert, lane, row, fits, hist)`` per sorted lane.

    Sorted by (expert, lane), the step's slots of expert e follow one another in lane order after
    the ``first[e]`` slots of smaller experts, so sorted lane p takes row ``nxt[e] - first[e] + p``
    (``nxt``: each expert's next free row). That per-expert shift goes through ``SHIFT_ROW``
    (``E_PAD`` scratch entries of this program), the one way to look up a vector by a tensor of
    indices in every supported Triton (tl.gather is newer). ``lane``: the unsorted lane of each
    sorted one; ``fits``: a local expert's slot; ``hist``: the step's slots per expert."""
    lane = tl.arange(0, STEP)
    slot_expert, hist = _local_ids(ids, E, E_PAD)
    key = tl.sort(slot_expert * STEP + lane)
    tl.debug_barrier()  # every thread has read the previous step's shifts
    tl.store(SHIFT_ROW + tl.arange(0, E_PAD), nxt + hist - tl.cumsum(hist, 0))
    tl.debug_barrier()  # and sees these
    e = key // STEP
    fits = e < E
    row = tl.load(SHIFT_ROW + e, mask=fits, other=0) + lane
    return e, key % STEP, row, fits, hist


@triton.jit
def compared_rows(slot_e, E, SLOTS: tl.constexpr, E_PAD: tl.constexpr, ALIGN: tl.constexpr):
    """The layout of a few slots without a sort: ``(row [SLOTS], total, starts, ends, used)``, the
    per-expert ones as :func:`aligned_segments` gives them. ``slot_e``: each slot's expert, ``>= E``
    for a slot that is none (its row is meaningless).

    A slot's row is its expert's start plus the slots of that expert before it: the order
    :func:`sorted_rows` gives, found by comparing every pair of slots and every (expert, slot)
    pair. For a decode step's few slots that is a handful of independent reductions, where a
    sorting step is a chain of compare-exchange stages and two scratch round trips."""
    p = tl.arange(0, SLOTS)
    local = slot_e < E
    before = tl.sum(((slot_e[:, None] == slot_e[None, :]) & (p[None, :] < p[:, None])).to(tl.int32), 1)
    bins = tl.arange(0, E_PAD)
    mine = (slot_e[None, :] == bins[:, None]) & local[None, :]  # [E_PAD, SLOTS]
    total = tl.sum(mine.to(tl.int32), 1)
    starts, ends, used = aligned_segments(total, ALIGN)
    return tl.sum(tl.where(mine, starts[:, None], 0), 0) + before, total, starts, ends, used


@triton.jit
def mark_unused_rows(
    MIDX, starts, total, ends, used, M_ROWS, E, pid, nprog,
    E_PAD: tl.constexpr, TILE_ROWS: tl.constexpr, ROW_STEP: tl.constexpr, PADDED: tl.constexpr = True,
):  # fmt: skip
    """Rows no slot takes belong to no expert (``m_indices`` -1): program ``pid`` of ``nprog``
    marks the padding of experts pid, pid + nprog, ... (all of them at once, TILE_ROWS rows each a
    store) and its share of the spare rows past the last segment (``used``). ``PADDED`` False:
    the segments are known to hold no padding (counted, alignment 1), so the first part, a
    reduction across the program for its loop bound, is left out."""
    if PADDED:
        bins = tl.arange(0, E_PAD)
        filled = starts + total
        pad = tl.where((bins < E) & (bins % nprog == pid), ends - filled, 0)
        for r0 in range(0, tl.max(pad, 0), TILE_ROWS):
            row = (r0 + tl.arange(0, TILE_ROWS))[None, :]
            row_at = filled[:, None] + row
            unused = (row < pad[:, None]) & (row_at < M_ROWS)
            tl.store(MIDX + row_at, tl.full([E_PAD, TILE_ROWS], -1, tl.int32), mask=unused)
    for r0 in range(used + pid * ROW_STEP, M_ROWS, nprog * ROW_STEP):
        row = r0 + tl.arange(0, ROW_STEP)
        tl.store(MIDX + row, tl.full([ROW_STEP], -1, tl.int32), mask=row < M_ROWS)


@triton.jit
def _scatter_rows_kernel(
    X, XS, Y, YS, POS, H, S, stride_xm, stride_xsm, stride_ym, stride_ysm, stride_ysc,
    TOPK: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    x = tl.load(X + r * stride_xm + cols, mask=col_ok)
    # Unrolled with masked stores (no branch per slot): the k destination loads are independent,
    # so they are in flight together instead of one memory latency after another.
    for j in tl.static_range(TOPK):
        dst = tl.load(POS + r * TOPK + j)
        tl.store(Y + tl.maximum(dst, 0) * stride_ym + cols, x, mask=col_ok & (dst >= 0))
        if HAS_SCALE:
            if tl.program_id(1) == 0:
                sc = tl.arange(0, BLOCK_S)
                s = tl.load(XS + r * stride_xsm + sc, mask=sc < S)
                tl.store(YS + tl.maximum(dst, 0) * stride_ysm + sc * stride_ysc, s, mask=(sc < S) & (dst >= 0))


@triton.jit
def _gather_weighted_kernel(
    X, POS, W, OUT, H, stride_xm, stride_om, TOPK: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
):
    dependent_start(PDL)
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    # Unrolled: the k row loads do not wait for one another; the sum still runs in slot order.
    for j in tl.static_range(TOPK):
        src = tl.load(POS + r * TOPK + j)
        w = tl.load(W + r * TOPK + j)
        # A masked load of an invalid slot reads nothing; its zeros add nothing.
        row = tl.load(X + tl.maximum(src, 0) * stride_xm + cols, mask=col_ok & (src >= 0), other=0.0)
        acc += tl.where(src >= 0, row.to(tl.float32) * w, 0.0)
    tl.store(OUT + r * stride_om + cols, acc.to(OUT.dtype.element_ty), mask=col_ok)


ROW_PROGRAMS = 256
"""Programs the row copies (scatter, gather) aim for: a decode step's few rows are split along H
until about this many run (two per SM of an H200), instead of one program per 1024 columns
(7 programs for one token of H = 7168)."""
MIN_BLOCK_H = 128
"""Fewest columns per program of a row copy (one warp, 4 elements per thread)."""


def row_split(rows: int, hidden: int, device: torch.device) -> tuple[int, int]:
    """``(BLOCK_H, num_warps)`` of a row copy over ``rows x hidden``: up to 1024 columns per
    program, halved while fewer than :data:`ROW_PROGRAMS` programs would run (down to
    :data:`MIN_BLOCK_H`). On CPU (the interpreter runs programs one after another) the widest."""
    block = min(next_pow2(hidden), 1024)
    if device.type != "cpu":
        while block > MIN_BLOCK_H and rows * triton.cdiv(hidden, block) < ROW_PROGRAMS:
            block //= 2
    return block, max(1, min(4, block // 256))


def slot_positions(
    topk_ids: torch.Tensor, expert_offsets: torch.Tensor, num_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of every (token, slot) in the contiguous layout whose segments are ``expert_offsets``.

    Args:
        topk_ids: ``[R, k]`` int local expert ids; ids outside ``[0, E)`` are other ranks' slots.
        expert_offsets: ``[E + 1]`` int32/int64 on the device of ``topk_ids``, from 0 (rows
            before ``expert_offsets[0]`` are never written); segment ``e`` must have room for
            expert ``e``'s slots (slots past the room are dropped: their ``slot_pos`` is ``-1``
            and no row is written for them).
        num_rows: ``M = expert_offsets[-1]`` (known on the host by the caller); nothing is
            written at or past row ``M``, and rows past ``expert_offsets[-1]`` get ``-1``.

    Returns:
        ``slot_pos [R, k]`` int64 (``-1`` for foreign slots), ``m_indices [M]`` int32 (``-1`` on
        padding rows) and ``counts [E]`` int32 slots per expert. Inside a segment the slots keep
        token order.
    """
    _check_ids(topk_ids)
    if (
        not isinstance(expert_offsets, torch.Tensor)
        or expert_offsets.dim() != 1
        or expert_offsets.numel() < 1
        or expert_offsets.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError(f"expert_offsets must be an int32/int64 [E + 1] tensor; got {_describe(expert_offsets)}")
    if num_rows < 0:
        raise ValueError(f"num_rows={num_rows} must be >= 0 (expert_offsets[-1])")
    if expert_offsets.device != topk_ids.device:
        raise ValueError(f"expert_offsets is on {expert_offsets.device} but topk_ids on {topk_ids.device}")
    slot_pos, m_indices, counts = _slot_outputs(topk_ids, expert_offsets.numel() - 1, num_rows)
    _launch_slots(topk_ids, expert_offsets.contiguous(), slot_pos, m_indices, counts, 1, False)
    return slot_pos, m_indices, counts


def slot_layout(
    topk_ids: torch.Tensor, num_experts: int, alignment: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`slot_positions` with the segment sizes counted on the device: no host round trip.

    Each expert's segment is its slot count rounded up to ``alignment``. The host cannot know
    the row count without reading it back, so the rows are sized for the worst case,
    :func:`~epmoe.kernels.common.max_rows`; rows past ``expert_offsets[-1]`` are spare.

    Args:
        topk_ids: ``[R, k]`` int local expert ids (others: other ranks' slots).
        num_experts: local experts ``E`` (>= 1).
        alignment: segment granularity (>= 1).

    Returns:
        ``expert_offsets [E + 1]`` int32 on the device, ``slot_pos [R, k]`` int64, ``m_indices
        [max_rows]`` int32 (``-1`` on padding and spare rows) and ``counts [E]`` int32.
    """
    _check_ids(topk_ids)
    check_positive_int("num_experts", num_experts)
    check_positive_int("alignment", alignment)
    r, k = topk_ids.shape
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=topk_ids.device)
    rows = max_rows(r, k, num_experts, alignment)
    slot_pos, m_indices, counts = _slot_outputs(topk_ids, num_experts, rows)
    _launch_slots(topk_ids, offsets, slot_pos, m_indices, counts, alignment, True)
    return offsets, slot_pos, m_indices, counts


def _check_ids(topk_ids) -> None:
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2 or topk_ids.is_floating_point():
        raise ValueError(f"topk_ids must be an integer [R, k] tensor; got {_describe(topk_ids)}")


def _slot_outputs(topk_ids, e: int, num_rows: int):
    r, k = topk_ids.shape
    device = topk_ids.device
    slot_pos = torch.empty((r, k), dtype=torch.int64, device=device)
    m_indices = torch.empty((num_rows,), dtype=torch.int32, device=device)
    counts = torch.empty((e,), dtype=torch.int32, device=device)
    return slot_pos, m_indices, counts


def _launch_slots(
    topk_ids, offsets, slot_pos, m_indices, counts, alignment: int, sizes_on_device: bool, copy=None
) -> None:
    """The slot kernels; ``copy``: ``(x, x_scale, out, out_scale)`` rows to scatter in the same launch
    (a layout of one step on the device: :func:`fused_copy_step`), else ``None``."""
    r, k = topk_ids.shape
    e = counts.numel()
    if e == 0:
        slot_pos.fill_(-1)
        return
    n = r * k
    # Narrow ids widen to int32: the kernels' -1 fill and their foreign-expert marker need it.
    ids = topk_ids.reshape(-1)
    ids = as_contiguous(ids, None if ids.dtype in (torch.int32, torch.int64) else torch.int32)
    # At least 32 bins: older Tritons' tl.histogram wants a bin per lane of a warp.
    e_pad = max(32, next_pow2(e))
    step = _step(n)
    block = step * max(1, triton.cdiv(n, step * SLOT_PROGRAMS))
    blocks = max(1, triton.cdiv(n, block))
    one_block = blocks == 1 and block == step
    x = y = xs = ys = ids  # never dereferenced without copy
    h = s = 0
    block_h = 1
    programs = blocks
    if copy is not None:
        if not one_block:
            raise ValueError(f"{n} slots take more than one step of {step}: the rows cannot be copied in the layout's launch")
        x, xs, y, ys = copy
        h = x.shape[1]
        s = 0 if xs is None else xs.shape[1]
        block_h = min(next_pow2(max(h, s)), (INTERPRETER_TILE if ids.device.type == "cpu" else COPY_TILE) // step)
        programs = triton.cdiv(max(h, s), block_h)
        x, y = _as_copyable(x), _as_copyable(y)
        xs, ys = (ids, ids) if xs is None else (xs, ys)
    # Scratch sized by the shapes only, so the launches stay capturable in a CUDA graph.
    shift = torch.empty((programs, e_pad), dtype=torch.int64, device=ids.device)
    if one_block:
        hist = shift  # never read
    else:
        hist = torch.empty((blocks, e_pad), dtype=torch.int32, device=ids.device)
        _slot_histogram_kernel[(blocks,)](ids, hist, n, e, block, STEP=step, E_PAD=e_pad, num_warps=4)
    _slot_positions_kernel[(programs,)](
        ids, hist, shift, offsets, slot_pos, m_indices, counts, n, e, m_indices.numel(), blocks, block,
        x, xs, y, ys, h, s, x.stride(0), xs.stride(0), y.stride(0), ys.stride(0), ys.stride(1) if ys.dim() > 1 else 1,
        STEP=step, TILE_ROWS=max(1, SLOT_TILE // e_pad), ROW_STEP=SLOT_ROWS,
        SIZES_ON_DEVICE=sizes_on_device, ALIGN=alignment, E_PAD=e_pad, ONE_BLOCK=one_block,
        COPY=copy is not None, TOPK=k, HAS_SCALE=copy is not None and copy[1] is not None, BLOCK_H=block_h,
        num_warps=4,
    )  # fmt: skip


def _step(n: int) -> int:
    """Slots a positions program sorts at once for ``n`` slots."""
    return min(SLOT_STEP, max(128, next_pow2(n)))


COPY_TILE = 4096
"""Elements of a copying slot program's ``[STEP, BLOCK_H]`` tile on a GPU (32 columns a program for
128 slots: 224 programs for H=7168); on CPU, :data:`~epmoe.kernels.common.INTERPRETER_TILE`."""


def fused_copy_step(num_slots: int) -> bool:
    """Whether :func:`slot_layout_scatter` lays out and scatters ``num_slots`` slots in one launch."""
    return 0 < num_slots <= COPY_MAX_SLOTS


def slot_layout_scatter(
    topk_ids: torch.Tensor,
    num_experts: int,
    alignment: int,
    x: torch.Tensor,
    x_scale: torch.Tensor | None = None,
    *,
    scale_mn_major: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`slot_layout` then :func:`scatter_rows` (padding rows left unwritten): one launch up to
    :data:`COPY_MAX_SLOTS` slots (:func:`fused_copy_step`), the two kernels beyond.

    Args:
        topk_ids: ``[R, k]`` int local expert ids (others: other ranks' slots).
        num_experts, alignment: as in :func:`slot_layout`.
        x: ``[R, H]`` rows; ``x_scale``: ``[R, S]`` fp32 or ``None``.
        scale_mn_major: ``out_scale`` stored MN-major (:func:`~epmoe.kernels.common.mn_major_scales`).

    Returns:
        ``expert_offsets``, ``slot_pos``, ``m_indices``, ``counts`` (as :func:`slot_layout`), ``out
        [max_rows, H]`` and ``out_scale [max_rows, S]`` or ``None``; rows no slot points to hold
        anything.
    """
    _check_ids(topk_ids)
    check_positive_int("num_experts", num_experts)
    check_positive_int("alignment", alignment)
    r, k = topk_ids.shape
    if x.dim() != 2 or x.shape[0] != r:
        raise ValueError(f"x must be [R={r}, H]; got shape {tuple(x.shape)}")
    if x_scale is not None and (x_scale.dim() != 2 or x_scale.shape[0] != r):
        raise ValueError(f"x_scale must be [R={r}, S]; got shape {tuple(x_scale.shape)}")
    if not fused_copy_step(r * k) or x.shape[1] == 0:
        offsets, slot_pos, m_indices, counts = slot_layout(topk_ids, num_experts, alignment)
        out, out_scale = scatter_rows(x, slot_pos, m_indices.numel(), x_scale, fill_unused=False,
                                      scale_mn_major=scale_mn_major)  # fmt: skip
        return offsets, slot_pos, m_indices, counts, out, out_scale
    rows = max_rows(r, k, num_experts, alignment)
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=topk_ids.device)
    slot_pos, m_indices, counts = _slot_outputs(topk_ids, num_experts, rows)
    xc = x.contiguous()
    xs = None if x_scale is None else x_scale.contiguous()
    out = torch.empty((rows, x.shape[1]), dtype=x.dtype, device=x.device)
    out_scale = None if xs is None else _scale_out(rows, xs, scale_mn_major, torch.empty)
    _launch_slots(topk_ids, offsets, slot_pos, m_indices, counts, alignment, True, (xc, xs, out, out_scale))
    return offsets, slot_pos, m_indices, counts, out, out_scale


def scatter_rows(
    x: torch.Tensor,
    slot_pos: torch.Tensor,
    num_out_rows: int,
    x_scale: torch.Tensor | None = None,
    *,
    fill_unused: bool = True,
    scale_mn_major: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Copy received rows to their per-expert positions.

    Args:
        x: ``[R, H]`` received rows (any dtype, float or quantized).
        slot_pos: ``[R, k]`` int64 destination row of each (token, top-k slot), ``-1`` = none.
        num_out_rows: rows of the output (``M`` of the contiguous layout, ``E * cap`` masked).
        x_scale: optional ``[R, S]`` fp32 scales, moved with their rows.
        fill_unused: zero the rows no slot points to (scales one). ``False`` skips that memset
            when the caller knows every row is written (segments without padding).
        scale_mn_major: ``out_scale`` stored MN-major (:func:`~epmoe.kernels.common.mn_major_scales`).

    Returns:
        ``out [num_out_rows, H]`` (rows no slot points to are zero) and ``out_scale
        [num_out_rows, S]`` (ones there) or ``None``.
    """
    _check_slot_pos(slot_pos, x.shape[0] if isinstance(x, torch.Tensor) and x.dim() == 2 else None, "x")
    if x.dim() != 2:
        raise ValueError(f"x must be [R, H]; got shape {tuple(x.shape)}")
    if num_out_rows < 0:
        raise ValueError(f"num_out_rows={num_out_rows} must be >= 0")
    r, h = x.shape
    alloc = torch.zeros if fill_unused else torch.empty
    out = alloc((num_out_rows, h), dtype=x.dtype, device=x.device)
    out_scale = None
    if x_scale is not None:
        if x_scale.dim() != 2 or x_scale.shape[0] != r:
            raise ValueError(f"x_scale must be [R={r}, S]; got shape {tuple(x_scale.shape)}")
        out_scale = _scale_out(num_out_rows, x_scale, scale_mn_major, torch.ones if fill_unused else torch.empty)
    k = slot_pos.shape[1]
    if r == 0 or k == 0 or h == 0 or num_out_rows == 0:
        return out, out_scale
    xc = x.contiguous()
    pos = slot_pos.to(torch.int64).contiguous()
    # Without scales the scale pointers are never dereferenced; any tensor of the device does.
    xs = pos if x_scale is None else x_scale.contiguous()
    ys = pos if out_scale is None else out_scale
    s = 1 if x_scale is None else x_scale.shape[1]
    block_h, warps = row_split(r, h, x.device)
    _scatter_rows_kernel[(r, triton.cdiv(h, block_h))](
        _as_copyable(xc), xs, _as_copyable(out), ys, pos, h, s,
        xc.stride(0), xs.stride(0), out.stride(0), ys.stride(0), ys.stride(1) if ys.dim() > 1 else 1,
        TOPK=k, HAS_SCALE=x_scale is not None, BLOCK_H=block_h, BLOCK_S=max(16, next_pow2(s)), num_warps=warps,
    )  # fmt: skip
    return out, out_scale


def _scale_out(rows: int, x_scale: torch.Tensor, mn_major: bool, alloc) -> torch.Tensor:
    """``[rows, S]`` scales of ``x_scale``'s dtype made by ``alloc`` (``torch.empty`` or
    ``torch.ones``), row-major or MN-major."""
    if not mn_major:
        return alloc((rows, x_scale.shape[1]), dtype=x_scale.dtype, device=x_scale.device)
    out = mn_major_scales(rows, x_scale.shape[1], x_scale.device)
    return out.fill_(1.0) if alloc is torch.ones else out


def _as_copyable(t: torch.Tensor) -> torch.Tensor:
    """Same bytes under a dtype every Triton backend can load and store (fp8 -> uint8)."""
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8)
    return t


def gather_weighted(
    expert_out: torch.Tensor,
    slot_pos: torch.Tensor,
    topk_weights: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Per received token, the top-k weighted sum of its local experts' rows, summed in fp32.

    Args:
        expert_out: ``[M, H]`` backend output (any float dtype; a masked output is passed as
            ``[E * cap, H]``).
        slot_pos: ``[R, k]`` int64 rows (``-1`` = not local).
        topk_weights: ``[R, k]`` fp32.
        out_dtype: fp32, bf16 or fp16; the sum is formed in fp32 and rounded once on store.

    Returns:
        ``[R, H]`` of ``out_dtype``; tokens with no local slot get zeros.
    """
    if not isinstance(expert_out, torch.Tensor) or expert_out.dim() != 2 or not expert_out.is_floating_point():
        got = _describe(expert_out)
        raise ValueError(f"expert_out must be a floating-point [M, H] tensor; got {got}")
    _check_slot_pos(slot_pos, None, "expert_out")
    if tuple(topk_weights.shape) != tuple(slot_pos.shape):
        raise ValueError(
            f"topk_weights shape {tuple(topk_weights.shape)} must equal slot_pos shape {tuple(slot_pos.shape)}"
        )
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"out_dtype={out_dtype}; allowed: torch.float32, torch.bfloat16, torch.float16")
    r, k = slot_pos.shape
    h = expert_out.shape[1]
    out = torch.empty((r, h), dtype=out_dtype, device=expert_out.device)
    if r == 0 or h == 0:
        return out
    if k == 0:
        return out.zero_()
    xc = expert_out.contiguous()
    block_h, warps = row_split(r, h, xc.device)
    _gather_weighted_kernel[(r, triton.cdiv(h, block_h))](
        xc, slot_pos.to(torch.int64).contiguous(), topk_weights.float().contiguous(), out, h,
        xc.stride(0), out.stride(0), TOPK=k, BLOCK_H=block_h, num_warps=warps, **dependent(xc.device),
    )  # fmt: skip
    return out


def _describe(t) -> str:
    """``dtype (shape)`` of a tensor for an error message, or the type name of anything else."""
    return f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def _check_slot_pos(slot_pos: torch.Tensor, rows: int | None, other: str) -> None:
    if not isinstance(slot_pos, torch.Tensor) or slot_pos.dtype not in (torch.int32, torch.int64):
        got = slot_pos.dtype if isinstance(slot_pos, torch.Tensor) else type(slot_pos).__name__
        raise TypeError(f"slot_pos must be an int64 (or int32) tensor; got {got}")
    if slot_pos.dim() != 2:
        raise ValueError(f"slot_pos must be [R, k]; got shape {tuple(slot_pos.shape)}")
    if rows is not None and slot_pos.shape[0] != rows:
        raise ValueError(f"slot_pos has {slot_pos.shape[0]} rows but {other} has {rows}")
