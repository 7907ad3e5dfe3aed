"""Plumbing the reference trainers share: a config dataclass as command-line flags (with
``--resume`` keeping the run's settings), RNG states, ``metrics.jsonl`` rebuilt from a
checkpoint's history, and curve figures saved atomically."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import logging
import os
import random
import textwrap
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

C = TypeVar("C")


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (for ``--help``)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
    return {a.target.id: b.value.value for a, b in zip(body, body[1:], strict=False)
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr)
            and isinstance(b.value, ast.Constant)}


def start(cls: type[C], argv: list[str] | None, *, module: str, doc: str,
          resumable: set[str], check: Any) -> C:
    """A trainer's ``main`` preamble: the config from the command line (:func:`parse_config`,
    ``python -m <module>``, the first paragraph of ``doc`` as description), ``check(cfg)``
    (raises ValueError naming a setting), warnings-level logging. Returns the config."""
    cfg = parse_config(cls, argv, prog=f"python -m {module}", description=doc.split("\n\n")[0],
                       resumable=resumable)
    check(cfg)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return cfg


def parse_config(cls: type[C], argv: list[str] | None, *, prog: str, description: str,
                 resumable: set[str]) -> C:
    """Build the dataclass ``cls`` from command-line flags (one ``--flag`` per field, its
    docstring as help); on ``--resume`` start from ``run_dir/config.json`` and apply only the
    flags in ``resumable``. ``cls`` needs ``run_dir: str`` and ``resume: bool`` fields."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        kind = argparse.BooleanOptionalAction if isinstance(f.default, bool) else None
        typ = None if kind else (str if f.default is None else type(f.default))
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, action=kind,
                            help=f"{docs.get(f.name, '')} (default: {f.default})"
                            .replace("%", "%%"),  # argparse formats help with %
                            type=typ, default=argparse.SUPPRESS)
    given = vars(parser.parse_args(argv))
    run_dir = Path(given.get("run_dir", getattr(cls, "run_dir", "")))
    if not given.get("resume"):
        if run_dir.exists() and any(run_dir.iterdir()):
            parser.error(f"{run_dir} already holds a run: pass --resume or another --run-dir")
        return cls(**given)
    if not (run_dir / "config.json").exists():
        parser.error(f"--resume: {run_dir} holds no run (no config.json)")
    saved = json.loads((run_dir / "config.json").read_text())
    clash = {k: (saved[k], v) for k, v in given.items() if k not in resumable and saved[k] != v}
    if clash:
        parser.error(f"--resume keeps the run's settings; these differ from {run_dir}/config.json "
                     f"(saved, given): {clash}")
    return cls(**{**saved, **given})


def rng_states(rng: np.random.Generator) -> dict[str, Any]:
    """torch, numpy (``rng``) and Python RNG states, for ``torch.save``."""
    import torch

    return {"torch": torch.get_rng_state(), "numpy": rng.bit_generator.state,
            "python": random.getstate()}


def set_rng_states(states: dict[str, Any], rng: np.random.Generator) -> None:
    """Restore what :func:`rng_states` returned."""
    import torch

    torch.set_rng_state(states["torch"])
    rng.bit_generator.state = states["numpy"]
    random.setstate(states["python"])


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` by ``data`` (temporary file + rename; no fsync: files written with it
    are rebuilt from a checkpoint)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def restore_metrics(path: Path, history: list[dict[str, Any]], key: str) -> None:
    """Make ``metrics.jsonl`` hold exactly the checkpoint's rows (``history``, keyed by
    ``key``): drop lines of steps that never committed (and a line cut by a crash); a
    committed step whose line was lost is restored from ``history``."""
    logged: dict[int, str] = {}
    for line in (path.read_text().splitlines() if path.exists() else []):
        try:
            logged[json.loads(line)[key]] = line
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    lines = [logged.get(h[key], json.dumps(h)) for h in history]
    write_atomic(path, "".join(line + "\n" for line in lines).encode())


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> None:
    """Save ``fig`` as ``path`` (PNG) through a temporary file and a rename, then close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    tmp = path.with_name("tmp-" + path.name)
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)
