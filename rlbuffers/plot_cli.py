"""``rlbuffers plot RUN_DIR [-o PNG]``: draw a trainer run's curve from its metrics.jsonl
(needs the trainers extra: matplotlib and the trainer's modules)."""

from __future__ import annotations

import argparse
from typing import Any


def _plot(args: argparse.Namespace) -> int:
    from trainers.plot import plot_run

    print(plot_run(args.run_dir, args.out))
    return 0


def add_plot_parser(sub: Any) -> None:
    """Add the ``plot`` command to the ``rlbuffers`` subparsers ``sub``."""
    p = sub.add_parser("plot", help="draw a trainer run's curve from its metrics.jsonl",
                       description="Draw the curve of a run written by python -m trainers.* "
                       "(the trainer is read from config.json or the metrics' keys) and "
                       "print the PNG's path.")
    p.add_argument("run_dir", help="the run directory (holds metrics.jsonl)")
    p.add_argument("-o", "--out", default=None, metavar="PNG",
                   help="where to write the PNG (default: RUN_DIR/curve.png)")
    p.set_defaults(func=_plot)
