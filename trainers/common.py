"""The run lifecycle every trainer shares, written once.

A run directory holds ``config.json``, ``buffer/`` (the replay buffer), ``ckpt/<unit>-<N>/``
(checkpoints), ``metrics.jsonl`` (one line per completed unit), ``curve.png`` and whatever the
trainer adds (prompts, ``eval.json``). :func:`open_run` creates it atomically (absent or
complete) or reopens it at its last complete unit; :meth:`Run.commit` completes a unit in the
one order that makes resume exact:

1. checkpoint ``N`` (models, optimizers, RNG and trainer state: ``rlbuffers.checkpoint``);
2. the buffer commit with metadata ``{"trainer_<unit>": N}``: **the commit point**;
3. prune the checkpoints (those newer than the commit, and all but the newest kept);
4. the unit's row appended to the history, ``metrics.jsonl`` and the curve.

A crash anywhere leaves the last (checkpoint, buffer commit) pair, which :func:`open_run`
finds; ``metrics.jsonl`` is then rebuilt from that checkpoint's history. The loop unit is one
word per trainer (``step``, ``iteration``, ``generation``): it names the metadata key, the
checkpoint prefix and the metrics rows' key.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import shlex
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from rlbuffers import ReplayBuffer
from rlbuffers.checkpoint import Checkpoints, create_run, load_state
from rlbuffers.memory.process import process_peak_rss_bytes
from rlbuffers.safe_load import RunFileError, load_torch, read_bytes, restoring
from rlbuffers.storage.safe_files import append_inside, write_atomic_inside

# What the trainer packages use of trainers.run_files, re-exported: common is their shared layer
from trainers.run_files import MONITOR_STATE as MONITOR_STATE
from trainers.run_files import check_optimizer as check_optimizer
from trainers.run_files import check_state as check_state
from trainers.run_files import check_unit as check_unit
from trainers.run_files import metrics_rows as metrics_rows
from trainers.run_files import open_token_store as open_token_store
from trainers.run_files import real_dir

log = logging.getLogger("trainers.common")

#: The trainers' flags that set the replay buffer's capacity.
CAPACITY_FLAGS = ("buffer_capacity", "buffer_groups", "buffer_episodes")

#: ``curve(path, history)``: draws the run's curve (PNG) from its metrics rows.
CurveFn = Callable[[Path, list[dict[str, Any]]], None]


def rng_states(rng: np.random.Generator) -> dict[str, Any]:
    """torch (CPU and, where present, every CUDA device: uint8 tensors), numpy (``rng``: the
    bit generator's state, a dict of strings and ints) and Python (``random.getstate()``: a
    tuple of ints) RNG states, for ``torch.save``: plain data that
    ``torch.load(weights_only=True)`` reads back (:func:`load_rng`)."""
    import torch

    out = {"torch": torch.get_rng_state(), "numpy": rng.bit_generator.state,
           "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_states(states: dict[str, Any], rng: np.random.Generator,
                   path: str | os.PathLike[str] = "rng.pt") -> None:
    """Restore what :func:`rng_states` returned (``path``: the file it was read from, for
    the error message).

    Raises:
        rlbuffers.CorruptCheckpointError: ``states`` is not what :func:`rng_states` returns
            (one line naming ``path``).
    """
    import torch

    with restoring(path, "the RNG states of rng_states() (torch, numpy, python[, cuda])"):
        if not isinstance(states, dict):
            raise TypeError(f"a {type(states).__name__}")
        if not isinstance(states["torch"], torch.Tensor):
            raise TypeError(f"'torch' of type {type(states['torch']).__name__}")
        torch.set_rng_state(states["torch"])
        rng.bit_generator.state = states["numpy"]
        python = states["python"]
        random.setstate(tuple(python) if isinstance(python, list) else python)
        if "cuda" in states and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(states["cuda"])


def load_rng(path: Path, rng: np.random.Generator) -> None:
    """Restore the RNG states saved in ``path`` (a :func:`rng_states` ``torch.save``, read
    with ``weights_only=True``: a file asking for any Python object is refused).

    Raises:
        rlbuffers.CorruptCheckpointError: the file is missing, damaged, refused or not RNG
            states (one line naming it).
    """
    set_rng_states(load_torch(path), rng, path)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` by ``data`` (a temporary file of an unpredictable name + rename, never
    through a symlink or into a FIFO: ``rlbuffers.storage.safe_files.write_atomic_inside``
    in ``path``'s directory; no fsync: files written with it are rebuilt from a
    checkpoint).

    Raises:
        rlbuffers.UnsafePathError: ``path`` is a directory's name reached through a symlink.
    """
    write_atomic_inside(path.parent, path.name, data, durable=False)


def restore_metrics(path: Path, history: list[dict[str, Any]], key: str) -> None:
    """Make ``metrics.jsonl`` hold exactly the checkpoint's rows (``history``, keyed by
    ``key``): drop lines of units that never committed (and a line cut by a crash); a
    committed unit whose line was lost is restored from ``history``. A ``metrics.jsonl``
    that is not a regular file (a symlink, a FIFO) is not read, and is replaced."""
    logged: dict[int, str] = {}
    try:
        text = read_bytes(path).decode("utf-8", "replace")
    except RunFileError as e:
        if os.path.lexists(path):
            log.warning("%s; it is rebuilt from the checkpoint", e)
        text = ""
    for line in text.splitlines():
        try:
            logged[json.loads(line)[key]] = line
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    lines = [logged.get(h[key], json.dumps(h)) for h in history]
    write_atomic(path, "".join(line + "\n" for line in lines).encode())


class Interrupted(SystemExit):
    """Ctrl-C: exit code 130 (128 + SIGINT, as a shell reports it) after the line saying how
    to resume (``str()`` of the exception, already printed)."""

    def __init__(self, message: str) -> None:
        super().__init__(130)
        self.message = message

    def __str__(self) -> str:
        return self.message


def commit_line(unit: str, n: int, report: Any, seconds: float) -> str:
    """The one line a unit's commit logs: ``generation 3 committed in 0.8 s: checkpoint,
    buffer commit 3 (12 chunks, 4.1 MiB written), curve`` (``report``: the buffer's
    ``SaveReport``)."""
    b = report.bytes_written
    size = f"{b / 2**20:,.1f} MiB" if b >= 2**20 / 10 else f"{b / 2**10:,.1f} KiB"
    return (f"{unit} {n} committed in {seconds:.1f} s: checkpoint, buffer commit "
            f"{report.commit} ({report.chunks_written} chunks, {size} written), curve")


@dataclass
class Run:
    """An open run directory (see the module docstring); made by :func:`open_run`.

    Attributes:
        dir: the run directory.
        unit: the loop unit's word (``step``, ``iteration``, ``generation``).
        buf: the replay buffer, writable (None in a process that does not own the run,
            e.g. a rank > 0 of a distributed run).
        ckpts: the checkpoints, ``ckpt/<unit>-<N>``.
        done: the last complete unit (0 for a new run).
        checkpoint: the checkpoint directory of ``done`` (None: nothing to restore).
        history: the metrics rows of the complete units, oldest first.
        curve: draws ``curve.png`` from ``history`` after each commit (None: no curve).
        command: the trainer's command (``python3 -m trainers.grpo``).
        target: the unit the run trains to (``--steps`` ...; None: unknown).
    """

    dir: Path
    unit: str
    buf: ReplayBuffer | None
    ckpts: Checkpoints
    done: int = 0
    checkpoint: Path | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    curve: CurveFn | None = None
    command: str = ""
    target: int | None = None
    _tb: Any = None
    _saver: ThreadPoolExecutor | None = None
    _pending: Future[None] | None = None

    @property
    def key(self) -> str:
        """The buffer-commit metadata key naming the complete unit: ``trainer_<unit>``."""
        return f"trainer_{self.unit}"

    @property
    def resumed(self) -> bool:
        """Whether a checkpoint was found to continue from."""
        return self.checkpoint is not None

    def load_state(self) -> dict[str, Any]:
        """The JSON trainer state of :attr:`checkpoint` (its ``history`` becomes
        :attr:`history`, and ``metrics.jsonl`` is rebuilt from it).

        Raises:
            RuntimeError: there is no checkpoint to load.
            rlbuffers.CorruptCheckpointError: a file of the checkpoint fails its checksum, or
                its ``history`` is not a list of rows keyed by the unit.
            rlbuffers.safe_load.RunFileError: ``state.json`` is not a JSON object.
        """
        if self.checkpoint is None:
            raise RuntimeError(f"{self.dir}: no complete {self.unit} to resume from")
        state = load_state(self.checkpoint)
        history = state.get("history", [])
        with restoring(self.checkpoint / "state.json",
                       f"'history': a list of rows with an integer {self.unit!r}"):
            if not isinstance(history, list) or not all(
                    isinstance(h, dict) and type(h[self.unit]) is int for h in history):
                raise TypeError(f"{type(history).__name__} {str(history)[:60]}")
        self.history = list(history)
        if self.buf is not None:
            restore_metrics(self.dir / "metrics.jsonl", self.history, self.unit)
        return state

    def commit(self, n: int, row: dict[str, Any], *, state: dict[str, Any],
               torch_files: dict[str, Any] | None = None,
               writers: dict[str, Callable[[Path], None]] | None = None,
               metadata: dict[str, Any] | None = None) -> None:
        """Complete unit ``n``: checkpoint (``torch_files``: ``torch.save``d objects;
        ``writers``: ``{file name: write(path)}``; ``state``: plain data, saved as JSON with
        ``history`` added), buffer commit naming ``n`` (plus ``metadata``), prune, then
        ``row`` (with ``seconds_commit``: the whole commit's, curve included; ``commit_bytes``
        and ``process_peak_rss_bytes``, the process's true peak RSS so far, added) into the
        history, the curve, ``metrics.jsonl`` and TensorBoard (:meth:`tensorboard`); logs
        the commit's one line (:func:`commit_line`, INFO)."""
        t0 = time.perf_counter()
        self.ckpts.write(n, torch_files=torch_files or {}, writers=writers or {},
                         state={**state, "history": self.history + [row]})
        assert self.buf is not None, "only the process that owns the run commits"
        report = self.buf.save(metadata={self.key: n, **(metadata or {})})
        self.ckpts.prune(n)
        self.done = n
        row["commit_bytes"] = report.bytes_written
        row["process_peak_rss_bytes"] = process_peak_rss_bytes()
        self.history.append(row)
        if self.curve is not None:
            self.curve(self.dir / "curve.png", self.history)
        row["seconds_commit"] = time.perf_counter() - t0
        append_inside(self.dir, "metrics.jsonl", (json.dumps(row) + "\n").encode())
        self.tensorboard(n, row)
        log.info("%s", commit_line(self.unit, n, report, row["seconds_commit"]))

    def tensorboard(self, n: int, row: dict[str, Any]) -> None:
        """Write every numeric value of ``row`` (not bools, lists or dicts) as a scalar of
        step ``n`` under ``<dir>/tb`` (TensorBoard event files; ``tensorboard --logdir``).
        A resumed run drops the events of units after its last complete one. Without the
        ``tensorboard`` package: one warning, no events."""
        if self._tb is False:
            return
        if self._tb is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # tensorboard is in the trainers extra
                log.warning("no TensorBoard events (%s): pip install tensorboard", e)
                self._tb = False
                return
            self._tb = SummaryWriter(str(real_dir(self.dir, "tb")), purge_step=n)
        for key, value in row.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                self._tb.add_scalar(key, value, n)
        self._tb.flush()

    def commit_in_background(self, n: int, row: dict[str, Any], **kwargs: Any) -> None:
        """:meth:`commit` on a worker thread, one at a time (the previous one is waited for
        first). The caller must not change what the checkpoint reads (weights, optimizer
        state, buffer) before :meth:`wait`; pass ``state`` as a deep copy."""
        self.wait()
        if self._saver is None:
            self._saver = ThreadPoolExecutor(1, thread_name_prefix="commit")
        self._pending = self._saver.submit(self.commit, n, row, **kwargs)

    def wait(self) -> None:
        """Wait for a background commit; re-raise its error."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def interrupted_message(self, argv_hint: str = "") -> str:
        """The line printed on Ctrl-C: the last complete unit and the exact command that
        finishes the run (its target is in ``config.json``)."""
        last = self.buf.metadata.get(self.key, 0) if self.buf is not None else self.done
        of = f" (of {self.target})" if self.target is not None else ""
        return (f"interrupted; {self.unit} {last} is the last complete one{of}: continue with "
                f"{self.command} --resume --run-dir {shlex.quote(str(self.dir))}{argv_hint}")

    def exit_interrupted(self) -> NoReturn:
        """On Ctrl-C: wait for a background commit, close the progress bars (so nothing
        redraws over the message), print :meth:`interrupted_message` on its own line (stderr)
        and exit with code 130 (:class:`Interrupted`)."""
        from tqdm import tqdm

        try:
            self.wait()
        finally:
            for bar in list(getattr(tqdm, "_instances", ())):
                bar.close()
        message = self.interrupted_message()
        print(message, file=sys.stderr, flush=True)
        raise Interrupted(message)

    def close(self) -> None:
        """Wait for a background commit, then close the buffer."""
        try:
            self.wait()
        finally:
            if self._saver is not None:
                self._saver.shutdown(wait=True)
                self._saver = None
            if self.buf is not None:
                self.buf.close()
                self.buf = None
            if self._tb:
                self._tb.close()
            self._tb = None


def open_run(cfg: Any, *, unit: str, create: Callable[[Path], None],
             curve: CurveFn | None = None, owner: bool = True) -> Run:
    """Create the run directory of ``cfg`` (a dataclass with ``run_dir``, ``resume`` and
    ``keep_checkpoints``) or reopen it.

    A new run: ``config.json``, ``ckpt/`` and what ``create(dir)`` writes there (it must make
    ``dir/buffer``, e.g. with ``ReplayBuffer.create``) appear at once or not at all. Resuming
    (``cfg.resume``): the buffer opens writable at its last commit, whose ``trainer_<unit>``
    names the last complete unit; checkpoints of units that never committed are pruned.
    ``owner=False`` (a process that shares the run, e.g. rank > 0): nothing is created or
    pruned (the owner does that first), the buffer is read for its last commit and closed.

    Raises:
        FileExistsError: a new run's directory is not empty.
        trainers.config.ConfigError: the buffer refuses the capacity the trainer's flag
            (:data:`CAPACITY_FLAGS`) asks for.
        rlbuffers.ManifestError and other buffer errors: the buffer cannot be opened.
        rlbuffers.UnsafePathError: ``ckpt`` or ``buffer`` is a symlink or not a directory.
        rlbuffers.CorruptCheckpointError: the last complete unit's checkpoint is missing or
            fails its checksums.
    """
    run_dir = Path(cfg.run_dir)
    ckpts = Checkpoints(run_dir / "ckpt", prefix=unit, keep=cfg.keep_checkpoints)
    if cfg.resume:  # checkpoints and the buffer are written only inside the run directory
        real_dir(run_dir, "ckpt", make=False)
        real_dir(run_dir, "buffer", make=False)
    if not cfg.resume and owner:
        def make(d: Path) -> None:
            (d / "ckpt").mkdir()
            try:
                create(d)
            except ValueError as e:  # the buffer refuses a capacity: name the trainer's flag
                flag = next((f for f in CAPACITY_FLAGS if hasattr(cfg, f)), None)
                if flag is None or "capacity" not in str(e):
                    raise
                from trainers.config import ConfigError

                raise ConfigError(f"--{flag.replace('_', '-')} {getattr(cfg, flag)}: the "
                                  f"replay buffer refuses its capacity ({e})") from None

        create_run(run_dir, dataclasses.asdict(cfg), make)
    buf = ReplayBuffer.open(run_dir / "buffer", mode="r+" if owner else "r")
    done = int(buf.metadata.get(f"trainer_{unit}", 0))
    if owner:
        ckpts.prune(done)
    else:
        buf.close()
    from trainers.config import TARGETS

    target = next((getattr(cfg, k) for k, u in TARGETS.items() if u == unit and hasattr(cfg, k)),
                  None)
    package = type(cfg).__module__.rsplit(".", 1)[0]
    run = Run(run_dir, unit, buf if owner else None, ckpts, done, ckpts.latest(done),
              curve=curve, command=f"python3 -m {package}", target=target)
    if run.resumed:
        log.info("resuming %s at %s %d", run_dir, unit, done)
    return run
