"""Choosing a dispatcher: capability predicates that return reasons (lazy imports, as for
backends, so a missing DeepEP is a refusal with a reason)."""

from __future__ import annotations

from ..errors import DispatcherUnavailableError
from ..lazy import import_registered
from .base import DispatchConfig, Dispatcher

DISPATCHERS: dict[str, str] = {
    "local": "epmoe.dispatch.local:LocalDispatcher",
    "all_to_all": "epmoe.dispatch.all_to_all:AllToAllDispatcher",
    "deepep_normal": "epmoe.dispatch.deepep_dispatch.dispatchers:DeepEPNormalDispatcher",
    "deepep_low_latency": "epmoe.dispatch.deepep_dispatch.dispatchers:DeepEPLowLatencyDispatcher",
    "deepep_auto": "epmoe.dispatch.deepep_dispatch.dispatchers:DeepEPAutoDispatcher",
}

AUTO_ORDER = ("local", "deepep_auto", "deepep_normal", "all_to_all")
"""``dispatch="auto"``: one rank runs locally; several use DeepEP (low-latency while the batch fits,
normal otherwise) when it is installed and usable, DeepEP normal alone when the sizes rule out
low-latency mode, else torch.distributed all-to-all."""


def load_dispatcher(name: str, label: str | None = None) -> tuple[type[Dispatcher] | None, str]:
    """Import dispatcher ``name``; returns ``(class, "")`` or ``(None, reason)``. ``label`` names the
    request in the error (default ``dispatch=<name>``; see :func:`epmoe.environment.requested`)."""
    return import_registered(DISPATCHERS, name, label or f"dispatch={name!r}")


def dispatcher_decisions(
    cfg: DispatchConfig, candidates: tuple[str, ...]
) -> list[tuple[str, type[Dispatcher] | None, str]]:
    """For each candidate: ``(name, class or None when refused, reason)``."""
    out = []
    for name in candidates:
        cls, reason = load_dispatcher(name)
        if cls is not None:
            ok, reason = cls.available(cfg)
            if not ok:
                cls = None
        out.append((name, cls, reason))
    return out


def select_dispatcher(
    requested: str, cfg: DispatchConfig, label: str | None = None
) -> tuple[type[Dispatcher], list[str]]:
    """Pick the dispatcher class; returns it and log lines. A forced choice that cannot run raises
    :class:`DispatcherUnavailableError`; ``label`` names the request in errors (default
    ``dispatch=<requested>``; an environment variable's when it supplied the value)."""
    label = label or f"dispatch={requested!r}"
    candidates = AUTO_ORDER if requested == "auto" else (requested,)
    if requested != "auto":
        load_dispatcher(requested, label)
    lines = []
    for name, cls, reason in dispatcher_decisions(cfg, candidates):
        if cls is None:
            if requested != "auto":
                raise DispatcherUnavailableError(
                    f"{label} cannot run with {cfg.world_size} rank(s) on "
                    f"{cfg.device}: {reason}"
                )
            lines.append(f"dispatcher {name!r} refused: {reason}")
            continue
        lines.append(f"dispatcher {name!r} chosen for {cfg.world_size} rank(s) on {cfg.device}")
        return cls, lines
    raise DispatcherUnavailableError("no dispatcher can run here: " + "; ".join(lines))
