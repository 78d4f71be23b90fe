"""Dispatchers: the contract in :mod:`.base`, selection in :mod:`.select`."""

from .all_to_all import CollectiveError, CollectiveTimeoutError
from .base import PAYLOADS, DispatchConfig, Dispatched, Dispatcher

__all__ = ["PAYLOADS", "CollectiveError", "CollectiveTimeoutError", "DispatchConfig", "Dispatched", "Dispatcher"]
