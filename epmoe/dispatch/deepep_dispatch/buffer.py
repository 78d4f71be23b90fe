"""The owner of a process group's one ``deep_ep.Buffer``: layers register what they need when they
are built; the buffer is allocated at first use, sized from the largest registration (the rules are
in :mod:`.sizing`), and shared by all layers of the group.

``deep_ep`` is imported lazily, so this module imports without it.
"""

from __future__ import annotations

import itertools
import logging
import weakref

import torch
import torch.distributed as dist

from ...devices import sm_count
from ...tensors import capturing
from .sizing import (
    _NORMAL_CHUNKS, BufferNeeds, BufferPlan, DeepEPBufferError, check_num_sms, low_latency_shape_problems, normal_shape_problems,
    plan_buffer,
)  # fmt: skip

log = logging.getLogger("epmoe")


def import_deep_ep():
    """``deep_ep`` or ``None`` plus the reason it cannot be imported."""
    try:
        import deep_ep  # noqa: F401
    except Exception as exc:  # ImportError, or OSError from a missing shared library
        return None, f"deep_ep is not importable ({type(exc).__name__}: {exc})"
    return deep_ep, ""



_OPEN: weakref.WeakValueDictionary[int, DeepEPBuffer] = weakref.WeakValueDictionary()
"""Open buffer owners by :attr:`DeepEPBuffer.id`: how the DeepEP custom ops (:mod:`epmoe.ops`), whose
arguments can only be tensors and plain values, reach the buffer of their dispatcher. Weak: the
owner's lifetime stays with its layers; :meth:`DeepEPBuffer.close` removes it."""

_IDS = itertools.count(1)


def buffer_by_id(buffer_id: int) -> DeepEPBuffer:
    """The open :class:`DeepEPBuffer` whose ``id`` is ``buffer_id``."""
    owner = _OPEN.get(buffer_id)
    if owner is None:
        raise DeepEPBufferError(f"no open DeepEPBuffer has id={buffer_id} (it was closed or garbage-collected)")
    return owner


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
        self.normal_channels: int | None = None  # DeepEP's channels (SMs / 2) of the normal kernels
        self.id = next(_IDS)  # the key the DeepEP custom ops find this owner by (buffer_by_id)
        _OPEN[self.id] = self

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
        # The channel count sizes the handle's prefix matrices, which a traced graph must know.
        self.normal_channels = (self._normal_sms(world) or buffer_cls.num_sms) // 2
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
        _OPEN.pop(self.id, None)
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
