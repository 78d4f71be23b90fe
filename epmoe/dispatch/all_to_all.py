"""Expert-parallel dispatch over ``torch.distributed`` all-to-all (NCCL on GPU, gloo on CPU).

Each token is sent once to every rank that owns at least one of its experts (not once per expert),
with its top-k ids rewritten to that rank's local ids (``-1`` for the other ranks' slots) and its
weights. Activation, scale, ids and weights travel packed as bytes in one collective, so any 1-byte
payload (int8, e4m3) works on any backend of torch.distributed.

Every collective whose result the host waits on is given ``timeout_s``: a peer that died or skipped
the batch raises :class:`CollectiveTimeoutError` naming the collective instead of hanging forever.
After such an error the process group is unusable; tear it down.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .base import PAYLOADS, DispatchConfig, Dispatched, Dispatcher


class CollectiveError(RuntimeError):
    """A collective of the all-to-all dispatcher failed (a peer rank died, or the group broke)."""


class CollectiveTimeoutError(CollectiveError):
    """A collective did not complete in time (a peer rank died or never joined)."""


@dataclass
class _Handle:
    send_token: torch.Tensor  # [N] int64: the source token of each sent row, in send order
    send_counts: list[int]  # rows sent to each rank
    recv_counts: list[int]  # rows received from each rank


def _pack(parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate ``[N, *]`` tensors of any dtypes as bytes: ``[N, total_bytes]`` uint8."""
    n = parts[0].shape[0]
    flat = [p.contiguous().reshape(n, p.shape[1:].numel()) for p in parts]
    return torch.cat([f.view(torch.uint8) for f in flat], dim=1)


def _unpack(buf: torch.Tensor, specs: list[tuple[torch.dtype, int]]) -> list[torch.Tensor]:
    """Inverse of :func:`_pack` for ``(dtype, columns)`` specs."""
    out, start = [], 0
    for dtype, cols in specs:
        nbytes = cols * torch.empty((), dtype=dtype).element_size()
        out.append(buf[:, start : start + nbytes].contiguous().view(dtype))
        start += nbytes
    return out


class AllToAllDispatcher(Dispatcher):
    """Dispatch with ``dist.all_to_all_single`` over ``cfg.group``; the host waits at most
    ``cfg.timeout_s`` seconds for each collective."""

    name = "all_to_all"
    layouts = frozenset({"contiguous"})
    payloads = frozenset(PAYLOADS)

    def __init__(self, cfg: DispatchConfig):
        super().__init__(cfg)
        if cfg.timeout_s <= 0:
            raise ValueError(f"timeout_s={cfg.timeout_s} must be > 0 seconds")
        self.timeout_s = float(cfg.timeout_s)
        self.group = cfg.group
        self._rank = cfg.rank
        self._world = cfg.world_size

    @classmethod
    def available(cls, cfg: DispatchConfig) -> tuple[bool, str]:
        if not dist.is_available():
            return False, "this torch build has no torch.distributed"
        if cfg.world_size == 1 and not dist.is_initialized():
            return False, "torch.distributed is not initialized (a single process)"
        return True, "available"

    def _wait(self, work, what: str) -> None:
        start = time.monotonic()
        where = f"collective '{what}' on rank {self._rank} of {self._world}"
        try:
            while not work.is_completed():
                waited = time.monotonic() - start
                if waited > self.timeout_s:
                    raise CollectiveTimeoutError(
                        f"all_to_all dispatcher: {where} did not complete within "
                        f"timeout_s={self.timeout_s:g}; a peer rank died or did not call the "
                        "layer for this batch"
                    )
                # Spin for the first 2 ms (collectives usually finish by then), then yield the CPU.
                if waited > 2e-3:
                    time.sleep(1e-4)
            work.wait()
        except CollectiveError:
            raise
        except RuntimeError as exc:  # the backend's own failure, e.g. a peer's closed connection
            raise CollectiveError(f"all_to_all dispatcher: {where} failed: {exc}") from exc

    def _exchange(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int], what):
        recv = send.new_empty((sum(recv_counts), send.shape[1]))
        work = dist.all_to_all_single(
            recv, send, recv_counts, send_counts, group=self.group, async_op=True
        )
        self._wait(work, what)
        return recv

    def send(self, x, x_scale, topk_ids, topk_weights) -> Dispatched:
        t, k = topk_ids.shape
        e_loc = self.cfg.num_local_experts
        dest = topk_ids // e_loc
        on_rank = torch.zeros(t, self._world, dtype=torch.bool, device=x.device)
        on_rank.scatter_(1, dest, True)
        pairs = on_rank.t().nonzero()  # (rank, token), sorted by rank then token
        send_rank, send_token = pairs[:, 0], pairs[:, 1]
        counts = on_rank.sum(0)
        recv_counts_t = torch.empty_like(counts)
        work = dist.all_to_all_single(recv_counts_t, counts, group=self.group, async_op=True)
        self._wait(work, "dispatch counts")
        send_counts, recv_counts = counts.tolist(), recv_counts_t.tolist()

        local = topk_ids[send_token] - send_rank.unsqueeze(1) * e_loc
        local = torch.where((local >= 0) & (local < e_loc), local, torch.full_like(local, -1))
        parts = [topk_weights[send_token].float(), local.to(torch.int32)]
        specs = [(torch.float32, k), (torch.int32, k)]
        if x_scale is not None:
            parts.append(x_scale[send_token].float())
            specs.append((torch.float32, x_scale.shape[1]))
        parts.append(x[send_token])
        specs.append((x.dtype, x.shape[1]))
        recv = self._exchange(_pack(parts), send_counts, recv_counts, "dispatch payload")
        fields = _unpack(recv, specs)
        weights, ids = fields[0], fields[1].long()
        recv_scale = fields[2] if x_scale is not None else None
        return Dispatched(
            x=fields[-1],
            x_scale=recv_scale,
            handle=_Handle(send_token, send_counts, recv_counts),
            num_tokens=t,
            topk_ids=ids,
            topk_weights=weights,
        )

    def combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        h: _Handle = dispatched.handle
        back = self._exchange(
            _pack([y]), h.recv_counts, h.send_counts, "combine payload"
        ).view(y.dtype)
        out = torch.zeros(dispatched.num_tokens, y.shape[1], dtype=torch.float32, device=y.device)
        return out.index_add_(0, h.send_token, back.float())
