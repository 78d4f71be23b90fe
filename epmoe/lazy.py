"""Import a class named by a ``"module:attr"`` path, turning a missing optional library into a
reason instead of an import error (backends and dispatchers are found this way)."""

from __future__ import annotations

import importlib


def import_attr(spec: str) -> tuple[object | None, str]:
    """``(attr, "")``, or ``(None, reason)`` when the module (or a library it needs) is missing."""
    module, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), attr), ""
    except ImportError as exc:
        return None, f"cannot be imported ({exc})"


def import_registered(registry: dict[str, str], name: str, label: str) -> tuple[object | None, str]:
    """``import_attr(registry[name])``; a ``name`` the registry lacks raises ``ValueError`` naming
    ``label`` (the request, as the caller spells it) and the allowed names."""
    if name not in registry:
        raise ValueError(f"{label} is not known; allowed: {['auto', *registry]}")
    return import_attr(registry[name])
