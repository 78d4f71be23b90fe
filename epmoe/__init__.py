"""epmoe: expert-parallel Mixture-of-Experts layers for inference."""

__version__ = "0.1.0"

from . import errors  # noqa: E402
from .errors import *  # noqa: E402,F401,F403  (every exception class; the list is errors.__all__)
from .layer import DeepEPMoELayer  # noqa: E402
from .linear import Int8Linear, Int8MLP  # noqa: E402
from .routing import select_experts  # noqa: E402

__all__ = ["DeepEPMoELayer", "Int8Linear", "Int8MLP", "select_experts", *errors.__all__, "__version__"]
