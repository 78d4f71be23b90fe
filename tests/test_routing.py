import math
import warnings

import pytest
import torch

from epmoe.routing import select_experts

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def reference_route(logits, top_k, scoring, n_group, topk_group, bias, renorm, scale, near_ties=None):
    """Per-token float64 transcription of DeepSeek-V3's MoEGate (noaux_tc) and V2's group_limited_greedy.

    Ties go to the lower index (Python's sort is stable): the fused kernel's rule. ``near_ties``:
    a list that receives, per token, whether a decision rested on two different values closer than
    1e-6 (which fp32 may order either way), so a caller can leave such tokens out; equal values
    are exact ties, decided by index, unless they are group scores summed from different values."""
    ids, weights = [], []
    for row in logits.double().tolist():
        near = False
        if scoring == "softmax":
            m = max(row)
            ex = [math.exp(v - m) for v in row]
            scores = [v / sum(ex) for v in ex]
        else:
            scores = [1 / (1 + math.exp(-v)) for v in row]
        choice = [s + (bias[i] if bias is not None else 0.0) for i, s in enumerate(scores)]
        allowed = set(range(len(row)))
        if n_group:
            size = len(row) // n_group
            groups = [choice[g * size : (g + 1) * size] for g in range(n_group)]
            best = [tuple(sorted(gr, reverse=True)[: 2 if bias is not None else 1]) for gr in groups]
            gscore = [sum(b) for b in best]
            ranked = sorted(range(n_group), key=lambda g: -gscore[g])
            keep = ranked[:topk_group]
            if topk_group < n_group:
                a, b = ranked[topk_group - 1], ranked[topk_group]
                near |= best[a] != best[b] and abs(gscore[a] - gscore[b]) < 1e-6
            allowed = {g * size + i for g in keep for i in range(size)}
        ranked = sorted(allowed, key=lambda i: -choice[i])
        top = ranked[:top_k]
        pairs = zip(ranked[: top_k + 1], ranked[1 : top_k + 1])
        near |= any(0 < choice[a] - choice[b] < 1e-6 for a, b in pairs)
        if near_ties is not None:
            near_ties.append(near)
        w = [scores[i] for i in top]
        if renorm:
            w = [v / sum(w) for v in w]
        ids.append(top)
        weights.append([v * scale for v in w])
    return torch.tensor(ids), torch.tensor(weights, dtype=torch.float64)


CASES = [
    # (E, top_k, scoring, n_group, topk_group, bias, renorm, scale)
    (16, 4, "softmax", None, None, False, False, 1.0),
    (16, 4, "softmax", None, None, False, True, 1.0),
    (32, 8, "sigmoid", 4, 2, True, True, 2.5),  # DeepSeek-V3 (256 experts, 8 groups, 4 kept) scaled down
    (32, 6, "softmax", 8, 3, False, False, 16.0),  # DeepSeek-V2 group-limited greedy
    (64, 8, "sigmoid", 8, 4, True, True, 2.5),
]


@pytest.mark.parametrize("case", CASES)
def test_matches_independent_implementation(case):
    e, k, scoring, ng, tg, use_bias, renorm, scale = case
    torch.manual_seed(hash(case) % 1000)
    logits = torch.randn(37, e) * 2
    bias = torch.randn(e) * 0.1 if use_bias else None
    ids, w = select_experts(
        logits, k, renormalize=renorm, scoring_func=scoring, num_expert_group=ng,
        topk_group=tg, correction_bias=bias, routed_scaling_factor=scale,
    )  # fmt: skip
    ref_ids, ref_w = reference_route(
        logits, k, scoring, ng, tg, bias.tolist() if bias is not None else None, renorm, scale
    )
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == (37, k)
    # Order within a token is not part of the contract: compare as sorted (id, weight) pairs.
    order, ref_order = ids.argsort(1), ref_ids.argsort(1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(w.gather(1, order).double(), ref_w.gather(1, ref_order), rtol=1e-5, atol=1e-6)


def test_bias_changes_choice_not_weights():
    logits = torch.zeros(1, 8)
    logits[0, :4] = torch.tensor([4.0, 3.0, 2.0, 1.0])
    bias = torch.zeros(8)
    bias[7] = 10.0  # forces expert 7 into the top-2 although its score is lowest
    ids, w = select_experts(logits, 2, renormalize=False, scoring_func="sigmoid", correction_bias=bias)
    assert sorted(ids[0].tolist()) == [0, 7]
    assert w[0, ids[0].tolist().index(7)].item() == pytest.approx(0.5)  # sigmoid(0), unbiased


def test_empty_batch():
    ids, w = select_experts(torch.zeros(0, 16), 4, num_expert_group=4, topk_group=2, scoring_func="sigmoid")
    assert ids.shape == (0, 4) and w.shape == (0, 4)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(top_k=0), r"top_k=0 must be an integer in \[1, num_experts=16\]"),
        (dict(scoring_func="relu"), r"scoring_func='relu'; allowed: \['softmax', 'sigmoid'\]"),
        (dict(num_expert_group=3, topk_group=1), "num_expert_group=3 must be >= 1 and divide num_experts=16"),
        (dict(num_expert_group=4), "must be given together"),
        (dict(num_expert_group=4, topk_group=5), r"topk_group=5 must be in \[1, num_expert_group=4\]"),
        (dict(top_k=8, num_expert_group=4, topk_group=1), "hold fewer than top_k=8 experts"),
        (dict(num_expert_group=2.0, topk_group=1), r"^num_expert_group=2.0; allowed: None or a positive integer$"),
        (dict(num_expert_group="2", topk_group=1), r"^num_expert_group='2'; allowed: None or a positive integer$"),
        (dict(num_expert_group=2, topk_group=True), r"^topk_group=True; allowed: None or a positive integer$"),
        (dict(routed_scaling_factor=float("nan")), r"^routed_scaling_factor=nan must be a finite number > 0$"),
        (dict(routed_scaling_factor=0), r"^routed_scaling_factor=0 must be a finite number > 0$"),
    ],
)
def test_bad_config(kwargs, match):
    args = dict(top_k=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        select_experts(torch.randn(3, 16), args.pop("top_k"), **args)


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "triton"])
def test_numpy_integers_are_integers(kernel):
    import numpy as np

    logits = torch.randn(3, 16, device=DEVICE)
    got = select_experts(logits, np.int64(4), num_expert_group=np.int32(4), topk_group=np.int64(2), kernel=kernel)
    want = select_experts(logits, 4, num_expert_group=4, topk_group=2, kernel=kernel)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_bad_logits():
    with pytest.raises(TypeError, match="^router_logits must be a torch.Tensor; got list$"):
        select_experts([[0.0] * 16], 2)
    with pytest.raises(TypeError, match="^correction_bias must be a torch.Tensor or None; got list$"):
        select_experts(torch.randn(3, 16), 2, correction_bias=[0.0] * 16)
    with pytest.raises(ValueError, match="router_logits must be a floating-point"):
        select_experts(torch.ones(3, 16, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match=r"correction_bias must have shape \[16\]"):
        select_experts(torch.randn(3, 16), 2, correction_bias=torch.zeros(8))
    with pytest.raises(ValueError, match="correction_bias is on meta but router_logits on cpu"):
        select_experts(torch.randn(3, 16), 2, correction_bias=torch.zeros(16, device="meta"))


# ----------------------------------------------------------------------------- the fused kernel
MODES = {
    # name: (scoring, grouped, bias, renormalize, routed_scaling_factor)
    "softmax_renormalized": ("softmax", False, False, True, 1.0),
    "softmax": ("softmax", False, False, False, 1.0),
    "softmax_grouped": ("softmax", True, False, False, 16.0),  # DeepSeek-V2 group-limited greedy
    "sigmoid_bias_grouped": ("sigmoid", True, True, True, 2.5),  # DeepSeek-V3 noaux_tc
    "sigmoid_bias": ("sigmoid", False, True, False, 1.0),
    "softmax_bias_grouped": ("softmax", True, True, True, 1.0),
}
SIZES = {8: (2, 4, 2), 64: (6, 8, 3), 96: (6, 4, 2), 256: (8, 8, 4)}
"""E: (top_k, num_expert_group, topk_group); 96 is padded to 128 lanes, its groups of 24 too."""


def _tied_inputs(t, e, seed):
    """Logits on a grid of quarter steps (offset from 0, so no two sigmoid scores sum to exactly
    1) and a bias of five levels: many experts of a token share a logit (exact ties, in fp32 as in
    fp64) and different values stay at least 6e-5 apart."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(-12, 13, (t, e), generator=g) / 4 + 0.3
    bias = torch.randint(-2, 3, (e,), generator=g) * 0.0371
    return logits, bias


def _fused_against_reference(logits, bias, k, mode, groups, topk_group):
    scoring, grouped, use_bias, renorm, scale = MODES[mode]
    ng, tg = (groups, topk_group) if grouped else (None, None)
    bias = bias if use_bias else None
    ids, w = select_experts(logits, k, renormalize=renorm, scoring_func=scoring, num_expert_group=ng,
                            topk_group=tg, correction_bias=bias, routed_scaling_factor=scale, kernel=True)  # fmt: skip
    ids, w = ids.cpu(), w.cpu()
    near = []
    ref_ids, ref_w = reference_route(logits, k, scoring, ng, tg, None if bias is None else bias.tolist(), renorm,
                                     scale, near)  # fmt: skip
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == w.shape == (logits.shape[0], k)
    sure = ~torch.tensor(near, dtype=torch.bool)
    # The order is part of the kernel's contract: by choice score, ties by id.
    assert torch.equal(ids[sure], ref_ids[sure])
    torch.testing.assert_close(w[sure].double(), ref_w[sure], rtol=1e-5, atol=1e-7)
    return sure


@pytest.mark.parametrize("t", [1, 7, 300])
@pytest.mark.parametrize("e", sorted(SIZES))
@pytest.mark.parametrize("mode", list(MODES))
def test_fused_kernel_matches_float64_reference_with_ties(mode, e, t):
    k, groups, topk_group = SIZES[e]
    logits, bias = _tied_inputs(t, e, seed=t * 1000 + e)
    sure = _fused_against_reference(logits, bias, k, mode, groups, topk_group)
    assert sure.float().mean() >= 0.9  # near ties set aside are rare
    if e >= 64:  # the tokens do rank tied experts: the tie rule was exercised
        ranked = logits.sort(1, descending=True).values
        assert (ranked[:, : k - 1] == ranked[:, 1:k]).any()


# 256 experts are left out: no launch selects a 256-lane tile by rank (one token on the decode
# prep's warps is 4x past RANK_PAIRS_PER_THREAD), so there is no rank path to compare there; the
# float64 reference test above covers their rounds.
@pytest.mark.parametrize("e", [8, 64, 96])
@pytest.mark.parametrize("mode", list(MODES))
def test_fused_kernel_selects_alike_by_rank_and_by_rounds(mode, e, monkeypatch):
    if e > 64:
        # A routing launch of one token of 128 lanes has one warp and takes the rounds; the decode
        # prep ranks that tile on its PREP_WARPS. Rank as the prep would, so the two paths differ.
        from epmoe.kernels import prep, topk

        plain = topk.by_rank
        monkeypatch.setattr(topk, "by_rank", lambda b, e_pad, w: plain(b, e_pad, max(w, prep.PREP_WARPS)))
    rank_against_rounds(mode, e, "cpu")


def rank_against_rounds(mode: str, e: int, device) -> None:
    """A token or four a launch select by rank where the kernel takes that path
    (:func:`topk.by_rank`), a batch of 300 by arg-max rounds: on tied scores and a NaN row, the
    same ids and the same weights, row by row (bit for bit in the interpreter; on a GPU the
    renormalizing sum may add in another order). At least one of them is ranked."""
    from epmoe.kernels import topk

    k, groups, topk_group = SIZES[e]
    logits, bias = _tied_inputs(300, e, seed=e + 17)
    logits[9, 3] = float("nan")
    logits, bias = logits.to(device), bias.to(device)
    scoring, grouped, use_bias, renorm, scale = MODES[mode]
    kw = dict(renormalize=renorm, scoring_func=scoring, num_expert_group=groups if grouped else None,
              topk_group=topk_group if grouped else None, correction_bias=bias if use_bias else None,
              routed_scaling_factor=scale, kernel=True)  # fmt: skip
    e_pad = 1 << (e - 1).bit_length()

    def ranked(rows):
        block_t, warps = topk.launch_shape(rows, e_pad, logits.device)
        return topk.by_rank(block_t, e_pad, warps)

    assert not ranked(300), f"{e} experts on {device}: 300 rows are ranked too, no rounds to compare with"
    tol = dict(rtol=0, atol=0) if device == "cpu" else dict(rtol=1e-6, atol=1e-9)
    checked = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the interpreter's numpy meets the NaN
        want_ids, want_w = select_experts(logits, k, **kw)
        for r0, n in [(0, 1), (9, 1), (20, 4)]:
            if not ranked(n):
                continue
            ids, w = select_experts(logits[r0 : r0 + n], k, **kw)
            assert torch.equal(ids, want_ids[r0 : r0 + n])
            torch.testing.assert_close(w, want_w[r0 : r0 + n], equal_nan=True, **tol)
            checked += 1
    assert checked, f"{e} experts on {device}: no launch of 1 or 4 rows is ranked, nothing was compared"
    assert torch.isnan(want_w[9]).any()


@pytest.mark.parametrize("mode", list(MODES))
def test_fused_kernel_on_random_logits(mode):
    """Untied float logits (bf16 in, as a model's router may give them)."""
    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(33, 64, generator=g) * 2).to(torch.bfloat16)
    _fused_against_reference(logits.float(), torch.randn(64, generator=g) * 0.1, *SIZES[64][:1], mode, *SIZES[64][1:])
    ids, _ = select_experts(logits, 6, kernel=True)
    assert torch.equal(ids, select_experts(logits.float(), 6, kernel=True)[0])


def test_fused_kernel_breaks_full_ties_by_index():
    """Every expert equal: the first k ids in order; grouped, the first groups win."""
    logits = torch.zeros(3, 16)
    ids, w = select_experts(logits, 5, kernel=True)
    assert ids.tolist() == [[0, 1, 2, 3, 4]] * 3 and torch.allclose(w, torch.full((3, 5), 0.2))
    bias = torch.zeros(16)
    ids, _ = select_experts(logits, 5, scoring_func="sigmoid", num_expert_group=4, topk_group=2,
                            correction_bias=bias, kernel=True)  # fmt: skip
    assert ids.tolist() == [[0, 1, 2, 3, 4]] * 3
    logits[:, :4] = -1.0  # group 0 worst now: groups 1 and 2 are kept
    ids, _ = select_experts(logits, 5, scoring_func="sigmoid", num_expert_group=4, topk_group=2,
                            correction_bias=bias, kernel=True)  # fmt: skip
    assert ids.tolist() == [[4, 5, 6, 7, 8]] * 3


def test_fused_kernel_nan_row_stays_in_its_row():
    """A NaN logit (validate=False lets it through) still gives k distinct ids in range; the row's
    weights are NaN (as on the torch path), the other rows are untouched."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 32, generator=g)
    bad = logits.clone()
    bad[2, 5] = float("nan")
    for kw in (dict(), dict(scoring_func="sigmoid", num_expert_group=4, topk_group=2, correction_bias=torch.zeros(32))):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the interpreter's numpy meets the NaN
            ids, w = select_experts(bad, 4, kernel=True, **kw)
        want_ids, want_w = select_experts(logits, 4, kernel=True, **kw)
        assert ((ids >= 0) & (ids < 32)).all() and all(len(set(r)) == 4 for r in ids.tolist())
        rows = [0, 1, 3]
        assert torch.equal(ids[rows], want_ids[rows]) and torch.equal(w[rows], want_w[rows])
        assert torch.isnan(w[2]).any()


def test_fused_kernel_refuses_sizes_it_does_not_take():
    from epmoe.routing import FUSED_MAX_EXPERTS, FUSED_MAX_TOP_K

    with pytest.raises(ValueError, match=f"kernel=True: num_experts={FUSED_MAX_EXPERTS + 1} is over"):
        select_experts(torch.zeros(1, FUSED_MAX_EXPERTS + 1), 2, kernel=True)
    with pytest.raises(ValueError, match=f"kernel=True: top_k={FUSED_MAX_TOP_K + 1} is over"):
        select_experts(torch.zeros(1, 64), FUSED_MAX_TOP_K + 1, kernel=True)


def test_fused_kernel_empty_batch_and_strided_logits():
    ids, w = select_experts(torch.zeros(0, 16), 4, kernel=True)
    assert ids.shape == w.shape == (0, 4)
    wide = torch.randn(5, 40, generator=torch.Generator().manual_seed(1))
    ids, w = select_experts(wide[:, :32], 4, kernel=True)  # rows 40 apart
    want_ids, want_w = select_experts(wide[:, :32].contiguous(), 4, kernel=True)
    assert torch.equal(ids, want_ids) and torch.equal(w, want_w)
