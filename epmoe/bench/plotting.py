"""Plots of ``epmoe bench``: matplotlib is the optional ``plot`` extra."""

from __future__ import annotations

import argparse
import importlib.util

PLOT_EXTRA = "pip install 'epmoe[plot]'"


def check_plot(p: argparse.ArgumentParser, path: str | None) -> None:
    """``--plot PATH`` needs matplotlib: refused before anything runs when it is missing."""
    if path and importlib.util.find_spec("matplotlib") is None:
        p.error(f"--plot {path} needs matplotlib, which is not installed: {PLOT_EXTRA}")


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
