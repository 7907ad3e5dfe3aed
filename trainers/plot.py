"""Draw a run's curve from its ``metrics.jsonl``: the trainer is read from ``config.json``
(its fields) or, without one, from the metrics' keys, and its own curve function draws it.

    python3 -m trainers.plot RUN_DIR [-o PNG]

prints the PNG's path; a run directory it cannot draw is one line on stderr (exit code 2).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

PROG = "python3 -m trainers.plot"

TRAINERS = ("erl", "grpo", "crsp", "guidance")


def which_trainer(config: dict[str, Any], row: dict[str, Any]) -> str:
    """The trainer that wrote a run: from its config's fields, else its first metrics row.

    Raises:
        ValueError: neither names a known trainer.
    """
    keys = set(config) | set(row)
    if "generations" in keys or "best_fitness" in keys:
        return "erl"
    if "iterations" in keys or "turn1_accuracy" in keys:
        return "guidance"
    if "tensor_summary" in keys or "solver_reward" in keys:
        return "crsp"
    if "group_size" in keys or "reward_mean" in keys:
        return "grpo"
    raise ValueError(f"cannot tell which trainer wrote this run (config keys "
                     f"{sorted(config)[:8]}, metrics keys {sorted(row)[:8]}); expected one of "
                     f"{', '.join(TRAINERS)}")


def draw(trainer: str, path: Path, history: list[dict[str, Any]],
         config: dict[str, Any]) -> None:
    """Draw ``history`` with ``trainer``'s curve function to ``path`` (PNG)."""
    if trainer == "erl":
        from trainers.erl.train import draw_curve as erl_curve

        erl_curve(path, history, env=config.get("env", "?"))
    elif trainer == "grpo":
        from trainers.grpo.train import curve as grpo_curve

        grpo_curve(path, history, config.get("task", "?"))
    elif trainer == "crsp":
        from trainers.crsp.train import draw_curve as crsp_curve

        crsp_curve(path, history)
    elif trainer == "guidance":
        from trainers.guidance.train import draw_curve as guidance_curve

        guidance_curve(path, history, task=config.get("task", "?"))
    else:
        raise ValueError(f"trainer: expected one of {', '.join(TRAINERS)}, got {trainer!r}")


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw the curve of the run in ``run_dir`` from its ``metrics.jsonl`` to ``out``
    (default ``run_dir/curve.png``); returns the PNG's path.

    Raises:
        FileNotFoundError: ``run_dir`` has no ``metrics.jsonl``.
        ValueError: the file holds no row, or the trainer cannot be told.
    """
    d = Path(run_dir)
    metrics = d / "metrics.jsonl"
    if not d.is_dir():
        raise FileNotFoundError(f"{d}: no such directory" if not os.path.lexists(d)
                                else f"{d}: not a directory (give a run directory)")
    if not os.path.lexists(metrics):
        hint = " (a buffer: give its run directory)" if (d / "manifest.json").exists() else ""
        raise FileNotFoundError(f"{d}: no metrics.jsonl, not a trainer's run directory{hint}")
    from rlbuffers.safe_load import load_json
    from trainers.run_files import metrics_rows

    history = metrics_rows(d)  # a regular file, never a FIFO; a bad line named
    if not history:
        raise ValueError(f"{metrics}: no rows yet (the first unit has not completed)")
    config = load_json(d / "config.json", dict) if (d / "config.json").exists() else {}
    path = Path(out) if out is not None else d / "curve.png"
    if not path.parent.is_dir():
        raise FileNotFoundError(f"-o {path}: no directory {path.parent} to write it in")
    if path.suffix.lower() != ".png":
        raise ValueError(f"-o {path}: expected a .png file name")
    draw(which_trainer(config, history[0]), path, history, config)
    return path


def main(argv: list[str] | None = None) -> int:
    """``python3 -m trainers.plot RUN_DIR [-o PNG]``: draw the run's curve, print the PNG's
    path (exit 0); an error is one line on stderr naming the run directory or the file
    (exit 2)."""
    from rlbuffers.errors import RLBuffersError
    from rlbuffers.safe_load import one_line
    from trainers.config import ArgumentParser

    p = ArgumentParser(prog=PROG, description="Draw the curve of a run written by python3 -m "
                       "trainers.* (the trainer is read from config.json or the metrics' "
                       "keys) and print the PNG's path.")
    p.add_argument("run_dir", help="the run directory (holds metrics.jsonl)")
    p.add_argument("-o", "--out", default=None, metavar="PNG",
                   help="where to write the PNG (default: RUN_DIR/curve.png)")
    args = p.parse_args(argv)
    try:
        print(plot_run(args.run_dir, args.out))
    except (RLBuffersError, OSError, ValueError) as e:
        text = str(e) if not isinstance(e, OSError) or e.filename is None else \
            f"{e.filename}: {e.strerror}"
        print(f"{PROG}: error: {one_line(text, 1000)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
