"""Trainer settings as command-line flags: the base every trainer's ``Config`` extends, the
flags built from a dataclass (one ``--flag`` per field, its docstring as help), ``--resume``
keeping the run's settings (a new target - ``--steps``, ``--iterations``, ``--generations`` -
is written to the run's ``config.json``), validation that names the flag (one line on the
console: :class:`ConfigError`, :func:`run_main`), and the log level (messages written
through ``tqdm.write``, so they never land on a progress bar's line)."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import logging
import math
import os
import re
import sys
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

C = TypeVar("C")
log = logging.getLogger("trainers.config")

#: The most threads a ``--*-threads`` flag takes (torch's thread count is a C int).
MAX_THREADS = 1024

#: The field naming a trainer's target and the loop unit it counts.
TARGETS = {"steps": "step", "iterations": "iteration", "generations": "generation"}


class ConfigError(ValueError):
    """A setting out of range, named by its flag (``--flag: expected ..., got ...``); the
    console entry (:func:`run_main`) prints it as one line (with :attr:`hint`)."""

    hint = " (see --help)"


class TargetError(ConfigError):
    """``--resume`` with a target (``--steps`` ...) below the run's last complete unit."""

    hint = ""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line pointing at ``--help`` (not the usage block), with
    no prefix matching (``--generation 1`` is an error, not ``--generations 1``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> Any:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _prog(module: str) -> str:
    """``python3 -m trainers.grpo`` of ``trainers.grpo.train``."""
    return f"python3 -m {module.rsplit('.', 1)[0]}"


def run_main(module: str, prog: str | None = None, resumable: bool = True) -> None:
    """A trainer's ``__main__``: say what loads (torch and transformers take seconds to import;
    not with ``--quiet``), import ``module`` and run its ``main()``; a :class:`ConfigError`
    or an rlbuffers error (a run directory's file missing, damaged or refused:
    ``rlbuffers.safe_load.RunFileError``, ``CorruptCheckpointError``, ``UnsafePathError``,
    a buffer error) or an allocation too large for the machine is printed as one line (exit
    code 2) instead of a traceback; Ctrl-C before the loop (which handles its own) exits 130
    with the command to run again (``prog``, default ``python3 -m <package>``; ``--resume``
    added when ``resumable`` and the run directory now holds a run)."""
    import importlib

    from trainers.phases import heartbeat

    set_log_level("--quiet" in sys.argv, "--verbose" in sys.argv)
    with heartbeat(f"loading {module.rsplit('.', 1)[0]} (torch, transformers)"):
        main = importlib.import_module(module).main
    from rlbuffers.errors import RLBuffersError
    from rlbuffers.safe_load import one_line

    try:
        main()
    except ConfigError as e:
        _close_bars()
        print(f"error: {one_line(str(e), 1000)}{e.hint}", file=sys.stderr)
        sys.exit(2)
    except RLBuffersError as e:  # a run directory's file refused or damaged: one line
        _close_bars()
        print(f"error: {one_line(str(e), 1000)}", file=sys.stderr)
        sys.exit(2)
    except Exception as e:  # an allocation a setting made too large: one line, not a trace
        from rlbuffers.memory.oom import is_out_of_memory

        if not is_out_of_memory(e):
            raise
        _close_bars()
        print(f"error: out of memory ({one_line(str(e) or type(e).__name__, 300)}): a size "
              "setting may be too large for this machine (see the memory plan above, and "
              "--help)", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # before a run's loop (its loop says how to resume itself)
        _close_bars()
        print(f"interrupted during setup, before the training loop; to go on: "
              f"{_rerun_hint(prog or _prog(module), resumable)}", file=sys.stderr, flush=True)
        sys.exit(130)


def _rerun_hint(prog: str, resumable: bool = True) -> str:
    """How to go on after Ctrl-C during a run's setup: the same command (``--resume`` added
    when ``resumable`` and ``--run-dir`` now holds a run)."""
    import shlex

    argv = sys.argv[1:]
    run_dir = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--run-dir"), None)
    if run_dir is None:
        run_dir = next((a.split("=", 1)[1] for a in argv if a.startswith("--run-dir=")), None)
    resume = resumable and "--resume" not in argv and run_dir is not None \
        and os.path.lexists(Path(run_dir) / "config.json")
    command = " ".join([prog, *(shlex.quote(a) for a in argv),
                        *(["--resume"] if resume else [])])
    return f"run {command}"


def _close_bars() -> None:
    """Close the progress bars still open, so that an error starts a line of its own."""
    if "tqdm" in sys.modules:
        from tqdm import tqdm

        for bar in list(getattr(tqdm, "_instances", ())):
            bar.close()


#: Loggers of libraries the trainers use, kept at WARNING whatever the trainer's level.
QUIET_LOGGERS = ("transformers", "peft", "urllib3", "filelock", "matplotlib", "PIL", "ray",
                 "torch", "datasets", "fsspec", "httpx", "numcodecs", "zarr", "asyncio", "OpenGL",
                 # the buffer's own per-save line: a trainer logs one line per commit instead
                 # (trainers.common.commit_line); the saver's warnings still show
                 "rlbuffers.storage.saver")


@dataclass
class RunConfig:
    """Fields every trainer has: where the run lives, its seed, how many checkpoints it
    keeps, resuming, and how much it logs."""

    run_dir: str = "runs/run"
    """Directory of the run: config.json, buffer/, ckpt/, metrics.jsonl, curve.png."""
    seed: int = 0
    """Seed of the data, the sampling and the models' new parameters."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept in run_dir/ckpt."""
    resume: bool = False
    """Continue the run in --run-dir from its last complete step (its settings are kept)."""
    quiet: bool = False
    """Log warnings only (the memory plan and per-phase figures are not printed)."""
    verbose: bool = False
    """Log debug messages of rlbuffers and the trainer."""


#: Settings of :class:`RunConfig` that a resumed run may change.
RUN_RESUMABLE = frozenset({"run_dir", "resume", "quiet", "verbose", "evaluate_again"})


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass and of its dataclass bases (for
    ``--help``); a subclass's docstring wins for a field it declares again."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(_declared_field_docs(klass))
    return docs


@functools.cache
def _declared_field_docs(klass: type) -> tuple[tuple[str, str], ...]:
    """``(field, docstring)`` of the fields ``klass`` declares itself, from its source (read
    and parsed once per class and process: every ``parse_config`` call asks, and
    ``inspect.getsource`` takes ~10 ms a class)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body  # type: ignore[attr-defined]
    return tuple((a.target.id, b.value.value) for a, b in zip(body, body[1:], strict=False)
                 if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)
                 and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant))


def check_rules(c: Any, rules: Mapping[str, tuple[bool, str]]) -> None:
    """Raise ValueError for the first rule that fails: ``{field: (ok, expected)}``.

    Raises:
        ConfigError: (a ValueError) ``--flag: expected <expected>, got <value>``.
    """
    for name, (ok, expected) in rules.items():
        if not ok:
            raise ConfigError(f"--{name.replace('_', '-')}: expected {expected}, got "
                             f"{getattr(c, name)!r}")


#: ``--ray-address`` values: none, ``auto``, ``local``, or ``[ray://]host:port``.
RAY_ADDRESS = re.compile(r"(|auto|local|((ray|https?)://)?[^\s/]+:\d+)")


def check_run(c: RunConfig) -> None:
    """Validate the :class:`RunConfig` fields (ValueError naming the flag)."""
    check_rules(c, {"seed": (0 <= c.seed < 2**63, "in [0, 2**63)"),
                    "keep_checkpoints": (c.keep_checkpoints >= 1, ">= 1"),
                    "quiet": (not (c.quiet and c.verbose), "not both --quiet and --verbose")})


def parse_config(cls: type[C], argv: list[str] | None, *, prog: str, description: str,
                 resumable: set[str] | frozenset[str]) -> C:
    """Build the dataclass ``cls`` from command-line flags (one ``--flag`` per field, its
    docstring as help); on ``--resume`` start from ``run_dir/config.json`` and apply only the
    flags in ``resumable`` (fields added since the run was created take their defaults).

    Raises:
        SystemExit: argparse's error (exit code 2) for an unknown flag, a bad value, a run
            directory that already holds a run without ``--resume``, or a changed setting
            that ``resumable`` does not allow.
        rlbuffers.safe_load.RunFileError: the run's ``config.json`` is not a regular file,
            not a JSON object, or a field's value is not of the field's type.
    """
    parser = ArgumentParser(prog=prog, description=description)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        # A flag --x / --no-x for a bool; BooleanOptionalAction takes no ``type`` (passing
        # one, even None, is deprecated since Python 3.12 and an error from 3.14).
        kind = {"action": argparse.BooleanOptionalAction} if isinstance(f.default, bool) \
            else {"type": str if f.default is None else type(f.default)}
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name,
                            help=f"{docs.get(f.name, '')} (default: {f.default})"
                            .replace("%", "%%"),  # argparse formats help with %
                            default=argparse.SUPPRESS, **kind)
    given = vars(parser.parse_args(argv))
    run_dir = Path(given.get("run_dir", getattr(cls, "run_dir", "")))
    if not given.get("resume"):
        if run_dir.exists() and any(run_dir.iterdir()):
            parser.error(f"{run_dir} already holds a run: pass --resume or another --run-dir")
        return cls(**given)
    path = run_dir / "config.json"
    if not os.path.lexists(path):
        parser.error(f"--resume: {run_dir} holds no run (no config.json)")
    saved = saved_config(cls, path)
    clash = {k: (saved[k], v) for k, v in given.items()
             if k not in resumable and k in saved and saved[k] != v}
    if clash:
        parser.error(f"--resume keeps the run's settings; these differ from {run_dir}/config.json "
                     f"(saved, given): {clash}")
    return cls(**{**saved, **given})


def check_finite(cfg: Any) -> None:
    """Every float setting of the dataclass ``cfg`` is finite (``nan`` and ``inf`` parse as
    floats, from the command line or ``config.json``, and break arithmetic later).

    Raises:
        ConfigError: ``--flag: expected a finite number, got inf``.
    """
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"--{f.name.replace('_', '-')}: expected a finite number, got "
                              f"{value!r}")


def saved_config(cls: type, path: Path) -> dict[str, Any]:
    """The fields of the dataclass ``cls`` saved in the run's ``config.json`` at ``path``
    (unknown keys dropped), each checked to have its field's type (a float field takes an
    integer).

    Raises:
        rlbuffers.safe_load.RunFileError: ``path`` is missing, not a regular file (a symlink,
            a FIFO ...), not a JSON object, or a field's value has another type
            (``<path>: <field>: expected int, got 'abc'``).
    """
    from rlbuffers.safe_load import RunFileError, load_json

    raw = load_json(path, dict)
    saved = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in raw:
            continue
        value, kind = raw[f.name], type(f.default)
        ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            ok, value = True, float(value)
        if not ok:
            raise RunFileError(path, f.name, kind.__name__, repr(value)[:80])
        saved[f.name] = value
    return saved


class TqdmHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A log handler writing to stderr through ``tqdm.write``: an open progress bar is
    cleared first and redrawn below the message."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging's contract: report, never raise
            self.handleError(record)


def set_log_level(quiet: bool = False, verbose: bool = False) -> None:
    """Trainers log at INFO (the memory plan, budgets, per-phase peaks), WARNING with
    ``quiet``, DEBUG with ``verbose``; the libraries in :data:`QUIET_LOGGERS` stay at
    WARNING."""
    level = logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO
    handler = TqdmHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def start(cls: type[C], argv: list[str] | None, *, module: str, doc: str,
          resumable: set[str] | frozenset[str], check: Callable[[C], None],
          evaluates: Callable[[C], bool] | None = None) -> C:
    """A trainer's ``main`` preamble: the config from the command line (:func:`parse_config`,
    ``python3 -m <module>``, the first paragraph of ``doc`` as description), ``check(cfg)``
    (raises ValueError naming a flag), the log level of ``--quiet`` / ``--verbose``.

    On ``--resume``, a new target (``--steps`` ...) is written to the run's ``config.json``
    (atomically), so a later plain ``--resume`` keeps it; a run already at its target, whose
    final evaluation (``evaluates(cfg)``: whether the trainer evaluates at the end) is
    written for its last unit, prints one line and exits 0 (``SystemExit(None)``) unless
    ``--evaluate-again``. Returns the config."""
    cfg = parse_config(cls, argv, prog=f"python3 -m {module}", description=doc.split("\n\n")[0],
                       resumable=resumable)
    try:
        check_finite(cfg)
        check(cfg)
    except ConfigError as e:  # on --resume the value may come from the run's config.json
        if not getattr(cfg, "resume", False):
            raise
        raise ConfigError(f"{Path(cfg.run_dir) / 'config.json'} or the flags: {e}") from None
    set_log_level(getattr(cfg, "quiet", False), getattr(cfg, "verbose", False))
    if not getattr(cfg, "resume", False):
        return cfg
    target = next((name for name in TARGETS if hasattr(cfg, name)), None)
    if target is None:
        return cfg
    run_dir = Path(cfg.run_dir)
    unit, n = TARGETS[target], getattr(cfg, target)
    done = last_complete(run_dir, unit)
    if n < done:
        raise TargetError(f"--{target} {n}: {run_dir} has already completed {unit} {done}; a "
                          f"target below it is refused (config.json is unchanged)")
    if done < n:
        keep_target(run_dir, target, n)
        return cfg
    again = bool(getattr(cfg, "evaluate_again", False))
    if evaluates is not None and evaluates(cfg) and (again or not evaluated(run_dir, unit, done)):
        return cfg
    sys.exit(print(f"{run_dir}: {unit} {done} of {n} is complete, nothing to train (raise "
                   f"--{target} to continue)", file=sys.stderr, flush=True))


def keep_target(run_dir: Path, name: str, value: int) -> None:
    """Write ``name = value`` into ``run_dir/config.json`` (temporary file, fsync, rename) when
    it differs."""
    from rlbuffers.checkpoint import write_json_atomic
    from rlbuffers.safe_load import load_json

    path = run_dir / "config.json"
    saved = load_json(path, dict)
    if saved.get(name) == value:
        return
    log.info("%s: --%s %s -> %s (config.json)", run_dir, name, saved.get(name), value)
    saved[name] = value
    write_json_atomic(path, saved)


def last_complete(run_dir: Path, unit: str) -> int:
    """The last complete unit of the run in ``run_dir`` (its buffer's ``trainer_<unit>``).

    Raises:
        rlbuffers.UnsafePathError: ``buffer`` is a symlink or not a directory (a reader
            would register itself there). rlbuffers.NotABufferError: it is missing.
    """
    from rlbuffers import ReplayBuffer
    from trainers.run_files import real_dir

    if os.path.lexists(run_dir / "buffer"):
        real_dir(run_dir, "buffer", make=False)
    buf = ReplayBuffer.open(run_dir / "buffer", mode="r")
    try:
        return int(buf.metadata.get(f"trainer_{unit}", 0))
    finally:
        buf.close()


def evaluated(run_dir: Path, unit: str, n: int) -> bool:
    """Whether ``run_dir/eval.json`` holds the final evaluation of unit ``n`` (``"after":
    {..., "<unit>": n}``, written by ``trainers.summary.write_eval``)."""
    from rlbuffers.safe_load import RunFileError, load_json

    try:  # a missing, damaged or planted eval.json: not evaluated (it is written again)
        data = load_json(run_dir / "eval.json", dict)
    except RunFileError:
        return False
    return isinstance(data.get("after"), dict) and data["after"].get(unit) == n
