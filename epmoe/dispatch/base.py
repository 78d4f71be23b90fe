"""The dispatcher contract.

A dispatcher moves token rows to the ranks that own their experts and brings the expert outputs
back. ``dispatch`` returns a :class:`Dispatched` that carries everything ``combine`` needs (the
handle): the dispatcher object itself keeps nothing per batch, so two batches can be in flight.

Each dispatcher declares:

* ``layouts``: ``{"contiguous"}`` (it delivers received tokens that the layer scatters into the
  contiguous layout), ``{"masked"}`` (it delivers a masked batch), or both (an auto dispatcher that
  picks per batch); the backend must implement every layout the dispatcher may deliver;
* ``payloads``: the activation formats it can carry (see :data:`PAYLOADS`); it quantizes into
  ``cfg.payload`` itself, so a mode that casts inside the collective (DeepEP low-latency) needs no
  quantize-dequantize round trip;
* ``keeps_rows``: ``dispatch`` moves nothing (every expert is local, the received rows are the
  sent ones and the ids are local ids) and ``combine`` returns what it is given; the layer may
  then route, lay out and quantize a small batch itself in one launch (the decode prep) instead
  of calling ``dispatch`` and ``combine``;
* per batch, :attr:`Dispatched.combine_applies_weights`: whether ``combine`` multiplies by the
  top-k weights itself. When it does not, the layer applies them in the weighted gather before
  ``combine``; either way exactly once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..quant.payload import quantize_payload
from ..tensors import check_positive_int

PAYLOADS = ("float", "int8_token", "int8_group", "fp8_group")
"""Activation formats on the wire: the input dtype; int8 with a per-token or per-1x128 fp32 scale;
e4m3 with per-1x128 fp32 scales."""

LOW_LATENCY_PAYLOADS = ("float", "fp8_group")
"""What low-latency paths carry: BF16, or FP8 with 1x128 scales cast inside the collective."""


@dataclass
class Dispatched:
    """What arrived on this rank, plus the handle to send results back.

    Token layout (``layout == "contiguous"``: the layer scatters these rows into it):
        x: ``[R, H]`` received rows (payload dtype); x_scale: ``[R, S]`` fp32 or ``None``;
        topk_ids: ``[R, k]`` int64 local expert ids, ``-1`` for slots of other ranks;
        topk_weights: ``[R, k]`` fp32.
        padded_rows: optional host list ``[E_loc]``: rows per local expert rounded up to
            ``cfg.alignment``, when the dispatcher knows them without a device sync (DeepEP
            normal mode reports them); the layer's scatter then skips its own count read-back.
        expected_m (contiguous): set with ``padded_rows=None`` when the dispatcher did not wait
            for the receive counts (its rows past the received ones have ``topk_ids`` ``-1``):
            the layer then keeps the segment sizes on the device when its backend can
            (``device_segments``), with this rows-per-expert hint.
    Masked layout (``layout == "masked"``):
        x: ``[E_loc, cap, H]``; x_scale: ``[E_loc, cap, S]`` or ``None``; masked_m: ``[E_loc]``
        int32; expected_m: row-count hint.
    Both:
        handle: dispatcher-private state for ``combine``.
        num_tokens: tokens this rank sent (the row count ``combine`` returns).
        combine_applies_weights: ``True`` when ``combine`` weighs the expert outputs itself.
    """

    x: torch.Tensor
    x_scale: torch.Tensor | None
    handle: Any
    num_tokens: int
    topk_ids: torch.Tensor | None = None
    topk_weights: torch.Tensor | None = None
    padded_rows: list[int] | None = None
    masked_m: torch.Tensor | None = None
    expected_m: int | None = None
    combine_applies_weights: bool = False

    @property
    def layout(self) -> str:
        return "masked" if self.masked_m is not None else "contiguous"


@dataclass(frozen=True)
class DispatchConfig:
    """What a dispatcher is built from: complete before it is built, never written after (frozen;
    derive a variant with :func:`dataclasses.replace`).

    Attributes:
        num_experts: global expert count ``E``.
        hidden_size: ``H``.
        top_k: experts per token.
        group: process group, or ``None`` for a single process / the default group.
        world_size, rank: of ``group``.
        device: where the tokens live.
        alignment: rows each expert segment is padded to in the contiguous layout (the backend's).
        timeout_s: how long the host waits on a collective before raising.
        max_tokens_per_rank: capacity of fixed-size (low-latency) dispatch.
        normal_max_tokens_per_rank: a bound on every rank's batch that normal-mode DeepEP
            dispatch may assume (``None``: none). With it the host does not wait for the receive
            counts: buffers are sized for ``world_size x`` this many received tokens.
        deepep_buffer: the shared DeepEP buffer owner, when DeepEP is used (``None``: a DeepEP
            dispatcher makes a private one).
        payload: what the dispatcher quantizes activations into before sending them (one of
            :data:`PAYLOADS`; the layer picks the scheme's own format when the dispatcher carries it).
        low_latency_payload: the same for low-latency paths, which cast inside the collective:
            ``"float"`` (BF16 on the wire) or ``"fp8_group"``.
    """

    num_experts: int
    hidden_size: int
    top_k: int
    group: Any = None
    world_size: int = 1
    rank: int = 0
    device: torch.device = torch.device("cpu")
    alignment: int = 1
    timeout_s: float = 300.0
    max_tokens_per_rank: int = 128
    normal_max_tokens_per_rank: int | None = None
    deepep_buffer: Any = None
    payload: str = "float"
    low_latency_payload: str = "float"

    def __post_init__(self) -> None:
        # Frozen: the normalized value replaces the given one once, here, before anyone reads it.
        object.__setattr__(self, "normal_max_tokens_per_rank", check_positive_int(
            "normal_max_tokens_per_rank", self.normal_max_tokens_per_rank, optional=True
        ))  # fmt: skip
        for name, value, allowed in (
            ("payload", self.payload, PAYLOADS), ("low_latency_payload", self.low_latency_payload, LOW_LATENCY_PAYLOADS),
        ):  # fmt: skip
            if value not in allowed:
                raise ValueError(f"{name}={value!r}; allowed: {list(allowed)}")

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.world_size


class Dispatcher(ABC):
    """Base class of dispatchers; see the module docstring for the declared attributes."""

    name: ClassVar[str]
    layouts: ClassVar[frozenset[str]]
    payloads: ClassVar[frozenset[str]]
    keeps_rows: ClassVar[bool] = False

    def __init__(self, cfg: DispatchConfig) -> None:
        self.cfg = cfg

    @classmethod
    def available(cls, cfg: DispatchConfig) -> tuple[bool, str]:
        """Whether this dispatcher can run for ``cfg`` (ranks, device, sizes) here."""
        return True, "available"

    def dispatch(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> Dispatched:
        """Quantize rows into ``cfg.payload`` and send them to their experts' ranks.

        Args:
            x: ``[T, H]`` floating-point activations.
            topk_ids: ``[T, k]`` int64 global expert ids.
            topk_weights: ``[T, k]`` fp32.
        """
        x, x_scale = quantize_payload(x, self.cfg.payload)
        return self.send(x, x_scale, topk_ids, topk_weights)

    @abstractmethod
    def send(
        self,
        x: torch.Tensor,
        x_scale: torch.Tensor | None,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> Dispatched:
        """Send an already-quantized payload (the second half of :meth:`dispatch`).

        Args:
            x: ``[T, H]`` payload (float, int8 or e4m3) in ``cfg.payload``'s format.
            x_scale: ``[T, S]`` fp32, or ``None`` for a float payload.
            topk_ids: ``[T, k]`` int64 global expert ids.
            topk_weights: ``[T, k]`` fp32.
        """

    @abstractmethod
    def combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """Bring results home and sum them per token.

        Args:
            y: token layout: ``[R, H]`` already weighted per received token; masked layout:
                ``[E_loc, cap, H]`` expert outputs (weights applied here).
            dispatched: what :meth:`dispatch` returned.

        Returns:
            ``[T, H]`` fp32 or the input dtype.
        """
