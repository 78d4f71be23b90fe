"""Dispatch through DeepEP (v1.2.1, the ``deep_ep.Buffer`` API), in three parts: :mod:`.sizing`
(the sizes DeepEP's kernels take and how large a shared buffer must be), :mod:`.buffer` (the owner
of a group's one ``deep_ep.Buffer``) and :mod:`.dispatchers` (normal, low-latency and auto).
``deep_ep`` is imported lazily: everything here imports without it."""

from .buffer import DeepEPBuffer, DeepEPBufferError
from .dispatchers import DeepEPAutoDispatcher, DeepEPLowLatencyDispatcher, DeepEPNormalDispatcher

__all__ = [
    "DeepEPAutoDispatcher", "DeepEPBuffer", "DeepEPBufferError", "DeepEPLowLatencyDispatcher",
    "DeepEPNormalDispatcher",
]  # fmt: skip
