"""The scatter's slot-position kernel against the torch reference path of ``to_contiguous``.

On CPU the kernel runs in Triton's interpreter; on a GPU compiled. The reference is the stable
sort of :func:`epmoe.layouts._to_contiguous_torch` (written independently of the kernel).
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from epmoe.kernels import permute  # noqa: E402
from epmoe.layouts import _to_contiguous_kernels, _to_contiguous_torch, to_contiguous  # noqa: E402
from reference import gather_reference  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class _PoisonedTorch:
    """``torch`` for :mod:`epmoe.kernels.permute` whose ``empty`` is filled with 12345, a value
    the kernels never write, so an output entry a kernel skipped cannot pass as a right one."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*shape, dtype=None, device=None, **kw):
        size = shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape
        return torch.full(size, 12345, dtype=dtype, device=device)


class _BytePoisonedTorch(_PoisonedTorch):
    """``torch`` whose ``empty`` fills every byte with 0x5A (any dtype, e4m3 included)."""

    @staticmethod
    def empty(*shape, dtype=None, device=None, **kw):
        out = torch.empty(*shape, dtype=dtype, device=device, **kw)
        out.view(torch.uint8).fill_(0x5A)
        return out


@pytest.fixture
def poisoned(monkeypatch):
    monkeypatch.setattr(permute, "torch", _PoisonedTorch())


def _ids(r, k, e, seed, foreign=-1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, e, (r, k), generator=g)
    if r:
        ids[0] = foreign  # a token with no local slot
    return ids


@pytest.mark.parametrize(
    "r,k,e,alignment,seed",
    [(11, 3, 4, 1, 0), (37, 8, 5, 4, 1), (300, 2, 3, 128, 2), (5000, 2, 6, 1, 3), (1, 1, 1, 1, 4)],
)
def test_slot_positions_match_stable_sort(r, k, e, alignment, seed, poisoned):
    _check_against_stable_sort(_ids(r, k, e, seed), e, alignment)


def _check_against_stable_sort(ids, e, alignment):
    ref = _to_contiguous_torch(torch.zeros(ids.shape[0], 1), None, ids, e, alignment)
    offsets = ref.expert_offsets.to(DEVICE)
    res = permute.slot_positions(ids.to(DEVICE), offsets, int(offsets[-1]))
    slot_pos, m_indices, counts = (t.cpu() for t in res)
    assert torch.equal(slot_pos, ref.slot_pos)
    assert torch.equal(m_indices, ref.m_indices)
    assert counts.tolist() == ref.num_rows


@pytest.fixture(params=["blocks", "steps"])
def small_blocks(request, monkeypatch):
    """Steps of 128 slots (the fewest the launcher allows), so that a few thousand slots cross
    many boundaries: of blocks (one step each), or of steps (three blocks of several steps). The
    histogram table is read two rows at a time."""
    monkeypatch.setattr(permute, "SLOT_STEP", 128)
    monkeypatch.setattr(permute, "SLOT_PROGRAMS", 1 << 30 if request.param == "blocks" else 3)
    monkeypatch.setattr(permute, "SLOT_TILE", 64)


@pytest.mark.parametrize("alignment", [1, 128])
def test_slot_positions_across_many_blocks(alignment, poisoned, small_blocks):
    """The counts of the blocks before, and the running count from one step to the next: 1032
    slots in 9 blocks of one step (the last 8 slots long), or in 3 blocks of 3 steps."""
    _check_against_stable_sort(_ids(129, 8, 7, 5), 7, alignment)


def test_slot_positions_foreign_ids_beyond_range_and_empty_experts(poisoned):
    # ids >= E (another rank's numbering) and experts nobody picked
    ids = torch.tensor([[7, 0], [0, -1], [9, 9], [0, 3]])
    offsets = torch.tensor([0, 3, 3, 3, 4], dtype=torch.int32)
    slot_pos, m_indices, counts = (t.cpu() for t in permute.slot_positions(ids.to(DEVICE), offsets.to(DEVICE), 4))
    assert slot_pos.tolist() == [[-1, 0], [1, -1], [-1, -1], [2, 3]]
    assert m_indices.tolist() == [0, 0, 0, 3]
    assert counts.tolist() == [3, 0, 0, 1]


def test_slot_positions_never_write_past_a_short_segment(poisoned):
    ids = torch.tensor([[0, 1], [0, 1], [0, 1]])
    offsets = torch.tensor([0, 2, 5], dtype=torch.int32)  # expert 0 has 3 slots but room for 2
    slot_pos, m_indices, counts = (t.cpu() for t in permute.slot_positions(ids.to(DEVICE), offsets.to(DEVICE), 5))
    assert m_indices.tolist() == [0, 0, 1, 1, 1]
    assert slot_pos[:, 1].tolist() == [2, 3, 4]
    # the third slot of expert 0 has no room: it is dropped (-1), not left uninitialised
    assert slot_pos[:, 0].tolist() == [0, 1, -1]
    assert counts.tolist() == [3, 3]


def test_slot_positions_rejects_bad_arguments():
    ids = torch.zeros(2, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="expert_offsets must be an int32/int64"):
        permute.slot_positions(ids, torch.zeros(3), 0)
    with pytest.raises(ValueError, match="topk_ids must be an integer"):
        permute.slot_positions(ids.float(), torch.zeros(3, dtype=torch.int32), 0)


def test_to_contiguous_rejects_padded_rows_of_wrong_length():
    with pytest.raises(ValueError, match="padded_rows has 2 entries; expected num_experts=3"):
        to_contiguous(torch.zeros(2, 4), None, torch.zeros(2, 1, dtype=torch.int64), 3, 1, [1, 1])


@pytest.mark.parametrize(
    "padded,msg", [([4, -4], r"padded_rows\[1\]=-4"), ([4, 6], r"padded_rows\[1\]=6.*alignment=4")]
)
def test_to_contiguous_rejects_bad_padded_rows(padded, msg):
    with pytest.raises(ValueError, match=msg):
        to_contiguous(torch.zeros(2, 4), None, torch.zeros(2, 1, dtype=torch.int64), 2, 4, padded)


# On CPU the same kernel path runs under the interpreter (to_contiguous itself takes the torch
# path for CPU tensors); rows are copied bit for bit, so bf16 is exact there too.
@pytest.mark.parametrize("alignment,known", [(1, False), (1, True), (128, False), (128, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int8])
def test_to_contiguous_kernels_equal_torch_path(alignment, known, dtype):
    on_gpu = torch.cuda.is_available()
    r, k, e, h = (700, 8, 16, 256) if on_gpu else (90, 4, 6, 48)
    ids = _ids(r, k, e, 5)
    x = (torch.randn(r, h) * 30).to(dtype)
    xs = torch.rand(r, 2)
    ref = _to_contiguous_torch(x, xs, ids, e, alignment)
    padded = [int(b - a) for a, b in zip(ref.expert_offsets[:-1].tolist(), ref.expert_offsets[1:].tolist())]
    scatter = to_contiguous if on_gpu else _to_contiguous_kernels
    got = scatter(x.to(DEVICE), xs.to(DEVICE), ids.to(DEVICE), e, alignment, padded if known else None)
    assert torch.equal(got.expert_offsets.cpu(), ref.expert_offsets)
    assert torch.equal(got.m_indices.cpu(), ref.m_indices)
    assert torch.equal(got.slot_pos.cpu(), ref.slot_pos)
    assert got.rows_per_expert() == ref.num_rows
    # Padding rows hold anything on the kernel path (ContiguousBatch); the slots' rows are exact.
    used = ref.m_indices >= 0
    assert torch.equal(got.x.cpu()[used].view(torch.uint8), ref.x[used].view(torch.uint8))
    assert torch.equal(got.x_scale.cpu()[used], ref.x_scale[used])


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])
def test_gather_weighted_rounds_the_fp32_sum_once(out_dtype):
    ids = _ids(23, 3, 4, 7)
    ref = _to_contiguous_torch(torch.zeros(23, 1), None, ids, 4, 1)
    g = torch.Generator().manual_seed(8)
    expert_out = torch.randn(ref.x.shape[0], 40, generator=g).half()
    w = torch.rand(23, 3, generator=g)
    want = gather_reference(expert_out, ref.slot_pos, w)
    got = permute.gather_weighted(expert_out.to(DEVICE), ref.slot_pos.to(DEVICE), w.to(DEVICE), out_dtype).cpu()
    assert got.dtype == out_dtype
    # fp32 sum of 3 terms, then one rounding to out_dtype
    tol = 1e-6 if out_dtype == torch.float32 else 2.0**-10
    assert torch.allclose(got.double(), want, rtol=tol, atol=tol)


def test_gather_weighted_rejects_int_out_dtype():
    with pytest.raises(TypeError, match="out_dtype=torch.int32; allowed"):
        permute.gather_weighted(torch.zeros(2, 4), torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1), torch.int32)


# ----------------------------------------------------------- segment sizes counted on the device
def _check_device_layout(ids, e, alignment):
    """slot_layout's offsets, slot rows and row experts against the stable sort; every row past
    the last segment (the worst case's spare room) belongs to no expert."""
    ref = _to_contiguous_torch(torch.zeros(ids.shape[0], 1), None, ids, e, alignment)
    offsets, slot_pos, m_indices, counts = (t.cpu() for t in permute.slot_layout(ids.to(DEVICE), e, alignment))
    m = int(ref.expert_offsets[-1])
    assert offsets.dtype == torch.int32 and torch.equal(offsets, ref.expert_offsets)
    assert torch.equal(slot_pos, ref.slot_pos)
    assert m_indices.numel() == permute.max_rows(*ids.shape, e, alignment) >= m
    assert torch.equal(m_indices[:m], ref.m_indices)
    assert (m_indices[m:] == -1).all()
    assert counts.tolist() == ref.num_rows


@pytest.mark.parametrize(
    "r,k,e,alignment,seed", [(11, 3, 4, 1, 0), (37, 8, 5, 4, 1), (300, 2, 3, 128, 2), (1, 1, 1, 1, 4), (64, 8, 40, 3, 6)]
)
def test_slot_layout_counts_segments_on_the_device(r, k, e, alignment, seed, poisoned):
    _check_device_layout(_ids(r, k, e, seed), e, alignment)


@pytest.mark.parametrize("alignment", [1, 16])
def test_slot_layout_across_many_blocks(alignment, poisoned, small_blocks):
    """The segments counted from 9 (or 3) block histograms."""
    _check_device_layout(_ids(129, 8, 7, 9), 7, alignment)


def _with_foreign(ids, e, share, g):
    """``ids`` with about ``share`` of the slots foreign: -1, E, E + 1 (under the kernel's
    power-of-two padding of E, when E is not a power of two), 2 * E + 7 (past it) or 2^33 + 1
    (1 if cut to 32 bits)."""
    other = torch.tensor([-1, e, e + 1, 2 * e + 7, 2**33 + 1])[torch.randint(0, 5, ids.shape, generator=g)]
    return torch.where(torch.rand(ids.shape, generator=g) < share, other, ids)


def _runs(n, e, run, seed):
    """``[n, 1]`` ids in runs of ``run`` slots per expert (so runs cross block and step
    boundaries), every expert again after the last, about one slot in four foreign."""
    g = torch.Generator().manual_seed(seed)
    return _with_foreign((torch.arange(n) // run) % e, e, 0.25, g).reshape(n, 1)


@pytest.mark.parametrize("alignment", [1, 128])
@pytest.mark.parametrize("n,run", [(1003, 50), (1003, 300), (130, 1)])
def test_slot_kernels_with_runs_across_block_boundaries(n, run, alignment, poisoned, small_blocks):
    """An expert's run split between steps and blocks (a run of 300 spans three blocks); slot
    counts that are no multiple of the block nor of the step."""
    ids = _runs(n, 6, run, n + run)
    _check_against_stable_sort(ids, 6, alignment)
    _check_device_layout(ids, 6, alignment)
    # Rank order, checked directly: every expert's slots take its segment's rows one after the
    # other, in slot order.
    offsets, slot_pos, _, counts = (t.cpu() for t in permute.slot_layout(ids.to(DEVICE), 6, alignment))
    for e in range(6):
        rows = slot_pos.reshape(-1)[ids.reshape(-1) == e]
        assert rows.tolist() == list(range(int(offsets[e]), int(offsets[e]) + int(counts[e])))


@pytest.mark.parametrize("alignment", [1, 128])
@pytest.mark.parametrize("r,k,e", [(97, 8, 5), (80, 8, 130), (64, 8, 256), (300, 8, 128)])
def test_slot_kernels_with_many_or_odd_expert_counts(r, k, e, alignment, poisoned):
    """E not a power of two (the kernel pads it to one: ids between E and the padding are
    foreign), E = 256, and E = 128 with alignment 128 and about half the slots foreign (the
    shape of a real rank's receive, scaled down), at the launcher's own block sizes."""
    g = torch.Generator().manual_seed(r + e)
    ids = _with_foreign(torch.randint(0, e, (r, k), generator=g), e, 0.5, g)
    _check_against_stable_sort(ids, e, alignment)
    _check_device_layout(ids, e, alignment)


@pytest.mark.parametrize(
    "dtype,e", [(torch.int32, 128), (torch.int16, 384), (torch.int8, 100), (torch.uint8, 200)]
)
def test_slot_kernels_take_any_integer_ids(dtype, e, poisoned):
    """Ids of any integer dtype, including narrow ones whose range cannot hold the kernels'
    markers (-1 fill, the padded expert count), and E = 384 (more bins than a table tile)."""
    g = torch.Generator().manual_seed(e)
    ids = torch.randint(0, e, (90, 8), generator=g)
    ids = torch.where(torch.rand(ids.shape, generator=g) < 0.3, torch.full_like(ids, e + 3), ids)
    if dtype.is_signed:
        ids = torch.where(torch.rand(ids.shape, generator=g) < 0.2, torch.full_like(ids, -1), ids)
    ids = ids.to(dtype)
    assert torch.equal(ids.long().to(dtype), ids)  # the test's ids fit the dtype
    _check_against_stable_sort(ids, e, 128)
    _check_device_layout(ids, e, 1)


def test_slot_kernels_take_non_contiguous_ids(poisoned):
    ids = _with_foreign(torch.randint(0, 9, (8, 70), generator=torch.Generator().manual_seed(3)), 9, 0.4,
                        torch.Generator().manual_seed(4)).t()  # fmt: skip
    assert not ids.is_contiguous()
    _check_against_stable_sort(ids, 9, 4)
    _check_device_layout(ids, 9, 1)


def test_slot_positions_never_write_at_or_past_num_rows(poisoned):
    """Offsets that end past ``num_rows`` (a caller's inconsistency): rows at or past it are never
    written (the output is only ``num_rows`` long) and the slots that would land there get -1."""
    ids = torch.tensor([[0, 1], [1, 0], [1, 1], [0, 0]])
    offsets = torch.tensor([0, 4, 8], dtype=torch.int32, device=DEVICE)
    slot_pos, m_indices, counts = (t.cpu() for t in permute.slot_positions(ids.to(DEVICE), offsets, 6))
    assert m_indices.tolist() == [0, 0, 0, 0, 1, 1] and counts.tolist() == [4, 4]
    assert slot_pos.tolist() == [[0, 4], [5, 1], [-1, -1], [2, 3]]


def test_slot_kernels_with_no_slots(poisoned):
    """A rank that received nothing: empty segments, every (padding) row unused."""
    ids = torch.zeros(0, 8, dtype=torch.int64)
    offsets, slot_pos, m_indices, counts = (t.cpu() for t in permute.slot_layout(ids.to(DEVICE), 3, 4))
    assert offsets.tolist() == [0, 0, 0, 0] and slot_pos.shape == (0, 8)
    assert m_indices.numel() == 0 and counts.tolist() == [0, 0, 0]  # no slot: no row can be needed
    zeros = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    slot_pos, m_indices, counts = (t.cpu() for t in permute.slot_positions(ids.to(DEVICE), zeros, 0))
    assert slot_pos.shape == (0, 8) and m_indices.numel() == 0 and counts.tolist() == [0, 0, 0]


def _rows_per_expert(ids, offsets, num_rows):
    """slot_positions' outputs for any int offsets, expert by expert: the expert's slots in slot
    order take the rows of its segment from the start, as many as fit (the rest -1)."""
    flat = ids.reshape(-1)
    slot_pos = torch.full_like(flat, -1)
    m_indices = torch.full((num_rows,), -1, dtype=torch.int32)
    counts = []
    for e in range(offsets.numel() - 1):
        slots = (flat == e).nonzero().flatten()
        start, end = int(offsets[e]), int(offsets[e + 1])
        fit = min(slots.numel(), max(end - start, 0))
        slot_pos[slots[:fit]] = torch.arange(start, start + fit)
        m_indices[start : start + fit] = e
        counts.append(slots.numel())
    return slot_pos.reshape(ids.shape), m_indices, counts


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_slot_positions_with_roomy_and_short_segments_across_blocks(dtype, poisoned, small_blocks):
    """Given segments with spare room (padding rows, some longer than a marking store) and one
    too short for its slots, spread over many blocks, int32 or int64 offsets."""
    ids = _runs(1003, 4, 40, 3)
    counts = [int((ids == e).sum()) for e in range(4)]
    room = [counts[0] + 3, counts[1] + 1500, counts[2] - 20, counts[3]]
    offsets = torch.tensor([0] + room, dtype=dtype).cumsum(0).to(dtype)
    m = int(offsets[-1])
    res = permute.slot_positions(ids.to(DEVICE), offsets.to(DEVICE), m)
    slot_pos, m_indices, got_counts = (t.cpu() for t in res)
    want_pos, want_rows, want_counts = _rows_per_expert(ids, offsets, m)
    assert torch.equal(slot_pos, want_pos)
    assert torch.equal(m_indices, want_rows)
    assert got_counts.tolist() == want_counts == counts


@pytest.mark.parametrize(
    "e,alignment,offsets,pos,rows",
    [
        (4, 2, [0, 4, 4, 4, 6], [[-1, 0], [1, -1], [-1, -1], [2, 4], [-1, -1]], [0, 0, 0, -1, 3, -1]),
        # unpadded
        (4, 1, [0, 3, 3, 3, 4], [[-1, 0], [1, -1], [-1, -1], [2, 3], [-1, -1]], [0, 0, 0, 3]),
        # the last expert owns no slot
        (5, 1, [0, 3, 3, 3, 4, 4], [[-1, 0], [1, -1], [-1, -1], [2, 3], [-1, -1]], [0, 0, 0, 3]),
    ],
)
def test_slot_layout_foreign_ids_and_empty_experts(e, alignment, offsets, pos, rows, poisoned):
    ids = torch.tensor([[7, 0], [0, -1], [9, 9], [0, 3], [-1, -1]])  # ids >= E, -1, empty experts
    got_offsets, slot_pos, m_indices, counts = (t.cpu() for t in permute.slot_layout(ids.to(DEVICE), e, alignment))
    assert got_offsets.tolist() == offsets
    assert slot_pos.tolist() == pos
    assert m_indices.tolist() == rows + [-1] * (permute.max_rows(5, 2, e, alignment) - len(rows))
    assert counts.tolist() == [3, 0, 0, 1] + [0] * (e - 4)


def test_slot_layout_rejects_bad_arguments():
    ids = torch.zeros(2, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="num_experts=0 must be a positive integer"):
        permute.slot_layout(ids, 0)
    with pytest.raises(ValueError, match="alignment=0 must be a positive integer"):
        permute.slot_layout(ids, 2, 0)
    with pytest.raises(ValueError, match="topk_ids must be an integer"):
        permute.slot_layout(ids.float(), 2)


@pytest.mark.parametrize("alignment", [1, 8])
def test_to_contiguous_with_device_sizes_equals_exact_layout(alignment):
    """The no-read-back layout holds the exact layout's rows, then spare rows nobody points to."""
    r, k, e, h = 60, 4, 6, 32
    ids = _ids(r, k, e, 11)
    x = torch.randint(-127, 128, (r, h), dtype=torch.int8)
    xs = torch.rand(r, 1)
    ref = _to_contiguous_torch(x, xs, ids, e, alignment)
    scatter = to_contiguous if torch.cuda.is_available() else _to_contiguous_kernels
    got = scatter(x.to(DEVICE), xs.to(DEVICE), ids.to(DEVICE), e, alignment, None, expected_m=40)
    m = int(ref.expert_offsets[-1])
    assert got.expected_m == 40 and got.x.shape[0] == permute.max_rows(r, k, e, alignment) > m
    assert torch.equal(got.valid_rows.cpu(), ref.expert_offsets[-1:])
    # Padding rows are left unwritten (ContiguousBatch): only the rows of some slot must agree.
    used = ref.m_indices >= 0
    assert torch.equal(got.m_indices[:m].cpu(), ref.m_indices)
    assert torch.equal(got.x[:m].cpu()[used], ref.x[used])
    assert torch.equal(got.x_scale[:m].cpu()[used], ref.x_scale[used])
    assert torch.equal(got.slot_pos.cpu(), ref.slot_pos)
    assert got.rows_per_expert() == ref.num_rows


def test_to_contiguous_rejects_bad_expected_m():
    with pytest.raises(ValueError, match="expected_m=0 must be a positive integer or None"):
        to_contiguous(torch.zeros(2, 4), None, torch.zeros(2, 1, dtype=torch.int64), 2, expected_m=0)


def _most_rows_by_enumeration(r, k, e, alignment):
    """The most rows any routing of ``r x k`` slots over ``e`` experts (ids -1..e-1, repeats
    allowed) lays out, by trying every routing."""
    best = 0
    for flat in itertools.product(range(-1, e), repeat=r * k):
        counts = [flat.count(x) for x in range(e)]
        best = max(best, sum(-(-c // alignment) * alignment for c in counts))
    return best


@pytest.mark.parametrize("r,k,e", [(1, 2, 3), (2, 2, 2), (1, 3, 5), (3, 1, 2), (1, 4, 2)])
@pytest.mark.parametrize("alignment", [1, 2, 3, 4])
def test_max_rows_is_the_tight_worst_case(r, k, e, alignment):
    """max_rows is reached by some routing and exceeded by none (every routing tried)."""
    assert permute.max_rows(r, k, e, alignment) == _most_rows_by_enumeration(r, k, e, alignment)


def test_max_rows_of_a_decode_step_with_128_row_segments():
    """One token, top-8 of 128 experts, 128-row segments: 8 experts can be non-empty, not 128."""
    assert permute.max_rows(1, 8, 128, 128) == 8 * 128
    assert permute.max_rows(64, 8, 128, 128) == (512 + 128 * 127) // 128 * 128  # all 128 can be


def test_row_split_spreads_a_decode_step_over_programs():
    """One token of H = 7168 runs on 56 programs of 128 columns, not 7 of 1024; large batches keep
    1024 columns; the interpreter always takes the widest."""
    cuda = torch.device("cuda")
    assert permute.row_split(1, 7168, cuda) == (128, 1)
    assert permute.row_split(32, 7168, cuda) == (512, 2)
    assert permute.row_split(128, 7168, cuda) == (1024, 4)
    assert permute.row_split(1, 7168, torch.device("cpu")) == (1024, 4)


def test_row_copies_split_along_h_match_the_reference(monkeypatch):
    """Scatter and gather with each row split over several column programs (what row_split gives
    a decode step on a GPU) against the torch path."""
    monkeypatch.setattr(permute, "row_split", lambda rows, hidden, device: (16, 1))
    ids = _ids(9, 3, 4, 12)
    x = torch.randn(9, 40, generator=torch.Generator().manual_seed(13)).half()
    xs = torch.rand(9, 2)
    ref = _to_contiguous_torch(x, xs, ids, 4, 1)
    got = _to_contiguous_kernels(x.to(DEVICE), xs.to(DEVICE), ids.to(DEVICE), 4, 1, None)
    assert torch.equal(got.x.cpu(), ref.x) and torch.equal(got.x_scale.cpu(), ref.x_scale)
    w = torch.rand(9, 3)
    want = gather_reference(ref.x, ref.slot_pos, w)
    out = permute.gather_weighted(got.x, got.slot_pos, w.to(DEVICE), torch.float32).cpu()
    assert torch.allclose(out.double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("r,launches", [(64, 0), (65, 1)])
def test_slot_layout_of_one_step_is_one_launch(r, launches, monkeypatch):
    """Up to SLOT_STEP slots (64 tokens of top-8) the positions kernel counts the experts itself:
    no histogram launch; past it the histogram kernel runs. The layout is the same either way."""
    calls = []
    hist = permute._slot_histogram_kernel

    class Counting:
        def __getitem__(self, grid):
            calls.append(grid)
            return hist[grid]

    monkeypatch.setattr(permute, "_slot_histogram_kernel", Counting())
    _check_device_layout(_ids(r, 8, 6, 14), 6, 4)
    assert len(calls) == launches


@pytest.mark.parametrize(
    "r,k,e,alignment,dtype,scales,tile,mn_major",
    [(1, 8, 128, 128, torch.float8_e4m3fn, 56, None, True),  # a DeepSeek decode step (H scaled down)
     (1, 8, 128, 128, torch.float8_e4m3fn, 2, 128 * 16, True),  # its rows split over 16 column programs
     (1, 8, 128, 128, torch.float8_e4m3fn, 2, 128 * 16, False),
     (16, 8, 6, 4, torch.int8, 1, 128 * 32, False), (7, 3, 5, 1, torch.float16, None, None, False),
     (5, 2, 3, 8, torch.bfloat16, None, 128 * 16, False)],
)
def test_slot_layout_scatter_in_one_launch_matches_the_reference(r, k, e, alignment, dtype, scales, tile, mn_major,
                                                                 monkeypatch):  # fmt: skip
    """Up to 128 slots the layout and the row copies are one launch (the positions kernel copies
    the rows; with ``tile`` each program its 16 or 32 columns): the stable sort's layout, the slots'
    rows byte for byte, padding and spare rows belonging to no expert, no histogram or scatter
    launch; the scales row-major or MN-major (the CUTLASS kernels' layout)."""
    if tile is not None:
        monkeypatch.setattr(permute, "INTERPRETER_TILE", tile)
        monkeypatch.setattr(permute, "COPY_TILE", tile)
    for name in ("_slot_histogram_kernel", "_scatter_rows_kernel"):
        monkeypatch.setattr(permute, name, None)  # a launch of either fails
    monkeypatch.setattr(permute, "torch", _BytePoisonedTorch())  # a row left unwritten cannot pass
    g = torch.Generator().manual_seed(22)
    if k <= e:  # distinct experts per token, as a router picks them
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(r)])
    else:
        ids = torch.randint(-1, e, (r, k), generator=g)
    ids[-1, -1] = e + 3  # another rank's expert
    h = 256
    x = (torch.randn(r, h, generator=g) * 30).to(dtype)
    xs = None if scales is None else torch.rand(r, scales, generator=g)
    assert permute.fused_copy_step(r * k)
    ref = _to_contiguous_torch(x, xs, ids, e, alignment)
    got = permute.slot_layout_scatter(ids.to(DEVICE), e, alignment, x.to(DEVICE), None if xs is None else xs.to(DEVICE),
                                      scale_mn_major=mn_major)  # fmt: skip
    if xs is not None:
        rows = got[5].shape[0]
        assert got[5].stride() == ((1, -(-rows // 4) * 4) if mn_major else (xs.shape[1], 1))
    offsets, slot_pos, m_indices, counts, out, out_scale = (None if t is None else t.cpu() for t in got)
    m = int(ref.expert_offsets[-1])
    assert torch.equal(offsets, ref.expert_offsets) and torch.equal(slot_pos, ref.slot_pos)
    assert counts.tolist() == ref.num_rows
    assert m_indices.numel() == out.shape[0] == permute.max_rows(r, k, e, alignment)
    assert torch.equal(m_indices[:m], ref.m_indices) and (m_indices[m:] == -1).all()
    used = ref.m_indices >= 0
    assert torch.equal(out[:m][used].view(torch.uint8), ref.x[used].view(torch.uint8))
    assert (out_scale is None) == (xs is None)
    if xs is not None:
        assert torch.equal(out_scale[:m][used], ref.x_scale[used])


def test_slot_layout_scatter_beyond_one_step_uses_two_launches():
    """Past 128 slots: slot_layout then scatter_rows, the scales MN-major when asked."""
    ids = _ids(20, 8, 6, 23)  # 160 slots
    x = torch.randn(20, 64).half()
    xs = torch.rand(20, 3)
    assert not permute.fused_copy_step(160)
    ref = _to_contiguous_torch(x, xs, ids, 6, 4)
    got = permute.slot_layout_scatter(ids.to(DEVICE), 6, 4, x.to(DEVICE), xs.to(DEVICE), scale_mn_major=True)
    _, slot_pos, _, _, out, out_scale = got
    used = ref.m_indices >= 0
    m = int(ref.expert_offsets[-1])
    assert out_scale.stride() == (1, -(-out.shape[0] // 4) * 4)
    assert torch.equal(slot_pos.cpu(), ref.slot_pos)
    assert torch.equal(out.cpu()[:m][used], ref.x[used]) and torch.equal(out_scale.cpu()[:m][used], ref.x_scale[used])
