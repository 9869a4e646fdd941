"""Plots of the user commands. matplotlib is optional (the ``plot`` extra): without it the commands
still print their tables and write their JSON, and say in one line how to get the plot."""

from __future__ import annotations

from types import ModuleType

PLOT_MISSING = "plot skipped: matplotlib is not installed (pip install 'vllm-router-ext[plot]')"


def pyplot() -> ModuleType | None:
    """matplotlib's pyplot on the file-only Agg backend, or None where matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
