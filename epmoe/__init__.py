"""epmoe: expert-parallel Mixture-of-Experts layers for inference."""

__version__ = "0.1.0"
