"""What a run prints when it ends, and how evaluation results read: one function each
trainer calls (:func:`finish`), figures rounded, every output file's path, the command that
inspects the buffer.

Peak RSS in the summary is the process's true peak since it started
(``rlbuffers.memory.process.process_peak_rss_bytes``: the kernel's high-water mark, never
lost to the per-phase resets), what ``/usr/bin/time -v`` reports; the metrics rows'
``peak_rss_<phase>_bytes`` are phase peaks (see docs/internals.md).
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlbuffers.memory.process import process_peak_rss_bytes
from trainers.common import Run

MIB = 2**20
UNITS = ("step", "iteration", "generation")


def figure(value: Any) -> str:
    """A metric as people read it: 3 significant digits (integers as they are)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    return "0" if value == 0 else f"{value:.3g}"


def no_negative_zero(value: Any) -> Any:
    """``value`` with every float that is zero made ``0.0`` (``-0.0`` prints as ``-0.0``),
    through dicts, lists and tuples (tuples become lists, as JSON has them)."""
    if isinstance(value, float):
        return 0.0 if value == 0 else value
    if isinstance(value, dict):
        return {k: no_negative_zero(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [no_negative_zero(v) for v in value]
    return value


def json_bytes(value: Any) -> bytes:
    """``value`` as indented JSON, without ``-0.0`` (:func:`no_negative_zero`)."""
    return json.dumps(no_negative_zero(value), indent=1).encode()


def fixed(value: float, digits: int = 3) -> str:
    """``value`` with ``digits`` decimals, never ``-0.000`` (a value that rounds to zero)."""
    text = f"{value:.{digits}f}"
    return text[1:] if text.startswith("-") and float(text) == 0 else text


def format_eval(result: dict[str, Any]) -> str:
    """One line of an evaluation result: ``{set: {"accuracy", "n", "ci95"}}`` as ``set 0.18
    [0.12, 0.27] (n=100)``; other numbers as ``name 0.05``."""
    parts = []
    for name, value in result.items():
        if isinstance(value, dict) and "accuracy" in value:
            lo, hi = value.get("ci95", (value["accuracy"], value["accuracy"]))
            parts.append(f"{name} {fixed(value['accuracy'])} [{fixed(lo)}, {fixed(hi)}] "
                         f"(n={value.get('n', '?')})")
        elif isinstance(value, int | float) and name not in UNITS:
            parts.append(f"{name} {figure(value)}")
    return "; ".join(parts)


def write_eval(run: Run, evals: dict[str, Any], n: int) -> Path:
    """Write ``evals`` (``{"before": ..., "after": ...}``) to ``eval.json``, the final
    evaluation marked with the unit it evaluated (``"after": {..., "step": n}``), so a resume
    knows it is done."""
    from trainers.common import write_atomic

    if "after" in evals:
        evals["after"][run.unit] = n
    path = run.dir / "eval.json"
    write_atomic(path, json_bytes(evals))
    return path


def summary(run: Run, keys: Sequence[str], evals: dict[str, Any] | None = None) -> str:
    """The closing lines of a run: its last unit, the last row's ``keys`` rounded, the
    held-out evaluation (with intervals), the process's peak RSS and where each output is."""
    d = run.dir
    last = run.history[-1] if run.history else {}
    of = f" of {run.target}" if run.target is not None else ""
    lines = [f"done: {run.unit} {run.done}{of} in {d}"]
    shown = [f"{k} {figure(last[k])}" for k in keys if k in last]
    if shown:
        lines.append("  last " + run.unit + ": " + " | ".join(shown))
    for when in ("before", "after"):
        if evals and when in evals:
            lines.append(f"  held-out {when}: {format_eval(evals[when])}")
    lines.append(f"  peak RSS {process_peak_rss_bytes() / MIB:,.0f} MiB (process)")
    paths = [("curve", d / "curve.png"), ("metrics", d / "metrics.jsonl"),
             ("evaluation", d / "eval.json"), ("buffer", d / "buffer"),
             ("tensorboard", d / "tb")]
    lines += [f"  {name:<12}{path}" for name, path in paths if path.exists()]
    lines.append(f"  inspect:    rlbuffers inspect {shlex.quote(str(d / 'buffer'))}")
    lines.append(f"  plot:       python3 -m trainers.plot {shlex.quote(str(d))}")
    return "\n".join(lines)


def finish(run: Run, keys: Sequence[str], evals: dict[str, Any] | None = None) -> None:
    """Print :func:`summary` to stderr (after the progress bars, on lines of its own); a
    process that does not own the run (``run.buf`` None: rank > 0) prints nothing."""
    from tqdm import tqdm

    if run.buf is None:
        return
    tqdm.write(summary(run, keys, evals), file=sys.stderr)
