"""The curve every trainer draws from its metrics rows: one function, readable at 1 point
(markers) and at 1,000 (a moving mean over the raw points), integer units on the x axis, a
second y axis for series of another scale, the legend outside the data."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Series:
    """One line of a curve: the metrics ``key``, its legend ``label``, and whether it goes on
    the right-hand y axis."""

    key: str
    label: str
    right: bool = False


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_curve(path: Path, history: Sequence[dict[str, Any]], *, x: str, xlabel: str,
               series: Sequence[Series], ylabel: str, title: str, right_label: str = "",
               smooth_over: int = 50) -> None:
    """Draw ``series`` of the rows in ``history`` against ``x`` to ``path`` (PNG, written to a
    temporary file and renamed). A series missing from a row is skipped at that row; with more
    than ``smooth_over`` points, the raw points are faint and a moving mean (window ~1/20 of
    the points) is drawn over them."""
    from matplotlib.ticker import MaxNLocator

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=90)
    ax2 = ax.twinx() if any(s.right for s in series) else None
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, s in enumerate(series):
        pts = [(h[x], h[s.key]) for h in history if h.get(s.key) is not None and x in h]
        if not pts:
            continue
        xs, ys = zip(*pts, strict=True)
        axis = ax2 if s.right and ax2 is not None else ax
        color = "gray" if s.right else colors[i % len(colors)]
        if len(pts) > smooth_over:
            window = max(2, len(pts) // 20)
            axis.plot(xs, ys, ".", color=color, alpha=0.25, markersize=3)
            mean = [sum(ys[j - window + 1:j + 1]) / window for j in range(window - 1, len(ys))]
            axis.plot(xs[window - 1:], mean, color=color, label=f"{s.label} (mean of {window})")
        else:
            axis.plot(xs, ys, "o-", color=color, markersize=4, label=s.label)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if ax2 is not None:
        ax2.set_ylabel(right_label)
    handles, labels = ax.get_legend_handles_labels()
    if ax2 is not None:
        more = ax2.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    if handles:
        ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2,
                  fontsize=8, frameon=False)
    fig.tight_layout()
    tmp = path.with_name("tmp-" + path.name)
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)
