"""Choosing an experts backend: capability predicates that return reasons.

Backends are imported lazily by dotted path, so a missing optional library (DeepGEMM, sgl-kernel)
turns into a refusal with a reason instead of an import error at ``import epmoe``.
"""

from __future__ import annotations

import logging

import torch

from ..errors import BackendUnavailableError
from ..lazy import import_registered
from ..quant.schemes import QuantScheme
from .base import ExpertsBackend

log = logging.getLogger("epmoe")

BACKENDS: dict[str, str] = {
    "torch": "epmoe.experts.torch_backend:TorchBackend",
    "triton": "epmoe.experts.triton_backend:TritonBackend",
    "deepgemm": "epmoe.experts.deepgemm_backend:DeepGemmBackend",
    "cutlass": "epmoe.experts.cutlass_backend:CutlassBackend",
}

AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "bf16": ("triton", "torch"),
    "int8_channel": ("cutlass", "triton", "torch"),
    "int8_block": ("cutlass", "triton", "torch"),
    "fp8_block": ("cutlass", "deepgemm", "torch"),
}
"""Preference of ``backend="auto"`` per scheme, fastest first; ``torch`` runs anywhere. ``cutlass``
is considered only with ``SGLANG_CUTLASS_MOE=1`` (and for ``int8_channel`` only with the int32
accumulator; for both INT8 schemes only with the CUTLASS headers); see
:mod:`epmoe.experts.fp8_selection`."""

AUTO_DEVICE_TYPES: dict[str, frozenset[str]] = {"torch": frozenset({"cpu", "cuda"})}
"""Device types where ``auto`` may pick a backend; others are GPU-only for ``auto`` (Triton's
CPU interpreter is for tests, far too slow to be picked silently)."""


def load_backend(name: str, label: str | None = None) -> tuple[type[ExpertsBackend] | None, str]:
    """Import backend ``name``; returns ``(class, "")`` or ``(None, reason)``. ``label`` names the
    request in the error (default ``backend=<name>``; see :func:`epmoe.environment.requested`)."""
    return import_registered(BACKENDS, name, label or f"backend={name!r}")


def backend_decisions(
    scheme: QuantScheme,
    layouts: frozenset[str],
    device: torch.device,
    hidden: int,
    intermediate: int,
    candidates: tuple[str, ...],
    accumulator: str = "fp32",
) -> list[tuple[str, type[ExpertsBackend] | None, str]]:
    """For each candidate name: ``(name, class or None when refused, reason)``."""
    out = []
    for name in candidates:
        cls, reason = load_backend(name)
        if cls is not None:
            for layout in sorted(layouts):
                ok, reason = cls.supports(scheme, layout, device, hidden, intermediate, accumulator=accumulator)
                if not ok:
                    cls = None
                    break
        out.append((name, cls, reason))
    return out


def select_backend(
    requested: str,
    scheme: QuantScheme,
    layouts: frozenset[str],
    device: torch.device,
    hidden: int,
    intermediate: int,
    accumulator: str = "fp32",
    label: str | None = None,
) -> tuple[type[ExpertsBackend], list[str]]:
    """Pick the backend class; returns it and log lines (the choice and every refusal).

    ``requested="auto"`` walks :data:`AUTO_ORDER`; a named backend that cannot run raises
    :class:`BackendUnavailableError` with the reason (never a silent fallback). ``label`` names
    the request in errors (default ``backend=<requested>``; an environment variable's when it
    supplied the value, see :func:`epmoe.environment.requested`).
    """
    label = label or f"backend={requested!r}"
    if requested == "auto":
        candidates = AUTO_ORDER[scheme.name]
    else:
        load_backend(requested, label)  # validates the name
        candidates = (requested,)
    lines = []
    for name, cls, reason in backend_decisions(
        scheme, layouts, device, hidden, intermediate, candidates, accumulator
    ):
        if cls is not None and requested == "auto":
            allowed = AUTO_DEVICE_TYPES.get(name, frozenset({"cuda"}))
            if device.type not in allowed:
                cls, reason = None, f"auto picks it on {sorted(allowed)} only (force it to use it)"
        if cls is None:
            if requested != "auto":
                raise BackendUnavailableError(
                    f"{label} cannot run quant={scheme.name!r} on "
                    f"{device} with layouts {sorted(layouts)}: {reason}"
                )
            lines.append(f"experts backend {name!r} refused: {reason}")
            continue
        lines.append(f"experts backend {name!r} chosen for quant={scheme.name!r} on {device}")
        return cls, lines
    raise BackendUnavailableError(
        f"no experts backend can run quant={scheme.name!r} on {device}: " + "; ".join(lines)
    )
