"""Grouped GEMMs in Triton over the contiguous and the masked expert layouts.

Every function computes ``out[m, n] = sum_k A[m, k] * B[e(m), n, k]`` where ``e(m)`` is the expert
that owns row ``m`` and ``B`` is stored out x in (``w13 [E, 2I, H]``, ``w2 [E, H, I]``).

Modes:

* ``"bf16"``: bf16 / fp16 / fp32 operands (both the same dtype), fp32 accumulation.
* ``"int8_channel"``: int8 operands, ``a_scale [M, 1]`` per token, ``b_scale [E, N, 1]`` per output
  channel. Each K step's int32 tile product is exact; the scales are applied once per output
  tile. ``accumulator="fp32"`` sums K steps in fp32 (the default, as in the INT8 DeepSeek-R1
  work), ``"int32"`` keeps the whole K sum in the MMA's int32 accumulator (exact, no per-step
  conversion, faster).
* ``"int8_block"``: int8 operands, ``a_scale [M, K/128]`` per 1x128 group (any strides: row-major,
  or MN-major as the CUTLASS kernels read it, without a copy) and
  ``b_scale [E, ceil(N/128), ceil(K/128)]`` per 128x128 block; every K step is scaled before
  it is added to the fp32 accumulator, so ``BLOCK_K`` divides 128.

Scheduling: one kernel serves both layouts. Each program reads the per-expert row segments
(``expert_offsets`` or ``masked_m``), counts ``BLOCK_M`` tiles per expert in registers and walks
the global list of non-empty tiles with a stride of the grid's M extent. Empty experts cost
nothing, no host sync is needed (CUDA-graph safe), and a masked batch whose capacity far exceeds
its rows launches only as many programs as ``expected_m`` suggests. Program ids are swizzled in
groups of ``GROUP_M`` M tiles so that concurrently running programs share A and B panels in L2.

TMA variant (``GemmConfig.tma``, sm_90+): :func:`_grouped_gemm_tma_kernel` reads B tiles through a
host-side tensor descriptor over ``[E*N, K]`` and A tiles through a descriptor it builds per tile,
``[start + length, K]`` over the flat rows, so that it ends at the tile's expert's last row. It
walks a flattened (M tile, N tile) space with the same swizzle, optionally persistent (one program
per SM). Every program first writes each expert's first tile index (:func:`_write_tile_table`) and
binary-searches it per tile (no host sync; empty experts own no tiles). The output store stays a
masked pointer store (a TMA store would overwrite neighbouring experts' rows). Operands that break
TMA's 16-byte alignment rules fall back to the pointer kernel (:func:`tma_fallback_reason`); the
TMA kernel has no ``SWAP_AB`` variant.

For decode-sized batches (a few rows per expert) the kernel is bound by reading the weights; the
configs then use a 16-row tile (or ``SWAP_AB``: the weight tile becomes the MMA's M side so that
Hopper's wgmma, whose M is at least 64, still applies) and long K steps.

On Hopper both kernels launch as programmatic dependents (:mod:`.pdl`): the launch and the
programs' placement overlap the kernel before (a decode step's prep, the activation between the
GEMMs), which is most of a small batch's gap between kernels.
"""

from __future__ import annotations

import contextvars
import functools
import logging

import torch
import triton
import triton.language as tl

from .. import devices
from ..tensors import as_contiguous, check_positive_int
from .common import check_masked_m, next_pow2, placeholder
from .configs import GemmConfig, get_config
from .pdl import dependent, dependent_start

MODES = ("bf16", "int8_channel", "int8_block")
ACCUMULATORS = ("fp32", "int32")
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SCALE_BLOCK = 128

_MODE_IDS = {("bf16", "fp32"): 0, ("int8_channel", "fp32"): 1, ("int8_channel", "int32"): 2,
             ("int8_block", "fp32"): 3}


@triton.jit
def _mma(a, b, acc, SWAP_AB: tl.constexpr):
    """``a [BM, BK] . b [BN, BK]^T`` as ``[BM, BN]``, or transposed ``[BN, BM]`` with SWAP_AB."""
    if SWAP_AB:
        out = tl.dot(b, tl.trans(a), acc)
    else:
        out = tl.dot(a, tl.trans(b), acc)
    return out


@triton.jit
def _mma_int8(a, b, acc, SWAP_AB: tl.constexpr):
    """:func:`_mma` for int8 operands: exact int32 products."""
    if SWAP_AB:
        out = tl.dot(b, tl.trans(a), acc, out_dtype=tl.int32)
    else:
        out = tl.dot(a, tl.trans(b), acc, out_dtype=tl.int32)
    return out


@triton.jit
def _mma_ieee(a, b, acc, SWAP_AB: tl.constexpr):
    """fp32 operands: exact fp32 products instead of TF32, so the bf16 mode with fp32 weights
    matches the reference."""
    if SWAP_AB:
        out = tl.dot(b, tl.trans(a), acc, input_precision="ieee")
    else:
        out = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
    return out


@triton.jit
def _outer(row_vec, col_vec, SWAP_AB: tl.constexpr):
    """Outer product laid out like the accumulator of :func:`_mma`."""
    if SWAP_AB:
        out = col_vec[:, None] * row_vec[None, :]
    else:
        out = row_vec[:, None] * col_vec[None, :]
    return out


@triton.jit
def _zero_acc(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr, INT_ACC: tl.constexpr):
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if INT_ACC:
        acc = acc.to(tl.int32)
    return acc


@triton.jit
def _k_step(
    a, b, acc, kk, AS, BS, rows, e64, n_first, cols,
    stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk,
    MODE: tl.constexpr, FP32_IEEE: tl.constexpr, SWAP_AB: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_BLOCK: tl.constexpr,
):
    """One K step of every mode: ``acc`` plus the tile product (scaled per K block for
    ``int8_block``). ``cols`` are the tile's weight rows clamped in range, ``n_first`` its first."""
    if MODE == 0:
        if FP32_IEEE:
            acc = _mma_ieee(a, b, acc, SWAP_AB)
        else:
            acc = _mma(a, b, acc, SWAP_AB)
    elif MODE == 2:
        acc = _mma_int8(a, b, acc, SWAP_AB)
    elif MODE == 1:
        acc += _mma_int8(a, b, None, SWAP_AB).to(tl.float32)
    else:
        kb = (kk * BLOCK_K) // SCALE_BLOCK
        sa = tl.load(AS + rows * stride_asm + kb * stride_ask)
        part = _mma_int8(a, b, None, SWAP_AB).to(tl.float32)
        if BLOCK_N <= SCALE_BLOCK:
            # The tile lies inside one weight block: one scalar, and a row vector instead
            # of a [BM, BN] scale tile keeps registers for the two accumulators.
            sb_blk = tl.load(BS + e64 * stride_bse + (n_first // SCALE_BLOCK) * stride_bsn + kb * stride_bsk)
            if SWAP_AB:
                acc += part * (sa * sb_blk)[None, :]
            else:
                acc += part * (sa * sb_blk)[:, None]
        else:
            sb = tl.load(BS + e64 * stride_bse + (cols // SCALE_BLOCK) * stride_bsn + kb * stride_bsk)
            acc += part * _outer(sa, sb, SWAP_AB)
    return acc


@triton.jit
def _grouped_gemm_kernel(
    A, B, C, AS, BS, SEG,
    N, K, E, CAP, GRID_M,
    stride_am, stride_be, stride_bn, stride_cm,
    stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk,
    MODE: tl.constexpr, MASKED: tl.constexpr, E_PAD: tl.constexpr, FP32_IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr,
    SCALE_BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    dependent_start(PDL)
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group_width = GROUP_M * num_pid_n
    first_slot = (pid // group_width) * GROUP_M
    group_rows = tl.minimum(GRID_M - first_slot, GROUP_M)
    slot = first_slot + (pid % group_width) % group_rows
    pid_n = (pid % group_width) // group_rows

    # Row segment of every expert, and the running count of its BLOCK_M tiles.
    offs_e = tl.arange(0, E_PAD)
    e_ok = offs_e < E
    if MASKED:
        seg_len = tl.minimum(tl.load(SEG + offs_e, mask=e_ok, other=0), CAP)
        seg_start = offs_e.to(tl.int64) * CAP
    else:
        lo = tl.load(SEG + offs_e, mask=e_ok, other=0)
        seg_len = tl.load(SEG + offs_e + 1, mask=e_ok, other=0) - lo
        seg_start = lo.to(tl.int64)
    seg_len = tl.maximum(seg_len, 0)
    tiles = (seg_len + BLOCK_M - 1) // BLOCK_M
    tiles_end = tl.cumsum(tiles, 0)
    total_tiles = tl.sum(tiles, 0)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    # Clamped indices keep every load in bounds without masks; the store is masked instead.
    cols = tl.where(n_ok, offs_n, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_bm = tl.arange(0, BLOCK_M)

    for t in range(slot, total_tiles, GRID_M):
        e = tl.sum((tiles_end <= t).to(tl.int32), 0)
        is_e = offs_e == e
        start = tl.sum(tl.where(is_e, seg_start, 0), 0)
        length = tl.sum(tl.where(is_e, seg_len, 0), 0)
        first_tile = tl.sum(tl.where(is_e, tiles_end - tiles, 0), 0)
        local = (t - first_tile) * BLOCK_M + offs_bm
        m_ok = local < length
        rows = start + tl.where(m_ok, local, 0)
        e64 = e.to(tl.int64)

        a_ptrs = A + rows[:, None] * stride_am + offs_k[None, :]
        b_ptrs = B + e64 * stride_be + cols[:, None] * stride_bn + offs_k[None, :]
        acc = _zero_acc(BLOCK_M, BLOCK_N, SWAP_AB, MODE == 2)

        for kk in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_ok = offs_k < K - kk * BLOCK_K
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0)
                b = tl.load(b_ptrs, mask=k_ok[None, :], other=0)
            acc = _k_step(
                a, b, acc, kk, AS, BS, rows, e64, pid_n * BLOCK_N, cols, stride_asm, stride_ask, stride_bse,
                stride_bsn, stride_bsk, MODE, FP32_IEEE, SWAP_AB, BLOCK_N, BLOCK_K, SCALE_BLOCK,
            )
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K

        if MODE == 1 or MODE == 2:
            sa = tl.load(AS + rows * stride_asm)
            sb = tl.load(BS + e64 * stride_bse + cols * stride_bsn)
            res = acc.to(tl.float32) * _outer(sa, sb, SWAP_AB)
        else:
            res = acc
        res = res.to(C.dtype.element_ty)
        if SWAP_AB:
            c_ptrs = C + rows[None, :] * stride_cm + offs_n[:, None]
            tl.store(c_ptrs, res, mask=m_ok[None, :] & n_ok[:, None])
        else:
            c_ptrs = C + rows[:, None] * stride_cm + offs_n[None, :]
            tl.store(c_ptrs, res, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _write_tile_table(SEG, TB, E, CAP, MASKED: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """``TB[e]`` = index of expert ``e``'s first ``BLOCK_M`` tile, for ``e`` in ``[0, E_PAD]``;
    entries past ``E`` (and ``TB[E_PAD]``) hold the total tile count.

    Every program of the GEMM writes the whole table before its first tile (the same values, so
    concurrent writes agree) and reads it after a barrier: no separate launch, whose host cost
    would sit between the scatter and GEMM1 on the prefill path."""
    offs_e = tl.arange(0, E_PAD)
    e_ok = offs_e < E
    if MASKED:
        seg_len = tl.minimum(tl.load(SEG + offs_e, mask=e_ok, other=0), CAP)
    else:
        seg_len = tl.load(SEG + offs_e + 1, mask=e_ok, other=0) - tl.load(SEG + offs_e, mask=e_ok, other=0)
    tiles = (tl.maximum(seg_len, 0) + BLOCK_M - 1) // BLOCK_M
    tiles_end = tl.cumsum(tiles, 0)
    tl.store(TB + offs_e + 1, tiles_end)
    tl.store(TB, 0)
    # Global writes of this program are visible to all its threads after the barrier.
    tl.debug_barrier()


@triton.jit(do_not_specialize=["M", "CAP", "NUM_PROGRAMS"])
def _grouped_gemm_tma_kernel(
    A, b_desc, C, AS, BS, SEG, TB,
    M, E, N, K, CAP, NUM_PROGRAMS,
    stride_cm, stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk,
    MODE: tl.constexpr, MASKED: tl.constexpr, E_PAD: tl.constexpr, LOG_E: tl.constexpr, FP32_IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SCALE_BLOCK: tl.constexpr, FLATTEN: tl.constexpr, PDL: tl.constexpr,
):
    """:func:`_grouped_gemm_kernel` with TMA-fed operands, over a flattened (M tile, N tile) space.

    ``A`` is the flat contiguous ``[M, K]`` activations, ``b_desc`` covers the weights as
    ``[E*N, K]``. A tile that starts inside an expert's segment may run past its end. Its A
    descriptor ends at the segment's last row, so those rows are TMA's zero fill rather than the
    next expert's rows (contiguous layout) or the expert's unused rows past ``masked_m`` (masked
    layout). They are computed but never stored either way; zeros make the tensor cores draw less
    power, and under the H200's power cap the prefill GEMM1 alone ran 3.3 % (INT8) and 1.4 %
    (BF16) faster (docs/perf-notes.md, item 19). Weight rows past ``N`` within an expert are
    computed and never stored. K past the end is zero-filled, so no K masks are needed. Each
    program walks tiles ``pid, pid + NUM_PROGRAMS, ...`` of the ``GROUP_M``-swizzled tile space:
    one tile per program for the plain launch, several for the persistent one (``NUM_PROGRAMS`` =
    the SM count).

    The expert of an M tile is a binary search over ``TB`` (:func:`_write_tile_table`) with
    scalar loads, which keeps the per-tile lookup out of the expert-count-wide vectors of the
    pointer kernel.
    """
    dependent_start(PDL)
    _write_tile_table(SEG, TB, E, CAP, MASKED, E_PAD, BLOCK_M)
    pid = tl.program_id(0)
    total_tiles = tl.load(TB + E_PAD)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group_width = GROUP_M * num_pid_n
    num_tiles = total_tiles * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    offs_bm = tl.arange(0, BLOCK_M)
    offs_bn = tl.arange(0, BLOCK_N)

    for tile_id in tl.range(pid, num_tiles, NUM_PROGRAMS, flatten=FLATTEN):
        first_slot = (tile_id // group_width) * GROUP_M
        group_rows = tl.minimum(total_tiles - first_slot, GROUP_M)
        t = first_slot + (tile_id % group_width) % group_rows
        pid_n = (tile_id % group_width) // group_rows

        # The last expert whose first tile is <= t owns tile t (empty experts share their first
        # tile index with the next expert and are passed over).
        e = 0
        for i in tl.static_range(LOG_E):
            probe = e + (E_PAD >> (i + 1))
            e = tl.where(tl.load(TB + probe) <= t, probe, e)
        first_tile = tl.load(TB + e)
        if MASKED:
            start = e.to(tl.int64) * CAP
            length = tl.minimum(tl.load(SEG + e), CAP)
        else:
            lo = tl.load(SEG + e)
            start = lo.to(tl.int64)
            length = tl.load(SEG + e + 1) - lo
        m0 = (t - first_tile) * BLOCK_M
        row0 = (start + m0).to(tl.int32)
        n0 = pid_n * BLOCK_N
        brow0 = e * N + n0
        e64 = e.to(tl.int64)
        local = m0 + offs_bm
        m_ok = local < length
        rows = start + tl.where(m_ok, local, 0)
        # Bounded by A's rows too: offsets past them (malformed input) must not move TMA's reads.
        a_end = tl.minimum(start + length, M).to(tl.int32)
        a_desc = tl.make_tensor_descriptor(A, shape=[a_end, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])

        cols_b = tl.minimum(n0 + offs_bn, N - 1)
        acc = _zero_acc(BLOCK_M, BLOCK_N, False, MODE == 2)
        for kk in range(k_tiles):
            a = a_desc.load([row0, kk * BLOCK_K])
            b = b_desc.load([brow0, kk * BLOCK_K])
            acc = _k_step(
                a, b, acc, kk, AS, BS, rows, e64, n0, cols_b, stride_asm, stride_ask, stride_bse,
                stride_bsn, stride_bsk, MODE, FP32_IEEE, False, BLOCK_N, BLOCK_K, SCALE_BLOCK,
            )

        offs_n = n0 + offs_bn
        n_ok = offs_n < N
        if MODE == 1 or MODE == 2:
            cols = tl.where(n_ok, offs_n, 0)
            sa = tl.load(AS + rows * stride_asm)
            sb = tl.load(BS + e64 * stride_bse + cols * stride_bsn)
            res = acc.to(tl.float32) * (sa[:, None] * sb[None, :])
        else:
            res = acc
        c_ptrs = C + rows[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, res.to(C.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def grouped_gemm_contiguous(
    a: torch.Tensor,
    b: torch.Tensor,
    expert_offsets: torch.Tensor,
    *,
    mode: str,
    a_scale: torch.Tensor | None = None,
    b_scale: torch.Tensor | None = None,
    accumulator: str = "fp32",
    out_dtype: torch.dtype = torch.bfloat16,
    config: GemmConfig | dict | None = None,
    out: torch.Tensor | None = None,
    expected_m: int | None = None,
) -> torch.Tensor:
    """Grouped GEMM over the contiguous layout.

    Args:
        a: ``[M, K]`` rows grouped by expert (int8 for the int8 modes).
        b: ``[E, N, K]`` weights, out x in.
        expert_offsets: ``[E + 1]`` int32/int64; expert ``e`` owns rows ``offsets[e]:offsets[e+1]``
            (padding rows inside a segment are computed like any other row; rows outside every
            segment are not written).
        mode: ``"bf16"``, ``"int8_channel"`` or ``"int8_block"``.
        a_scale, b_scale: fp32 scales of the int8 modes (see the module doc).
        accumulator: ``"fp32"`` or, for ``"int8_channel"`` only, ``"int32"``.
        out_dtype: bf16, fp16 or fp32.
        config: tile config; looked up per (device, mode, N, K, rows per expert) when ``None``.
        out: optional ``[M, N]`` output buffer of ``out_dtype``.
        expected_m: typical rows per expert when ``a`` has spare rows past ``offsets[-1]``
            (segment sizes counted on the device); picks the config and sizes the grid instead
            of ``M / E``. Any segment sizes are still computed correctly.

    Returns:
        ``[M, N]`` of ``out_dtype``.
    """
    _check_2d_or_3d(a, 2, "a")
    _check_common(a, b, mode, a_scale, b_scale, accumulator, out_dtype)
    m_rows, k = a.shape
    e, n, _ = b.shape
    if not isinstance(expert_offsets, torch.Tensor) or expert_offsets.dtype not in (torch.int32, torch.int64):
        raise TypeError("expert_offsets must be an int32/int64 tensor")
    if tuple(expert_offsets.shape) != (e + 1,):
        raise ValueError(
            f"expert_offsets shape {tuple(expert_offsets.shape)} must be [E + 1] = [{e + 1}] for b {tuple(b.shape)}"
        )
    _check_scales_rows(mode, a_scale, m_rows, k)
    check_positive_int("expected_m", expected_m, optional=True)
    out = _output(out, (m_rows, n), out_dtype, a.device)
    if m_rows == 0 or e == 0 or n == 0:
        return out
    hint = m_rows / e if expected_m is None else min(expected_m, m_rows)
    cfg = _resolve_config(config, mode, accumulator, n, k, hint, a.device)
    # Every kernel walks its tiles with a stride of the grid, so any grid is correct; this one
    # covers the expected tiles (all of them when the row count is exact).
    grid_m = triton.cdiv(m_rows if expected_m is None else min(m_rows, e * hint), cfg.block_m) + e
    _launch(a, b, out, a_scale, b_scale, as_contiguous(expert_offsets), e, 1, grid_m, mode, accumulator, False, cfg)
    return out


def grouped_gemm_masked(
    a: torch.Tensor,
    b: torch.Tensor,
    masked_m: torch.Tensor,
    *,
    mode: str,
    a_scale: torch.Tensor | None = None,
    b_scale: torch.Tensor | None = None,
    accumulator: str = "fp32",
    out_dtype: torch.dtype = torch.bfloat16,
    expected_m: int | None = None,
    config: GemmConfig | dict | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped GEMM over the masked layout.

    Args:
        a: ``[E, cap, K]``; only the first ``masked_m[e]`` rows of expert ``e`` are read.
        b: ``[E, N, K]``.
        masked_m: ``[E]`` int32/int64 valid rows per expert (values above ``cap`` are clamped).
        expected_m: typical rows per expert; sizes the grid and picks the config (defaults to
            ``cap``). Any ``masked_m`` is still computed correctly when it is off.
        Other arguments as in :func:`grouped_gemm_contiguous`; scales are ``[E, cap, S]``.

    Returns:
        ``[E, cap, N]`` of ``out_dtype``; rows past ``masked_m`` are not written.
    """
    _check_2d_or_3d(a, 3, "a")
    _check_common(a, b, mode, a_scale, b_scale, accumulator, out_dtype)
    e, cap, k = a.shape
    n = b.shape[1]
    if e != b.shape[0]:
        raise ValueError(f"a has {e} experts but b has {b.shape[0]} (a {tuple(a.shape)}, b {tuple(b.shape)})")
    check_masked_m(masked_m, a.shape, "a")
    _check_scales_rows(mode, None if a_scale is None else a_scale.reshape(-1, a_scale.shape[-1]), e * cap, k)
    if a_scale is not None and a_scale.shape[:2] != a.shape[:2]:
        raise ValueError(f"a_scale shape {tuple(a_scale.shape)} must start with [E, cap] = {tuple(a.shape[:2])}")
    out = _output(out, (e, cap, n), out_dtype, a.device)
    if e == 0 or cap == 0 or n == 0:
        return out
    hint = cap if expected_m is None else max(1, min(int(expected_m), cap))
    cfg = _resolve_config(config, mode, accumulator, n, k, hint, a.device)
    grid_m = e * triton.cdiv(hint, cfg.block_m)
    flat = lambda t: None if t is None else t.reshape(e * cap, t.shape[-1])  # noqa: E731
    _launch(
        flat(a), b, out.view(e * cap, n), flat(a_scale), b_scale,
        as_contiguous(masked_m, torch.int32), e, cap, grid_m, mode, accumulator, True, cfg,
    )
    return out


def _launch(a, b, out, a_scale, b_scale, seg, e, cap, grid_m, mode, accumulator, masked, cfg: GemmConfig):
    a = as_contiguous(a)
    b = as_contiguous(b)
    k = a.shape[1]
    n = b.shape[1]
    unused = placeholder(a.device, torch.float32).view(1, 1, 1)  # never read without scales
    # The activation scales are read through both strides: MN-major ones (the CUTLASS kernels'
    # layout, in which a caller may hand a batch) need no transposing copy here.
    as_ = unused[0] if a_scale is None else _scale_rows(a_scale, a.shape[0])
    bs = unused if b_scale is None else as_contiguous(b_scale, torch.float32)
    block_k = cfg.block_k if mode != "int8_block" else min(cfg.block_k, SCALE_BLOCK)
    num_pid_n = triton.cdiv(n, cfg.block_n)
    common = dict(
        MODE=_MODE_IDS[(mode, accumulator)], MASKED=masked, E_PAD=max(16, next_pow2(e)),
        FP32_IEEE=a.dtype == torch.float32, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
        GROUP_M=cfg.group_m, SCALE_BLOCK=SCALE_BLOCK, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **dependent(a.device),
    )
    fallback = tma_fallback_reason(a, b, cfg) if cfg.tma else None
    if fallback is not None:
        _log_tma_fallback(fallback)
    if cfg.tma and fallback is None:
        from triton.tools.tensor_descriptor import TensorDescriptor

        # The weights' descriptor is built on the host: it travels by value in the kernel's
        # parameters (a CUtensorMap), so a captured CUDA graph replays it like a pointer argument.
        b_desc = TensorDescriptor.from_tensor(b.view(e * n, k), [cfg.block_n, block_k])
        programs = grid_m * num_pid_n
        if cfg.persistent:
            programs = min(programs, num_sms(a.device))
        table = torch.empty(common["E_PAD"] + 1, dtype=torch.int32, device=a.device)
        launch = functools.partial(
            _grouped_gemm_tma_kernel[(programs,)],
            a, b_desc, out, as_, bs, seg, table,
            a.shape[0], e, n, k, cap, programs,
            out.stride(0), as_.stride(0), as_.stride(1), bs.stride(0), bs.stride(1), bs.stride(2),
            LOG_E=common["E_PAD"].bit_length() - 1, FLATTEN=cfg.flatten,
            **common,
        )
        with_scratch_allocator(a.device, launch)
        return
    # The pointer kernel runs the same tiles; the TMA-only options have no meaning here (and a TMA
    # config never has SWAP_AB: GemmConfig.validate).
    _grouped_gemm_kernel[(grid_m * num_pid_n,)](
        a, b, out, as_, bs, seg,
        n, k, e, cap, grid_m,
        a.stride(0), b.stride(0), b.stride(1), out.stride(0),
        as_.stride(0), as_.stride(1), bs.stride(0), bs.stride(1), bs.stride(2),
        SWAP_AB=cfg.swap_ab, EVEN_K=k % block_k == 0, **common,
    )


def _scale_rows(a_scale: torch.Tensor, rows: int) -> torch.Tensor:
    """``a_scale`` as fp32 ``[rows, S]`` for the kernels, which read it through both strides:
    a view where one exists (row-major, or MN-major as
    :func:`~epmoe.kernels.common.mn_major_scales` makes it), copied only to change the dtype or
    where no 2-D view of those rows exists."""
    return a_scale.reshape(rows, -1).float()  # .float() is the tensor itself when it is fp32


def with_scratch_allocator(device: torch.device, launch):
    """Runs ``launch()`` with a Triton allocator that takes the device-side descriptors' global
    scratch from torch's caching allocator (on the current stream, so a CUDA graph capture keeps
    it in the graph's pool). It is set in a copy of the caller's context only: an allocator the
    caller set stays as it was.

    ``device`` is the operands' device; like every Triton launch in this package, the launch
    expects it to be the current device (Triton launches on the current device and stream).
    Torch's blocks are 512-byte aligned, more than the 128 bytes Triton asks for. The scratch is
    freed when the launch returns: torch hands a freed block only to later work on the same
    stream, which runs after the kernel or, launched as a programmatic dependent, waits for it
    before it reads or writes anything (:func:`~epmoe.kernels.pdl.dependent_start`)."""
    return contextvars.copy_context().run(_launch_with_allocator, device, launch)


def _launch_with_allocator(device, launch):
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device))
    return launch()


@functools.lru_cache(maxsize=None)
def _log_tma_fallback(reason: str) -> None:
    """Say once per reason that a TMA config runs the pointer kernel (the result is the same; only
    the speed measured for the config differs)."""
    logging.getLogger("epmoe").info("grouped GEMM config with TMA=True runs the pointer kernel: %s", reason)


def tma_fallback_reason(a: torch.Tensor, b: torch.Tensor, cfg: GemmConfig) -> str | None:
    """Why a call with config ``cfg`` runs the pointer kernel: ``None`` when the TMA kernel applies.

    ``a`` is the flat ``[rows, K]`` activation and ``b`` the ``[E, N, K]`` weights, both contiguous
    as the kernel sees them. TMA needs 16-byte aligned base addresses and row strides (``K`` times
    the element size a multiple of 16), int32 tile coordinates, and sm_90 or newer.
    """
    if not cfg.tma:
        return "the config has TMA off"
    if not _has_tensor_descriptors():
        return f"triton {triton.__version__} lacks host-side or device-side tensor descriptors"
    if a.device.type == "cuda":
        if devices.capability(a.device)[0] < 9:
            return "TMA needs compute capability 9.0 or newer"
    if not (a.is_contiguous() and b.is_contiguous()):
        return "operands are not contiguous"
    k = a.shape[1]
    if k == 0:
        return "K=0 (a tensor map needs non-empty dimensions)"
    if (k * a.element_size()) % 16:
        return f"K={k} x {a.element_size()} bytes is not a multiple of 16 (TMA row stride)"
    if a.data_ptr() % 16 or b.data_ptr() % 16:
        return "an operand's base address is not 16-byte aligned"
    if a.shape[0] >= 2**31 or b.shape[0] * b.shape[1] >= 2**31:
        return "tile coordinates exceed int32"
    return None


@functools.lru_cache(maxsize=None)
def _has_tensor_descriptors() -> bool:
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    # Host-side descriptors for the weights; device-side ones (and an allocator for their scratch)
    # for the activations.
    return all((hasattr(tl, "tensor_descriptor"), hasattr(tl, "make_tensor_descriptor"),
                hasattr(triton, "set_allocator")))


def num_sms(device: torch.device) -> int:
    """Programs of a persistent launch: the GPU's SM count (4 under the CPU interpreter, so that
    each program walks several tiles)."""
    if device.type != "cuda":
        return 4
    return devices.sm_count(device)


def _resolve_config(config, mode, accumulator, n, k, m_per_expert, device) -> GemmConfig:
    if config is None:
        return get_config(mode, n, k, m_per_expert, device=device, accumulator=accumulator)
    cfg = config if isinstance(config, GemmConfig) else GemmConfig.from_dict(config)
    cfg.validate()
    if mode == "int8_block" and SCALE_BLOCK % cfg.block_k:
        raise ValueError(f"config BLOCK_K={cfg.block_k}: int8_block needs a BLOCK_K dividing {SCALE_BLOCK}")
    return cfg


def _output(out, shape, out_dtype, device) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=out_dtype, device=device)
    if tuple(out.shape) != tuple(shape) or out.dtype != out_dtype or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {list(shape)} tensor of {out_dtype}; got "
            f"{tuple(out.shape)} {out.dtype} (contiguous={out.is_contiguous()})"
        )
    return out


def _check_2d_or_3d(a: torch.Tensor, dims: int, name: str) -> None:
    if not isinstance(a, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(a).__name__}")
    if a.dim() != dims:
        want = "[M, K]" if dims == 2 else "[E, cap, K]"
        raise ValueError(f"{name} must be {want}; got shape {tuple(a.shape)}")


def _check_common(a, b, mode, a_scale, b_scale, accumulator, out_dtype) -> None:
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; allowed: {list(MODES)}")
    if accumulator not in ACCUMULATORS:
        raise ValueError(f"accumulator={accumulator!r}; allowed: {list(ACCUMULATORS)}")
    if accumulator == "int32" and mode != "int8_channel":
        raise ValueError(f"accumulator='int32' applies to mode='int8_channel' only; got mode={mode!r}")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype={out_dtype}; allowed: {list(OUT_DTYPES)}")
    if not isinstance(b, torch.Tensor) or b.dim() != 3:
        raise ValueError(f"b must be [E, N, K]; got {tuple(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__}")
    if a.shape[-1] != b.shape[2]:
        raise ValueError(f"K mismatch: a {tuple(a.shape)} has K={a.shape[-1]}, b {tuple(b.shape)} has K={b.shape[2]}")
    if a.device != b.device:
        raise ValueError(f"a is on {a.device} but b is on {b.device}")
    e, n, k = b.shape
    if mode == "bf16":
        if a.dtype not in FLOAT_DTYPES or b.dtype != a.dtype:
            raise TypeError(f"mode='bf16' needs a and b of one dtype in bf16/fp16/fp32; got {a.dtype} and {b.dtype}")
        if a_scale is not None or b_scale is not None:
            raise ValueError("mode='bf16' takes no a_scale / b_scale")
        return
    if a.dtype != torch.int8 or b.dtype != torch.int8:
        raise TypeError(f"mode={mode!r} needs int8 a and b; got {a.dtype} and {b.dtype}")
    if a_scale is None or b_scale is None:
        raise ValueError(f"mode={mode!r} needs both a_scale and b_scale")
    if mode == "int8_channel":
        want_b = (e, n, 1)
    else:
        if k % SCALE_BLOCK:
            raise ValueError(f"mode='int8_block' needs K to be a multiple of {SCALE_BLOCK}; got K={k}")
        want_b = (e, -(-n // SCALE_BLOCK), k // SCALE_BLOCK)
    if tuple(b_scale.shape) != want_b:
        raise ValueError(f"b_scale shape {tuple(b_scale.shape)}; mode={mode!r} with b {tuple(b.shape)} needs {list(want_b)}")


def _check_scales_rows(mode: str, a_scale: torch.Tensor | None, rows: int, k: int) -> None:
    if mode == "bf16" or a_scale is None:
        return
    cols = 1 if mode == "int8_channel" else k // SCALE_BLOCK
    if tuple(a_scale.shape) != (rows, cols):
        raise ValueError(
            f"a_scale shape {tuple(a_scale.shape)}; mode={mode!r} with {rows} rows and K={k} needs [{rows}, {cols}]"
        )
