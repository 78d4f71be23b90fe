"""The deepgemm experts backend: DeepGEMM's m-grouped FP8 GEMMs (SM90, 1x128 x 128x128 scales).

One forward, on either layout, with no host synchronisation (CUDA-graph capturable after
:meth:`DeepGemmBackend.warmup`):

    quantize x to e4m3 1x128 (unless it arrived so) -> GEMM1 (w13)
    -> silu(gate) * up requantized to e4m3 1x128 (one fused Triton kernel) -> GEMM2 (w2)

* contiguous (normal / all-to-all dispatch): ``m_grouped_fp8_gemm_nt_contiguous`` with
  ``m_indices`` (``-1`` on padding); every expert segment is padded to DeepGEMM's M alignment (128).
* masked (low-latency dispatch): ``m_grouped_fp8_gemm_nt_masked`` with ``masked_m`` and the
  ``expected_m`` hint; DeepEP's MN-major, TMA-aligned scales pass through untouched.

DeepGEMM renamed its API over time; :func:`deep_gemm_api` resolves whichever names the installed
version has (current ``m_grouped_fp8_gemm_nt_*``, ``m_grouped_fp8_fp4_gemm_nt_*`` or the legacy
``m_grouped_gemm_fp8_fp8_bf16_nt_*``). Activation scales are handed over fp32 ``[M, K/128]``: current
DeepGEMM moves them into the MN-major TMA-aligned layout itself (a no-op when they already are);
for the legacy API this module does it with ``get_col_major_tma_aligned_tensor``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from ..layouts import ContiguousBatch, MaskedBatch
from ..quant.schemes import BLOCK, QuantScheme
from ..timing import phase
from . import stages
from .base import ExpertsBackend, ExpertWeights, fp8_gemm_input
from .fp8_selection import deepgemm_decision, machine_facts

log = logging.getLogger("epmoe")

CONTIGUOUS_NAMES = (
    "m_grouped_fp8_gemm_nt_contiguous",
    "m_grouped_fp8_fp4_gemm_nt_contiguous",
    "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous",  # DeepGEMM v1 (legacy)
)
MASKED_NAMES = (
    "m_grouped_fp8_gemm_nt_masked",
    "m_grouped_fp8_fp4_gemm_nt_masked",
    "fp8_m_grouped_gemm_nt_masked",
    "m_grouped_gemm_fp8_fp8_bf16_nt_masked",  # DeepGEMM v1 (legacy)
)
TMA_NAMES = ("get_mn_major_tma_aligned_tensor", "get_col_major_tma_aligned_tensor")
ALIGNMENT_NAMES = ("get_mk_alignment_for_contiguous_layout", "get_m_alignment_for_contiguous_layout")
LEGACY_NAMES = frozenset({"m_grouped_gemm_fp8_fp8_bf16_nt_contiguous", "m_grouped_gemm_fp8_fp8_bf16_nt_masked"})
DEFAULT_ALIGNMENT = 128


@dataclass
class DeepGemmAPI:
    """The DeepGEMM functions this backend calls, resolved by name (see :data:`CONTIGUOUS_NAMES` ...).

    Attributes:
        module: the imported ``deep_gemm``.
        contiguous / masked: ``fn((a, sfa), (b, sfb), d, m_indices)`` and
            ``fn((a, sfa), (b, sfb), d, masked_m, expected_m)``; ``None`` when absent.
        tma_aligned: ``fn(sf) -> sf`` into the MN-major TMA-aligned layout, or ``None``.
        alignment: M alignment of the contiguous layout.
        names: which name each entry resolved to.
        needs_tma_scales: the legacy API wants activation scales already TMA-aligned.
    """

    module: object
    contiguous: Callable | None
    masked: Callable | None
    tma_aligned: Callable | None
    alignment: int
    names: dict[str, str] = field(default_factory=dict)
    needs_tma_scales: bool = False


def _first(module, names: Iterable[str]) -> tuple[Callable | None, str]:
    for name in names:
        fn = getattr(module, name, None)
        if callable(fn):
            return fn, name
    return None, ""


def resolve_api(module) -> DeepGemmAPI:
    """Build the function table from an imported ``deep_gemm`` (or any object with its names)."""
    contiguous, c_name = _first(module, CONTIGUOUS_NAMES)
    masked, m_name = _first(module, MASKED_NAMES)
    tma, t_name = _first(module, TMA_NAMES)
    align_fn, a_name = _first(module, ALIGNMENT_NAMES)
    alignment = DEFAULT_ALIGNMENT
    if align_fn is not None:
        try:
            alignment = int(align_fn())
        except Exception as exc:  # a DeepGEMM that needs a device for it
            # A warning: every contiguous batch is padded to this value, now a guess rather than
            # DeepGEMM's answer. Once per process: deep_gemm_api is cached.
            log.warning(
                "deep_gemm.%s() failed (%s: %s); the contiguous layout pads each expert segment "
                "to %d rows, epmoe's default, instead of the alignment it would have returned",
                a_name, type(exc).__name__, exc, alignment,
            )  # fmt: skip
    names = {"contiguous": c_name, "masked": m_name, "tma_aligned": t_name, "alignment": a_name}
    legacy = c_name in LEGACY_NAMES or m_name in LEGACY_NAMES
    return DeepGemmAPI(module, contiguous, masked, tma, alignment, names, legacy)


@functools.lru_cache(maxsize=1)
def deep_gemm_api() -> DeepGemmAPI | None:
    """The resolved API of the installed DeepGEMM, or ``None`` when it does not import."""
    try:
        module = importlib.import_module("deep_gemm")
    except Exception as exc:  # ImportError, or OSError from its C++ module
        _import_error[0] = f"{type(exc).__name__}: {exc}"
        return None
    api = resolve_api(module)
    log.info("deep_gemm %s: %s", getattr(module, "__version__", "?"), api.names)
    return api


_import_error = [""]


def _installed() -> dict[str, bool]:
    return {"deep_gemm": importlib.util.find_spec("deep_gemm") is not None and deep_gemm_api() is not None}


def _require_api(layout: str) -> DeepGemmAPI:
    api = deep_gemm_api()
    if api is None:
        raise RuntimeError(f"deep_gemm is not importable ({_import_error[0]})")
    fn = api.contiguous if layout == "contiguous" else api.masked
    if fn is None:
        names = CONTIGUOUS_NAMES if layout == "contiguous" else MASKED_NAMES
        raise RuntimeError(f"this deep_gemm has none of {list(names)}")
    return api


# ------------------------------------------------------------------------------------ GEMM calls
def _scales_for(api: DeepGemmAPI, sf: torch.Tensor) -> torch.Tensor:
    sf = sf if sf.dtype == torch.float32 else sf.float()
    if api.needs_tma_scales and api.tma_aligned is not None:
        return api.tma_aligned(sf)
    return sf


def gemm_contiguous(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    m_indices: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[i] = (a[i] * a_scale[i]) @ (b[g] * b_scale[g])^T`` with ``g = m_indices[i]`` (bf16;
    rows with ``m_indices = -1`` are unspecified)."""
    api = _require_api("contiguous")
    if out is None:
        out = torch.empty((a.shape[0], b.shape[1]), dtype=torch.bfloat16, device=a.device)
    if a.shape[0] == 0:
        return out
    api.contiguous((a, _scales_for(api, a_scale)), (b, b_scale), out, m_indices)
    return out


MASKED_CAP_ALIGN = 128
"""DeepGEMM's SM90 masked kernels walk each group's rows in blocks of up to 128 and get wrong
groups when the capacity is not a multiple of the block (seen on an H200, 2026-11-30: capacity 96
wrong, 128 right, docs/fp8.md). Capacities are padded to this."""


def masked_capacity(cap: int) -> int:
    """``cap`` rounded up to :data:`MASKED_CAP_ALIGN`."""
    return -(-cap // MASKED_CAP_ALIGN) * MASKED_CAP_ALIGN


def pad_capacity(t: torch.Tensor | None, cap: int) -> torch.Tensor | None:
    """``[E, c, ...]`` -> ``[E, cap, ...]`` with zero rows appended (``t`` itself when ``c == cap``)."""
    if t is None or t.shape[1] == cap:
        return t
    out = t.new_zeros((t.shape[0], cap, *t.shape[2:]))
    out[:, : t.shape[1]] = t
    return out


def gemm_masked(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    masked_m: torch.Tensor,
    expected_m: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[g, :masked_m[g]] = (a[g] * a_scale[g]) @ (b[g] * b_scale[g])^T`` (bf16; rows past
    ``masked_m[g]`` are unspecified). A capacity that is not a multiple of
    :data:`MASKED_CAP_ALIGN` is padded (one copy of ``a``); DeepEP's capacities need none."""
    api = _require_api("masked")
    e, cap, _ = a.shape
    if out is None:
        out = torch.empty((e, cap, b.shape[1]), dtype=torch.bfloat16, device=a.device)
    if cap == 0 or e == 0:
        return out
    padded = masked_capacity(cap)
    if padded != cap:
        full = gemm_masked(
            pad_capacity(a, padded), pad_capacity(a_scale, padded), b, b_scale, masked_m, expected_m
        )
        out.copy_(full[:, :cap])
        return out
    api.masked((a, _scales_for(api, a_scale)), (b, b_scale), out, masked_m, max(1, int(expected_m)))
    return out


# -------------------------------------------------------------------------------------- backend
class DeepGemmBackend(ExpertsBackend):
    name = "deepgemm"
    schemes = frozenset({"fp8_block"})
    layouts = frozenset({"contiguous", "masked"})

    @property
    def alignment(self) -> int:
        api = deep_gemm_api()
        return DEFAULT_ALIGNMENT if api is None else api.alignment

    @classmethod
    def available(cls, device: torch.device) -> tuple[bool, str]:
        device = torch.device(device)
        capability, _ = machine_facts(device)
        installed = _installed() if capability is not None else {}
        decision = deepgemm_decision(capability, installed)
        if not decision.ok and capability is not None and _import_error[0]:
            return False, f"{decision.reason}: {_import_error[0]}"
        return decision.ok, decision.reason

    @classmethod
    def supports(
        cls, scheme: QuantScheme, layout: str, device: torch.device, hidden: int, intermediate: int, **kw
    ) -> tuple[bool, str]:
        ok, reason = super().supports(scheme, layout, device, hidden, intermediate, **kw)
        if not ok:
            return ok, reason
        api = deep_gemm_api()
        fn = api.contiguous if layout == "contiguous" else api.masked
        if fn is None:
            return False, f"this deep_gemm has no {layout} FP8 grouped GEMM"
        return True, f"{reason} ({api.names[layout]})"

    # ------------------------------------------------------------------------------- forward
    def run_contiguous(
        self, batch: ContiguousBatch, weights: ExpertWeights, out_dtype: torch.dtype
    ) -> torch.Tensor:
        from .. import ops

        self.require_exact_batch(batch)
        m = batch.x.shape[0]
        if m == 0:
            return torch.empty((0, weights.hidden_size), dtype=out_dtype, device=batch.x.device)
        m_indices = batch.m_indices.to(torch.int32).contiguous()
        padding = stages.padding_rows(batch)
        with phase("epmoe.quantize"):
            a, a_scale = fp8_gemm_input(batch.x, batch.x_scale, weights.hidden_size, row_expert=padding)
        with phase("epmoe.gemm1"):
            gate_up = ops.deepgemm_contiguous(a, a_scale, weights.w13, weights.w13_scale, m_indices)
        with phase("epmoe.activation"):
            h, h_scale = ops.silu_and_mul_quant(gate_up, "group", BLOCK, torch.float8_e4m3fn, row_expert=padding)
        with phase("epmoe.gemm2"):
            out = ops.deepgemm_contiguous(h, h_scale, weights.w2, weights.w2_scale, m_indices)
        return out if out_dtype == torch.bfloat16 else out.to(out_dtype)

    def run_masked(
        self, batch: MaskedBatch, weights: ExpertWeights, out_dtype: torch.dtype
    ) -> torch.Tensor:
        from .. import ops

        cap = batch.x.shape[1]
        masked_m = batch.masked_m.to(device=batch.x.device, dtype=torch.int32).contiguous()
        # Pad once here (not in each GEMM) when the capacity is off DeepGEMM's block multiple.
        padded = masked_capacity(cap)
        x, xs = pad_capacity(batch.x, padded), pad_capacity(batch.x_scale, padded)
        with phase("epmoe.quantize"):
            a, a_scale = fp8_gemm_input(x, xs, weights.hidden_size, masked_m=masked_m)
        expected_m = max(1, int(batch.expected_m))
        with phase("epmoe.gemm1"):
            gate_up = ops.deepgemm_masked(a, a_scale, weights.w13, weights.w13_scale, masked_m, expected_m)
        with phase("epmoe.activation"):
            h, h_scale = ops.silu_and_mul_quant(
                gate_up, "group", BLOCK, torch.float8_e4m3fn, masked_m=masked_m
            )
        with phase("epmoe.gemm2"):
            out = ops.deepgemm_masked(h, h_scale, weights.w2, weights.w2_scale, masked_m, expected_m)[:, :cap]
        return out if out_dtype == torch.bfloat16 else out.to(out_dtype)

    # -------------------------------------------------------------------------------- warmup
    def warmup(
        self,
        weights: ExpertWeights,
        max_m: int,
        *,
        layouts: Iterable[str] = ("masked", "contiguous"),
        expected_ms: Iterable[int] | None = None,
    ) -> None:
        """Run every GEMM shape once so DeepGEMM's JIT compiles (and caches) its kernels before
        any CUDA-graph capture or timing.

        Args:
            weights: the prepared local weights (shapes of GEMM1 and GEMM2).
            max_m: rows per expert to cover: the masked capacity, and the largest per-expert
                row count of the contiguous layout that will be timed or captured.
            layouts: which layouts to warm.
            expected_ms: ``expected_m`` hints of the masked calls to come (default: powers of two
                up to ``max_m``); DeepGEMM picks its kernel configuration from it.
        """
        weights = self.prepare_weights(weights)
        dev = weights.w13.device
        e = weights.num_experts
        hidden, inter = weights.hidden_size, weights.intermediate_size
        max_m = max(1, int(max_m))
        pow2 = [1 << i for i in range(max_m.bit_length()) if (1 << i) <= max_m]
        if pow2[-1] != max_m:
            pow2.append(max_m)
        layouts = tuple(layouts)
        if "masked" in layouts:
            ems = sorted(set(expected_ms)) if expected_ms is not None else pow2
            x = torch.zeros((e, max_m, hidden), dtype=torch.bfloat16, device=dev)
            masked_m = torch.full((e,), max_m, dtype=torch.int32, device=dev)
            for em in ems:
                self.run_masked(MaskedBatch(x, None, masked_m, int(em)), weights, torch.bfloat16)
            del x
        if "contiguous" in layouts:
            align = self.alignment
            for per_expert in sorted({-(-m // align) * align for m in pow2}):
                rows = e * per_expert
                offsets = torch.arange(0, rows + 1, per_expert, dtype=torch.int32, device=dev)
                m_indices = torch.arange(e, dtype=torch.int32, device=dev).repeat_interleave(per_expert)
                x = torch.zeros((rows, hidden), dtype=torch.bfloat16, device=dev)
                batch = ContiguousBatch(x, None, offsets, m_indices, torch.empty(0, 1, dtype=torch.int64, device=dev), [per_expert] * e)
                self.run_contiguous(batch, weights, torch.bfloat16)
                del x
        torch.cuda.synchronize(dev)
        log.info("deepgemm warm-up done: E=%d H=%d I=%d max_m=%d layouts=%s", e, hidden, inter, max_m, layouts)
