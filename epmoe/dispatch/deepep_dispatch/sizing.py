"""DeepEP's sizing rules: the sizes its kernels take, how large one shared buffer must be for the
layers registered with it, and auto mode's capacity rule. Pure functions and records: nothing here
needs ``deep_ep``, a GPU or a process group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ...errors import DeepEPBufferError

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


def expected_rows_per_expert(num_tokens: int, world_size: int, top_k: int, num_experts: int) -> int:
    """Rows-per-expert hint (masked layout, device-sized contiguous layout): rows a local expert
    gets when every rank sends ``num_tokens`` tokens with uniform routing (a host-side number,
    so it is fixed inside a CUDA graph)."""
    return max(1, -(-(num_tokens * world_size * top_k) // max(num_experts, 1)))
