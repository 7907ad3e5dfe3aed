"""The curve every trainer draws from its metrics rows: one function, readable at 1 point
(markers) and at 1,000 (a moving mean over the raw points), integer units on the x axis, a
second y axis for series of another scale, the legend outside the data."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlbuffers.storage.safe_files import write_atomic_inside


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


def _number(value: Any) -> bool:
    """Whether ``value`` is a real number a curve can draw (not a bool, None or a list)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


#: Line styles and markers by series, so lines that coincide stay visible (a dashed line over
#: a solid one, different markers).
STYLES = (("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"))


def plot_curve(path: Path, history: Sequence[dict[str, Any]], *, x: str, xlabel: str,
               series: Sequence[Series], ylabel: str, title: str, right_label: str = "",
               smooth_over: int = 50) -> dict[str, Any]:
    """Draw ``series`` of the rows in ``history`` against ``x`` to ``path`` (PNG, written to a
    temporary file of an unpredictable name and renamed over ``path``: a symlink or FIFO
    planted there is replaced, never written through; ``rlbuffers.UnsafePathError`` if
    ``path``'s directory is reached through a symlink below it). A series missing from a row
    is skipped at that row; with more than ``smooth_over`` points, the raw points are faint
    and a moving mean (window ~1/20 of the points) is drawn over them. Each series has its
    own line style and marker; an axis whose values are all >= 0 starts at 0; a single x
    value is centred in a range of 2.

    Returns ``{"labels": legend labels, "ylim": left axis (low, high), "right_ylim": right
    axis (or None), "xlim": (low, high)}``."""
    from matplotlib.ticker import MaxNLocator

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=90)
    ax2 = ax.twinx() if any(s.right for s in series) else None
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    low: dict[Any, float] = {}
    xs_all: set[float] = set()
    for i, s in enumerate(series):
        pts = [(h[x], h[s.key]) for h in history if _number(h.get(s.key)) and _number(h.get(x))]
        if not pts:
            continue
        xs, ys = zip(*pts, strict=True)
        axis = ax2 if s.right and ax2 is not None else ax
        color = "gray" if s.right else colors[i % len(colors)]
        style, marker = STYLES[i % len(STYLES)]
        if len(pts) > smooth_over:
            window = max(2, len(pts) // 20)
            axis.plot(xs, ys, marker, color=color, alpha=0.2, markersize=2, linestyle="none")
            mean = [sum(ys[j - window + 1:j + 1]) / window for j in range(window - 1, len(ys))]
            axis.plot(xs[window - 1:], mean, color=color, linestyle=style, linewidth=1.6,
                      label=f"{s.label} (mean of {window})")
        else:
            axis.plot(xs, ys, color=color, linestyle=style, marker=marker, markersize=5,
                      markerfacecolor="none" if i % 2 else color, label=s.label)
        low[axis] = min(low.get(axis, 0.0), min(ys))
        xs_all.update(xs)
    for axis, lowest in low.items():
        if lowest >= 0:  # shares, losses, returns >= 0: no negative axis
            axis.set_ylim(bottom=0)
    if len(xs_all) == 1:
        (x0,) = xs_all
        ax.set_xlim(x0 - 1, x0 + 1)
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
    info = {"labels": labels, "ylim": ax.get_ylim(), "xlim": ax.get_xlim(),
            "right_ylim": ax2.get_ylim() if ax2 is not None else None}
    try:  # a temporary file of an unpredictable name, renamed over (never through) path
        write_atomic_inside(path.parent, path.name, lambda f: fig.savefig(f, format="png"),
                            durable=False)
    finally:
        plt.close(fig)
    return info
