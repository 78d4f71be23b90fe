"""Top-k routing with DeepSeek-V3 semantics (the router seam).

``select_experts`` maps router logits ``[T, E]`` to ``topk_ids [T, k]`` (global expert ids, int64)
and ``topk_weights [T, k]`` (fp32):

1. scores = softmax(logits) or sigmoid(logits), in fp32;
2. choice = scores + e_score_correction_bias (when given) — the bias steers *which* experts are
   chosen, never the weights;
3. grouped top-k (when ``num_expert_group`` is set): experts form ``num_expert_group`` equal
   groups; a group's score is the sum of its top-2 choice scores when a bias is given (DeepSeek-V3)
   and its max choice score otherwise (DeepSeek-V2); experts outside the ``topk_group`` best groups
   are excluded;
4. the ``top_k`` best choice scores give the ids; the weights are the *unbiased* scores there;
5. ``renormalize`` divides the weights by their sum; then they are multiplied by
   ``routed_scaling_factor``.

On CUDA, routes of up to :data:`FUSED_MAX_EXPERTS` experts and :data:`FUSED_MAX_TOP_K` slots run as
one Triton kernel (:mod:`epmoe.kernels.topk`; about seven launches fewer per step than the torch
path, which a CUDA-graphed decode step pays in launch gaps); everything else takes the torch path
(``kernel=`` of :func:`select_experts` forces either).

Ties: the kernel gives the lower expert id (and, choosing groups, the lower group) the better
rank, and returns the ids by descending choice score, equal scores by ascending id. The torch path
breaks them as ``torch.topk`` does, which documents no order (lowest index first on CPU in
practice).
"""

from __future__ import annotations

import math
import numbers

import torch

from . import ops
from .tensors import check_tensor, is_integer

SCORING_FUNCS = ("softmax", "sigmoid")

FUSED_MAX_EXPERTS = 1024
"""Most experts the fused routing kernel takes: it holds each row of logits in registers."""
FUSED_MAX_TOP_K = 32
"""Most slots per token the fused routing kernel takes: it selects them one arg-max at a time."""


def fused_refusal(num_experts: int, top_k: int) -> str | None:
    """Why the fused routing kernel does not take routes of these sizes (``None`` when it does)."""
    if num_experts > FUSED_MAX_EXPERTS:
        return f"num_experts={num_experts} is over the fused routing kernel's {FUSED_MAX_EXPERTS}"
    if top_k > FUSED_MAX_TOP_K:
        return f"top_k={top_k} is over the fused routing kernel's {FUSED_MAX_TOP_K}"
    return None


def check_routing_config(
    num_experts: int,
    top_k: int,
    scoring_func: str,
    num_expert_group: int | None,
    topk_group: int | None,
    routed_scaling_factor: float = 1.0,
) -> tuple[int, int | None, int | None]:
    """``(top_k, num_expert_group, topk_group)`` as Python ints (the Triton kernels take their
    sizes as constants, which NumPy integers are not); raises ``ValueError`` naming the argument
    when the routing options do not fit together (integers may be NumPy's; ``bool`` is not one)."""
    if not is_integer(num_experts) or num_experts < 1:
        raise ValueError(f"num_experts={num_experts!r} must be a positive integer")
    if not is_integer(top_k) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k!r} must be an integer in [1, num_experts={num_experts}]")
    if (
        not isinstance(routed_scaling_factor, numbers.Real)
        or isinstance(routed_scaling_factor, bool)
        or not math.isfinite(routed_scaling_factor)
        or routed_scaling_factor <= 0
    ):
        raise ValueError(f"routed_scaling_factor={routed_scaling_factor!r} must be a finite number > 0")
    for name, value in (("num_expert_group", num_expert_group), ("topk_group", topk_group)):
        if value is not None and not is_integer(value):
            raise ValueError(f"{name}={value!r}; allowed: None or a positive integer")
    if scoring_func not in SCORING_FUNCS:
        raise ValueError(f"scoring_func={scoring_func!r}; allowed: {list(SCORING_FUNCS)}")
    if (num_expert_group is None) != (topk_group is None):
        raise ValueError(
            f"num_expert_group={num_expert_group!r} and topk_group={topk_group!r} must be given "
            "together (both None disables grouped routing)"
        )
    if num_expert_group is not None:
        if num_expert_group < 1 or num_experts % num_expert_group:
            raise ValueError(
                f"num_expert_group={num_expert_group} must be >= 1 and divide "
                f"num_experts={num_experts}"
            )
        if not 1 <= topk_group <= num_expert_group:
            raise ValueError(
                f"topk_group={topk_group} must be in [1, num_expert_group={num_expert_group}]"
            )
        per_group = num_experts // num_expert_group
        if topk_group * per_group < top_k:
            raise ValueError(
                f"topk_group={topk_group} groups of {per_group} experts hold fewer than "
                f"top_k={top_k} experts"
            )
        return int(top_k), int(num_expert_group), int(topk_group)
    return int(top_k), None, None


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool = True,
    scoring_func: str = "softmax",
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    kernel: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route tokens to experts.

    Args:
        router_logits: ``[T, E]`` floating point.
        top_k: experts per token.
        renormalize: divide the chosen weights by their sum.
        scoring_func: ``"softmax"`` or ``"sigmoid"``.
        num_expert_group, topk_group: grouped top-k (both or neither).
        correction_bias: ``[E]`` added to the scores for the choice only.
        routed_scaling_factor: multiplies the final weights.
        kernel: ``None`` runs the fused Triton kernel on CUDA where :func:`fused_refusal` allows
            it and the torch path elsewhere; ``True`` forces the kernel (``ValueError`` naming the
            size it cannot take; on CPU it runs under Triton's interpreter, as the tests do),
            ``False`` the torch path.

    Returns:
        ``topk_ids [T, k]`` int64 and ``topk_weights [T, k]`` fp32.
    """
    check_tensor("router_logits", router_logits)
    check_tensor("correction_bias", correction_bias, optional=True)
    if router_logits.dim() != 2 or not router_logits.is_floating_point():
        raise ValueError(
            "router_logits must be a floating-point [T, num_experts] tensor; got "
            f"shape {tuple(router_logits.shape)} dtype {router_logits.dtype}"
        )
    t, e = router_logits.shape
    top_k, num_expert_group, topk_group = check_routing_config(
        e, top_k, scoring_func, num_expert_group, topk_group, routed_scaling_factor
    )
    if correction_bias is not None and correction_bias.shape != (e,):
        raise ValueError(f"correction_bias must have shape [{e}]; got {tuple(correction_bias.shape)}")
    if correction_bias is not None and correction_bias.device != router_logits.device:
        raise ValueError(
            f"correction_bias is on {correction_bias.device} but router_logits on {router_logits.device}"
        )
    if kernel is None:
        kernel = router_logits.is_cuda and fused_refusal(e, top_k) is None
    elif kernel and (why := fused_refusal(e, top_k)):
        raise ValueError(f"kernel=True: {why}")
    if kernel:
        return ops.fused_topk(
            router_logits, top_k, renormalize=renormalize, scoring_func=scoring_func,
            num_expert_group=num_expert_group, topk_group=topk_group, correction_bias=correction_bias,
            routed_scaling_factor=routed_scaling_factor,
        )  # fmt: skip
    logits = router_logits.float()
    scores = torch.softmax(logits, dim=-1) if scoring_func == "softmax" else torch.sigmoid(logits)
    choice = scores
    if correction_bias is not None:
        choice = scores + correction_bias.float().unsqueeze(0)
    if num_expert_group is not None and topk_group < num_expert_group:
        grouped = choice.view(t, num_expert_group, e // num_expert_group)
        if correction_bias is not None:
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        else:
            group_scores = grouped.amax(dim=-1)
        keep = group_scores.topk(topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(t, e)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    topk_ids = choice.topk(top_k, dim=-1).indices
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True).clamp(min=1e-20)
    if routed_scaling_factor != 1.0:
        topk_weights = topk_weights * routed_scaling_factor
    return topk_ids.to(torch.int64), topk_weights.float()
