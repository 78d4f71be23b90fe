"""Experts backends: the contract in :mod:`.base`, selection in :mod:`.select`."""

from .base import ExpertsBackend, ExpertWeights

__all__ = ["ExpertsBackend", "ExpertWeights"]
