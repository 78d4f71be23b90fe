"""Router logits to top-k expert ids and weights in one Triton kernel.

The same routing as the torch path of :func:`epmoe.routing.select_experts` (softmax or sigmoid
scores in fp32, a correction bias that steers the choice only, DeepSeek's grouped top-k, the
weights taken from the unbiased scores, renormalized, scaled), in one launch where the torch path
takes about seven (softmax, topk's two sort kernels, gather, sum, clamp, divide) — in a CUDA-graphed
decode step each of those is a launch gap of its own.

Each program holds ``BLOCK_T`` whole rows ``[BLOCK_T, E]`` in registers. A small tile (up to
:data:`RANK_PAIRS_PER_THREAD` of its ``[BLOCK_T, E, E]`` pairs per thread: a decode step's token
or few on several warps, :func:`by_rank`) selects by rank:
every expert's rank is the number of experts ahead of it (a larger score, or an equal one and a
lower index), counted in one compare of all pairs, and slot ``j`` takes the expert of rank ``j``
(the groups likewise: a group's two best experts are its ranks 0 and 1, the kept groups those of
rank below ``topk_group``). That is a few independent reductions where the arg-max rounds below
are a chain of ``top_k`` (and ``topk_group``, and two per group) reductions, each waiting for the
one before, which is what a one-token launch spends its time on. Larger tiles select by repeated
arg-max: ``top_k`` rounds over the experts (and, for grouped routing, ``topk_group`` rounds over the
group scores before them), each round taking the largest remaining value. Both give the same ids
and the same weights before the renormalizing sum (bit for bit), but for a row with fewer than
``top_k`` finite choice scores (a ``-inf`` bias), where the rounds may take an expert twice.

Ties: among equal values the lower index wins (expert id, or group index for the groups), and the
ids come out in descending order of their choice score, equal scores in ascending id order. This is
the order a stable descending sort gives; torch.topk documents no order among ties. A NaN choice
score ranks above every number (as torch.topk ranks NaN), so a row with NaN logits still gets
``top_k`` distinct ids in ``[0, E)`` (its weights are NaN, as on the torch path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import INTERPRETER_TILE, next_pow2

GPU_TILE = 1024
"""Elements of a program's ``[BLOCK_T, E]`` tile on a GPU: rows are stacked up to this many."""
RANK_PAIRS_PER_THREAD = 128
"""Most expert pairs per thread of a tile that selects by rank (:func:`by_rank`): one token of 128
experts on 4 warps (the decode prep's common case). Past that the compare costs more issue slots
than the arg-max rounds' barriers it saves (one warp's rounds have no barrier at all), and the
pairs crowd the registers."""


def by_rank(block_t: int, e_pad: int, num_warps: int) -> bool:
    """Whether :func:`route_rows` selects a ``[block_t, e_pad]`` tile on ``num_warps`` warps by rank
    (its ``RANK``), else by arg-max rounds."""
    return block_t * e_pad * e_pad <= RANK_PAIRS_PER_THREAD * 32 * num_warps


def launch_shape(tokens: int, e_pad: int, device: torch.device) -> tuple[int, int]:
    """``(BLOCK_T, num_warps)`` of :func:`fused_topk` for ``tokens`` rows of ``e_pad`` lanes."""
    tile = INTERPRETER_TILE if device.type == "cpu" else GPU_TILE
    block_t = max(1, min(next_pow2(tokens), tile // e_pad))
    return block_t, max(1, min(4, block_t * e_pad // 256))


@triton.jit
def _ranks(v, idx, peers=None):
    """Rank of each ``v [B, N]`` among its peers (``peers [N, N]``: which ``m`` compete with
    ``n``; ``None``: all): how many peers have a larger value, or the same value and a lower
    ``idx [N]`` (the arg-max rounds' order: ties to the lower index)."""
    mine = v[:, :, None]
    other = v[:, None, :]
    ahead = (other > mine) | ((other == mine) & (idx[None, None, :] < idx[None, :, None]))
    if peers is not None:
        ahead = ahead & peers[None, :, :]
    return tl.sum(ahead.to(tl.int32), 2)


@triton.jit
def _add_pairs(a, b, c, d):
    return a + c, b + d


@triton.jit
def _of_rank(rank, idx, value, r):
    """``([B, R], [B, R])``: the ``idx [N]`` and ``value [B, N]`` of the one entry of each row whose
    ``rank`` is ``r [R]`` (0 where none is); sums of one value and zeros, so bit for bit that value,
    both in one reduction (one exchange across warps, not two)."""
    hit = rank[:, :, None] == r[None, None, :]
    return tl.reduce((tl.where(hit, idx[None, :, None], 0), tl.where(hit, value[:, :, None], 0.0)), 1, _add_pairs)


@triton.jit
def route_rows(
    LOGITS, BIAS, rows, row_ok, stride_l, scaling,
    E: tl.constexpr, E_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
    GROUPED: tl.constexpr, GROUPS: tl.constexpr, G_PAD: tl.constexpr, PER_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr, RANK: tl.constexpr,
):  # fmt: skip
    """``(ids [BLOCK_T, K_PAD] int32, weights [BLOCK_T, K_PAD] fp32)`` of the logits rows ``rows``
    (``row_ok``: which exist): the routing of :func:`fused_topk`, shared with the decode prep
    (:mod:`epmoe.kernels.prep`). Slots ``>= K`` and rows past the batch hold zeros. ``RANK``:
    select by rank (:func:`by_rank` says when), else by arg-max rounds."""
    e = tl.arange(0, E_PAD)
    col_ok = (e < E)[None, :]
    x = tl.load(LOGITS + rows[:, None].to(tl.int64) * stride_l + e[None, :], mask=row_ok[:, None] & col_ok,
                other=float("-inf")).to(tl.float32)  # fmt: skip
    x = tl.where(row_ok[:, None], x, 0.0)  # rows past T: finite, so their (unstored) math raises nothing
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        p = tl.exp(x - tl.max(x, 1)[:, None])
        p = tl.where(col_ok, p, 0.0)
        scores = p / tl.sum(p, 1)[:, None]
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(BIAS + e, mask=e < E, other=0.0).to(tl.float32)[None, :]
    # NaN ranks first (torch.topk's order); the padding columns never rank.
    choice = tl.where(choice != choice, float("inf"), choice)
    choice = tl.where(col_ok, choice, float("-inf"))

    if GROUPED and RANK:
        # The groups' ranks instead of their rounds below: each expert ranked inside its group
        # (the padding columns form groups of their own past GROUPS), the group score from its
        # ranks 0 and 1 (the rounds' best and the best of the rest), the groups ranked by it.
        group = e // PER_GROUP
        g = tl.arange(0, G_PAD)
        in_g = (group[None, :] == g[:, None])[None, :, :]  # [1, G_PAD, E_PAD]
        g_rank = _ranks(choice, e, group[:, None] == group[None, :])[:, None, :]
        g_score = tl.max(tl.where(in_g & (g_rank == 0), choice[:, None, :], float("-inf")), 2)
        if HAS_BIAS and PER_GROUP > 1:
            g_score += tl.max(tl.where(in_g & (g_rank == 1), choice[:, None, :], float("-inf")), 2)
        kept = (_ranks(g_score, g) < TOPK_GROUP) & (g < GROUPS)[None, :]
        allowed = tl.max(tl.where(in_g & kept[:, :, None], 1, 0), 1)
        choice = tl.where(allowed > 0, choice, float("-inf"))
    elif GROUPED:
        # Group score: the sum of the group's two best choice scores with a bias (DeepSeek-V3),
        # its best without (DeepSeek-V2); then the TOPK_GROUP best groups stay.
        group = e // PER_GROUP
        g_idx = tl.arange(0, G_PAD)[None, :]
        g_score = tl.full([BLOCK_T, G_PAD], float("-inf"), tl.float32)
        for g in range(GROUPS):
            in_g = (group == g)[None, :]
            v = tl.where(in_g, choice, float("-inf"))
            if HAS_BIAS and PER_GROUP > 1:
                best, first = tl.max(v, 1, return_indices=True, return_indices_tie_break_left=True)
                best = best + tl.max(tl.where(e[None, :] == first[:, None], float("-inf"), v), 1)
            else:
                best = tl.max(v, 1)
            g_score = tl.where(g_idx == g, best[:, None], g_score)
        g_left = (g_idx < GROUPS) & row_ok[:, None]  # [BLOCK_T, G_PAD], as the loop keeps it
        kept = tl.zeros([BLOCK_T, G_PAD], dtype=tl.int32)
        for _ in range(TOPK_GROUP):
            pick = tl.max(tl.where(g_left, g_score, float("-inf")), 1, return_indices=True,
                          return_indices_tie_break_left=True)[1]  # fmt: skip
            hit = g_idx == pick[:, None]
            kept = tl.where(hit, 1, kept)
            g_left = g_left & (g_idx != pick[:, None])
        allowed = tl.zeros([BLOCK_T, E_PAD], dtype=tl.int32)
        for g in range(GROUPS):
            kept_g = tl.sum(tl.where(g_idx == g, kept, 0), 1)
            allowed = tl.where((group == g)[None, :], kept_g[:, None], allowed)
        choice = tl.where(allowed > 0, choice, float("-inf"))

    slot = tl.arange(0, K_PAD)[None, :]
    if RANK:
        # Slot j takes the expert of rank j: the one the j-th arg-max round picks. The padding
        # columns (-inf, past every index) and the experts of dropped groups (-inf) rank last.
        # The weight is the chosen expert's unbiased score, as in the rounds (where a NaN score,
        # ranked as +inf, keeps its NaN).
        rank = _ranks(choice, e)
        r = tl.arange(0, K_PAD)
        take = (slot < K) & row_ok[:, None]
        ids, weights = _of_rank(rank, e, scores, r)
        ids = tl.where(take, ids, 0)
        weights = tl.where(take, weights, 0.0)
    else:
        left = col_ok & row_ok[:, None]
        ids = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
        weights = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
        for j in range(K):
            # One reduction for the best value and its lowest index (ties: the lower id).
            top, pick = tl.max(tl.where(left, choice, float("-inf")), 1, return_indices=True,
                               return_indices_tie_break_left=True)  # fmt: skip
            if HAS_BIAS:
                w = tl.sum(tl.where(e[None, :] == pick[:, None], scores, 0.0), 1)  # the unbiased score
            else:
                # The choice is the score itself, but where a NaN score was ranked as +inf.
                w = tl.where(top == float("inf"), float("nan"), top)
            ids = tl.where(slot == j, pick[:, None], ids)
            weights = tl.where(slot == j, w[:, None], weights)
            left = left & (e[None, :] != pick[:, None])
    if RENORM:
        total = tl.sum(weights, 1)  # the padding slots hold zeros
        # The torch path's clamp(min=1e-20); a NaN total stays NaN.
        weights = weights / tl.where(total < 1e-20, 1e-20, total)[:, None]
    return ids, weights * scaling


@triton.jit
def _fused_topk_kernel(
    LOGITS, BIAS, IDS, WEIGHTS, T, stride_l, scaling,
    E: tl.constexpr, E_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
    GROUPED: tl.constexpr, GROUPS: tl.constexpr, G_PAD: tl.constexpr, PER_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr, RANK: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    ids, weights = route_rows(
        LOGITS, BIAS, rows, row_ok, stride_l, scaling, E, E_PAD, K, K_PAD, BLOCK_T, SIGMOID, HAS_BIAS, RENORM,
        GROUPED, GROUPS, G_PAD, PER_GROUP, TOPK_GROUP, RANK,
    )  # fmt: skip
    slot = tl.arange(0, K_PAD)[None, :]
    out = rows[:, None].to(tl.int64) * K + slot
    mask = row_ok[:, None] & (slot < K)
    tl.store(IDS + out, ids.to(tl.int64), mask=mask)
    tl.store(WEIGHTS + out, weights, mask=mask)


def fused_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring_func: str, num_expert_group: int | None,
    topk_group: int | None, correction_bias: torch.Tensor | None, routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`epmoe.routing.select_experts` in one launch (arguments as there, already checked by
    it: ``scoring_func`` ``"softmax"`` or ``"sigmoid"``, groups dividing ``E``, ``top_k`` within the
    kept groups). Ties as the module says.

    Returns:
        ``topk_ids [T, k]`` int64 and ``topk_weights [T, k]`` fp32.
    """
    t, e = router_logits.shape
    device = router_logits.device
    ids = torch.empty((t, top_k), dtype=torch.int64, device=device)
    weights = torch.empty((t, top_k), dtype=torch.float32, device=device)
    if t == 0:
        return ids, weights
    logits, bias, consts = route_operands(router_logits, top_k, renormalize, scoring_func, num_expert_group,
                                          topk_group, correction_bias)  # fmt: skip
    e_pad = consts["E_PAD"]
    block_t, warps = launch_shape(t, e_pad, device)
    _fused_topk_kernel[(triton.cdiv(t, block_t),)](
        logits, bias, ids, weights, t, logits.stride(0), float(routed_scaling_factor), BLOCK_T=block_t,
        RANK=by_rank(block_t, e_pad, warps), num_warps=warps, **consts,
    )  # fmt: skip
    return ids, weights


def route_operands(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring_func: str, num_expert_group: int | None,
    topk_group: int | None, correction_bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, dict]:  # fmt: skip
    """``(logits, bias, constexprs)`` of a :func:`route_rows` launch: the logits with unit column
    stride, the bias as contiguous fp32 (the logits stand in for a missing one: never read), and
    every routing constexpr but ``BLOCK_T``."""
    e = router_logits.shape[1]
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    grouped = num_expert_group is not None and topk_group < num_expert_group
    groups = num_expert_group if grouped else 1
    bias = correction_bias
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    consts = dict(
        E=e, E_PAD=next_pow2(e), K=top_k, K_PAD=next_pow2(top_k), SIGMOID=scoring_func == "sigmoid",
        HAS_BIAS=bias is not None, RENORM=bool(renormalize), GROUPED=grouped, GROUPS=groups,
        G_PAD=next_pow2(groups), PER_GROUP=e // groups, TOPK_GROUP=topk_group if grouped else 1,
    )  # fmt: skip
    return logits, logits if bias is None else bias, consts
