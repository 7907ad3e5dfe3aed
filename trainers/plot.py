"""Draw a run's curve from its ``metrics.jsonl`` (``rlbuffers plot RUN_DIR``): the trainer is
read from ``config.json`` (its fields) or, without one, from the metrics' keys, and its own
curve function draws it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
    if not metrics.exists():
        hint = " (a buffer: give its run directory)" if (d / "manifest.json").exists() else ""
        raise FileNotFoundError(f"{d}: no metrics.jsonl, not a trainer's run directory{hint}")
    from rlbuffers.safe_load import load_json
    from trainers.run_files import metrics_rows

    history = metrics_rows(d)  # a regular file, never a FIFO; a bad line named
    if not history:
        raise ValueError(f"{metrics}: no rows yet (the first unit has not completed)")
    config = load_json(d / "config.json", dict) if (d / "config.json").exists() else {}
    path = Path(out) if out is not None else d / "curve.png"
    draw(which_trainer(config, history[0]), path, history, config)
    return path
