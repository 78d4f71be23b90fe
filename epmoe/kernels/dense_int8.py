"""W8A8 INT8 dense GEMM for small batches (decode): the weight read once, by every SM.

At a few rows the dense linear is bound by reading its INT8 weight (half of BF16's bytes), and at
that size every extra launch, and every program that sits idle, shows. So the small-batch path
is one kernel that

* runs a 1-D grid over ``ceil(N / BLOCK_N) * ceil(M / BLOCK_M)`` output tiles whose N tiles are
  narrow enough (down to 16 weight rows) to put programs on every SM: a weight-read-bound GEMM
  needs all SMs pulling from HBM, and a wide tile on a narrow layer (``kv_a``: 576 outputs)
  would leave most of them idle (many row tiles run in groups, for L2 reuse of the weight);
* splits K across programs where even the narrowest tiles are too few (``split_k``): each
  program stores its share's raw sums and :func:`split_k_reduce_kernel` adds the shares in a
  fixed order and applies the epilogue (a second launch, no atomics: the int32 sum of the shares
  is the one-pass sum bit for bit, and no result depends on which program finished first);
* quantizes the activations itself when they are few (``fused``): each program reads its rows'
  float activations, forms the per-token scale from the row's amax (channel: one pass over the
  whole row before the GEMM loop) or each 1x128 group's scale on the fly (block), and turns every
  K tile into INT8 codes right before the MMA. Only the batch's rows are quantized (rounded up to
  a power of two); the MMA's 16-row minimum is met by repeating them, and the copies' outputs are
  never stored. Every program repeats this work, so the default rule chooses it only at a few
  rows (:func:`small_m_config`); otherwise a per-token / per-group quantizer runs first and the
  GEMM reads the codes;
* applies both scales (and the bias, in fp32) in the epilogue and stores the output dtype.

The codes are those of :mod:`epmoe.kernels.quantize` bit for bit (the same device functions:
``amax_bits``, ``scale_of``, ``codes``), so fused and unfused runs agree, and the int32
accumulator makes the K sum exact. The weight tiles are loaded with 16-byte accesses and
pipelined through shared memory (``cp.async``) when K and the row strides are multiples of 16,
which the JIT sees for every DeepSeek shape. The same kernel with unfused 64- or 128-row tiles
serves larger batches where a measured table (:mod:`epmoe.kernels.dense_configs`) says so.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import devices
from ..tensors import check_bool
from .common import next_pow2, placeholder
from .pdl import PREFETCH_ALIGN, dependent, gdc_launch_dependents, gdc_wait, prefetch_rows_l2
from .quantize import INT8_QMAX, amax_bits, codes, per_group_quant, per_token_quant_int8, scale_of

SCHEMES = ("int8_channel", "int8_block")
SCALE_BLOCK = 128
PROGRAMS_PER_SM = 2
SMEM_SHARED = 72 * 1024
"""Shared memory a program's pipeline stages may take when programs share SMs: three fit on an
H100/H200 SM (227 KB), so a grid of two or three programs per SM runs in one wave."""
REDUCE_BLOCK_M = 16
REDUCE_BLOCK_N = 128
"""Tile of the split-K reduction: a few partial rows per program, 512-byte row segments."""
FUSED_M_MAX = 8
"""Most rows the default rule quantizes inside the GEMM (channel scheme; see small_m_config)."""
MIN_SPLIT_COLS = 512
"""Fewest K columns a split-K share keeps: below it the partial sums' traffic and the reduction
cost more than the programs they add."""
SMEM_ALONE = 160 * 1024
"""... and when the grid has no more programs than SMs (narrow layers): each program has an SM
to itself, and deeper stages keep more of its weight bytes in flight."""
PREFETCH_CHOICES = (32 * 1024, 128 * 1024)
"""``SmallMConfig.prefetch`` values the sweep times on each cell's programmatic-dependent twin.
A previous kernel's tail of a few microseconds at ~4.3 TB/s moves ~10-20 MB, a third of the
H200's L2: 32 KB per program over 2-3 programs per SM asks ~10 MB (the whole slice of a narrow
split layer), 128 KB up to ~50 MB (the first K steps of the widest layers, or all of mid-size
ones), which may already evict itself; the table keeps whichever wins per cell."""


class SmallMConfig(NamedTuple):
    """Tiles, warps, pipeline stages, and whether the kernel quantizes the activations itself."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    fused: bool
    split_k: int = 1
    """Programs that share each output tile's K range (split-K); above 1 each writes its partial
    sums and :func:`split_k_reduce_kernel` adds them in a fixed order and applies the epilogue."""
    group_m: int = 1
    """Row tiles whose programs run next to each other for each N tile (tile order for L2 reuse
    when there are many row tiles); 1: all N tiles of a row tile, then the next row tile."""
    pdl: bool = False
    """Programmatic dependent launch (:func:`dense_int8_small_m` ignores it where
    :func:`~epmoe.kernels.pdl.pdl_enabled` is False: before compute capability 9.0, or
    ``EPMOE_PDL=0``): the GEMM (and the split-K reduction) launch while the kernel before them is
    still finishing, and wait for it (``griddepcontrol.wait``) before they read anything it may have
    written, so the launch latency of each kernel boundary overlaps the previous kernel; the
    quantizer of an unfused launch is a dependent launch too and lets the GEMM launch at once; a
    split GEMM lets its reduction launch as soon as it starts, an unsplit one the next kernel once
    every program has left its K loop (the reduction: once it starts). Only a launch's timing
    changes; every read of the activations still follows the previous kernel's writes.
    """
    prefetch: int = 0
    """With ``pdl``: weight bytes each program asks L2 for before it waits for the previous kernel
    (the first ``prefetch / block_n`` bytes, rounded down to 16, of each of its weight rows' K
    share; :func:`~epmoe.kernels.pdl.prefetch_rows_l2`), so its first K steps read L2 instead of
    HBM while the kernel before finishes. The weight is no kernel's output, so it may be read
    before the wait; the activations never are. A bound, not the whole slice: where the grid's
    weight is larger than L2, a whole-slice prefetch would evict itself. 0: none; skipped where
    the weight rows are not 16-byte aligned (the bulk prefetch's granularity)."""

    def to_dict(self) -> dict:
        return self._asdict()

    @classmethod
    def from_dict(cls, d: dict) -> "SmallMConfig":
        unknown = set(d) - set(cls._fields)
        missing = set(cls._fields) - set(cls._field_defaults) - set(d)
        if unknown or missing:
            raise ValueError(f"small-batch config {d}: unknown keys {sorted(unknown)}, missing {sorted(missing)}; "
                             f"allowed: {list(cls._fields)}")  # fmt: skip
        cfg = cls(**{k: (check_bool(f"small-batch config {k}", v) if k in ("fused", "pdl") else int(v))
                     for k, v in d.items()})  # fmt: skip
        cfg.validate()
        return cfg

    def validate(self) -> None:
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"small-batch config {name}={v}; allowed: a power of two")
        if self.split_k < 1 or self.group_m < 1:
            raise ValueError(f"small-batch config split_k={self.split_k}, group_m={self.group_m}; allowed: >= 1")
        if self.block_m < 16 or self.block_n < 16 or self.block_k < 32 or self.num_stages < 1:
            raise ValueError(f"small-batch config {self}: block_m, block_n >= 16, block_k >= 32, num_stages >= 1")
        if self.prefetch < 0 or (self.prefetch and not self.pdl):
            raise ValueError(f"small-batch config prefetch={self.prefetch}, pdl={self.pdl}; allowed: prefetch >= 0, "
                             "and above 0 only with pdl=True (the bytes a dependent launch fetches before it waits)")


@functools.lru_cache(maxsize=4096)
def small_m_config(
    m: int, n: int, k: int, scheme: str, sms: int, fused: bool | None = None, *,
    block_m: int | None = None, block_n: int | None = None, split_k: int | None = None,
    group_m: int | None = None,
) -> SmallMConfig:
    """The default launch for an ``[m, k] x [n, k]^T`` call on a GPU with ``sms`` SMs (cached:
    the forward looks it up on every call). ``fused``: ``None`` for the rule below, or forced
    (int8 activations with their scales take ``False``); ``block_m``, ``block_n``, ``split_k``:
    ``None`` for the rule, or forced (a sweep's candidates); K steps, stages and warps (8 for
    128-row tiles) are then sized by the rule for the choice.

    ``block_n`` is the widest of 128, 64, 32, 16 that still gives ``PROGRAMS_PER_SM`` programs
    per SM, and never narrower than half of ``block_m``. Where even the narrowest tiles leave
    fewer programs than that (narrow layers: ``kv_a``, ``q_a``), K is split: ``split_k`` doubles
    while the grid is short of ``PROGRAMS_PER_SM`` programs per SM and each share keeps at least
    ``MIN_SPLIT_COLS`` columns. ``fused`` (channel scheme, at most ``FUSED_M_MAX`` rows) holds
    when the activations a program reads from L2 are at most its weight bytes (an amax pass over
    the whole row plus its share, ``2 m (split_k + 1) <= block_n``, relaxed to twice the weight
    bytes when K is split); the block scheme's default is unfused. ``block_k`` starts at 512,
    or 1024 when programs have SMs to themselves (block scheme: the longest such multiple of 128
    dividing K), no longer than a split's share, and is halved until four stages fit the
    shared-memory budget; then as many stages as fit, 2 to 5 (8 when programs have SMs to
    themselves). A fused stage holds the batch's rows of bf16 activations, an unfused one
    ``block_m`` rows of codes. Past 8 row tiles the tiles run in groups of 8 row tiles
    (``group_m``) for L2 reuse of the weight.
    """
    if block_m is None:
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    m_tiles = -(-m // block_m)
    if block_n is None:
        # Every program reads its block_m rows of activations whole: tiles at least half as wide
        # as tall keep those reads within twice the program's weight bytes.
        block_n = max(16, block_m // 2)
        for cand in (128, 64, 32):
            if cand > block_n and -(-n // cand) * m_tiles >= PROGRAMS_PER_SM * sms:
                block_n = cand
                break
    programs = -(-n // block_n) * m_tiles
    split = 1 if split_k is None else split_k
    while split_k is None and programs * split < PROGRAMS_PER_SM * sms and k // (2 * split) >= MIN_SPLIT_COLS:
        split *= 2
    alone = programs * split <= sms
    budget, max_stages, max_k = (SMEM_ALONE, 8, 1024) if alone else (SMEM_SHARED, 5, 512)
    if block_m >= 128:
        budget, max_stages = SMEM_ALONE, 5  # one such program per SM fills it
    if fused is None:
        # Measured on the H200: the block scheme's fusion (a group scale per row and K block in
        # every program) lost to the quantizer kernel plus the GEMM at every batch; the channel
        # scheme's won at a few rows, and lost from 16 on, where every program's codes cost more
        # than the second launch.
        reads_ok = 2 * m * (split + 1) <= block_n * (2 if split > 1 else 1)
        fused = scheme == "int8_channel" and m <= FUSED_M_MAX and reads_ok
    x_rows = min(next_pow2(m), block_m) if fused else block_m
    share = -(-k // split)
    if scheme == "int8_block":
        fits = [b for b in (1024, 512, 256) if b <= max_k and k % b == 0 and b <= share]
        block_k = fits[0] if fits else SCALE_BLOCK
    else:
        block_k = max(32, min(max_k, next_pow2(k), max(128, 1 << (share.bit_length() - 1))))
    if fused and x_rows > 8:
        block_k = min(block_k, 256)  # the fp32 activation tile lives in registers
    x_bytes = 2 if fused else 1

    def stage(bk):
        return x_rows * bk * x_bytes + block_n * bk

    # Four stages in flight keep the HBM pipe full; shorter K steps before fewer stages.
    while block_k > 128 and 4 * stage(block_k) > budget:
        block_k //= 2
    stages = max(2, min(max_stages, budget // stage(block_k)))
    if group_m is None:
        group_m = 8 if m_tiles > 8 else 1
    return SmallMConfig(block_m, block_n, block_k, 8 if block_m >= 128 else 4, stages, fused, split, group_m)


def checked_launch(cfg: SmallMConfig, x: torch.Tensor, weight: torch.Tensor) -> SmallMConfig:
    """``cfg``, unfused where its fused 64-row kernel could give wrong outputs: with
    activation or weight rows not 16-byte aligned, the weight tile reaches shared memory through
    plain stores, and Triton (3.6) places the proxy fence the Hopper MMA needs after the barrier
    instead of before it in that kernel (docs/dense.md). Unfused gives the same codes (one more
    launch). The rule's and the dense plan's launches pass through here; a launch given to
    :func:`dense_int8_small_m` explicitly runs as given."""
    if not cfg.fused or cfg.block_m <= 32:
        return cfg
    aligned = (x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
               and (x.stride(0) * x.element_size()) % 16 == 0 and weight.stride(0) % 16 == 0)  # fmt: skip
    return cfg if aligned else cfg._replace(fused=False)


AMAX_LOADS = 8192
"""Activation elements the fused amax pass keeps in flight per program (64 per thread of 4
warps): enough loads to hide an L2 round trip, few enough registers not to spill."""


def amax_unroll(cfg: SmallMConfig, m: int) -> int:
    """K steps the fused channel kernel's amax pass loads at once (1 to 8)."""
    x_rows = min(next_pow2(m), cfg.block_m)
    return max(1, min(8, AMAX_LOADS // (x_rows * cfg.block_k)))


def split_plan(k: int, cfg: SmallMConfig) -> tuple[int, int]:
    """``(columns per split, splits launched)`` of ``cfg`` on a K of ``k``: each share a whole
    number of ``block_k`` steps, so fewer splits than asked may remain."""
    k_split = -(-(-(-k // cfg.split_k)) // cfg.block_k) * cfg.block_k
    return k_split, -(-k // k_split)


@triton.jit
def _rows_to_tile(t, BLOCK_M: tl.constexpr, X_ROWS: tl.constexpr, COLS: tl.constexpr):
    """``t [X_ROWS, COLS]`` repeated down to ``BLOCK_M`` rows (row ``i`` is ``t[i % X_ROWS]``): the
    MMA needs 16 rows, the quantization only the batch's few; the copies' outputs are never
    stored."""
    if X_ROWS == BLOCK_M:
        out = t
    else:
        out = tl.reshape(tl.broadcast_to(t[None, :, :], (BLOCK_M // X_ROWS, X_ROWS, COLS)), (BLOCK_M, COLS))
    return out


@triton.jit
def _rows_to_vec(t, BLOCK_M: tl.constexpr, X_ROWS: tl.constexpr):
    """:func:`_rows_to_tile` for a ``[X_ROWS]`` vector (per-row scales)."""
    if X_ROWS == BLOCK_M:
        out = t
    else:
        out = tl.reshape(tl.broadcast_to(t[None, :], (BLOCK_M // X_ROWS, X_ROWS)), (BLOCK_M,))
    return out


@triton.jit
def _tile(pid_n, pid_m, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Output columns of tile ``(pid_n, pid_m)`` and which exist, the same clamped into range,
    and its rows (which exist, clamped, int64). Clamped indices keep every load in bounds without
    a mask; the stores are masked."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    return offs_n, n_ok, tl.where(n_ok, offs_n, 0).to(tl.int64), m_ok, tl.where(m_ok, offs_m, 0).to(tl.int64)


@triton.jit
def _tile_order(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """``(pid_n, pid_m)`` of program ``pid`` of a 1-D grid over the output tiles: groups of
    ``GROUP_M`` row tiles, and within a group the row tiles of one N tile next to each other, so
    a weight tile is read while its neighbours' rows are still in L2 (the last group may be
    shorter)."""
    n_tiles = tl.cdiv(N, BLOCK_N)
    if GROUP_M == 1:
        pid_n = pid % n_tiles
        pid_m = pid // n_tiles
    else:
        width = GROUP_M * n_tiles
        first_m = (pid // width) * GROUP_M
        size = tl.minimum(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % size
        pid_n = (pid % width) // size
    return pid_n, pid_m


@triton.jit
def dense_small_m_kernel(
    X, XS, W, WS, BIAS, OUT, SA_OUT,
    M, N, K, K_SPLIT,
    stride_xm, stride_xsm, stride_wn, stride_wsn, stride_wsk, stride_om, stride_os,
    FUSED: tl.constexpr, BLOCK_SCALES: tl.constexpr, INT_ACC: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    X_ROWS: tl.constexpr, QMAX: tl.constexpr, SCALE: tl.constexpr, SPLIT: tl.constexpr,
    GROUP_M: tl.constexpr, AMAX_UNROLL: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
):
    """``OUT[m, n] = sa . sw . sum_k q[m, k] w[n, k] (+ bias[n])`` for one ``[BLOCK_M, BLOCK_N]``
    tile. ``FUSED``: ``X`` is float and quantized here (``XS`` unused), ``X_ROWS`` rows of it at
    a time (the batch's rows, a power of two up to ``BLOCK_M``); else ``X`` holds int8 codes and
    ``XS`` their scales (``[M, 1]`` channel, ``[M, K / SCALE]`` block).

    Each K step of ``BLOCK_K`` columns is ``BLOCK_K / SUB`` sub-steps of ``SUB`` columns: one
    for the channel scheme, one per ``SCALE``-column block for the block scheme (whose scales
    change every block), so a long step keeps many weight bytes in flight either way.

    ``SPLIT``: program ``(.., s)`` takes the K columns ``[s K_SPLIT, (s + 1) K_SPLIT)`` (a
    multiple of ``BLOCK_K``) and stores its raw sums (int32, or fp32 already scaled per K block)
    at ``OUT + s stride_os`` with no epilogue; with ``FUSED`` channel scales, the programs of the
    first N tile and K range also store the rows' scales at ``SA_OUT``, which the reduction needs.

    ``PDL``: launched as a programmatic dependent (:mod:`epmoe.kernels.pdl`). Before its wait for
    the previous kernel (which may have written ``X``) a program only finds its tile and, with
    ``PREFETCH`` (bytes per weight row; 0: none), asks L2 for the first ``PREFETCH`` bytes of each
    of the tile's weight rows in its K share (``W`` and ``stride_wn`` 16-byte aligned). With ``SPLIT`` the reduction (ours, short, waiting the same way) may launch at once;
    without, the next kernel may launch once every program has issued its last loads, so its
    programs and prefetches overlap this grid's tail, not its weight stream."""
    SUB: tl.constexpr = SCALE if BLOCK_SCALES else BLOCK_K
    GROUPS: tl.constexpr = BLOCK_K // SUB
    pid_n, pid_m = _tile_order(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    offs_n, n_ok, cols, m_ok, rows = _tile(pid_n, pid_m, M, N, BLOCK_M, BLOCK_N)
    if PREFETCH:
        k_lo = pid_k * K_SPLIT if SPLIT else 0
        share = tl.minimum(K_SPLIT, K - k_lo) if SPLIT else K
        prefetch_rows_l2(W + cols * stride_wn + k_lo, tl.minimum(share, PREFETCH), BLOCK_N)
    if PDL:
        gdc_wait()
        if SPLIT:
            gdc_launch_dependents()
    if not SPLIT:
        sw, bias = _column_operands(WS, BIAS, cols, stride_wsn, BLOCK_SCALES, HAS_BIAS)
    offs_s = tl.arange(0, SUB)
    w_base = W + cols[:, None] * stride_wn + offs_s[None, :]
    if FUSED:
        # Only the batch's rows are quantized: the codes' ALU work is per row, not per MMA row.
        offs_xm = pid_m * BLOCK_M + tl.arange(0, X_ROWS)
        xm_ok = offs_xm < M
        x_base = X + tl.where(xm_ok, offs_xm, 0).to(tl.int64)[:, None] * stride_xm + offs_s[None, :]
    else:
        x_base = X + rows[:, None] * stride_xm + offs_s[None, :]
    k_steps = tl.cdiv(K, BLOCK_K)

    if not BLOCK_SCALES:
        if FUSED:
            # The row's scale needs its whole amax before the first code: one pass over K, which
            # nothing pipelines. AMAX_UNROLL independent loads per iteration and an elementwise
            # running max (one reduction at the end, the bits' integer max as in amax_bits) keep
            # that many loads in flight instead of one L2 round trip per K step.
            run = tl.zeros([X_ROWS, SUB], dtype=tl.int32)
            for kk in range(0, k_steps, AMAX_UNROLL):
                for u in tl.static_range(AMAX_UNROLL):
                    k_ok = offs_s < K - (kk + u) * BLOCK_K
                    x = tl.load(x_base + (kk + u) * BLOCK_K, mask=xm_ok[:, None] & k_ok[None, :], other=0.0)
                    run = tl.maximum(run, x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF)
            amax = tl.max(run, 1)
            sa_x = scale_of(amax, QMAX)
            rcp = tl.div_rn(1.0, sa_x)
            finite = sa_x < float("inf")
            sa = _rows_to_vec(sa_x, BLOCK_M, X_ROWS)
        else:
            sa = tl.load(XS + rows * stride_xsm)
    else:
        sa = tl.zeros([BLOCK_M], dtype=tl.float32)  # never read: block sums are scaled per K block

    if INT_ACC:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SPLIT:
        step_lo = pid_k * (K_SPLIT // BLOCK_K)
        step_hi = tl.minimum(k_steps, step_lo + K_SPLIT // BLOCK_K)
    else:
        step_lo = 0
        step_hi = k_steps
    for kk in range(step_lo, step_hi):
        for g in tl.static_range(GROUPS):
            k0 = kk * BLOCK_K + g * SUB
            if EVEN_K:
                w = tl.load(w_base + k0)
            else:
                k_ok = offs_s < K - k0
                w = tl.load(w_base + k0, mask=k_ok[None, :], other=0)
            if FUSED:
                if EVEN_K:
                    x = tl.load(x_base + k0, mask=xm_ok[:, None], other=0.0).to(tl.float32)
                else:
                    x = tl.load(x_base + k0, mask=xm_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
                if BLOCK_SCALES:
                    sa_x = scale_of(amax_bits(x, 1), QMAX)
                    q = codes(x, sa_x[:, None], tl.div_rn(1.0, sa_x)[:, None], (sa_x < float("inf"))[:, None],
                              QMAX, False)  # fmt: skip
                    sa_k = _rows_to_vec(sa_x, BLOCK_M, X_ROWS)
                else:
                    q = codes(x, sa_x[:, None], rcp[:, None], finite[:, None], QMAX, False)
                a = _rows_to_tile(q, BLOCK_M, X_ROWS, SUB)
            else:
                if EVEN_K:
                    a = tl.load(x_base + k0)
                else:
                    a = tl.load(x_base + k0, mask=k_ok[None, :], other=0)
                if BLOCK_SCALES:
                    sa_k = tl.load(XS + rows * stride_xsm + k0 // SCALE)
            if BLOCK_SCALES:
                sw = tl.load(WS + (cols // SCALE) * stride_wsn + (k0 // SCALE) * stride_wsk)
                part = tl.dot(a, tl.trans(w), out_dtype=tl.int32).to(tl.float32)
                acc += part * (sa_k[:, None] * sw[None, :])
            elif INT_ACC:
                acc = tl.dot(a, tl.trans(w), acc, out_dtype=tl.int32)
            else:
                acc += tl.dot(a, tl.trans(w), out_dtype=tl.int32).to(tl.float32)

    if PDL and not SPLIT:
        gdc_launch_dependents()
    if SPLIT:
        if FUSED and not BLOCK_SCALES:
            if (pid_n == 0) & (pid_k == 0):
                tl.store(SA_OUT + offs_xm, sa_x, mask=xm_ok)
        p_ptrs = OUT + pid_k.to(tl.int64) * stride_os + rows[:, None] * stride_om + offs_n[None, :]
        tl.store(p_ptrs, acc, mask=m_ok[:, None] & n_ok[None, :])
    else:
        _epilogue(acc, sa, sw, bias, OUT, rows, offs_n, m_ok, n_ok, stride_om, BLOCK_SCALES, HAS_BIAS)


@triton.jit
def _column_operands(WS, BIAS, cols, stride_wsn, BLOCK_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The epilogue's per-column operands, fp32: the weight scales (channel; zeros for the block
    scheme, whose sums are scaled per K block) and the bias (zeros without). Loaded before the
    K loop: each program's columns are cold in L2, and a load in the epilogue would add a DRAM
    round trip to every program's tail, where the kernel's time ends."""
    if BLOCK_SCALES:
        sw = tl.zeros(cols.shape, dtype=tl.float32)
    else:
        sw = tl.load(WS + cols * stride_wsn)
    if HAS_BIAS:
        bias = tl.load(BIAS + cols).to(tl.float32)
    else:
        bias = tl.zeros(cols.shape, dtype=tl.float32)
    return sw, bias


@triton.jit
def _epilogue(acc, sa, sw, bias, OUT, rows, offs_n, m_ok, n_ok, stride_om,
              BLOCK_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Both scales (channel; block sums are scaled per K block already), the bias in fp32 (see
    :func:`_column_operands`), one rounding to the output dtype: shared by the one-pass kernel
    and the split-K reduction, so a split int32 sum gives the unsplit output bit for bit."""
    if BLOCK_SCALES:
        res = acc
    else:
        res = acc.to(tl.float32) * (sa[:, None] * sw[None, :])
    if HAS_BIAS:
        res += bias[None, :]
    o_ptrs = OUT + rows[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, res.to(OUT.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def split_k_reduce_kernel(
    P, SA, WS, BIAS, OUT,
    M, N, SPLITS,
    stride_ps, stride_pm, stride_sam, stride_wsn, stride_om,
    BLOCK_SCALES: tl.constexpr, INT_ACC: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    """``OUT = epilogue(sum_s P[s])``: the split-K partial sums added in split order (int32: exact;
    fp32: one fixed order, so a result does not depend on which program finished first).
    ``PDL``: wait for the GEMM that wrote ``P`` before anything else, then let the next kernel
    launch (and prefetch) while this short one runs."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    offs_n, n_ok, cols, m_ok, rows = _tile(tl.program_id(0), tl.program_id(1), M, N, BLOCK_M, BLOCK_N)
    sw, bias = _column_operands(WS, BIAS, cols, stride_wsn, BLOCK_SCALES, HAS_BIAS)
    p_ptrs = P + rows[:, None] * stride_pm + cols[None, :]
    if INT_ACC:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(0, SPLITS):
        acc += tl.load(p_ptrs + s * stride_ps)
    if BLOCK_SCALES:
        sa = tl.zeros([BLOCK_M], dtype=tl.float32)  # never read: block sums are scaled per K block
    else:
        sa = tl.load(SA + rows * stride_sam)
    _epilogue(acc, sa, sw, bias, OUT, rows, offs_n, m_ok, n_ok, stride_om, BLOCK_SCALES, HAS_BIAS)


def _sms(device: torch.device) -> int:
    return devices.sm_count(device) if device.type == "cuda" else 4


def dense_int8_small_m(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    scheme: str,
    accumulator: str,
    x_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: SmallMConfig | None = None,
) -> torch.Tensor:
    """``x [M, K] @ dequant(weight [N, K])^T (+ bias)`` with W8A8 INT8 codes, for small ``M``.

    Args:
        x: ``[M, K]`` float activations (quantized per token / per 1x128 group, fused into the
            GEMM when :func:`small_m_config` says so, else by the quantizer kernel first), or
            int8 codes with ``x_scale``.
        weight: ``[N, K]`` int8, rows contiguous.
        weight_scale: fp32 ``[N, 1]`` (``int8_channel``) or ``[ceil(N/128), K/128]`` (``int8_block``).
        bias: optional float ``[N]`` added in fp32 before the output rounding.
        scheme: ``"int8_channel"`` or ``"int8_block"`` (K a multiple of 128).
        accumulator: ``"int32"`` (channel only: exact K sum) or ``"fp32"`` (each K step's exact
            int32 product added in fp32).
        x_scale: fp32 scales of int8 ``x``: ``[M, 1]`` or ``[M, K/128]``.
        out_dtype: the output dtype (default: ``x``'s; bf16 for int8 ``x``).
        config: a launch, run as given (default :func:`small_m_config` through
            :func:`checked_launch`, unfused for int8 ``x``); a fused config with int8 ``x`` is
            refused.

    Returns:
        ``[M, N]`` of ``out_dtype``.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme={scheme!r}; allowed: {list(SCHEMES)}")
    if accumulator == "int32" and scheme != "int8_channel":
        raise ValueError("accumulator='int32' needs scheme='int8_channel' (block scales apply per K step)")
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or weight.dtype != torch.int8 or weight.stride(1) != 1:
        raise ValueError(f"weight: {weight.dtype} {tuple(weight.shape)}; allowed: int8 [N, {k}] with contiguous rows")
    block = scheme == "int8_block"
    if block and k % SCALE_BLOCK:
        raise ValueError(f"x: K={k}; scheme='int8_block' needs a multiple of {SCALE_BLOCK}")
    quantized = x.dtype == torch.int8
    if quantized != (x_scale is not None):
        raise ValueError("x_scale goes with int8 x (codes), and only with them")
    if out_dtype is None:
        out_dtype = torch.bfloat16 if quantized else x.dtype
    cfg = config
    if cfg is None:
        cfg = checked_launch(small_m_config(m, n, k, scheme, _sms(x.device), False if quantized else None), x, weight)
    if cfg.fused and quantized:
        raise ValueError("config.fused=True quantizes float x; int8 x with x_scale needs fused=False")
    if block and (cfg.block_k % SCALE_BLOCK or k % cfg.block_k):
        raise ValueError(
            f"config.block_k={cfg.block_k}; scheme='int8_block' needs a multiple of {SCALE_BLOCK} dividing K={k}"
        )
    if x.stride(-1) != 1:
        x = x.contiguous()
    device = x.device
    out = torch.empty((m, n), dtype=out_dtype, device=device)
    if m == 0 or n == 0:
        return out
    launch = dependent(device, cfg.pdl)  # PDL and the launch option, together
    pdl = launch["PDL"]
    if not cfg.fused and not quantized:
        # The quantizer launched as a dependent too, so that this GEMM can launch (and prefetch)
        # during it: it lets its dependents launch before it waits.
        x, x_scale = per_group_quant(x, SCALE_BLOCK, torch.int8, pdl=pdl) if block else per_token_quant_int8(x, pdl=pdl)
    unused = placeholder(device, torch.float32)  # never read: its flag is off
    xs = unused if x_scale is None else x_scale
    ws = weight_scale
    b = unused if bias is None else bias
    int_acc = accumulator == "int32"
    k_split, splits = split_plan(k, cfg)
    split = splits > 1
    if split:
        part = torch.empty((splits, m, n), dtype=torch.int32 if int_acc else torch.float32, device=device)
        sa_out = torch.empty((m, 1), dtype=torch.float32, device=device) if cfg.fused and not block else unused
    else:
        part, sa_out = out, unused
    # Plain integer arithmetic: triton.cdiv is a constexpr_function whose call costs host time.
    grid = (-(-n // cfg.block_n) * -(-m // cfg.block_m), splits)
    prefetch = 0  # bytes per weight row
    if pdl and cfg.prefetch and weight.data_ptr() % PREFETCH_ALIGN == 0 and weight.stride(0) % PREFETCH_ALIGN == 0:
        prefetch = (cfg.prefetch // cfg.block_n) // PREFETCH_ALIGN * PREFETCH_ALIGN
    dense_small_m_kernel[grid](
        x, xs, weight, ws, b, part, sa_out,
        m, n, k, k_split,
        x.stride(0), xs.stride(0), weight.stride(0), ws.stride(0), ws.stride(1), part.stride(-2),
        part.stride(0) if split else 0,
        FUSED=cfg.fused, BLOCK_SCALES=block, INT_ACC=int_acc, HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0,
        X_ROWS=min(next_pow2(m), cfg.block_m) if cfg.fused else cfg.block_m,  # unused unless fused: one compile
        QMAX=INT8_QMAX, SCALE=SCALE_BLOCK, SPLIT=split, GROUP_M=cfg.group_m,
        AMAX_UNROLL=amax_unroll(cfg, m) if cfg.fused and not block else 1, PREFETCH=prefetch,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch,
    )  # fmt: skip
    if split:
        sa = sa_out if cfg.fused else xs
        bm = min(next_pow2(m), REDUCE_BLOCK_M)
        split_k_reduce_kernel[(-(-n // REDUCE_BLOCK_N), -(-m // bm))](
            part, sa, ws, b, out, m, n, splits,
            part.stride(0), part.stride(1), sa.stride(0), ws.stride(0), out.stride(0),
            BLOCK_SCALES=block, INT_ACC=int_acc, HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=REDUCE_BLOCK_N,
            **launch,
        )  # fmt: skip
    return out
