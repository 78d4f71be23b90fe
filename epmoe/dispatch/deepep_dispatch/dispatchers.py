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

``deep_ep`` is imported lazily, so this module imports (and its pure helpers run) without it.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...quant.payload import quantize_payload
from ...tensors import as_contiguous, capturing
from ..base import PAYLOADS, DispatchConfig, Dispatched, Dispatcher
from .buffer import DeepEPBuffer, import_deep_ep
from .sizing import BufferNeeds, choose_mode, expected_rows_per_expert

log = logging.getLogger("epmoe")


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


def pad_empty_batch(x, topk_ids, topk_weights):
    """A batch of 0 tokens becomes one dummy token that selects no expert (``-1`` ids), so DeepEP
    never sees empty send tensors; ``combine`` drops the row. Other batches pass unchanged."""
    if x.shape[0]:
        return x, topk_ids, topk_weights
    x = x.new_zeros((1, x.shape[1]))
    topk_ids = torch.full((1, topk_ids.shape[1]), -1, dtype=torch.int64, device=topk_ids.device)
    topk_weights = topk_weights.new_zeros((1, topk_weights.shape[1]))
    return x, topk_ids, topk_weights


def _device_barrier(group, device: torch.device) -> None:
    """A barrier ordered after the work already queued on the current stream (an all-reduce of
    one element, then a host sync)."""
    flag = torch.ones(1, dtype=torch.int32, device=device)
    dist.all_reduce(flag, group=group)
    flag.item()


@dataclass(frozen=True)
class NormalHandle:
    """What normal-mode ``combine`` needs of one batch."""

    deep_ep_handle: object  # DeepEP's own handle of the dispatch
    num_tokens: int  # the batch's rows (an empty batch was sent as one dummy row)


@dataclass(frozen=True)
class LowLatencyHandle:
    """What low-latency ``combine`` needs of one batch."""

    deep_ep_handle: object
    num_tokens: int
    topk_ids: torch.Tensor  # [max(T, 1), k] int64, as sent
    topk_weights: torch.Tensor  # [max(T, 1), k] fp32, applied by DeepEP's combine


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

    # DeepEP's calls are pybind functions, opaque to torch.compile: a compiled model breaks its
    # graph once here and once at combine (docs/compile.md).
    @torch.compiler.disable
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
        cap = self.cfg.normal_max_tokens_per_rank
        if global_max_tokens is None:
            if cap is not None and t > cap:
                raise ValueError(
                    f"deepep_normal: batch of {t} tokens exceeds normal_max_tokens_per_rank={cap} on rank "
                    f"{self.cfg.rank} (every rank's receive buffers assume it); raise it or set it to None"
                )
            global_max_tokens = t
        bounded = cap is not None and global_max_tokens <= cap
        if t == 0:
            x, topk_ids, topk_weights = pad_empty_batch(x, topk_ids, topk_weights)
            if x_scale is not None:
                x_scale = x_scale.new_ones((1, x_scale.shape[1]))
        buf = self.buffer.get()
        topk_ids = as_contiguous(topk_ids, torch.int64)
        # The layout kernel goes first: with the GPU idle (eager prefill) host work before it
        # delays the whole dispatch, while the work below overlaps the kernel. The kernel is local
        # to this rank and DeepEP joins its stream back, so raising after it (under capture, or
        # for a bad payload) leaves no peer waiting.
        num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, _ = (
            buf.get_dispatch_layout(topk_ids, self.cfg.num_experts)
        )
        if capturing(x.device):
            raise RuntimeError(
                "deepep_normal is not CUDA-graph capturable here (without normal_max_tokens_per_rank "
                "the host waits for the receive counts; the bounded path has not been validated "
                "under capture); use deepep_low_latency or deepep_auto for captured batches"
            )
        payload = normal_payload(x, x_scale)
        topk_weights = as_contiguous(topk_weights, torch.float32)
        cfg = self.cfg
        worst = cfg.world_size * cfg.normal_max_tokens_per_rank if bounded else 0
        recv_x, recv_ids, recv_w, padded_rows, handle, _ = buf.dispatch(
            payload,
            topk_idx=topk_ids,
            topk_weights=topk_weights,
            num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
            is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=num_tokens_per_expert,
            expert_alignment=max(1, int(cfg.alignment)),
            num_worst_tokens=worst,
            config=self.buffer.dispatch_config,
        )
        self.buffer.mark_normal_used()
        rx, rs = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
        if worst:
            hint = expected_rows_per_expert(max(global_max_tokens, 1), cfg.world_size, cfg.top_k, cfg.num_experts)
            sizes = dict(expected_m=hint)
        else:
            sizes = dict(padded_rows=list(padded_rows))
        return Dispatched(
            x=rx, x_scale=rs, handle=NormalHandle(handle, t), num_tokens=t,
            topk_ids=recv_ids, topk_weights=recv_w, **sizes,
        )  # fmt: skip

    @torch.compiler.disable  # DeepEP's combine (docs/compile.md)
    def combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        h: NormalHandle = dispatched.handle
        out, _, _ = self.buffer.get().combine(
            as_contiguous(y, torch.bfloat16), h.deep_ep_handle, config=self.buffer.combine_config
        )
        self.buffer.mark_normal_used()
        t = h.num_tokens
        return out if out.shape[0] == t else out[:t]  # a slice costs microseconds of host time


class DeepEPLowLatencyDispatcher(_OneMode):
    """DeepEP low-latency dispatch into the masked layout; CUDA-graph capturable.

    Every rank's batch must fit ``max_tokens_per_rank`` (use ``deepep_auto`` otherwise). Float
    payloads travel as BF16, ``"fp8_group"`` as FP8 with 1x128 scales cast by DeepEP.
    """

    name = "deepep_low_latency"
    layouts = frozenset({"masked"})
    payloads = frozenset({"float"})  # FP8 is cast inside DeepEP (cfg.low_latency_payload)
    modes_needed = ("low_latency",)

    # DeepEP's calls are pybind functions, opaque to torch.compile: a compiled model breaks its
    # graph once here and once at combine (docs/compile.md).
    @torch.compiler.disable
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
        buf = self.buffer.get()
        if self.buffer.clean_low_latency():
            # Every peer must have cleaned before anyone sends low-latency traffic.
            _device_barrier(self.buffer.group, x.device)
        if not t:
            x, topk_ids, topk_weights = pad_empty_batch(x, topk_ids, topk_weights)
        use_fp8 = cfg.low_latency_payload == "fp8_group"
        ids = as_contiguous(topk_ids, torch.int64)
        # Only what the launch needs comes before it: in eager decode the GPU waits for this host
        # work. DeepEP takes BF16 and casts to FP8 (1x128 scales) inside its kernel when asked.
        recv, count, handle, _, _ = buf.low_latency_dispatch(
            as_contiguous(x, torch.bfloat16), ids, self.buffer.plan.ll_max_tokens, cfg.num_experts,
            use_fp8=use_fp8, async_finish=False, return_recv_hook=False,
        )  # fmt: skip
        weights = as_contiguous(topk_weights, torch.float32)
        rx, rs = recv if use_fp8 else (recv, None)
        return Dispatched(
            x=rx, x_scale=rs, handle=LowLatencyHandle(handle, t, ids, weights),
            num_tokens=t, masked_m=count,
            expected_m=expected_rows_per_expert(max(t, 1), cfg.world_size, cfg.top_k, cfg.num_experts),
            combine_applies_weights=True,
        )  # fmt: skip

    @torch.compiler.disable  # DeepEP's combine (docs/compile.md)
    def combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        h: LowLatencyHandle = dispatched.handle
        out, _, _ = self.buffer.get().low_latency_combine(
            as_contiguous(y, torch.bfloat16), h.topk_ids, h.topk_weights, h.deep_ep_handle,
            async_finish=False, return_recv_hook=False,
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
