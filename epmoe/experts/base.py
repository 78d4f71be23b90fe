"""The experts-backend contract.

A backend computes ``w2 . silu_and_mul(w13 . x)`` for every local expert on one layout. It
declares the schemes and layouts it supports and answers ``supports(...) -> (ok, reason)`` so the
layer can say why it was or was not chosen.

Input activations reach a backend either in floating point (``x_scale is None``: the backend
quantizes them the way its scheme does) or already quantized (``x_scale`` given). A quantized input
whose format differs from the scheme's (FP8 1x128 from low-latency dispatch into an INT8 backend)
is dequantized and requantized by the backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..layouts import ContiguousBatch, MaskedBatch
from ..quant.schemes import BLOCK, QuantScheme

ACCUMULATORS = ("fp32", "int32")


@dataclass
class ExpertWeights:
    """The local experts' weights, stored out x in.

    Attributes:
        scheme: the quantization scheme.
        w13: ``[E, 2I, H]`` gate rows then up rows (bf16/fp16/fp32, int8 or e4m3).
        w2: ``[E, H, I]``.
        w13_scale: fp32 ``[E, 2I, 1]`` (channel) or ``[E, 2I/128, H/128]`` (block), else ``None``.
        w2_scale: fp32 ``[E, H, 1]`` or ``[E, H/128, I/128]``, else ``None``.
    """

    scheme: QuantScheme
    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None

    def contiguous(self) -> ExpertWeights:
        """The same weights with contiguous tensors and fp32 scales (what every kernel reads)."""

        def scale(t):
            return None if t is None else t.float().contiguous()

        return ExpertWeights(
            self.scheme, self.w13.contiguous(), self.w2.contiguous(), scale(self.w13_scale), scale(self.w2_scale)
        )

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w13.shape[2]

    @property
    def intermediate_size(self) -> int:
        return self.w2.shape[2]


class ExpertsBackend(ABC):
    """Base class of experts backends.

    Class attributes:
        name: the value of the layer's ``backend=`` argument that selects it.
        schemes: scheme names it implements.
        layouts: ``"contiguous"`` and/or ``"masked"``.
        device_segments: ``run_contiguous`` takes a batch whose segment sizes live only on the
            device (``ContiguousBatch.expected_m`` set, spare rows past the last segment), so the
            layer need not read the counts back; otherwise it gets exact host-sized batches.
        prefers_host_sizes: with ``device_segments``, the backend still picks its kernels by the
            host's row counts when they can be had (the layer then reads them back in eager
            mode; under CUDA-graph capture and ``torch.compile`` it gets device sizes).
        compile_segments: while ``torch.compile`` traces, ``run_contiguous`` takes device-sized
            batches even without ``device_segments`` (a traceable path of its own), so a compiled
            graph holds no host read.
        mn_major_scales: the contiguous batch's activation scales are wanted MN-major
            (:func:`~epmoe.kernels.common.mn_major_scales`; the layer asks the scatter for them so).

    Instances carry only configuration (scheme, accumulator); nothing per batch.
    """

    name: ClassVar[str]
    schemes: ClassVar[frozenset[str]]
    layouts: ClassVar[frozenset[str]]
    device_segments: ClassVar[bool] = False
    prefers_host_sizes: ClassVar[bool] = False
    compile_segments: ClassVar[bool] = False
    mn_major_scales: ClassVar[bool] = False

    def __init__(self, scheme: QuantScheme, *, accumulator: str = "fp32") -> None:
        if scheme.name not in type(self).schemes:
            raise ValueError(
                f"backend {type(self).name!r} runs quant in {sorted(type(self).schemes)}; got quant={scheme.name!r}"
            )
        if accumulator not in ACCUMULATORS:
            raise ValueError(f"accumulator={accumulator!r}; allowed: {list(ACCUMULATORS)}")
        if accumulator == "int32" and scheme.name != "int8_channel":
            raise ValueError(
                f"accumulator='int32' applies to quant='int8_channel' only; got quant={scheme.name!r}"
            )
        self.scheme = scheme
        self.accumulator = accumulator

    @property
    def alignment(self) -> int:
        """Rows each expert segment of the contiguous layout is padded to."""
        return 1

    def alignment_for(self, rows_per_expert: int, device: torch.device) -> int:
        """The alignment for a batch of about ``rows_per_expert`` rows per expert on ``device``,
        when the layer lays the batch out itself from a rows-per-expert hint (local dispatch): a backend that
        runs other kernels by batch size may want less padding for some of them."""
        return self.alignment

    @classmethod
    def available(cls, device: torch.device) -> tuple[bool, str]:
        """Whether the libraries and hardware this backend needs are present on ``device``."""
        return True, "available"

    @classmethod
    def supports(
        cls,
        scheme: QuantScheme,
        layout: str,
        device: torch.device,
        hidden: int,
        intermediate: int,
        *,
        accumulator: str = "fp32",
    ) -> tuple[bool, str]:
        """Whether this backend can run ``scheme`` on ``layout`` for these sizes on ``device``
        (``accumulator``: the one the layer will construct it with)."""
        if scheme.name not in cls.schemes:
            return False, f"does not implement quant={scheme.name!r} (has {sorted(cls.schemes)})"
        if layout not in cls.layouts:
            return False, f"does not implement the {layout} layout (has {sorted(cls.layouts)})"
        if scheme.needs_block_alignment and (hidden % BLOCK or intermediate % BLOCK):
            return False, (
                f"quant={scheme.name!r} needs hidden and intermediate sizes that are multiples of "
                f"{BLOCK}; got hidden={hidden}, intermediate={intermediate}"
            )
        return cls.available(device)

    def require_exact_batch(self, batch: ContiguousBatch) -> None:
        """Refuse a batch with spare rows (device-side segment sizes) in a backend that runs
        over every row of ``batch.x``."""
        if batch.expected_m is not None and not self.device_segments:
            raise ValueError(
                f"backend {self.name!r} needs a contiguous batch sized on the host; got one with "
                f"spare rows (expected_m={batch.expected_m}): build it with to_contiguous(..., "
                "expected_m=None)"
            )

    def prepare_weights(self, weights: ExpertWeights) -> ExpertWeights:
        """Hook for a backend-specific weight layout, called once after weights change. The
        default checks them against the scheme and makes them contiguous (what the Triton,
        DeepGEMM — K-major e4m3 with contiguous 128x128 fp32 scales — and CUTLASS kernels read)."""
        check_weights(weights, self.scheme)
        return weights.contiguous()

    @abstractmethod
    def run_contiguous(
        self, batch: ContiguousBatch, weights: ExpertWeights, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """Experts over the contiguous layout: returns ``[M, H]`` of ``out_dtype`` (padding rows
        hold anything)."""

    @abstractmethod
    def run_masked(
        self, batch: MaskedBatch, weights: ExpertWeights, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """Experts over the masked layout: returns ``[E, cap, H]`` of ``out_dtype`` (rows past
        ``masked_m`` hold anything)."""


def check_weights(weights: ExpertWeights, scheme: QuantScheme) -> None:
    """The shapes and dtypes every backend's kernels rely on (``w13 [E, 2I, H]``, ``w2 [E, H, I]``,
    the scheme's storage dtype and weight-scale shapes), with messages naming what is wrong."""
    w13, w2 = weights.w13, weights.w2
    if weights.scheme.name != scheme.name:
        raise ValueError(f"weights are quant={weights.scheme.name!r} but the backend runs quant={scheme.name!r}")
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w13 must be [E, 2I, H] and w2 [E, H, I]; got {tuple(w13.shape)} and {tuple(w2.shape)}")
    e, two_i, hidden = w13.shape
    if tuple(w2.shape) != (e, hidden, two_i // 2) or two_i % 2:
        raise ValueError(f"w2 shape {tuple(w2.shape)} does not match w13 {tuple(w13.shape)}: expected [{e}, {hidden}, {two_i // 2}]")
    if scheme.quantized:
        if w13.dtype != scheme.qdtype or w2.dtype != scheme.qdtype:
            raise TypeError(f"quant={scheme.name!r} needs {scheme.qdtype} weights; got {w13.dtype} and {w2.dtype}")
        for name, w, s in (("w13", w13, weights.w13_scale), ("w2", w2, weights.w2_scale)):
            want = scheme.weight_scale_shape(*w.shape)
            if s is None or tuple(s.shape) != want:
                got = None if s is None else tuple(s.shape)
                raise ValueError(f"{name}_scale shape {got}; quant={scheme.name!r} with {name} {tuple(w.shape)} needs {list(want)}")
    elif w13.dtype not in (torch.bfloat16, torch.float16, torch.float32) or w2.dtype != w13.dtype:
        raise TypeError(f"quant='bf16' needs w13 and w2 of one dtype in bf16/fp16/fp32; got {w13.dtype} and {w2.dtype}")


def fp8_gemm_input(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    hidden: int,
    masked_m: torch.Tensor | None = None,
    expected_m: int | None = None,
    row_expert: torch.Tensor | None = None,
    scale_mn_major: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GEMM1's operand as e4m3 with ``[.., K/128]`` fp32 scales: used as it is when it arrived so
    (DeepEP low-latency FP8 keeps its MN-major, TMA-aligned scales), else quantized (float input)
    or requantized (another quantized format) with the Triton quantizer of
    :mod:`epmoe.kernels.quantize` (through :mod:`epmoe.ops`); ``masked_m`` (masked layout) limits that to the
    valid rows, ``expected_m`` (with it) sizes the quantizer's grid, ``row_expert`` (a contiguous
    layout's ``m_indices``) skips its padding rows; ``scale_mn_major``: scales it writes are stored
    MN-major (:func:`~epmoe.kernels.common.mn_major_scales`)."""
    from .. import ops

    if x.shape[-1] != hidden:
        raise ValueError(f"x has hidden size {x.shape[-1]}; the weights expect {hidden}")
    rows = expected_m if masked_m is not None else None  # a grid hint only over masked rows
    if x_scale is None:
        if not x.is_floating_point():
            raise TypeError(f"x of dtype {x.dtype} arrived without x_scale")
        return ops.per_group_quant(x, BLOCK, torch.float8_e4m3fn, masked_m=masked_m, expected_m=rows,
                                   row_expert=row_expert, scale_mn_major=scale_mn_major)  # fmt: skip
    if x.dtype == torch.float8_e4m3fn and x_scale.shape[-1] == hidden // BLOCK:
        return x, x_scale.float()
    return ops.per_group_quant(x, BLOCK, torch.float8_e4m3fn, x_scale, masked_m=masked_m, expected_m=rows,
                               row_expert=row_expert, scale_mn_major=scale_mn_major)  # fmt: skip
