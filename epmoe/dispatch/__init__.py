"""Dispatchers: the contract in :mod:`.base`, selection in :mod:`.select`."""

from .all_to_all import CollectiveTimeoutError
from .base import PAYLOADS, DispatchConfig, Dispatched, Dispatcher

__all__ = ["PAYLOADS", "CollectiveTimeoutError", "DispatchConfig", "Dispatched", "Dispatcher"]
