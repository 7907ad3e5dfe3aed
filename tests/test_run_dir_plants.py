"""Issue 44, W2: a symlink (to a copy outside the run, whose content must stay unchanged) or a
FIFO planted at every path a short GRPO run writes in its run directory (the list is taken
from a real one-step run, plus the names of the next step's checkpoint and the temporary
names the trainers used to write through), then ``--resume`` through the real entry point.
Each resume either refuses with one line (exit code 2) or replaces the planted entry and
completes; it never writes through the symlink, never hangs on the FIFO (a watchdog opens
the FIFO's other end after a while so that a hang fails the test instead of blocking it).
The buffer's own files (``buffer/*``) are the storage layer's (its tests plant there); the
``buffer`` directory itself is planted here."""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from pathlib import Path

import pytest

from tests.heavy import require

require("reasoning_gym", "transformers", "peft", "tokenizers")

from tests.test_grpo import ARGS  # noqa: E402
from tests.test_resume_hostile import PROGRESS, entry  # noqa: E402
from tests.tiny_lm import make_tiny_lm_dir  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

MODULE = "trainers.grpo.train"
#: Names the trainers wrote through before issue 44 (temporary files), and step 2's.
EXTRA = ["config.json.tmp", "metrics.jsonl.tmp", "eval.json.tmp", "tmp-curve.png",
         "ckpt/step-2", "ckpt/step-2.tmp", "ckpt/step.spare"]
#: Paths a completed resume must have written afresh (so a planted entry is gone).
WRITTEN = {"metrics.jsonl", "curve.png", "eval.json", "config.json", "ckpt/step-2"}
HANG_S = 30.0


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("plants")
    lm = make_tiny_lm_dir(d / "lm")
    run = d / "run"
    with pytest.MonkeyPatch.context() as mp:
        assert entry(MODULE, [*ARGS, "--model", str(lm), "--run-dir", str(run), "--steps",
                              "1", "--quiet"], mp) == 0
    return run


def written_paths(run: Path) -> list[str]:
    """Every path of the run (files and directories) outside ``buffer/``, plus
    :data:`EXTRA`."""
    out = ["buffer"]
    for p in sorted(run.rglob("*")):
        rel = p.relative_to(run).as_posix()
        if not rel.startswith("buffer"):
            out.append(rel)
    return out + EXTRA


def snapshot(path: Path) -> dict[str, str]:
    """``{relative name: sha256}`` of a file or of every file below a directory."""
    if path.is_file():
        return {"": hashlib.sha256(path.read_bytes()).hexdigest()}
    return {p.relative_to(path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            if p.is_file() else "dir" for p in sorted(path.rglob("*"))}


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


class Watchdog:
    """After ``HANG_S`` seconds, open the FIFO at ``path`` read-write (which releases a
    process blocked opening it) and drain it until :meth:`stop`; ``hung`` says whether it
    had to."""

    def __init__(self, path: Path) -> None:
        self.path, self.hung = path, False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._done.wait(HANG_S) or not self.path.is_fifo():
            return
        self.hung = True
        fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK)
        try:
            while not self._done.wait(0.05):
                try:
                    os.read(fd, 1 << 16)
                except BlockingIOError:
                    pass
        finally:
            os.close(fd)

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


def plant(run: Path, rel: str, kind: str, outside: Path) -> Path | None:
    """Replace ``run/rel`` by a symlink to a copy of it (or of an empty file) under
    ``outside``, or by a FIFO; returns the copy (None for a FIFO)."""
    path = run / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        remove(path)
        os.mkfifo(path)
        return None
    target = outside / rel.replace("/", "_")
    if path.is_dir():
        shutil.copytree(path, target)
    elif path.exists():
        shutil.copy2(path, target)
    else:
        target.write_bytes(b"outside: must stay unchanged\n")
    remove(path)
    path.symlink_to(target, target_is_directory=target.is_dir())
    return target


def test_every_planted_symlink_and_fifo_is_refused_or_replaced(pristine, tmp_path, monkeypatch,
                                                               capsys):
    paths = written_paths(pristine)
    assert {"config.json", "metrics.jsonl", "curve.png", "eval.json", "reference.pt", "tb",
            "prompts/meta.json", "ckpt/step-1/rng.pt", "ckpt/step-1/state.json",
            "ckpt/step-1/checksums.json", "ckpt/step-1/optimizer.pt"} <= set(paths)
    outcomes: dict[str, list[str]] = {"refused": [], "replaced": []}
    for i, rel in enumerate(paths):
        for kind in ("symlink", "fifo"):
            run, outside = tmp_path / f"run{i}{kind}", tmp_path / f"outside{i}{kind}"
            outside.mkdir()
            shutil.copytree(pristine, run, symlinks=True)
            target = plant(run, rel, kind, outside)
            before = snapshot(target) if target is not None else None
            dog = Watchdog(run / rel) if kind == "fifo" else None
            capsys.readouterr()
            try:
                code = entry(MODULE, ["--resume", "--run-dir", str(run), "--steps", "2",
                                      "--quiet"], monkeypatch)
            finally:
                if dog is not None:
                    dog.stop()
            err = capsys.readouterr().err
            what = f"{kind} at {rel}"
            assert dog is None or not dog.hung, f"{what}: the resume hung on the FIFO"
            assert "Traceback" not in err, (what, err[-2000:])
            if target is not None:
                assert snapshot(target) == before, f"{what}: written through"
            lines = [x for x in err.splitlines() if x.strip() and not PROGRESS.search(x)
                     and not x.startswith(("WARNING ", "INFO "))]
            if code == 2:
                assert len(lines) == 1 and lines[0].startswith("error: "), (what, lines)
                outcomes["refused"].append(what)
            else:
                assert code in (0, None), (what, code, lines)
                if rel in WRITTEN:
                    assert not (run / rel).is_symlink() and not (run / rel).is_fifo(), what
                outcomes["replaced"].append(what)
            shutil.rmtree(run)
    print({k: sorted(v) for k, v in outcomes.items()})  # pytest -s shows them
    # what the trainers rewrite anyway is replaced, not refused; what resume reads is refused
    assert "symlink at metrics.jsonl" in outcomes["replaced"]
    assert "fifo at curve.png" in outcomes["replaced"]
    assert "symlink at ckpt/step-1/rng.pt" in outcomes["refused"]
    assert "fifo at config.json" in outcomes["refused"]
