"""The two expert layouts and the conversions between received tokens and them.

This module is the contract between the dispatcher seam and the experts seam: dispatchers deliver
received tokens (to be scattered into the contiguous layout) or a masked batch; backends consume a
:class:`ContiguousBatch` or a :class:`MaskedBatch`. Neither seam imports the other, both import this.

Shapes (``R`` received tokens, ``k`` top-k, ``E`` local experts, ``H`` hidden, ``S`` scale columns):

* received tokens: ``x [R, H]``, ``x_scale [R, S] | None``, ``topk_ids [R, k]`` int64 *local*
  expert ids with ``-1`` for slots owned by another rank, ``topk_weights [R, k]`` fp32.
* contiguous: ``x [M, H]`` rows grouped by expert, each expert's segment padded to ``alignment``.
* masked: ``x [E, cap, H]`` with the first ``masked_m[e]`` rows of expert ``e`` valid.

The torch code here is the reference and the CPU path; on CUDA tensors :func:`to_contiguous` and
:func:`gather_weighted` move rows with the Triton kernels of ``epmoe.kernels.permute`` (same
semantics, tested against these).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import ops  # the Triton row-movement kernels as registered ops (Triton imported where they run)
from .kernels.common import max_rows
from .tensors import check_positive_int


@dataclass
class ContiguousBatch:
    """Rows grouped by local expert.

    Attributes:
        x: ``[M, H]`` activations (float, or quantized int8 / e4m3 with ``x_scale``).
        x_scale: ``[M, S]`` fp32 or ``None``.
        expert_offsets: ``[E + 1]`` int32; expert ``e`` owns rows ``offsets[e]:offsets[e+1]``
            (segment lengths are multiples of the backend's alignment).
        m_indices: ``[M]`` int32 expert of each row, ``-1`` on padding rows.
        slot_pos: ``[R, k]`` int64 row of each (received token, top-k slot), ``-1`` when the slot is
            not a local expert. This is the map back used by :func:`gather_weighted`.
        num_rows: ``[E]`` valid rows per expert (before padding): a host list, or an int32
            device tensor when the scatter ran without reading counts back (see
            :meth:`rows_per_expert`).
        expected_m: ``None`` when the segments fill ``x`` exactly. Otherwise the segment sizes
            were counted on the device (no host round trip), ``x`` has room for the worst case
            (:func:`~epmoe.kernels.common.max_rows`: ``R * k + min(R * k, E) * (alignment - 1)``
            rows, rounded down to a multiple of ``alignment``), rows past ``expert_offsets[-1]``
            are spare (``m_indices`` -1 there; their data is never to be read), and this is the
            typical rows per expert, a hint for tile configs and grids.

    Padding rows (``m_indices`` -1) hold anything on the kernel path (CUDA): nothing is written
    there, because no valid output reads them. Every backend computes each row from that row
    alone (GEMMs, row-wise quantizers, activations) and :func:`gather_weighted` reads only the
    rows of ``slot_pos``, so even NaN there stays in the padding's own output rows. The torch
    path (CPU) zero-fills them.
    """

    x: torch.Tensor
    x_scale: torch.Tensor | None
    expert_offsets: torch.Tensor
    m_indices: torch.Tensor
    slot_pos: torch.Tensor
    num_rows: list[int] | torch.Tensor
    expected_m: int | None = None
    alignment: int | None = None
    """What every segment length is a multiple of: the ``alignment`` :func:`to_contiguous` laid the
    batch out for; ``None`` for a batch built otherwise (not recorded)."""

    @property
    def num_experts(self) -> int:
        return self.expert_offsets.numel() - 1

    @property
    def valid_rows(self) -> torch.Tensor:
        """``[1]`` int32 device view of the rows in use (``expert_offsets[-1]``): the row count
        of a batch with spare rows, as a masked-layout bound over one ``[1, M, ...]`` slab."""
        return self.expert_offsets[-1:]

    def rows_per_expert(self) -> list[int]:
        """:attr:`num_rows` as a host list (a device-to-host copy when it is a tensor)."""
        if isinstance(self.num_rows, torch.Tensor):
            return [int(c) for c in self.num_rows.tolist()]
        return list(self.num_rows)


@dataclass
class MaskedBatch:
    """Fixed-capacity per-expert slabs (what low-latency dispatch delivers).

    Attributes:
        x: ``[E, cap, H]`` activations; rows past ``masked_m[e]`` are garbage and never read back.
        x_scale: ``[E, cap, S]`` fp32 or ``None``.
        masked_m: ``[E]`` int32 valid rows per expert.
        expected_m: hint for kernels: typical rows per expert.
    """

    x: torch.Tensor
    x_scale: torch.Tensor | None
    masked_m: torch.Tensor
    expected_m: int

    @property
    def num_experts(self) -> int:
        return self.x.shape[0]


def _local_slots(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indices ``r * k + j`` of valid slots, ordered by (expert, token) — a stable sort —
    and their experts, int64 whatever the ids' dtype (narrow ids index wrongly: uint8 as a mask)."""
    key = _slot_keys(topk_ids, num_experts)
    order = torch.sort(key, stable=True).indices[: int((key < num_experts).sum())]
    return order, key[order]


def _slot_keys(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Each slot's local expert, ``num_experts`` for a slot of another rank (or ``-1``): int64,
    flat."""
    flat = topk_ids.reshape(-1).long()
    return torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)


def _copy_rows(x, x_scale, src, pos, rows: int):
    """``rows`` rows with ``x[src]`` (and its scales) at ``pos``; rows no slot lands on hold zeros
    (scales: ones)."""
    out_x = x.new_zeros((rows, x.shape[1]))
    out_x[pos] = x[src]
    out_scale = None
    if x_scale is not None:
        out_scale = x_scale.new_ones((rows, x_scale.shape[1]))
        out_scale[pos] = x_scale[src]
    return out_x, out_scale


def to_contiguous(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    topk_ids: torch.Tensor,
    num_experts: int,
    alignment: int = 1,
    padded_rows: Sequence[int] | None = None,
    *,
    expected_m: int | None = None,
    scale_mn_major: bool = False,
) -> ContiguousBatch:
    """Scatter received tokens into the contiguous layout.

    Args:
        x: ``[R, H]`` received activations.
        x_scale: ``[R, S]`` fp32 or ``None``.
        topk_ids: ``[R, k]`` local expert ids, ``-1`` for other ranks' slots.
        num_experts: local experts ``E``.
        alignment: each expert's segment is padded to a multiple of this.
        padded_rows: optional host list ``[E]`` of each expert's segment length (its slot count
            rounded up to ``alignment``), when the dispatcher already knows it (DeepEP's
            ``num_recv_tokens_per_expert_list``). Without it the counts are computed on the
            device and read back: one host synchronisation. Entries must be non-negative
            multiples of ``alignment``. The CPU (torch) path recomputes the sizes itself.
        expected_m: without ``padded_rows``, skip the read-back: on CUDA the segment sizes stay
            on the device, the rows are allocated for the worst case
            (:func:`~epmoe.kernels.common.max_rows`) and the batch carries this rows-per-expert hint (see
            :attr:`ContiguousBatch.expected_m`). On the CPU the same layout comes from torch
            operations of static shapes (what ``torch.compile`` traces without a host read).
        scale_mn_major: on CUDA, store ``x_scale`` MN-major
            (:func:`~epmoe.kernels.common.mn_major_scales`), as the backend reads it
            (:attr:`~epmoe.experts.base.ExpertsBackend.mn_major_scales`); the torch path stores
            them row-major either way.

    Returns:
        A :class:`ContiguousBatch`. Its padding rows hold anything on CUDA (see
        :class:`ContiguousBatch`); the torch path zero-fills them (scale 1 when scales exist).
    """
    if padded_rows is not None:
        _check_padded_rows(padded_rows, num_experts, alignment)
    check_positive_int("expected_m", expected_m, optional=True)
    if not x.is_cuda:
        if padded_rows is None and expected_m is not None:
            return _to_contiguous_torch_device(x, x_scale, topk_ids, num_experts, alignment, expected_m)
        return _to_contiguous_torch(x, x_scale, topk_ids, num_experts, alignment)
    return _to_contiguous_kernels(x, x_scale, topk_ids, num_experts, alignment, padded_rows, expected_m, scale_mn_major)


def _check_padded_rows(padded_rows: Sequence[int], num_experts: int, alignment: int) -> None:
    if len(padded_rows) != num_experts:
        raise ValueError(f"padded_rows has {len(padded_rows)} entries; expected num_experts={num_experts}")
    # min() runs in C; the per-entry modulo only when there is an alignment to check.
    if min(padded_rows, default=0) >= 0 and (alignment <= 1 or not any(int(p) % alignment for p in padded_rows)):
        return
    bad = [(e, int(p)) for e, p in enumerate(padded_rows) if int(p) < 0 or int(p) % max(alignment, 1)]
    if bad:
        e, p = bad[0]
        raise ValueError(
            f"padded_rows[{e}]={p}; every entry must be >= 0 and a multiple of alignment={alignment}"
        )


def _round_up(counts: Sequence[int], alignment: int) -> list[int]:
    """Each expert's segment length: its row count rounded up to a multiple of ``alignment``."""
    return [-(-int(c) // alignment) * alignment for c in counts]


def _segment_offsets(lengths: Sequence[int]) -> list[int]:
    """``[0, l0, l0 + l1, ...]``: the ``E + 1`` segment offsets of the contiguous layout."""
    return list(itertools.accumulate(map(int, lengths), initial=0))


def _to_contiguous_kernels(
    x, x_scale, topk_ids, num_experts, alignment, padded_rows, expected_m=None, scale_mn_major=False
) -> ContiguousBatch:
    """The Triton scatter (the CUDA path of :func:`to_contiguous`; on CPU it runs under Triton's
    interpreter, which is how the CPU tests reach it)."""
    if padded_rows is None and expected_m is not None:
        # One launch for a decode step's few slots (layout and row copies), two beyond.
        offsets, slot_pos, m_indices, counts, out_x, out_scale = ops.slot_layout_scatter(
            topk_ids, num_experts, alignment, x, x_scale, scale_mn_major=scale_mn_major
        )
        return ContiguousBatch(out_x, out_scale, offsets, m_indices, slot_pos, counts, expected_m, alignment)
    device = x.device
    num_rows: list[int] | None = None
    if padded_rows is None:
        # Counted with a scatter-add into an extra bin for foreign ids: a boolean-mask index or
        # torch.bincount would each add host synchronisations of their own before the read-back.
        flat = topk_ids.reshape(-1).to(torch.int64)
        bins = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
        counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
        counts.scatter_add_(0, bins, torch.ones_like(bins))
        num_rows = counts[:num_experts].tolist()  # the one host synchronisation
        padded_rows = _round_up(num_rows, alignment)
    offsets_list = _segment_offsets(padded_rows)
    m = offsets_list[-1]
    # From pinned memory the copy is asynchronous; from pageable memory it would first wait for
    # everything queued on the stream (the dispatch), leaving the GPU idle while the host then
    # launches the next kernels.
    host = torch.tensor(offsets_list, dtype=torch.int32, pin_memory=device.type == "cuda")
    offsets = host.to(device, non_blocking=True)
    slot_pos, m_indices, counts = ops.slot_positions(topk_ids, offsets, m)
    if num_rows is None:
        num_rows = counts
    # Padding rows are never read by a valid output (ContiguousBatch): no memset.
    out_x, out_scale = ops.scatter_rows(x, slot_pos, m, x_scale, fill_unused=False, scale_mn_major=scale_mn_major)
    return ContiguousBatch(out_x, out_scale, offsets, m_indices, slot_pos, num_rows, alignment=alignment)


def _to_contiguous_torch(x, x_scale, topk_ids, num_experts, alignment) -> ContiguousBatch:
    """The reference (and CPU) scatter: a stable sort by expert, one host sync for the counts."""
    r, k = topk_ids.shape
    device = x.device
    slots, experts = _local_slots(topk_ids, num_experts)
    counts = torch.bincount(experts, minlength=num_experts)[:num_experts]
    num_rows = counts.tolist()
    offsets_list = _segment_offsets(_round_up(num_rows, alignment))
    m = offsets_list[-1]
    offsets = torch.tensor(offsets_list, dtype=torch.int64, device=device)
    # Rank of each slot inside its expert segment: slots are sorted by expert, so it is the slot's
    # position minus the first position of its expert.
    first = torch.cumsum(counts, 0) - counts
    within = torch.arange(slots.numel(), device=device) - first[experts]
    pos = offsets[:-1][experts] + within

    m_indices = torch.full((m,), -1, dtype=torch.int32, device=device)
    m_indices[pos] = experts.to(torch.int32)
    slot_pos = torch.full((r * k,), -1, dtype=torch.int64, device=device)
    slot_pos[slots] = pos
    slot_pos = slot_pos.reshape(r, k)
    out_x, out_scale = _copy_rows(x, x_scale, slots // k, pos, m)
    return ContiguousBatch(out_x, out_scale, offsets.to(torch.int32), m_indices, slot_pos, num_rows, alignment=alignment)


def _to_contiguous_torch_device(x, x_scale, topk_ids, num_experts, alignment, expected_m) -> ContiguousBatch:
    """:func:`_to_contiguous_torch` without the host read: the counts, offsets and positions stay
    tensors and every shape follows from the input shapes (rows for the worst case, as the Triton
    :func:`~epmoe.kernels.permute.slot_layout`), so ``torch.compile`` traces it in one graph."""
    r, k = topk_ids.shape
    device = x.device
    m = max_rows(r, k, num_experts, alignment)
    key = _slot_keys(topk_ids, num_experts)  # foreign slots sort last, into an extra bin
    order = torch.sort(key, stable=True).indices
    experts = key[order]
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    room = (counts[:num_experts] + alignment - 1) // alignment * alignment
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    offsets[1:] = torch.cumsum(room, 0)
    first = torch.cumsum(counts, 0) - counts
    within = torch.arange(r * k, device=device) - first[experts]
    placed = experts < num_experts
    # Foreign slots go to a scratch row m, dropped below: every index stays in range.
    pos = torch.where(placed, offsets[experts.clamp(max=num_experts - 1)] + within, m)
    m_indices = torch.full((m + 1,), -1, dtype=torch.int32, device=device)
    m_indices[pos] = torch.where(placed, experts, -1).to(torch.int32)
    slot_pos = torch.full((r * k,), -1, dtype=torch.int64, device=device)
    slot_pos[order] = torch.where(placed, pos, -1)
    out_x, out_scale = _copy_rows(x, x_scale, order // k, pos, m + 1)
    return ContiguousBatch(
        out_x[:m], None if out_scale is None else out_scale[:m], offsets.to(torch.int32), m_indices[:m], slot_pos.reshape(r, k),
        counts[:num_experts].to(torch.int32), expected_m, alignment,
    )  # fmt: skip


def gather_weighted(
    expert_out: torch.Tensor,
    slot_pos: torch.Tensor,
    topk_weights: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Per received token, the top-k weighted sum of its local experts' rows, summed in fp32.

    Args:
        expert_out: ``[M, H]`` backend output on the contiguous layout.
        slot_pos: ``[R, k]`` int64 rows (``-1`` = not local), from :class:`ContiguousBatch`.
        topk_weights: ``[R, k]`` fp32.
        out_dtype: dtype of the result (fp32, bf16 or fp16), rounded once from the fp32 sum.

    Returns:
        ``[R, H]`` of ``out_dtype``. Tokens with no local slot get zeros.
    """
    if expert_out.is_cuda:
        return ops.gather_weighted(expert_out, slot_pos, topk_weights.float(), out_dtype)
    r, k = slot_pos.shape
    out = torch.zeros(r, expert_out.shape[1], dtype=torch.float32, device=expert_out.device)
    if expert_out.shape[0] == 0:  # no slot of the batch is local (every id -1, or other ranks')
        return out.to(out_dtype)
    weights = topk_weights.float()
    for j in range(k):
        pos = slot_pos[:, j]
        # Invalid slots select zeros, never their row's product: padding rows may hold garbage
        # (even NaN) from the backend. No boolean indexing: the shapes stay static (torch.compile).
        rows = expert_out.index_select(0, pos.clamp(min=0)).float()
        out += torch.where((pos >= 0).unsqueeze(1), rows * weights[:, j : j + 1], 0.0)
    return out.to(out_dtype)


def to_masked(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    topk_ids: torch.Tensor,
    num_experts: int,
    capacity: int,
) -> tuple[MaskedBatch, torch.Tensor]:
    """Scatter received tokens into the masked layout (used by tests and the local masked path).

    Returns:
        The :class:`MaskedBatch` and ``slot_pos [R, k]`` int64 flat row index ``e * cap + i``
        (``-1`` for non-local slots). Raises ``ValueError`` when an expert has more than
        ``capacity`` rows.
    """
    r, k = topk_ids.shape
    slots, experts = _local_slots(topk_ids, num_experts)
    counts = torch.bincount(experts, minlength=num_experts)[:num_experts]
    if slots.numel() and int(counts.max()) > capacity:
        raise ValueError(
            f"an expert received {int(counts.max())} rows, over the masked capacity {capacity}"
        )
    first = torch.cumsum(counts, 0) - counts
    within = torch.arange(slots.numel(), device=x.device) - first[experts]
    flat_pos = experts * capacity + within
    out_x = x.new_zeros((num_experts * capacity, x.shape[1]))
    out_x[flat_pos] = x[slots // k]
    out_scale = None
    if x_scale is not None:
        out_scale = x_scale.new_ones((num_experts * capacity, x_scale.shape[1]))
        out_scale[flat_pos] = x_scale[slots // k]
        out_scale = out_scale.reshape(num_experts, capacity, -1)
    slot_pos = torch.full((r * k,), -1, dtype=torch.int64, device=x.device)
    slot_pos[slots] = flat_pos
    batch = MaskedBatch(
        out_x.reshape(num_experts, capacity, -1),
        out_scale,
        counts.to(torch.int32),
        max(1, -(-slots.numel() // max(num_experts, 1))),
    )
    return batch, slot_pos.reshape(r, k)
