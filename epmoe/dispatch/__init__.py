"""Dispatchers: the contract in :mod:`.base`, selection in :mod:`.select`, DeepEP in :mod:`.deepep`."""

from .all_to_all import CollectiveError, CollectiveTimeoutError
from .base import PAYLOADS, DispatchConfig, Dispatched, Dispatcher
from .deepep import DeepEPBuffer

__all__ = [
    "PAYLOADS", "CollectiveError", "CollectiveTimeoutError", "DeepEPBuffer", "DispatchConfig", "Dispatched",
    "Dispatcher",
]  # fmt: skip
