"""Dispatch through DeepEP (v1.2.1, the ``deep_ep.Buffer`` API), in four parts: :mod:`.sizing`
(the sizes DeepEP's kernels take and how large a shared buffer must be), :mod:`.buffer` (the owner
of a group's one ``deep_ep.Buffer``), :mod:`.calls` (DeepEP's send and combine as functions of
tensors and plain values: the bodies of the ``epmoe::deepep_*`` custom ops) and :mod:`.dispatchers`
(normal, low-latency and auto).
``deep_ep`` is imported lazily: everything here imports without it."""

from .buffer import DeepEPBuffer, DeepEPBufferError
from .dispatchers import DeepEPAutoDispatcher, DeepEPLowLatencyDispatcher, DeepEPNormalDispatcher

__all__ = [
    "DeepEPAutoDispatcher", "DeepEPBuffer", "DeepEPBufferError", "DeepEPLowLatencyDispatcher",
    "DeepEPNormalDispatcher",
]  # fmt: skip
