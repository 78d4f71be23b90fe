import math

import pytest
import torch

from epmoe.routing import select_experts


def reference_route(logits, top_k, scoring, n_group, topk_group, bias, renorm, scale):
    """Per-token float64 transcription of DeepSeek-V3's MoEGate (noaux_tc) and V2's group_limited_greedy."""
    ids, weights = [], []
    for row in logits.double().tolist():
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
            gscore = [sum(sorted(gr, reverse=True)[:2]) if bias is not None else max(gr) for gr in groups]
            keep = sorted(range(n_group), key=lambda g: -gscore[g])[:topk_group]
            allowed = {g * size + i for g in keep for i in range(size)}
        top = sorted(allowed, key=lambda i: -choice[i])[:top_k]
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
    ],
)
def test_bad_config(kwargs, match):
    args = dict(top_k=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        select_experts(torch.randn(3, 16), args.pop("top_k"), **args)


def test_bad_logits():
    with pytest.raises(ValueError, match="router_logits must be a floating-point"):
        select_experts(torch.ones(3, 16, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match=r"correction_bias must have shape \[16\]"):
        select_experts(torch.randn(3, 16), 2, correction_bias=torch.zeros(8))
