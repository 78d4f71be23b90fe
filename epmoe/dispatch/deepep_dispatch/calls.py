"""The device work of DeepEP's send and combine, as functions of tensors and plain values.

These are the bodies of the ``epmoe::deepep_*`` custom ops (:mod:`epmoe.ops`), which make the
DeepEP dispatchers traceable by ``torch.compile``: a ``deep_ep.Buffer`` is an opaque Python object
and its handles are tuples of tensors and ints, neither of which a custom op can take. So the
buffer travels as the int id of its owner (:func:`~.buffer.buffer_by_id`, a weak registry the
owner leaves when it is closed) and a handle as its tensors, the ints being rebuilt from the
layer's sizes; each function does what the eager dispatcher did around the DeepEP call (allocate on
first use, clean the low-latency buffer after normal-mode use, refuse capture of normal mode).

What the functions return (DeepEP v1.2.1, intranode; ``R`` ranks, ``C`` = normal-mode SMs / 2):

* low-latency dispatch: ``recv_x [E_loc, R*N, H]`` (bf16, or e4m3 followed by its scales
  ``[E_loc, R*N, H/128]`` fp32, column-major in the last two dimensions), ``recv_count [E_loc]``
  int32, then the handle's ``src_info [E_loc, R*N]`` int32 and ``layout_range [E_loc, R]`` int64
  (``N``: DeepEP's ``num_max_dispatch_tokens_per_rank``).
* normal dispatch: ``recv_x [W, H]`` (the payload's dtype), its scales ``[W, S]`` fp32 when the
  payload has them, ``recv_topk_idx [W, k]`` int64, ``recv_topk_weights [W, k]`` fp32, then the
  handle: ``rank_prefix_matrix [R, R]``, ``channel_prefix_matrix [R, C]``,
  ``recv_channel_prefix_matrix [R, C]``, ``recv_src_idx [W]`` (int32), ``is_token_in_rank [T, R]``
  bool, ``send_head [T, R]`` int32. ``W`` is ``num_worst_tokens`` when it is set (no host sync),
  else the received count the host waited for.
* both combines: ``[T, H]`` bf16.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...tensors import as_contiguous, capturing
from .buffer import buffer_by_id

def normal_payload(x: torch.Tensor, x_scale: torch.Tensor | None):
    """The ``x`` argument of ``deep_ep.Buffer.dispatch`` for a layer payload.

    Float rows travel as BF16 (DeepEP's combine is BF16 only); a 1-byte payload (int8 or e4m3)
    travels as the tuple ``(x, fp32 scales [T, S])`` — DeepEP checks only the element size, so
    INT8 needs no reinterpretation.
    """
    if x_scale is None:
        if not x.is_floating_point() or x.element_size() == 1:
            raise TypeError(f"a {x.dtype} payload needs its scales")
        return as_contiguous(x, torch.bfloat16)
    if x.element_size() != 1:
        raise TypeError(f"a scaled payload must be 1-byte (int8 / e4m3); got {x.dtype}")
    if x_scale.dim() != 2 or x_scale.shape[0] != x.shape[0]:
        raise ValueError(f"x_scale must be [T, S]; got {tuple(x_scale.shape)} for x {tuple(x.shape)}")
    return as_contiguous(x), as_contiguous(x_scale, torch.float32)


def device_barrier(group, device: torch.device) -> None:
    """A barrier ordered after the work already queued on the current stream (an all-reduce of
    one element, then a host sync)."""
    flag = torch.ones(1, dtype=torch.int32, device=device)
    dist.all_reduce(flag, group=group)
    flag.item()


def low_latency_dispatch(
    buffer_id: int, x: torch.Tensor, topk_ids: torch.Tensor, num_max_tokens: int, num_experts: int, use_fp8: bool
) -> list[torch.Tensor]:
    """``Buffer.low_latency_dispatch`` of BF16 rows ``x [T, H]`` and int64 ``topk_ids [T, k]``
    (no async finish, no receive hook); returns the tensors listed in the module docstring."""
    owner = buffer_by_id(buffer_id)
    buf = owner.get()
    if owner.clean_low_latency():
        # Every peer must have cleaned before anyone sends low-latency traffic.
        device_barrier(owner.group, x.device)
    recv, count, handle, _, _ = buf.low_latency_dispatch(
        x, topk_ids, num_max_tokens, num_experts, use_fp8=use_fp8, async_finish=False, return_recv_hook=False
    )
    return [*(recv if use_fp8 else (recv,)), count, handle[0], handle[1]]


def low_latency_combine(
    buffer_id: int, y: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, src_info: torch.Tensor,
    layout_range: torch.Tensor, num_max_tokens: int, num_experts: int,
) -> torch.Tensor:  # fmt: skip
    """``Buffer.low_latency_combine`` of BF16 expert outputs ``y [E_loc, R*N, H]``: the weighted
    sum per token, ``[T, H]`` bf16. The handle is rebuilt from its tensors and the sizes."""
    handle = (src_info, layout_range, num_max_tokens, y.shape[-1], num_experts)
    out, _, _ = buffer_by_id(buffer_id).get().low_latency_combine(
        y, topk_ids, topk_weights, handle, async_finish=False, return_recv_hook=False
    )
    return out


def normal_dispatch(
    buffer_id: int, x: torch.Tensor, x_scale: torch.Tensor | None, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    num_experts: int, alignment: int, num_worst_tokens: int,
) -> tuple[list[torch.Tensor], list[int]]:  # fmt: skip
    """``Buffer.get_dispatch_layout`` then ``Buffer.dispatch`` of a layer payload (BF16 rows, or
    1-byte rows with fp32 scales ``[T, S]``); returns the tensors listed in the module docstring
    and DeepEP's rows per local expert, rounded up to ``alignment`` (a host list; empty with
    ``num_worst_tokens``, where the host does not wait for the receive counts)."""
    owner = buffer_by_id(buffer_id)
    buf = owner.get()
    # The layout kernel goes first: with the GPU idle (eager prefill) host work before it
    # delays the whole dispatch, while the work below overlaps the kernel. The kernel is local
    # to this rank and DeepEP joins its stream back, so raising after it (under capture, or
    # for a bad payload) leaves no peer waiting.
    num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, _ = (
        buf.get_dispatch_layout(topk_ids, num_experts)
    )
    if capturing(x.device):
        raise RuntimeError(
            "deepep_normal is not CUDA-graph capturable here (without normal_max_tokens_per_rank "
            "the host waits for the receive counts; the bounded path has not been validated "
            "under capture); use deepep_low_latency or deepep_auto for captured batches"
        )
    payload = normal_payload(x, x_scale)
    recv_x, recv_ids, recv_w, padded_rows, handle, _ = buf.dispatch(
        payload,
        topk_idx=topk_ids,
        topk_weights=topk_weights,
        num_tokens_per_rank=num_tokens_per_rank,
        num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
        is_token_in_rank=is_token_in_rank,
        num_tokens_per_expert=num_tokens_per_expert,
        expert_alignment=alignment,
        num_worst_tokens=num_worst_tokens,
        config=owner.dispatch_config,
    )
    owner.mark_normal_used()
    rows = list(recv_x) if isinstance(recv_x, tuple) else [recv_x]
    return [*rows, recv_ids, recv_w, *handle], list(padded_rows)


def normal_combine(buffer_id: int, y: torch.Tensor, handle: list[torch.Tensor]) -> torch.Tensor:
    """``Buffer.combine`` (unweighted sum over ranks) of BF16 rows ``y [W, H]`` with the handle's
    tensors; ``[T, H]`` bf16."""
    owner = buffer_by_id(buffer_id)
    out, _, _ = owner.get().combine(y, tuple(handle), config=owner.combine_config)
    owner.mark_normal_used()
    return out
