"""Checks of what ``DeepEPMoELayer.forward`` is given: hidden states, router logits or explicit
top-k ids and weights. Shape, dtype and device checks cost no host sync; value checks (finite
logits, expert-id range, repeated experts) cost one, and are skipped during CUDA-graph capture and
while ``torch.compile`` traces the forward (a compiled graph holds no host read)."""

from __future__ import annotations

import torch

from .tensors import check_tensor, host_reads_allowed

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""Dtypes of ``hidden_states`` (and of unquantized weights) the layer takes."""


def check_forward_inputs(
    hidden_states,
    router_logits,
    topk_ids,
    topk_weights,
    *,
    hidden_size: int,
    num_experts: int,
    top_k: int,
    device: torch.device,
) -> None:
    """Raise ``ValueError`` / ``TypeError`` naming the argument unless the forward inputs fit a
    layer of ``hidden_size``, ``num_experts`` and ``top_k`` on ``device``.

    Args:
        hidden_states: ``[T, hidden_size]`` in one of :data:`INPUT_DTYPES`.
        router_logits: ``[T, num_experts]`` floating point, or ``None`` when ``topk_ids`` and
            ``topk_weights`` are given instead.
        topk_ids: ``[T, top_k]`` int32 / int64 global expert ids, or ``None``.
        topk_weights: ``[T, top_k]`` floating point, or ``None``.
    """
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 2:
        raise ValueError(
            f"hidden_states must be a [T, hidden_size={hidden_size}] tensor; got "
            f"{tuple(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else type(hidden_states).__name__}"
        )
    routing = (("router_logits", router_logits), ("topk_ids", topk_ids), ("topk_weights", topk_weights))
    for name, tensor in routing:
        check_tensor(name, tensor, optional=True)
    t, h = hidden_states.shape
    if h != hidden_size:
        raise ValueError(f"hidden_states has hidden size {h}; the layer has hidden_size={hidden_size}")
    if hidden_states.dtype not in INPUT_DTYPES:
        raise TypeError(f"hidden_states has dtype {hidden_states.dtype}; allowed: {list(INPUT_DTYPES)}")
    if hidden_states.device != device:
        raise ValueError(f"hidden_states is on {hidden_states.device}; the layer is on {device}")
    for name, tensor in routing:
        if tensor is not None and tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device}; the layer is on {device}")
    if (router_logits is None) == (topk_ids is None and topk_weights is None):
        raise ValueError("pass either router_logits or both topk_ids and topk_weights")
    if router_logits is not None:
        if tuple(router_logits.shape) != (t, num_experts):
            raise ValueError(
                f"router_logits has shape {tuple(router_logits.shape)}; expected [{t}, {num_experts}]"
            )
        if not router_logits.is_floating_point():
            raise TypeError(f"router_logits has dtype {router_logits.dtype}; expected floating point")
        return
    if topk_ids is None or topk_weights is None:
        raise ValueError("topk_ids and topk_weights must be given together")
    for name, tensor in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if tuple(tensor.shape) != (t, top_k):
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}; expected [{t}, {top_k}]")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids has dtype {topk_ids.dtype}; allowed: int32, int64")
    if not topk_weights.is_floating_point():
        raise TypeError(f"topk_weights has dtype {topk_weights.dtype}; expected floating point")


def check_forward_values(
    router_logits,
    topk_ids,
    topk_weights,
    *,
    num_experts: int,
    device: torch.device,
    dispatch_name: str,
    distinct_experts: bool,
) -> None:
    """Value checks that need a host sync (one for all of them); skipped while a CUDA graph is
    being captured on ``device`` and while dynamo traces (:func:`~epmoe.tensors.host_reads_allowed`).
    Call after :func:`check_forward_inputs`.

    Args:
        num_experts: ids must lie in ``[0, num_experts)``, or be ``-1`` (a padded slot).
        dispatch_name: the dispatcher, named in the repeated-expert error.
        distinct_experts: the dispatcher needs distinct experts per token (fixed-capacity slabs).
    """
    if not host_reads_allowed(device):
        return
    check_logits = router_logits is not None and router_logits.numel() > 0
    check_ids = topk_ids is not None and topk_ids.numel() > 0
    check_dups = check_ids and distinct_experts and topk_ids.shape[1] > 1
    # Every statistic goes into one tensor, read back once: one host sync, not one per check.
    stats = []
    if check_logits:
        stats.append(torch.isfinite(router_logits).all().long())
    if check_ids:  # the weights come with the ids
        stats += [topk_ids.min().long(), topk_ids.max().long(), torch.isfinite(topk_weights).all().long()]
    if check_dups:
        # Fixed-capacity dispatch sizes each expert's slab for one row per token and rank:
        # a token naming an expert twice would overflow it. The first such row, or T if none.
        s = topk_ids.sort(dim=1).values
        rows = torch.arange(s.shape[0], device=s.device)
        dup = ((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any(dim=1)  # -1 slots may repeat
        stats.append(torch.where(dup, rows, s.shape[0]).min())
    if not stats:
        return
    values = iter(torch.stack(stats).tolist())  # all on one device (check_forward_inputs)
    if check_logits and not next(values):
        raise ValueError("router_logits contain NaN or Inf; routing on them is undefined")
    if check_ids:
        lo, hi, weights_finite = next(values), next(values), next(values)
        if lo < -1 or hi >= num_experts:
            bad = lo if lo < -1 else hi
            raise ValueError(
                f"topk_ids contains expert id {bad}, outside [0, {num_experts}) (-1 is allowed: a "
                "padded slot that selects no expert)"
            )
        if not weights_finite:
            raise ValueError("topk_weights contain NaN or Inf; the weighted sum over experts is undefined")
    if check_dups:
        t = next(values)
        if t < topk_ids.shape[0]:
            raise ValueError(
                f"topk_ids row {t} names an expert more than once ({topk_ids[t].tolist()}); "
                f"dispatch={dispatch_name!r} needs distinct experts per token"
            )
