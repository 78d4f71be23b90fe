"""Choices the environment may make in place of an argument, and how errors name them.

``EPMOE_BACKEND`` and ``EPMOE_DISPATCH`` stand in for ``backend="auto"`` / ``dispatch="auto"``
(an argument other than ``"auto"`` wins). An error about such a value names the variable and says
it came from the environment, so a user does not look for it in their own code.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Requested:
    """A requested choice and how errors name it.

    Attributes:
        value: the name asked for (``"auto"`` or a backend / dispatcher name).
        label: its origin for messages, e.g. ``"backend='triton'"`` or
            ``"EPMOE_BACKEND='bogus' (from the environment)"``.
    """

    value: str
    label: str


def requested(argument: str, value: str, variable: str, env: Mapping[str, str] | None = None) -> Requested:
    """The choice for ``argument``: ``value`` unless it is ``"auto"`` and ``variable`` is set.

    Args:
        argument: the argument's name (``"backend"``).
        value: the argument's value.
        variable: the environment variable that may replace ``"auto"`` (``"EPMOE_BACKEND"``).
        env: the environment (default ``os.environ``).
    Returns:
        :class:`Requested`.
    """
    env = os.environ if env is None else env
    if value == "auto" and variable in env:
        return Requested(env[variable], f"{variable}={env[variable]!r} (from the environment)")
    return Requested(value, f"{argument}={value!r}")
