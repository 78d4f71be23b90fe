"""epmoe: expert-parallel Mixture-of-Experts layers for inference."""

import importlib as _importlib
from importlib import metadata as _metadata

from . import errors
from .errors import *  # noqa: F401,F403  (every exception class; the list is errors.__all__)

try:
    __version__ = _metadata.version("epmoe")
except _metadata.PackageNotFoundError:  # a source tree on sys.path, never installed
    __version__ = "unknown (not installed)"

# Imported on first use, so that `import epmoe` (and `epmoe --help`) needs no torch.
_LAZY = {"DeepEPMoELayer": ".layer", "Int8Linear": ".linear", "Int8MLP": ".linear", "select_experts": ".routing"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(_importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'epmoe' has no attribute {name!r}")


__all__ = ["DeepEPMoELayer", "Int8Linear", "Int8MLP", "select_experts", *errors.__all__, "__version__"]
