"""Dispatch through DeepEP (v1.2.1, the ``deep_ep.Buffer`` API): normal, low-latency and auto.

* :class:`DeepEPNormalDispatcher` (prefill, any batch size): ``get_dispatch_layout`` then
  ``dispatch`` with the payload quantized just before (``cfg.payload``) (BF16, INT8 + fp32 scales per
  token or per 1x128 group, FP8 + 1x128 scales), ``expert_alignment`` = the backend's alignment.
  Rows arrive once per destination rank with *local* top-k ids (``-1`` for other ranks' slots):
  exactly the token layout of :class:`~epmoe.dispatch.base.Dispatched`. ``combine`` is DeepEP's
  unweighted sum over ranks, so the layer weighs rows in its gather first. The host waits for the
  receive counts (not CUDA-graph capturable), unless ``cfg.normal_max_tokens_per_rank`` bounds
  every rank's batch: then DeepEP allocates for ``world_size x`` that many received rows
  (``num_worst_tokens``; rows past the received ones carry ``-1`` ids), the host runs on, and a
  backend with ``device_segments`` builds the contiguous layout from device-side counts.
* :class:`DeepEPLowLatencyDispatcher` (decode): ``low_latency_dispatch`` (BF16 on the wire, or
  FP8 with 1x128 scales cast inside DeepEP) straight into the masked layout
  ``[E_loc, R * max_tokens, H]``; ``low_latency_combine`` applies the top-k weights. No host sync:
  the layer forward can be captured in a CUDA graph.
* :class:`DeepEPAutoDispatcher`: low-latency while every rank's batch fits the capacity
  (``max_tokens_per_rank``), normal otherwise. The decision is the same on every rank: the ranks
  all-reduce (MAX) their token counts first (one tiny NCCL all-reduce and a host sync per batch).
  The same maximum decides, on every rank alike, whether a normal batch fits
  ``normal_max_tokens_per_rank`` (no wait for the receive counts) or not (host-synced, logged once).
  During CUDA-graph capture no collective can run; then only low-latency is allowed.

:class:`~.buffer.DeepEPBuffer` owns the one ``deep_ep.Buffer`` of a process group (:mod:`.buffer`);
the size rules are in :mod:`.sizing`.

What travels is fixed when the layer is built, not by the batch: normal mode sends float rows as
BF16 and 1-byte payloads (``cfg.payload``) with fp32 scales, low-latency mode BF16 or FP8 cast
inside DeepEP (``cfg.low_latency_payload``), and both combine BF16. The input dtype of a batch
(bf16 / fp16 / fp32) never reaches the wire, so ranks that call with different input dtypes get
correct results; the payload formats are part of the layer's cross-rank fingerprint (checked once
per layer, :mod:`epmoe.dispatch.collective`). ``-1`` in ``topk_ids`` selects no expert: DeepEP skips
such slots in its layout, dispatch and combine kernels.

Under ``torch.compile`` DeepEP's calls are the custom ops ``epmoe::deepep_*`` (:mod:`epmoe.ops`,
bodies in :mod:`.calls`): low-latency and bounded normal dispatch trace without a graph break;
unbounded normal dispatch breaks at its send, where the host waits for the receive counts, and
auto mode at its routing, where the ranks agree on the mode, and at its combine (docs/compile.md).

``deep_ep`` is imported lazily, so this module imports (and its pure helpers run) without it.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ... import ops
from ...quant.payload import quantize_payload
from ...tensors import as_contiguous, capturing
from ..base import PAYLOADS, DispatchConfig, Dispatched, Dispatcher
from .buffer import DeepEPBuffer, DeepEPBufferError, import_deep_ep
from .calls import normal_dispatch, normal_payload
from .sizing import BufferNeeds, choose_mode, expected_rows_per_expert

__all__ = [
    "DeepEPAutoDispatcher", "DeepEPLowLatencyDispatcher", "DeepEPNormalDispatcher", "LowLatencyHandle",
    "NormalHandle", "normal_payload", "pad_empty_batch",
]  # fmt: skip

log = logging.getLogger("epmoe")


def pad_empty_batch(x, topk_ids, topk_weights):
    """A batch of 0 tokens becomes one dummy token that selects no expert (``-1`` ids), so DeepEP
    never sees empty send tensors; ``combine`` drops the row. Other batches pass unchanged."""
    if x.shape[0]:
        return x, topk_ids, topk_weights
    x = x.new_zeros((1, x.shape[1]))
    topk_ids = torch.full((1, topk_ids.shape[1]), -1, dtype=torch.int64, device=topk_ids.device)
    topk_weights = topk_weights.new_zeros((1, topk_weights.shape[1]))
    return x, topk_ids, topk_weights


@dataclass(frozen=True)
class NormalHandle:
    """What normal-mode ``combine`` needs of one batch: tensors and ints only, so that a traced
    forward carries it from the dispatch op to the combine op."""

    tensors: tuple[torch.Tensor, ...]  # DeepEP's handle of the dispatch (its six tensors: .calls)
    num_tokens: int  # the batch's rows (an empty batch was sent as one dummy row)


@dataclass(frozen=True)
class LowLatencyHandle:
    """What low-latency ``combine`` needs of one batch (DeepEP's handle is its two tensors and
    the sizes)."""

    num_tokens: int
    topk_ids: torch.Tensor  # [max(T, 1), k] int64, as sent
    topk_weights: torch.Tensor  # [max(T, 1), k] fp32, applied by DeepEP's combine
    src_info: torch.Tensor  # [E_loc, R * N] int32
    layout_range: torch.Tensor  # [E_loc, R] int64
    num_max_tokens: int  # N: DeepEP's num_max_dispatch_tokens_per_rank


def _problems(cfg: DispatchConfig, modes: tuple[str, ...]) -> list[str]:
    """Why DeepEP cannot serve ``modes`` for ``cfg`` here (empty list: it can)."""
    out = []
    _, reason = import_deep_ep()
    if reason:
        out.append(reason)
    if cfg.device.type != "cuda":
        out.append(f"DeepEP needs a CUDA device; the layer is on {cfg.device}")
    elif not torch.cuda.is_available():
        out.append("CUDA is not available")
    if cfg.world_size < 2:
        out.append(f"DeepEP needs a group of at least 2 ranks; it has {cfg.world_size}")
    if not dist.is_available():
        out.append("this torch build has no torch.distributed")
    buf = cfg.deepep_buffer
    if buf is not None and not isinstance(buf, DeepEPBuffer):
        out.append(f"deepep_buffer must be an epmoe.dispatch.DeepEPBuffer; got {type(buf).__name__}")
        buf = None
    out += (buf or DeepEPBuffer()).registration_problems(_needs(cfg, modes), cfg.world_size)
    return list(dict.fromkeys(out))


def _needs(cfg: DispatchConfig, modes) -> BufferNeeds:
    return BufferNeeds(cfg.hidden_size, cfg.num_experts, cfg.top_k, cfg.max_tokens_per_rank, frozenset(modes))


def _with_buffer(cfg: DispatchConfig) -> DispatchConfig:
    """``cfg`` itself when it names a shared buffer, else a copy with a private one (logged)."""
    if cfg.deepep_buffer is not None:
        return cfg
    log.warning(
        "rank %d: no deepep_buffer given: this layer owns a private DeepEP buffer; pass one "
        "epmoe.dispatch.DeepEPBuffer(group) to every layer of the group to share it",
        cfg.rank,
    )
    return dataclasses.replace(cfg, deepep_buffer=DeepEPBuffer(cfg.group))


class _DeepEPBase(Dispatcher):
    """What every DeepEP dispatcher shares: availability for its modes, and its buffer (``cfg``'s,
    or a private one)."""

    modes_needed: tuple[str, ...] = ()

    @classmethod
    def available(cls, cfg: DispatchConfig) -> tuple[bool, str]:
        problems = _problems(cfg, cls.modes_needed)
        return (False, "; ".join(problems)) if problems else (True, "available")

    def __init__(self, cfg: DispatchConfig) -> None:
        cfg = _with_buffer(cfg)
        super().__init__(cfg)
        self.buffer: DeepEPBuffer = cfg.deepep_buffer

    def _allocated(self) -> DeepEPBuffer:
        """The buffer owner with its ``deep_ep.Buffer`` allocated. Eagerly that happens at the
        first batch (a collective); a traced forward cannot allocate, and the sizes it traces
        with (the low-latency capacity, the normal-mode channels) are known only after it."""
        if not torch.compiler.is_compiling():
            self.buffer.get()
        elif not self.buffer.allocated:
            raise DeepEPBufferError(
                f"{self.name}: the DeepEP buffer is allocated at the first batch (a collective); "
                "run one batch eagerly before compiling"
            )
        return self.buffer


class _OneMode(_DeepEPBase):
    def __init__(self, cfg: DispatchConfig) -> None:
        super().__init__(cfg)
        self.buffer.register(_needs(self.cfg, self.modes_needed), self.cfg.world_size)


class DeepEPNormalDispatcher(_OneMode):
    """DeepEP high-throughput dispatch (NVLink, intranode); see the module docstring."""

    name = "deepep_normal"
    layouts = frozenset({"contiguous"})
    payloads = frozenset(PAYLOADS)
    modes_needed = ("normal",)

    def send(self, x, x_scale, topk_ids, topk_weights, *, global_max_tokens: int | None = None) -> Dispatched:
        """As :meth:`Dispatcher.send`, plus:

        Args:
            global_max_tokens: the largest batch over the ranks, when the caller knows it (an auto
                dispatcher does): then ``cfg.normal_max_tokens_per_rank`` holds on every rank or
                on none, and a batch over it runs host-synced (waiting for the receive counts)
                instead of raising. ``None``: only this rank's batch is known, and a batch over
                the bound raises (its peers then wait in DeepEP until their timeout).
        """
        t = x.shape[0]
        cfg = self.cfg
        cap = cfg.normal_max_tokens_per_rank
        if global_max_tokens is None:
            if cap is not None and t > cap:
                raise ValueError(
                    f"deepep_normal: batch of {t} tokens exceeds normal_max_tokens_per_rank={cap} on rank "
                    f"{cfg.rank} (every rank's receive buffers assume it); raise it or set it to None"
                )
            global_max_tokens = t
        if cap is None or global_max_tokens > cap:
            return self._send_host_synced(x, x_scale, topk_ids, topk_weights)
        buffer = self._allocated()
        x, x_scale, topk_ids, topk_weights = self._sendable(x, x_scale, topk_ids, topk_weights)
        out = ops.deepep_normal_dispatch(
            buffer.id, x, x_scale, topk_ids, topk_weights, num_experts=cfg.num_experts,
            alignment=max(1, int(cfg.alignment)), num_worst_tokens=cfg.world_size * cap, num_ranks=cfg.world_size,
            num_channels=buffer.normal_channels,
        )  # fmt: skip
        # Rows past the received ones carry -1 ids: the layer sizes the segments on the device.
        hint = expected_rows_per_expert(max(global_max_tokens, 1), cfg.world_size, cfg.top_k, cfg.num_experts)
        return _received(out, x_scale is not None, t, expected_m=hint)

    # The host waits for DeepEP's receive counts (a host list sizes the received rows): a compiled
    # model breaks its graph here, and only here (docs/compile.md).
    @torch.compiler.disable
    def _send_host_synced(self, x, x_scale, topk_ids, topk_weights) -> Dispatched:
        x, x_scale, sent_ids, sent_weights = self._sendable(x, x_scale, topk_ids, topk_weights)
        out, padded_rows = normal_dispatch(
            self._allocated().id, x, x_scale, sent_ids, sent_weights, self.cfg.num_experts,
            max(1, int(self.cfg.alignment)), 0,
        )  # fmt: skip
        return _received(out, x_scale is not None, topk_ids.shape[0], padded_rows=padded_rows)

    @staticmethod
    def _sendable(x, x_scale, topk_ids, topk_weights):
        """What DeepEP takes: never an empty batch (one dummy row that selects no expert, unit
        scales), contiguous int64 ids and fp32 weights."""
        if x.shape[0] == 0:
            x, topk_ids, topk_weights = pad_empty_batch(x, topk_ids, topk_weights)
            if x_scale is not None:
                x_scale = x_scale.new_ones((1, x_scale.shape[1]))
        return x, x_scale, as_contiguous(topk_ids, torch.int64), as_contiguous(topk_weights, torch.float32)

    def combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        h: NormalHandle = dispatched.handle
        out = ops.deepep_normal_combine(self.buffer.id, as_contiguous(y, torch.bfloat16), h.tensors)
        t = h.num_tokens
        return out if out.shape[0] == t else out[:t]  # a slice costs microseconds of host time


def _received(out: list[torch.Tensor], scaled: bool, num_tokens: int, **sizes) -> Dispatched:
    """The :class:`Dispatched` of a normal-mode dispatch's tensors (:mod:`.calls`)."""
    rx, rs = (out[0], out[1]) if scaled else (out[0], None)
    rest = out[2:] if scaled else out[1:]
    return Dispatched(
        x=rx, x_scale=rs, handle=NormalHandle(tuple(rest[2:]), num_tokens), num_tokens=num_tokens,
        topk_ids=rest[0], topk_weights=rest[1], **sizes,
    )  # fmt: skip


class DeepEPLowLatencyDispatcher(_OneMode):
    """DeepEP low-latency dispatch into the masked layout; CUDA-graph capturable.

    Every rank's batch must fit ``max_tokens_per_rank`` (use ``deepep_auto`` otherwise). Float
    payloads travel as BF16, ``"fp8_group"`` as FP8 with 1x128 scales cast by DeepEP.
    """

    name = "deepep_low_latency"
    layouts = frozenset({"masked"})
    payloads = frozenset({"float"})  # FP8 is cast inside DeepEP (cfg.low_latency_payload)
    modes_needed = ("low_latency",)

    def send(self, x, x_scale, topk_ids, topk_weights) -> Dispatched:
        if x_scale is not None:
            raise ValueError(
                "deepep_low_latency takes floating-point activations (DeepEP casts them to FP8 "
                "inside when cfg.low_latency_payload='fp8_group'); got a pre-quantized payload"
            )
        t = x.shape[0]
        cfg = self.cfg
        if t > cfg.max_tokens_per_rank:
            raise ValueError(
                f"deepep_low_latency: batch of {t} tokens exceeds max_tokens_per_rank={cfg.max_tokens_per_rank} "
                f"on rank {cfg.rank}; raise max_tokens_per_rank or use dispatch='deepep_auto'"
            )
        buffer = self._allocated()
        n = buffer.plan.ll_max_tokens
        if not t:
            x, topk_ids, topk_weights = pad_empty_batch(x, topk_ids, topk_weights)
        use_fp8 = cfg.low_latency_payload == "fp8_group"
        ids = as_contiguous(topk_ids, torch.int64)
        # Only what the launch needs comes before it: in eager decode the GPU waits for this host
        # work. DeepEP takes BF16 and casts to FP8 (1x128 scales) inside its kernel when asked.
        out = ops.deepep_low_latency_dispatch(
            buffer.id, as_contiguous(x, torch.bfloat16), ids, num_max_tokens=n, num_experts=cfg.num_experts,
            num_ranks=cfg.world_size, use_fp8=use_fp8,
        )  # fmt: skip
        weights = as_contiguous(topk_weights, torch.float32)
        rx, rs = (out[0], out[1]) if use_fp8 else (out[0], None)
        count, src_info, layout_range = out[-3:]
        return Dispatched(
            x=rx, x_scale=rs, handle=LowLatencyHandle(t, ids, weights, src_info, layout_range, n),
            num_tokens=t, masked_m=count,
            expected_m=expected_rows_per_expert(max(t, 1), cfg.world_size, cfg.top_k, cfg.num_experts),
            combine_applies_weights=True,
        )  # fmt: skip

    def combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        h: LowLatencyHandle = dispatched.handle
        out = ops.deepep_low_latency_combine(
            self.buffer.id, as_contiguous(y, torch.bfloat16), h.topk_ids, h.topk_weights, h.src_info,
            h.layout_range, num_max_tokens=h.num_max_tokens, num_experts=self.cfg.num_experts,
        )  # fmt: skip
        t = h.num_tokens
        return out if out.shape[0] == t else out[:t]


class DeepEPAutoDispatcher(_DeepEPBase):
    """Low-latency while every rank's batch fits ``max_tokens_per_rank``, normal otherwise: one
    :class:`DeepEPNormalDispatcher` and one :class:`DeepEPLowLatencyDispatcher` on one buffer.

    Rule (identical on every rank): the ranks all-reduce (MAX) their token counts, then
    :func:`~.sizing.choose_mode`. Cost: one small NCCL all-reduce and a host sync per batch. During
    CUDA-graph capture no collective runs: the batch must fit and goes low-latency. A batch over
    the capacity never fails: it runs in normal mode, and the first time is logged.
    """

    name = "deepep_auto"
    layouts = frozenset({"contiguous", "masked"})
    payloads = frozenset(PAYLOADS)
    modes_needed = ("normal", "low_latency")

    def __init__(self, cfg: DispatchConfig) -> None:
        super().__init__(cfg)
        cfg = self.cfg  # with the buffer both modes share
        self.normal = DeepEPNormalDispatcher(cfg)
        # Low-latency mode takes float rows (it casts inside DeepEP): its own payload is float.
        self.low_latency = DeepEPLowLatencyDispatcher(dataclasses.replace(cfg, payload="float"))
        self.stats = {"low_latency": 0, "normal": 0}  # batches per mode (statistics only)
        self._logged_limits: set[str] = set()  # limits already warned about (log once each)

    def decide(self, num_tokens: int, device: torch.device) -> str:
        """The mode of this batch, the same on every rank (see the class docstring)."""
        return self._decide(num_tokens, device)[0]

    def _decide(self, num_tokens: int, device: torch.device) -> tuple[str, int]:
        """``(mode, largest batch over the ranks)``; during capture the largest is not known
        and this rank's count stands in for it."""
        cap = self.cfg.max_tokens_per_rank
        if capturing(device):
            if num_tokens > cap:
                raise ValueError(
                    f"deepep_auto: a CUDA graph can only capture low-latency batches; {num_tokens} "
                    f"tokens exceed max_tokens_per_rank={cap}"
                )
            return "low_latency", num_tokens
        count = torch.tensor([num_tokens], dtype=torch.int64, device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.buffer.group)
        global_max = int(count.item())
        mode = choose_mode(global_max, cap)
        if mode == "normal":
            self._over_limit_once(global_max, "the low-latency capacity max_tokens_per_rank", cap,
                                  "such batches run in DeepEP normal mode")  # fmt: skip
        return mode, global_max

    def _over_limit_once(self, global_max: int, limit: str, value: int, then: str) -> None:
        """Warn, once per limit, that a batch went past it and what happens instead."""
        if limit in self._logged_limits:
            return
        self._logged_limits.add(limit)
        log.warning(
            "rank %d: deepep_auto: a batch of %d tokens per rank (largest over ranks) exceeds %s=%d; "
            "%s (logged once)", self.cfg.rank, global_max, limit, value, then,
        )  # fmt: skip

    def dispatch(self, x, topk_ids, topk_weights) -> Dispatched:
        return self._route(x, None, topk_ids, topk_weights, quantized=False)

    def send(self, x, x_scale, topk_ids, topk_weights) -> Dispatched:
        return self._route(x, x_scale, topk_ids, topk_weights, quantized=True)

    @torch.compiler.disable  # a collective and DeepEP's calls (docs/compile.md)
    def _route(self, x, x_scale, topk_ids, topk_weights, quantized: bool) -> Dispatched:
        self.buffer.get()
        # Clean before the all-reduce in _decide(): the collective orders every rank's clean
        # before any rank's next low-latency dispatch (so the low-latency send needs no barrier).
        self.buffer.clean_low_latency()
        mode, global_max = self._decide(x.shape[0], x.device)
        self.stats[mode] += 1
        if mode == "low_latency":
            if x_scale is not None:
                raise ValueError(
                    "deepep_auto chose low-latency mode, which takes floating-point activations; "
                    "got a pre-quantized payload (call dispatch(), which quantizes per mode)"
                )
            return self.low_latency.send(x, None, topk_ids, topk_weights)
        if not quantized:
            x, x_scale = quantize_payload(x, self.cfg.payload)
        # Every rank knows the largest batch here, so all agree on whether the bound holds.
        cap = self.cfg.normal_max_tokens_per_rank
        if cap is not None and global_max > cap:
            self._over_limit_once(global_max, "normal_max_tokens_per_rank", cap,
                                  "such batches wait on the host for DeepEP's receive counts")  # fmt: skip
        return self.normal.send(x, x_scale, topk_ids, topk_weights, global_max_tokens=global_max)

    @torch.compiler.disable  # DeepEP's combine (docs/compile.md)
    def combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        if isinstance(dispatched.handle, LowLatencyHandle):
            return self.low_latency.combine(y, dispatched)
        return self.normal.combine(y, dispatched)
