"""Dispatchers: the contract in :mod:`.base`, selection in :mod:`.select`, DeepEP in :mod:`.deepep`."""

from .collective import CollectiveError, CollectiveTimeoutError, RankMismatchError
from .base import PAYLOADS, DispatchConfig, Dispatched, Dispatcher
from .deepep_dispatch import DeepEPBuffer

__all__ = [
    "PAYLOADS", "CollectiveError", "CollectiveTimeoutError", "DeepEPBuffer", "DispatchConfig", "Dispatched",
    "Dispatcher", "RankMismatchError",
]  # fmt: skip
