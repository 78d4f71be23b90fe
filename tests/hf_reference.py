"""Float64 references for the transformers integration tests (CPU and GPU).

Why not compare an enabled bf16 model's logits with the eager bf16 model's directly: both round to
bf16 in different places, so a later layer's router sees slightly different hidden states, and a
token whose top-k has a near tie (router logits are rounded to bf16 themselves) then picks another
expert. One such token moves a tiny model's logits by about 1e-2 relative, in eager bf16 against
float64 as much as in epmoe against eager. Routing is the model's, not the layer's, so the tests
hold it fixed: the experts modules are compared on identical inputs, and whole models with every
MoE block's ids and weights pinned to the float64 model's.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from epmoe.integrations import transformers as et

BF16_UNIT_ROUNDOFF = 2.0**-8
"""Largest relative error of one round-to-nearest to bfloat16 (8 significant bits)."""


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Normwise relative error of ``a`` against ``b``, in float64."""
    return float((a.double() - b.double()).norm() / b.double().norm())


def float64_experts(module, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum_j w_j * down(silu(gate(x)) * up(x))`` in float64 from an experts module's own weights
    (written here, not taken from transformers or epmoe)."""
    w13, w2 = et._fused_weights(module)
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for e in range(w13.shape[0]):
        tok, slot = torch.where(ids == e)
        if tok.numel() == 0:
            continue
        gate, up = (x[tok].double() @ w13[e].double().t()).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w2[e].double().t()
        out.index_add_(0, tok, y * weights[tok, slot, None].double())
    return out


def experts_inputs(model, ids: torch.Tensor):
    """``(logits, calls)`` of one forward of ``model`` on ``ids``: ``calls`` holds ``(experts
    module, (hidden_states, top_k_index, top_k_weights))`` of every experts call, in call order."""
    calls = []

    def keep(module, args):
        calls.append((module, tuple(a.detach().clone() for a in args)))

    hooks = [m.register_forward_pre_hook(keep) for m in model.modules() if et._is_interface_experts(m)]
    try:
        with torch.no_grad():
            logits = model(ids).logits
    finally:
        for h in hooks:
            h.remove()
    return logits, calls


def float64_model(model):
    """A float64 copy of ``model`` running transformers' eager experts (the reference model)."""
    ref = copy.deepcopy(model).to(torch.float64)
    ref.set_experts_implementation("eager")
    return ref


def pinned_logits(model, ids: torch.Tensor, routes: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """``model(ids).logits`` with the i-th experts call given ``routes[i]`` (ids, weights) instead
    of its router's: every MoE block routes as the model the routes came from."""
    it = iter(routes)

    def pin(module, args):
        topk_ids, topk_weights = next(it)
        return args[0], topk_ids, topk_weights.to(args[2].dtype)

    modules = [m for m in model.modules() if et._is_interface_experts(m)]
    hooks = [m.register_forward_pre_hook(pin) for m in modules]
    try:
        with torch.no_grad():
            out = model(ids).logits
    finally:
        for h in hooks:
            h.remove()
    if next(it, None) is not None:
        raise AssertionError("fewer experts calls than pinned routes")
    return out


def routes_of(model, ids: torch.Tensor) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """``(logits, [(top_k_index, top_k_weights) per experts call])`` of one forward."""
    logits, calls = experts_inputs(model, ids)
    return logits, [(args[1], args[2]) for _, args in calls]


EAGER_MARGIN = 1.25
"""How much further from float64 than transformers' eager bf16 experts an enabled bf16 model may be:
epmoe's bf16 paths round fewer times than the eager loop (which also rounds SiLU, the product, the
weighted rows and every ``index_add`` to bf16), so it must be no further, up to rounding luck."""


@torch.no_grad()
def check_against_float64(model, ids: torch.Tensor, quant: str, bound: float, enable) -> dict:
    """Compare a bf16 model's experts (eager, then after ``enable(model)``) with float64.

    Per experts call, on identical inputs: epmoe within ``bound`` of :func:`float64_experts`; for
    bf16 also eager within ``bound`` and epmoe within :data:`EAGER_MARGIN` of eager's distance.
    Whole model, routing pinned to the float64 model's: epmoe's logits within ``EAGER_MARGIN``
    times eager's distance from the float64 model's (bf16), or that distance plus ``bound``
    (quantized schemes). Returns the measured errors.
    """
    reference = float64_model(model)
    ref_logits, routes = routes_of(reference, ids)
    eager_logits = pinned_logits(model, ids, routes)
    _, calls = experts_inputs(model, ids)
    refs = [float64_experts(m, *args) for m, args in calls]
    eager = [m(*args) for m, args in calls]
    enable(model)
    errors = {"experts": [], "experts_eager": []}
    for i, ((module, args), ref, e) in enumerate(zip(calls, refs, eager)):
        err, err_eager = rel(module(*args), ref), rel(e, ref)
        errors["experts"].append(err)
        errors["experts_eager"].append(err_eager)
        assert err <= bound, f"{quant} experts call {i}: {err:.2e} from float64 > {bound:.2e}"
        if quant == "bf16":
            assert err_eager <= bound, f"eager experts call {i}: {err_eager:.2e} from float64 > {bound:.2e}"
            assert err <= EAGER_MARGIN * err_eager, f"call {i}: epmoe {err:.2e} vs eager {err_eager:.2e} from float64"
    err, err_eager = rel(pinned_logits(model, ids, routes), ref_logits), rel(eager_logits, ref_logits)
    allowed = EAGER_MARGIN * err_eager if quant == "bf16" else err_eager + bound
    assert err <= allowed, f"{quant} logits: {err:.2e} from float64 (eager bf16 {err_eager:.2e}; allowed {allowed:.2e})"
    errors.update(logits=err, logits_eager=err_eager)
    return errors
