"""Every exception class of epmoe's own (all exported from :mod:`epmoe`).

An argument a caller got wrong on one rank raises the built-in ``ValueError`` / ``TypeError``
naming the argument, its value and what is allowed. The classes here are for what one call cannot
see: the machine or the environment (a forced backend, dispatcher or extension that cannot run),
the process group (a collective that failed or timed out, ranks that disagree; the latter is a
``ValueError`` since arguments are at fault), the shared DeepEP buffer and the rank launcher.
"""

from __future__ import annotations


class BackendUnavailableError(RuntimeError):
    """A forced experts backend (argument or environment) cannot run here."""


class DispatcherUnavailableError(RuntimeError):
    """A forced dispatcher (argument or environment) cannot run here."""


class CollectiveError(RuntimeError):
    """A collective of the all-to-all dispatcher failed (a peer rank died, or the group broke)."""


class CollectiveTimeoutError(CollectiveError):
    """A collective did not complete in time (a peer rank died or never joined)."""


class RankMismatchError(ValueError):
    """The ranks of a group were built, or called, with arguments that must agree and do not."""


class DeepEPBufferError(RuntimeError):
    """A registration the shared DeepEP buffer cannot serve (or a buffer used after close)."""


class RankError(RuntimeError):
    """A rank of :func:`epmoe.launch.run_ranks` raised, or its process ended without a result; the
    message holds the rank and its traceback (or exit code)."""


class CutlassUnavailableError(RuntimeError):
    """The CUTLASS extension cannot be found or built."""


class RankError(RuntimeError):
    """A rank started by :func:`epmoe.launch.run_ranks` raised, or its process ended without a
    result; the message holds the rank and its traceback (or exit code)."""


__all__ = [
    "BackendUnavailableError",
    "CollectiveError",
    "CollectiveTimeoutError",
    "CutlassUnavailableError",
    "DeepEPBufferError",
    "DispatcherUnavailableError",
    "RankError",
    "RankMismatchError",
]
