"""Expert-parallel dispatch over ``torch.distributed`` all-to-all (NCCL on GPU, gloo on CPU).

Each token is sent once to every rank that owns at least one of its experts (not once per expert),
with its top-k ids rewritten to that rank's local ids (``-1`` for the other ranks' slots) and its
weights. Activation, scale, ids and weights travel packed as bytes in one collective, so any 1-byte
payload (int8, e4m3) works on any backend of torch.distributed.

The receive counts travel in a per-batch header that also carries what the rows are: the
input dtype (the dtype ``combine`` sends back), the payload dtype and the row widths. Ranks that
call with different input dtypes (fp16 on one, bf16 on another: same width, other bits) raise
:class:`~epmoe.dispatch.collective.RankMismatchError` on every rank, naming the field and each
rank's value, before any payload moves; no collective is added for it.

``-1`` in ``topk_ids`` selects no expert: the slot is sent nowhere and contributes nothing (a token
whose slots are all ``-1`` comes back as zeros).

Every collective whose result the host waits on is given ``timeout_s``: a peer that died raises
:class:`CollectiveError`, one that skipped the batch :class:`CollectiveTimeoutError`, naming the
collective, instead of hanging forever. After such an error the process group is unusable; tear
it down.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..quant.payload import quantize_payload
from .base import PAYLOADS, DispatchConfig, Dispatched, Dispatcher
from .collective import CollectiveError, CollectiveTimeoutError, RankMismatchError, first_difference, wait

__all__ = ["AllToAllDispatcher", "CollectiveError", "CollectiveTimeoutError", "RankMismatchError"]

_DTYPES = (None, torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.float8_e4m3fn, torch.float64)
"""Header codes of dtypes (index; 0: not stated)."""
_HEADER = ("input dtype", "payload dtype", "payload width", "scale width")
"""Per-batch header fields after the row count, compared over the ranks."""


def _code(dtype: torch.dtype | None) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)


def _describe(field: str, value: int) -> str:
    if field.endswith("dtype"):
        return str(_DTYPES[value]) if value < len(_DTYPES) else "another dtype"
    return str(value)


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
        wait(work, what, who="all_to_all dispatcher", rank=self._rank, world=self._world, timeout_s=self.timeout_s)

    def _check_header(self, rows: list[list[int]]) -> None:
        """Raise on every rank when the ranks' batches differ in what their rows are: each rank
        received every rank's header, so all reach the same verdict."""
        records = [{f: _describe(f, v) for f, v in zip(_HEADER, row[1:])} for row in rows]
        problem = first_difference(records)
        if problem is not None:
            raise RankMismatchError(
                f"all_to_all dispatcher: this batch's rows differ between the ranks: {problem}; call "
                "the layer with the same input dtype on every rank (raised on every rank)"
            )

    def _exchange(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int], what):
        recv = send.new_empty((sum(recv_counts), send.shape[1]))
        work = dist.all_to_all_single(
            recv, send, recv_counts, send_counts, group=self.group, async_op=True
        )
        self._wait(work, what)
        return recv

    def dispatch(self, x, topk_ids, topk_weights) -> Dispatched:
        q, q_scale = quantize_payload(x, self.cfg.payload)
        return self.send(q, q_scale, topk_ids, topk_weights, input_dtype=x.dtype)

    # Opaque to torch.compile: the header exchange reads counts back on the host and the
    # collectives are asynchronous; a compiled model breaks its graph here, once (docs/compile.md).
    @torch.compiler.disable
    def send(self, x, x_scale, topk_ids, topk_weights, *, input_dtype: torch.dtype | None = None) -> Dispatched:
        """As :meth:`Dispatcher.send`, plus:

        Args:
            input_dtype: the dtype of the rows ``combine`` will send back (the layer's input
                dtype); ``None``: ``x``'s dtype for a float payload, else not stated. Compared
                over the ranks in the header.
        """
        t, k = topk_ids.shape
        if input_dtype is None and x_scale is None:
            input_dtype = x.dtype
        e_loc = self.cfg.num_local_experts
        # -1 (padding) selects no rank: it adds 0 to rank 0's flag (scatter_add, so a duplicate
        # index cannot overwrite a real slot's flag).
        valid = topk_ids >= 0
        dest = torch.where(valid, topk_ids // e_loc, 0)
        hits = torch.zeros(t, self._world, dtype=torch.int32, device=x.device)
        on_rank = hits.scatter_add_(1, dest, valid.to(torch.int32)) > 0
        pairs = on_rank.t().nonzero()  # (rank, token), sorted by rank then token
        send_rank, send_token = pairs[:, 0], pairs[:, 1]
        counts = on_rank.sum(0)
        widths = [_code(input_dtype), _code(x.dtype), x.shape[1], 0 if x_scale is None else x_scale.shape[1]]
        header = torch.tensor(widths, dtype=torch.int64, device=x.device).expand(self._world, -1)
        header = torch.cat([counts.unsqueeze(1).to(torch.int64), header], dim=1).contiguous()
        recv_header = torch.empty_like(header)
        work = dist.all_to_all_single(recv_header, header, group=self.group, async_op=True)
        self._wait(work, "dispatch counts")
        rows = recv_header.tolist()
        self._check_header(rows)
        send_counts, recv_counts = counts.tolist(), [r[0] for r in rows]

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

    @torch.compiler.disable  # a collective: one graph break (docs/compile.md)
    def combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        h: _Handle = dispatched.handle
        back = self._exchange(
            _pack([y]), h.recv_counts, h.send_counts, "combine payload"
        ).view(y.dtype)
        out = torch.zeros(dispatched.num_tokens, y.shape[1], dtype=torch.float32, device=y.device)
        return out.index_add_(0, h.send_token, back.float())
