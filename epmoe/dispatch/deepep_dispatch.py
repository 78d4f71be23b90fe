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

:class:`DeepEPBuffer` owns the one ``deep_ep.Buffer`` of a process group. Layers register what they
need when they are built; the buffer is allocated at first use, sized from the largest
registration, and shared by all layers of the group.

``deep_ep`` is imported lazily, so this module imports (and its pure helpers run) without it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..devices import sm_count
from ..tensors import as_contiguous, capturing
from ..quant.payload import quantize_payload
from .base import PAYLOADS, DispatchConfig, Dispatched, Dispatcher

log = logging.getLogger("epmoe")

NORMAL_WORLD_SIZES = (2, 4, 8)
"""Ranks DeepEP's intranode (NVLink) normal kernels support (more needs its internode RDMA path)."""

LOW_LATENCY_HIDDEN_SIZES = (2048, 2560, 4096, 5120, 6144, 7168, 8192)
"""Hidden sizes DeepEP v1.2.1's low-latency kernels are compiled for (``SWITCH_HIDDEN``)."""

LOW_LATENCY_MAX_TOP_K = 11
NORMAL_MAX_TOP_K = 32
MAX_LOCAL_EXPERTS = 1024
NORMAL_MAX_SCALES = 128
"""DeepEP's buffer-size hint reserves room for at most 128 fp32 scales per token."""

MODES = ("normal", "low_latency")

# DeepEP v1.2.1's recommended intranode chunk sizes (Buffer.get_dispatch_config / get_combine_config:
# NVL send / recv tokens, RDMA send / recv tokens), used when the SM count is chosen here; a
# deep_ep.Config does not expose its fields, so they cannot be copied from the recommended one.
_NORMAL_CHUNKS = {
    "dispatch": {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128)},
    "combine": {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128)},
}


def check_num_sms(num_sms) -> None:
    """``num_sms`` of normal-mode kernels: ``None`` (DeepEP's default) or an even integer >= 2
    (each channel is a sender and a receiver block)."""
    if num_sms is not None and (not isinstance(num_sms, int) or isinstance(num_sms, bool) or num_sms < 2 or num_sms % 2):
        raise ValueError(f"num_sms={num_sms!r} must be None (DeepEP's default) or an even integer >= 2")


class DeepEPBufferError(RuntimeError):
    """A registration the shared DeepEP buffer cannot serve (or a buffer used after close)."""


# ------------------------------------------------------------------------------ pure helpers
def low_latency_shape_problems(
    hidden_size: int, top_k: int, num_experts: int, world_size: int, max_tokens_per_rank: int
) -> list[str]:
    """Why DeepEP's low-latency kernels cannot take these sizes (empty list: they can)."""
    out = []
    if hidden_size not in LOW_LATENCY_HIDDEN_SIZES:
        out.append(
            f"hidden_size={hidden_size} is not one DeepEP low-latency mode is compiled for "
            f"{list(LOW_LATENCY_HIDDEN_SIZES)}"
        )
    if top_k > LOW_LATENCY_MAX_TOP_K:
        out.append(f"top_k={top_k} exceeds DeepEP low-latency's maximum {LOW_LATENCY_MAX_TOP_K}")
    if max_tokens_per_rank < 1:
        out.append(f"max_tokens_per_rank={max_tokens_per_rank} must be >= 1 for low-latency mode")
    if world_size > 0 and num_experts % world_size:
        out.append(f"num_experts={num_experts} is not divisible by {world_size} ranks")
    return out


def normal_shape_problems(hidden_size: int, top_k: int, num_experts: int, world_size: int) -> list[str]:
    """Why DeepEP's intranode normal kernels cannot take these sizes (empty list: they can)."""
    out = []
    if world_size not in NORMAL_WORLD_SIZES:
        out.append(
            f"DeepEP intranode normal kernels support {list(NORMAL_WORLD_SIZES)} ranks; the group "
            f"has {world_size}"
        )
    if hidden_size % 16:
        out.append(f"hidden_size={hidden_size} must be a multiple of 16 (DeepEP moves 16-byte words)")
    if hidden_size // 128 > NORMAL_MAX_SCALES:
        out.append(f"hidden_size={hidden_size} gives more than {NORMAL_MAX_SCALES} 1x128 scales per token")
    if top_k > NORMAL_MAX_TOP_K:
        out.append(f"top_k={top_k} exceeds DeepEP normal mode's maximum {NORMAL_MAX_TOP_K}")
    if world_size > 0 and num_experts // max(world_size, 1) > MAX_LOCAL_EXPERTS:
        out.append(f"{num_experts // world_size} local experts exceed DeepEP's maximum {MAX_LOCAL_EXPERTS}")
    return out


def low_latency_tokens(max_tokens_per_rank: int, world_size: int) -> int:
    """DeepEP's ``num_max_dispatch_tokens_per_rank`` for a capacity: rounded up so that
    ``world_size * tokens`` is a multiple of 4 (its TMA-aligned scale layout requires it)."""
    t = max(1, int(max_tokens_per_rank))
    while (world_size * t) % 4:
        t += 1
    return t


def choose_mode(global_max_tokens: int, capacity: int) -> str:
    """Auto mode's rule, fed the MAX over ranks of the batch sizes: ``"low_latency"`` when every
    rank's batch fits the capacity, else ``"normal"``."""
    return "low_latency" if global_max_tokens <= capacity else "normal"


@dataclass(frozen=True)
class BufferNeeds:
    """What one layer needs from the shared buffer."""

    hidden_size: int
    num_experts: int
    top_k: int
    max_tokens_per_rank: int
    modes: frozenset[str]

    def __post_init__(self):
        bad = set(self.modes) - set(MODES)
        if bad or not self.modes:
            raise ValueError(f"modes={sorted(self.modes)}; allowed: non-empty subset of {list(MODES)}")


@dataclass(frozen=True)
class BufferPlan:
    """Sizes and constructor arguments of one ``deep_ep.Buffer``."""

    num_nvl_bytes: int
    num_rdma_bytes: int
    low_latency_mode: bool
    num_qps_per_rank: int
    max_hidden_size: int = 0  # normal mode: the largest hidden size served
    ll_max_tokens: int = 0  # low-latency: DeepEP's num_max_dispatch_tokens_per_rank
    ll_hidden_size: int = 0
    ll_num_experts: int = 0

    def problems(self, needs: BufferNeeds, world_size: int) -> list[str]:
        """Why an allocated buffer of this plan cannot serve ``needs``."""
        out = []
        if "normal" in needs.modes:
            if self.num_nvl_bytes == 0:
                out.append("it was allocated without normal mode")
            elif needs.hidden_size > self.max_hidden_size:
                out.append(
                    f"hidden_size={needs.hidden_size} exceeds the {self.max_hidden_size} it was sized for"
                )
        if "low_latency" in needs.modes:
            if not self.low_latency_mode:
                out.append("it was allocated without low-latency mode")
            else:
                if (needs.hidden_size, needs.num_experts) != (self.ll_hidden_size, self.ll_num_experts):
                    out.append(
                        f"low-latency layers of one buffer must share hidden_size and num_experts "
                        f"(buffer: {self.ll_hidden_size}, {self.ll_num_experts}; layer: "
                        f"{needs.hidden_size}, {needs.num_experts})"
                    )
                if low_latency_tokens(needs.max_tokens_per_rank, world_size) > self.ll_max_tokens:
                    out.append(
                        f"max_tokens_per_rank={needs.max_tokens_per_rank} exceeds the "
                        f"{self.ll_max_tokens} it was sized for"
                    )
        return out


def plan_buffer(
    needs: list[BufferNeeds],
    world_size: int,
    nvl_hint: Callable[[int], int],
    ll_hint: Callable[[int, int, int, int], int],
) -> BufferPlan:
    """Size one buffer for all registrations.

    Args:
        needs: the registrations (at least one).
        world_size: ranks of the group.
        nvl_hint: ``hidden_bytes -> bytes`` of DeepEP's NVLink buffer for normal mode (the max of
            ``Config.get_nvl_buffer_size_hint`` over the dispatch and combine configs).
        ll_hint: ``(tokens, hidden, ranks, experts) -> bytes``
            (``Buffer.get_low_latency_rdma_size_hint``).

    Normal mode is sized for BF16 rows of the largest hidden size (1-byte payloads and their
    scales need less). Low-latency layers must agree on ``hidden_size`` and ``num_experts`` (the
    buffer's layout depends on both); the token capacity is the largest registered.
    """
    if not needs:
        raise ValueError("no layer registered with this DeepEP buffer")
    normal = [n for n in needs if "normal" in n.modes]
    ll = [n for n in needs if "low_latency" in n.modes]
    nvl = max_hidden = 0
    if normal:
        max_hidden = max(n.hidden_size for n in normal)
        nvl = int(nvl_hint(max_hidden * 2))
    rdma = ll_tokens = ll_hidden = ll_experts = 0
    if ll:
        shapes = {(n.hidden_size, n.num_experts) for n in ll}
        if len(shapes) > 1:
            raise DeepEPBufferError(
                "low-latency layers sharing one DeepEP buffer must have the same (hidden_size, "
                f"num_experts); registered: {sorted(shapes)}"
            )
        (ll_hidden, ll_experts), = shapes
        ll_tokens = low_latency_tokens(max(n.max_tokens_per_rank for n in ll), world_size)
        rdma = int(ll_hint(ll_tokens, ll_hidden, world_size, ll_experts))
    return BufferPlan(
        num_nvl_bytes=nvl,
        num_rdma_bytes=rdma,
        low_latency_mode=bool(ll),
        num_qps_per_rank=max(1, ll_experts // world_size) if ll else 1,
        max_hidden_size=max_hidden,
        ll_max_tokens=ll_tokens,
        ll_hidden_size=ll_hidden,
        ll_num_experts=ll_experts,
    )


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


def expected_rows_per_expert(num_tokens: int, world_size: int, top_k: int, num_experts: int) -> int:
    """Rows-per-expert hint (masked layout, device-sized contiguous layout): rows a local expert
    gets when every rank sends ``num_tokens`` tokens with uniform routing (a host-side number,
    so it is fixed inside a CUDA graph)."""
    return max(1, math.ceil(num_tokens * world_size * top_k / max(num_experts, 1)))


def import_deep_ep():
    """``deep_ep`` or ``None`` plus the reason it cannot be imported."""
    try:
        import deep_ep  # noqa: F401
    except Exception as exc:  # ImportError, or OSError from a missing shared library
        return None, f"deep_ep is not importable ({type(exc).__name__}: {exc})"
    return deep_ep, ""


def _device_barrier(group, device: torch.device) -> None:
    """A barrier ordered after the work already queued on the current stream (an all-reduce of
    one element, then a host sync)."""
    flag = torch.ones(1, dtype=torch.int32, device=device)
    dist.all_reduce(flag, group=group)
    flag.item()


# ------------------------------------------------------------------------------ buffer owner
_LIVE_LOW_LATENCY: list[int] = [0]
"""Low-latency (NVSHMEM) buffers alive in this process: NVSHMEM is initialized once per process,
so a second one is refused with a clear error instead of failing inside NVSHMEM."""


class DeepEPBuffer:
    """Owner of the one ``deep_ep.Buffer`` of a process group, shared by all layers on it.

    Build one per group and pass it to every layer (``DeepEPMoELayer(..., deepep_buffer=buf)``).
    Layers register their needs when they are built; the buffer is allocated (a collective call:
    every rank of the group must reach it) at the first dispatch, sized from the largest
    registration. A registration that needs more after allocation is refused. :meth:`close` (also
    collective) frees it.

    Args:
        group: the process group (``None``: the default group).
        allow_nvlink_for_low_latency: let low-latency mode use NVLink (``NVSHMEM_DISABLE_P2P=0``).
        num_sms: SMs of the normal-mode dispatch and combine kernels (even, at most the GPU's).
            ``None`` keeps DeepEP's default (20), sized for overlapping communication with
            compute. The layer runs them alone on its stream, so more SMs finish sooner (on
            2 x H200 at prefill size, 64 SMs take 0.55x the time of 20: docs/dispatch-deepep.md);
            the NVLink buffer grows with the SM count.
    """

    def __init__(self, group=None, *, allow_nvlink_for_low_latency: bool = True, num_sms: int | None = None) -> None:
        check_num_sms(num_sms)
        self.group = group
        self.allow_nvlink_for_low_latency = allow_nvlink_for_low_latency
        self.num_sms = num_sms
        self.needs: list[BufferNeeds] = []
        self.plan: BufferPlan | None = None
        self._buffer = None
        self._closed = False
        self._ll_dirty = False  # a normal-mode call ran since the low-latency buffer was cleaned
        self.dispatch_config = None
        self.combine_config = None

    # -- registration
    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group) if dist.is_available() and dist.is_initialized() else 1

    @property
    def allocated(self) -> bool:
        return self._buffer is not None

    def registration_problems(self, needs: BufferNeeds, world_size: int | None = None) -> list[str]:
        """Why ``needs`` cannot be registered (empty list: it can)."""
        world = self.world_size if world_size is None else world_size
        if self._closed:
            return ["the DeepEP buffer was closed"]
        out = []
        if "low_latency" in needs.modes:
            out += low_latency_shape_problems(
                needs.hidden_size, needs.top_k, needs.num_experts, world, needs.max_tokens_per_rank
            )
            others = {(n.hidden_size, n.num_experts) for n in self.needs if "low_latency" in n.modes}
            if others and (needs.hidden_size, needs.num_experts) not in others:
                out.append(
                    "low-latency layers sharing one DeepEP buffer must have the same (hidden_size, "
                    f"num_experts): registered {sorted(others)}, new ({needs.hidden_size}, "
                    f"{needs.num_experts})"
                )
        if "normal" in needs.modes:
            out += normal_shape_problems(needs.hidden_size, needs.top_k, needs.num_experts, world)
        if self.plan is not None:
            out += [f"the DeepEP buffer is already allocated and {p}" for p in self.plan.problems(needs, world)]
        return out

    def register(self, needs: BufferNeeds, world_size: int | None = None) -> None:
        """Add a layer's needs; raises :class:`DeepEPBufferError` naming what does not fit."""
        problems = self.registration_problems(needs, world_size)
        if problems:
            raise DeepEPBufferError(f"cannot register {needs} with the DeepEP buffer: " + "; ".join(problems))
        self.needs.append(needs)

    # -- allocation
    def _normal_sms(self, world: int) -> int | None:
        """The SM count the normal-mode kernels get on ``world`` ranks: ``num_sms`` where DeepEP's
        recommended chunk sizes are known, else ``None`` (DeepEP's default config)."""
        return self.num_sms if world in _NORMAL_CHUNKS["dispatch"] else None

    def _hints(self, deep_ep, world: int):
        buffer_cls = deep_ep.Buffer
        if self.num_sms is not None and self._normal_sms(world) is None:
            log.warning(
                "DeepEPBuffer(num_sms=%d) has no effect on %d ranks (normal mode runs on %s ranks only)",
                self.num_sms, world, sorted(_NORMAL_CHUNKS["dispatch"]),
            )  # fmt: skip
        if self._normal_sms(world) is None:
            self.dispatch_config = buffer_cls.get_dispatch_config(world)
            self.combine_config = buffer_cls.get_combine_config(world)
        else:
            sms = sm_count()
            if self.num_sms > sms:
                raise DeepEPBufferError(f"num_sms={self.num_sms} exceeds the GPU's {sms} SMs")
            self.dispatch_config, self.combine_config = (
                deep_ep.Config(self.num_sms, *_NORMAL_CHUNKS[op][world]) for op in ("dispatch", "combine")
            )

        def nvl_hint(hidden_bytes: int) -> int:
            return max(
                cfg.get_nvl_buffer_size_hint(hidden_bytes, world)
                for cfg in (self.dispatch_config, self.combine_config)
            )

        return nvl_hint, buffer_cls.get_low_latency_rdma_size_hint

    def get(self):
        """The ``deep_ep.Buffer``, allocated on first call (collective over the group)."""
        if self._closed:
            raise DeepEPBufferError("the DeepEP buffer was closed")
        if self._buffer is not None:
            return self._buffer
        if capturing(torch.device("cuda")):
            raise DeepEPBufferError(
                "the DeepEP buffer is allocated at the first batch; run one batch eagerly before "
                "capturing a CUDA graph"
            )
        deep_ep, reason = import_deep_ep()
        if deep_ep is None:
            raise DeepEPBufferError(reason)
        world = self.world_size
        nvl_hint, ll_hint = self._hints(deep_ep, world)
        plan = plan_buffer(self.needs, world, nvl_hint, ll_hint)
        if plan.low_latency_mode and _LIVE_LOW_LATENCY[0]:
            raise DeepEPBufferError(
                "another low-latency DeepEP buffer is alive in this process (NVSHMEM is initialized "
                "once per process): share one DeepEPBuffer between all layers of the group"
            )
        group = self.group if self.group is not None else dist.group.WORLD
        self._buffer = deep_ep.Buffer(
            group,
            plan.num_nvl_bytes,
            plan.num_rdma_bytes,
            low_latency_mode=plan.low_latency_mode,
            num_qps_per_rank=plan.num_qps_per_rank,
            allow_nvlink_for_low_latency_mode=self.allow_nvlink_for_low_latency,
            explicitly_destroy=True,
        )
        self.plan = plan
        if plan.low_latency_mode:
            _LIVE_LOW_LATENCY[0] += 1
        log.info(
            "DeepEP buffer allocated for %d layer(s): nvl %.1f MB, rdma %.1f MB, low_latency=%s "
            "(max_tokens_per_rank=%d, hidden=%d, experts=%d), normal-mode SMs %s",
            len(self.needs), plan.num_nvl_bytes / 1e6, plan.num_rdma_bytes / 1e6,
            plan.low_latency_mode, plan.ll_max_tokens, plan.ll_hidden_size, plan.ll_num_experts,
            self._normal_sms(world) or "DeepEP's default",
        )  # fmt: skip
        return self._buffer

    # -- mode switching
    def mark_normal_used(self) -> None:
        """Normal dispatch/combine dirties the low-latency signal area."""
        if self.plan is not None and self.plan.low_latency_mode:
            self._ll_dirty = True

    @property
    def low_latency_dirty(self) -> bool:
        return self._ll_dirty

    def clean_low_latency(self) -> bool:
        """Zero the low-latency signal buffers when a normal call ran since the last clean
        (DeepEP requires it). Returns whether it cleaned; the caller must order the clean before
        any peer's next low-latency dispatch (a collective after it does)."""
        if not self._ll_dirty:
            return False
        if capturing(torch.device("cuda")):
            raise DeepEPBufferError(
                "the low-latency buffer needs cleaning after normal-mode use, which cannot be "
                "captured: run one low-latency batch eagerly before capturing a CUDA graph"
            )
        p = self.plan
        self._buffer.clean_low_latency_buffer(p.ll_max_tokens, p.ll_hidden_size, p.ll_num_experts)
        self._ll_dirty = False
        return True

    # -- teardown
    def close(self) -> None:
        """Free the DeepEP buffer (collective: every rank of the group must call it)."""
        if self._closed:
            return
        self._closed = True
        if self._buffer is not None:
            if self.plan is not None and self.plan.low_latency_mode:
                _LIVE_LOW_LATENCY[0] -= 1
            self._buffer.destroy()
            self._buffer = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DeepEPBuffer(layers={len(self.needs)}, allocated={self.allocated}, plan={self.plan})"


# ------------------------------------------------------------------------------ dispatchers
def _common_problems(cfg: DispatchConfig) -> list[str]:
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
        out.append(f"deepep_buffer must be an epmoe.dispatch.deepep_dispatch.DeepEPBuffer; got {type(buf).__name__}")
    return out


def _needs(cfg: DispatchConfig, modes) -> BufferNeeds:
    return BufferNeeds(cfg.hidden_size, cfg.num_experts, cfg.top_k, cfg.max_tokens_per_rank, frozenset(modes))


class _DeepEPBase(Dispatcher):
    modes_needed: tuple[str, ...] = ()

    @classmethod
    def available(cls, cfg: DispatchConfig) -> tuple[bool, str]:
        problems = _common_problems(cfg)
        needs = _needs(cfg, cls.modes_needed)
        buf = cfg.deepep_buffer if isinstance(cfg.deepep_buffer, DeepEPBuffer) else DeepEPBuffer()
        problems += buf.registration_problems(needs, cfg.world_size)
        if problems:
            return False, "; ".join(dict.fromkeys(problems))
        return True, "available"

    def __init__(self, cfg: DispatchConfig) -> None:
        super().__init__(cfg)
        buf = cfg.deepep_buffer
        if buf is None:
            log.warning(
                "rank %d: no deepep_buffer given: this layer owns a private DeepEP buffer; pass one "
                "epmoe.dispatch.deepep_dispatch.DeepEPBuffer(group) to every layer of the group to share it",
                cfg.rank,
            )
            buf = DeepEPBuffer(cfg.group)
            cfg.deepep_buffer = buf
        self.buffer: DeepEPBuffer = buf
        self.buffer.register(_needs(cfg, self.modes_needed), cfg.world_size)


class DeepEPNormalDispatcher(_DeepEPBase):
    """DeepEP high-throughput dispatch (NVLink, intranode); see the module docstring."""

    name = "deepep_normal"
    layouts = frozenset({"contiguous"})
    payloads = frozenset(PAYLOADS)
    modes_needed = ("normal",)

    def send(self, x, x_scale, topk_ids, topk_weights) -> Dispatched:
        t = x.shape[0]
        cap = self.cfg.normal_max_tokens_per_rank
        if cap is not None and t > cap:
            raise ValueError(
                f"deepep_normal: batch of {t} tokens exceeds normal_max_tokens_per_rank={cap} on rank "
                f"{self.cfg.rank} (every rank's receive buffers assume it); raise it or set it to None"
            )
        return self._send(x, x_scale, topk_ids, topk_weights, bounded=cap is not None, hint_tokens=t)

    def _send(self, x, x_scale, topk_ids, topk_weights, *, bounded: bool, hint_tokens: int) -> Dispatched:
        """Dispatch; with ``bounded`` every rank's batch is known to fit
        ``cfg.normal_max_tokens_per_rank`` (checked by the caller), so DeepEP allocates the worst
        case and the host does not wait for the receive counts. ``hint_tokens``: tokens per rank
        the rows-per-expert hint assumes."""
        t = x.shape[0]
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
            hint = expected_rows_per_expert(max(hint_tokens, 1), cfg.world_size, cfg.top_k, cfg.num_experts)
            sizes = dict(expected_m=hint)
        else:
            sizes = dict(padded_rows=list(padded_rows))
        return Dispatched(
            x=rx, x_scale=rs, handle=("normal", handle, t), num_tokens=t,
            topk_ids=recv_ids, topk_weights=recv_w, **sizes,
        )  # fmt: skip

    def combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        _, handle, t = dispatched.handle
        out, _, _ = self.buffer.get().combine(
            as_contiguous(y, torch.bfloat16), handle, config=self.buffer.combine_config
        )
        self.buffer.mark_normal_used()
        return out if out.shape[0] == t else out[:t]  # a slice costs microseconds of host time


class DeepEPLowLatencyDispatcher(_DeepEPBase):
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
        cap = self.cfg.max_tokens_per_rank
        if t > cap:
            raise ValueError(
                f"deepep_low_latency: batch of {t} tokens exceeds max_tokens_per_rank={cap} on rank "
                f"{self.cfg.rank}; raise max_tokens_per_rank or use dispatch='deepep_auto'"
            )
        buf = self.buffer.get()
        if self.buffer.clean_low_latency():
            # Every peer must have cleaned before anyone sends low-latency traffic.
            _device_barrier(self.buffer.group, x.device)
        return self._dispatch(buf, x, topk_ids, topk_weights)

    def _dispatch(self, buf, x, topk_ids, topk_weights) -> Dispatched:
        t = x.shape[0]
        if not t:
            x, topk_ids, topk_weights = pad_empty_batch(x, topk_ids, topk_weights)
        cfg = self.cfg
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
            x=rx, x_scale=rs, handle=("low_latency", handle, t, ids, weights),
            num_tokens=t, masked_m=count,
            expected_m=expected_rows_per_expert(max(t, 1), cfg.world_size, cfg.top_k, cfg.num_experts),
            combine_applies_weights=True,
        )  # fmt: skip

    def combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        _, handle, t, topk_ids, topk_weights = dispatched.handle
        out, _, _ = self.buffer.get().low_latency_combine(
            as_contiguous(y, torch.bfloat16), topk_ids, topk_weights, handle,
            async_finish=False, return_recv_hook=False,
        )  # fmt: skip
        return out if out.shape[0] == t else out[:t]


class DeepEPAutoDispatcher(_DeepEPBase):
    """Low-latency while every rank's batch fits ``max_tokens_per_rank``, normal otherwise.

    Rule (identical on every rank): the ranks all-reduce (MAX) their token counts, then
    :func:`choose_mode`. Cost: one small NCCL all-reduce and a host sync per batch. During
    CUDA-graph capture no collective runs: the batch must fit and goes low-latency. A batch over
    the capacity never fails: it runs in normal mode, and the first time is logged.
    """

    name = "deepep_auto"
    layouts = frozenset({"contiguous", "masked"})
    payloads = frozenset(PAYLOADS)
    modes_needed = ("normal", "low_latency")

    def __init__(self, cfg: DispatchConfig) -> None:
        super().__init__(cfg)
        self.normal = DeepEPNormalDispatcher.__new__(DeepEPNormalDispatcher)
        self.low_latency = DeepEPLowLatencyDispatcher.__new__(DeepEPLowLatencyDispatcher)
        for sub in (self.normal, self.low_latency):
            Dispatcher.__init__(sub, cfg)
            sub.buffer = self.buffer
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

    def _route(self, x, x_scale, topk_ids, topk_weights, quantized: bool) -> Dispatched:
        buf = self.buffer.get()
        # Clean before the all-reduce in decide(): the collective orders every rank's clean
        # before any rank's next low-latency dispatch.
        self.buffer.clean_low_latency()
        mode, global_max = self._decide(x.shape[0], x.device)
        self.stats[mode] += 1
        if mode == "low_latency":
            if x_scale is not None:
                raise ValueError(
                    "deepep_auto chose low-latency mode, which takes floating-point activations; "
                    "got a pre-quantized payload (call dispatch(), which quantizes per mode)"
                )
            return self.low_latency._dispatch(buf, x, topk_ids, topk_weights)
        if not quantized:
            x, x_scale = quantize_payload(x, self.cfg.payload)
        # Every rank knows the largest batch here, so all agree on whether the bound holds: a
        # batch over normal_max_tokens_per_rank runs host-synced on every rank instead of raising
        # on one and leaving its peers waiting inside DeepEP.
        cap = self.cfg.normal_max_tokens_per_rank
        bounded = cap is not None and global_max <= cap
        if cap is not None and not bounded:
            self._over_limit_once(global_max, "normal_max_tokens_per_rank", cap,
                                  "such batches wait on the host for DeepEP's receive counts")  # fmt: skip
        return self.normal._send(x, x_scale, topk_ids, topk_weights, bounded=bounded, hint_tokens=global_max)

    def combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        if dispatched.handle[0] == "low_latency":
            return self.low_latency.combine(y, dispatched)
        return self.normal.combine(y, dispatched)


__all__ = [
    "BufferNeeds", "BufferPlan", "DeepEPAutoDispatcher", "DeepEPBuffer", "DeepEPBufferError",
    "DeepEPLowLatencyDispatcher", "DeepEPNormalDispatcher", "choose_mode",
    "low_latency_shape_problems", "low_latency_tokens", "normal_payload", "normal_shape_problems",
    "pad_empty_batch", "plan_buffer",
]  # fmt: skip
