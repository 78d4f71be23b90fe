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
