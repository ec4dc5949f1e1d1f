"""Drawing: the pictures of gpumem's data, apart from the data they draw.

    memory_map.py   a heap's address space (a Snapshot): inline SVG, HTML page, matplotlib
    timeline.py     live, reserved and cap over time (a Timeline): inline SVG, HTML page, matplotlib

What both share is here: escaping text for SVG and HTML, writing a page, and
the matplotlib axes and legend.  Nothing here reads a heap: each function takes
the object it draws (a gpumem.Snapshot, a gpumem.Timeline) and only reads it.
"""

from __future__ import annotations

import html
import os


def esc(s) -> str:
    """s (any value, as str) escaped for SVG and HTML text and attribute values."""
    return html.escape(str(s), quote=True)


def write_page(path, page: str) -> str:
    """Write page to path (when path is not None); returns page."""
    if path is not None:
        with open(os.fspath(path), "w", encoding="utf-8") as f:
            f.write(page)
    return page


def new_axes(ax, figsize):
    """ax, or the Axes of a new matplotlib figure of figsize (inches) when ax is None."""
    if ax is None:
        import matplotlib.pyplot as plt

        _, ax = plt.subplots(figsize=figsize)
    return ax


def legend_beside(ax, handles):
    """The legend to the right of the plot, outside it; returns ax."""
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    return ax
