"""epmoe: expert-parallel Mixture-of-Experts layers for inference."""

__version__ = "0.1.0"

from .dispatch.all_to_all import CollectiveError, CollectiveTimeoutError  # noqa: E402
from .layer import DeepEPMoELayer  # noqa: E402
from .linear import Int8Linear, Int8MLP  # noqa: E402
from .routing import select_experts  # noqa: E402

__all__ = ["DeepEPMoELayer", "Int8Linear", "Int8MLP", "CollectiveError", "CollectiveTimeoutError", "select_experts", "__version__"]
