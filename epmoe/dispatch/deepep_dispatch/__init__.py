"""Dispatch through DeepEP (v1.2.1, the ``deep_ep.Buffer`` API), in four parts: :mod:`.sizing`
(the sizes DeepEP's kernels take and how large a shared buffer must be), :mod:`.buffer` (the owner
of a group's one ``deep_ep.Buffer``), :mod:`.calls` (DeepEP's send and combine as functions of
tensors and plain values: the bodies of the ``epmoe::deepep_*`` custom ops) and :mod:`.dispatchers`
(normal, low-latency and auto).
``deep_ep`` is imported lazily: everything here imports without it."""

import importlib

from .buffer import DeepEPBuffer, DeepEPBufferError

_DISPATCHERS = ("DeepEPAutoDispatcher", "DeepEPLowLatencyDispatcher", "DeepEPNormalDispatcher")


def __getattr__(name: str):
    # The dispatchers on first use (PEP 562): their torch.compiler.disable decorators import
    # torch._dynamo (about a second), which a layer with another dispatcher never needs.
    if name in _DISPATCHERS:
        return getattr(importlib.import_module(".dispatchers", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DeepEPAutoDispatcher", "DeepEPBuffer", "DeepEPBufferError", "DeepEPLowLatencyDispatcher",
    "DeepEPNormalDispatcher",
]  # fmt: skip
