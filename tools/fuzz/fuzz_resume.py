"""Fuzz ``--resume`` of a run directory (issue 44): a real one-step GRPO run and a
one-generation ERL run, copied and damaged before each resume: ``config.json`` fields
replaced by other types, deleted, or its text mutated; checkpoint and run files (``state.json``,
``rng.pt``, optimizer, weights, ``checksums.json``, ``reference.pt``, prompts, metrics, eval)
truncated, bit-flipped, deleted, replaced by a symlink (to a copy outside) or a FIFO, or by a
pickle that would create a marker file; ``state.json`` mutated key by key; then the
checksums kept, recomputed to match, or deleted.

Property: the resume, through the trainers' entry point (``trainers.config.run_main``), either
completes (exit 0) or exits 2 with one ``error:`` line; never another exception (a
traceback), never a hang (a watchdog opens a planted FIFO's other end after ``HANG_S``
seconds and reports it), never the pickle's code (the marker file), never a write through a
symlink (the outside copy unchanged).

``python -m tools.fuzz.fuzz_resume --minutes 10`` (prints inputs tried, findings and the
outcomes: resumed, refused).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import re
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from tools.fuzz.common import Finding, mutate_bytes, mutate_json, run

HANG_S = 20.0
#: A progress bar's piece of a line (tqdm writes with \r).
PROGRESS = re.compile(r"\d+%\|.*\| *\d+/\d+ \[")
ERL = ["--env", "HalfCheetah-v5", "--max-episode-steps", "50", "--pop-size", "3", "--hidden",
       "16", "--learning-starts", "100", "--batch-size", "32"]
GRPO = ["--task", "basic_arithmetic", "--train-size", "40", "--prompts-per-step", "2",
        "--group-size", "3", "--max-completion-tokens", "12", "--max-prompt-tokens", "120",
        "--pack-tokens", "200", "--memory-budget", "none", "--train-threads", "1",
        "--lr", "1e-2", "--no-evaluate"]
#: Values put in config.json fields: other types, and numbers a setting may not take (sizes
#: stay small: a config asking for 10^18 problems is a long run, not a damaged one).
CONFIG_VALUES = [None, True, False, "abc", "", "1", 1.5, -1, 0, 1, 2, 3, [], {}, [1], {"a": 1},
                 float("nan"), float("inf"), -0.5, "runs/elsewhere"]
TRAINERS = {"grpo": ("trainers.grpo.train", "steps", "step"),
            "erl": ("trainers.erl.train", "generations", "generation")}


class Payload:
    """Unpickling it would create the file ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


@contextlib.contextmanager
def stdout_to_devnull() -> Any:
    """File descriptor 1 to /dev/null (the worker's stdout is its report channel; libraries
    write progress there from C, past ``sys.stdout``)."""
    sys.stdout.flush()
    saved = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def entry(module: str, argv: list[str]) -> tuple[Any, str]:
    """``run_main(module)`` with ``argv``: (exit code, 0 when it returned; stderr)."""
    from trainers.config import run_main

    err = io.StringIO()
    old = sys.argv
    sys.argv = [module, *argv]
    try:
        with contextlib.redirect_stderr(err), stdout_to_devnull():
            try:
                run_main(module)
                code: Any = 0
            except SystemExit as e:
                code = e.code
    finally:
        sys.argv = old
    return code, err.getvalue()


class Watchdog:
    """After :data:`HANG_S` seconds, open the FIFOs in ``paths`` read-write (releasing a
    process blocked opening them) and drain them until :meth:`stop`."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths, self.hung = paths, False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if not self.paths or self._done.wait(HANG_S):
            return
        self.hung = True
        fds = [os.open(p, os.O_RDWR | os.O_NONBLOCK) for p in self.paths if p.is_fifo()]
        try:
            while not self._done.wait(0.05):
                for fd in fds:
                    with contextlib.suppress(BlockingIOError):
                        os.read(fd, 1 << 16)
        finally:
            for fd in fds:
                os.close(fd)

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


class Fuzz:
    """``Fuzz(workdir, trainers)``: the pristine runs are made in ``workdir``."""

    def __init__(self, workdir: Path, trainers: tuple[str, ...] = ("grpo", "erl")) -> None:
        import torch

        from tests.tiny_lm import make_tiny_lm_dir

        torch.set_num_threads(1)
        self.work = Path(workdir)
        self.pristine: dict[str, Path] = {}
        self.outcomes = {"resumed": 0, "refused": 0}
        for name in trainers:
            run_dir = self.work / f"pristine-{name}"
            with stdout_to_devnull():
                lm = make_tiny_lm_dir(self.work / "lm") if name == "grpo" else None
            extra = [*GRPO, "--model", str(lm)] if name == "grpo" else ERL
            code, err = entry(TRAINERS[name][0], [*extra, "--run-dir", str(run_dir),
                                                  f"--{TRAINERS[name][1]}", "1", "--quiet"])
            assert code in (0, None), err[-2000:]
            self.pristine[name] = run_dir
        self.files = {name: sorted(p.relative_to(d).as_posix() for p in d.rglob("*")
                                   if p.is_file() and not p.relative_to(d).as_posix()
                                   .startswith(("buffer", "tb")))
                      for name, d in self.pristine.items()}
        self.config = {name: json.loads((d / "config.json").read_text())
                       for name, d in self.pristine.items()}

    def generate(self, rng: random.Random) -> bytes:
        name = rng.choice(sorted(self.pristine))
        ops: list[dict[str, Any]] = []
        for _ in range(rng.randint(1, 3)):
            kind = rng.choice(["config", "config", "file", "file", "file", "state", "payload"])
            if kind == "config":
                key = rng.choice(sorted(self.config[name]))
                how = rng.choice(["value", "delete", "text"])
                ops.append({"op": "config", "how": how, "key": key,
                            "value": rng.choice(CONFIG_VALUES), "seed": rng.randrange(2**31)})
            elif kind == "file":
                ops.append({"op": "file", "file": rng.choice(self.files[name]),
                            "how": rng.choice(["truncate", "mutate", "delete", "symlink",
                                               "fifo"]), "seed": rng.randrange(2**31)})
            elif kind == "state":
                ops.append({"op": "state", "seed": rng.randrange(2**31)})
            else:
                ops.append({"op": "payload", "file": rng.choice(
                    [f for f in self.files[name] if f.endswith(".pt")])})
        checksums = rng.choice(["kept", "recomputed", "deleted"])
        return json.dumps({"trainer": name, "ops": ops, "checksums": checksums}).encode()

    def check(self, data: bytes) -> None:
        case = json.loads(data)
        name = case["trainer"]
        with tempfile.TemporaryDirectory(dir=self.work) as tmp:
            run_dir, outside, marker = Path(tmp, "run"), Path(tmp, "outside"), Path(tmp, "m")
            shutil.copytree(self.pristine[name], run_dir, symlinks=True)
            outside.mkdir()
            fifos: list[Path] = []
            for op in case["ops"]:
                apply(op, run_dir, outside, marker, fifos)
            ckpt = next(iter(sorted((run_dir / "ckpt").glob("*-1"))), None) \
                if (run_dir / "ckpt").is_dir() and not (run_dir / "ckpt").is_symlink() else None
            if ckpt is not None and ckpt.is_dir() and not ckpt.is_symlink():
                checksums(ckpt, case["checksums"])
            before = {p: digest(p) for p in outside.iterdir()}
            module, target, _ = TRAINERS[name]
            dog = Watchdog(fifos)
            try:
                code, err = entry(module, ["--resume", "--run-dir", str(run_dir),
                                           f"--{target}", "2", "--quiet"])
            except BaseException as exn:  # noqa: BLE001 - the property is about what escapes
                raise Finding(f"{type(exn).__name__} escaped (a traceback): {exn!s:.300}"
                              ) from exn
            finally:
                dog.stop()
            if dog.hung:
                raise Finding(f"the resume hung on a planted FIFO {fifos}")
            if marker.exists():
                raise Finding("the pickle payload ran (code execution)")
            if any(digest(p) != h for p, h in before.items()):
                raise Finding("a write went through a planted symlink")
            lines = [x for x in err.splitlines() if x.strip() and not PROGRESS.search(x)
                     and not x.startswith(("WARNING ", "INFO "))]
            if "Traceback" in err:
                raise Finding(f"a traceback: {err[-500:]}")
            if code in (0, None):
                self.outcomes["resumed"] += 1
            elif code == 2 and len(lines) == 1 and "error: " in lines[0]:
                self.outcomes["refused"] += 1
            else:
                raise Finding(f"exit code {code!r} with {len(lines)} lines: {lines[:3]}")


def digest(path: Path) -> str:
    if path.is_dir():
        return ",".join(f"{p.name}:{digest(p)}" for p in sorted(path.iterdir()))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def apply(op: dict[str, Any], run_dir: Path, outside: Path, marker: Path,
          fifos: list[Path]) -> None:
    """Damage ``run_dir`` as ``op`` says (see the module docstring)."""
    import torch

    rng = random.Random(op.get("seed", 0))
    if op["op"] == "config":
        _damage_config(run_dir / "config.json", op, rng)
    elif op["op"] == "state":
        for path in (run_dir / "ckpt").glob("*-1/state.json"):
            if path.is_file() and not path.is_symlink():
                with contextlib.suppress(ValueError):
                    path.write_text(json.dumps(mutate_json(json.loads(path.read_bytes()), rng)))
    else:
        path = run_dir / op["file"]
        if not path.is_file() or path.is_symlink() or not path.parent.is_dir():
            return
        if op["op"] == "payload":
            torch.save({"torch": Payload(str(marker))}, path)
        else:
            _damage_file(path, op["how"], outside / op["file"].replace("/", "_"), rng, fifos)


def _damage_config(path: Path, op: dict[str, Any], rng: random.Random) -> None:
    if not path.is_file() or path.is_symlink():
        return
    data = path.read_bytes()
    if op["how"] == "text":
        path.write_bytes(mutate_bytes(data, rng))
        return
    with contextlib.suppress(ValueError):  # UnicodeDecodeError, JSONDecodeError: left as is
        config = json.loads(data)
        if isinstance(config, dict):
            if op["how"] == "delete":
                config.pop(op["key"], None)
            else:
                config[op["key"]] = op["value"]
            path.write_text(json.dumps(config))


def _damage_file(path: Path, how: str, copy: Path, rng: random.Random,
                 fifos: list[Path]) -> None:
    if how == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[:rng.randrange(len(data) + 1)])
    elif how == "mutate":
        path.write_bytes(mutate_bytes(path.read_bytes(), rng, max_steps=8))
    elif how == "delete":
        path.unlink()
    elif how == "symlink":  # to a copy outside, which must stay unchanged
        shutil.copy2(path, copy)
        path.unlink()
        path.symlink_to(copy)
    else:
        path.unlink()
        os.mkfifo(path)
        fifos.append(path)


def checksums(ckpt: Path, how: str) -> None:
    """Keep ``checksums.json``, recompute it over the files it names (what an attacker does
    to get past it), or delete it."""
    from rlbuffers.checkpoint import CHECKSUMS_JSON, file_crc32c

    path = ckpt / CHECKSUMS_JSON
    if how == "kept" or not path.is_file() or path.is_symlink():
        return
    if how == "deleted":
        path.unlink()
        return
    with contextlib.suppress(ValueError, AttributeError):
        names = json.loads(path.read_text())
        sums = {n: file_crc32c(ckpt / n) for n in names
                if (ckpt / n).is_file() and not (ckpt / n).is_symlink()}
        path.write_text(json.dumps(sums))


def main(argv: list[str] | None = None) -> int:
    """The runner of :mod:`tools.fuzz.common` (workers under a 16 GiB address space by
    default: torch maps more than the common 4 GiB), then the outcomes of every worker."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--worker" in args:
        return _worker(args)
    if "--address-space" not in args:
        args += ["--address-space", str(16 * 2**30)]
    if "--out" not in args:
        args += ["--out", tempfile.mkdtemp(prefix="rlbuffers-fuzz-resume-")]
    status = run("tools.fuzz.fuzz_resume", __doc__ or "", args)
    out = Path(args[args.index("--out") + 1])
    totals = {"resumed": 0, "refused": 0}
    for f in out.glob("w*/outcomes.json"):
        for k, v in json.loads(f.read_text()).items():
            totals[k] = totals.get(k, 0) + v
    print(f"outcomes: {totals['resumed']:,} resumed, {totals['refused']:,} refused "
          "(exit 2, one line)")
    return status


def _worker(args: list[str]) -> int:
    """The worker of :func:`tools.fuzz.common.run`, its outcomes kept in
    ``<workdir>/outcomes.json`` after each input."""
    import tools.fuzz.common as common
    import tools.fuzz.fuzz_resume as mod  # what common._worker imports (not __main__)

    i = args.index("--worker")
    workdir = Path(args[i + 3])
    real_check = mod.Fuzz.check

    def check(self: Fuzz, data: bytes) -> None:
        try:
            real_check(self, data)
        finally:
            (workdir / "outcomes.json").write_text(json.dumps(self.outcomes))

    mod.Fuzz.check = check  # type: ignore[method-assign]
    common._worker("tools.fuzz.fuzz_resume", int(args[i + 1]), int(args[i + 2]), str(workdir),
                   int(args[i + 4]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
