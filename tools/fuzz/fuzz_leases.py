"""Fuzz what a buffer's writer and readers meet in ``readers/`` and ``.working/`` (issue 44):
random junk planted there before a session: FIFOs, directories, symlinks (to a file or a
directory outside the buffer, to a FIFO outside, dangling), lease files with bad JSON, huge
sparse files, stale temporary leases, a mutated ``state.json``, at the names the library uses
(``obs.npy``, ``tok.ragged/c1.bin``, ``state.json``, ``x.lease``, ``.tmp-*``) and at random
ones. Then a writer opens the buffer (``mode="r+"``), adds rows, saves and closes, and a
reader opens it and reads every row.

Property: nothing hangs (an alarm), nothing but rlbuffers' own errors escapes (the writer may
refuse with ``UnsafePathError``; the reader must read), nothing outside the buffer changes
(a victim file and directory, and the target of every symlink, are compared byte for byte),
and the buffer then reads back exactly the rows of the commit it is at (the last commit before
the session, or the session's). ``rlbuffers verify`` must not raise either.

    python -m tools.fuzz.fuzz_leases --minutes 10
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import signal
from pathlib import Path
from typing import Any

import numpy as np

from tools.fuzz.common import (
    Finding,
    check_only_own_errors,
    files_under,
    mutate_bytes,
    mutate_json,
    run,
)

FIELDS_SPEC = {"obs": ((3,), "float32"), "tok": ((None,), "int16")}
CAPACITY, CHUNK = 16, 4
#: rows after the template's saves, and after the session's save
BEFORE, AFTER = 11, 14
#: one session longer than this is a hang (seconds)
HANG_SECONDS = 20
#: names the library uses in the working tier and in readers/
WORKING_NAMES = ["obs.npy", "_priority.npy", "_episode_id.npy", "state.json",
                 "tok.ragged", "tok.ragged/start.npy", "tok.ragged/length.npy",
                 "tok.ragged/c0.bin", "tok.ragged/c1.bin", "tok.ragged/c2.bin",
                 "tok.ragged/c3.bin", "state.json.tmp", ".state.json.1-abc.tmp"]
READER_NAMES = ["x.lease", "1-abcdef012345.lease", ".tmp-stale", ".tmp-0", "junk",
                "y.lease.tmp", "..lease"]
KINDS = ["fifo", "dir", "symlink_file", "symlink_dir", "symlink_fifo", "dangling",
         "bad_json", "huge", "stale_tmp", "empty", "lease_json"]


def _rows(first: int, n: int) -> dict[str, Any]:
    ids = np.arange(first, first + n)
    return {"obs": np.repeat(ids[:, None], 3, 1).astype(np.float32),
            "tok": [np.full(i % 4, i, np.int16) for i in ids.tolist()]}


def _rows_ok(buf: Any, total: int) -> bool:
    rows = buf[:]
    ids = np.arange(max(0, total - CAPACITY), total)
    if not np.array_equal(rows["obs"][:, 0], ids):
        return False
    return all(np.array_equal(got, np.full(i % 4, i, np.int16))
               for got, i in zip(rows["tok"], ids.tolist(), strict=True))


def _snapshot(root: Path) -> dict[str, bytes]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_symlink() or not p.is_file():
            out[str(p.relative_to(root))] = b"<not a file>"
        else:
            out[str(p.relative_to(root))] = p.read_bytes()
    return out


class Fuzz:
    """``Fuzz(workdir)``: a template buffer (two saves, a fixed and a ragged field, a
    prioritized sampler) and a sandbox; ``generate(rng)`` a plan of plants (JSON bytes);
    ``check(data)`` runs one session on a copy of the template with the plants."""

    def __init__(self, workdir: Path) -> None:
        from rlbuffers import FieldSpec, PrioritizedSampler, ReplayBuffer

        self.work = Path(workdir)
        self.template = self.work / "template"
        if self.template.exists():
            shutil.rmtree(self.template)
        fields = {n: FieldSpec(shape, dtype) for n, (shape, dtype) in FIELDS_SPEC.items()}
        with ReplayBuffer.create(self.template, capacity=CAPACITY, chunk_transitions=CHUNK,
                                 fields=fields, sampler=PrioritizedSampler(), seed=0) as buf:
            buf.extend(_rows(0, 6))
            buf.save()
            buf.extend(_rows(6, BEFORE - 6))
            buf.save()
        self.state = json.loads((self.template / ".working" / "state.json").read_text())
        self.lease = {"commit": 2, "pid": 1, "since": 1.0}

    def generate(self, rng: random.Random) -> bytes:
        plants = []
        for _ in range(rng.randint(1, 6)):
            where = rng.choice(["readers", ".working"])
            names = READER_NAMES if where == "readers" else WORKING_NAMES
            name = rng.choice(names) if rng.random() < 0.8 else \
                f"r{rng.randrange(1000)}{rng.choice(['', '.lease', '.npy', '.bin'])}"
            kind = rng.choice(KINDS)
            plant: dict[str, Any] = {"path": f"{where}/{name}", "kind": kind}
            if kind == "bad_json":
                plant["bytes"] = mutate_bytes(json.dumps(self.lease).encode(), rng).hex()
            if kind == "lease_json":
                plant["json"] = mutate_json(self.lease, rng)
            plants.append(plant)
        if rng.random() < 0.5:
            plants.append({"path": ".working/state.json", "kind": "state",
                           "json": mutate_json(self.state, rng)})
        return json.dumps({"plants": plants}).encode()

    def _plant(self, buf: Path, outside: Path, plant: dict[str, Any]) -> None:
        path = buf / plant["path"]
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        if not path.parent.is_dir() or path.parent.is_symlink():
            return  # its directory was replaced by an earlier plant
        _MAKERS[plant["kind"]](path, outside, plant)

    def check(self, data: bytes) -> None:
        from rlbuffers import ReplayBuffer
        from rlbuffers.cli.verify import _verify

        plan = json.loads(data)
        case = self.work / "case"
        if case.exists():
            shutil.rmtree(case)
        buf, outside = case / "buf", case / "outside"
        shutil.copytree(self.template, buf, symlinks=True)
        ReplayBuffer.open(buf).close()  # the copy's working tier is vouched for again
        outside.mkdir()
        (outside / "victim.bin").write_bytes(b"not the buffer's")
        (outside / "victim_dir").mkdir()
        (outside / "victim_dir" / "keep").write_bytes(b"not the buffer's either")
        os.mkfifo(outside / "victim.fifo")
        (buf / "readers").mkdir(exist_ok=True)
        for plant in plan["plants"]:
            self._plant(buf, outside, plant)
        before, names = _snapshot(outside), files_under(outside)

        def hang(signum: int, frame: Any) -> None:
            raise Finding(f"no result after {HANG_SECONDS} s (hang)")

        old = signal.signal(signal.SIGALRM, hang)
        signal.alarm(HANG_SECONDS)
        try:
            self._session(buf)
            try:  # its report goes nowhere: the runner's worker talks on stdout
                with contextlib.redirect_stdout(io.StringIO()):
                    _verify(_Args(str(buf)))
            except Finding:
                raise
            except BaseException as e:  # noqa: BLE001 - only rlbuffers errors may escape
                check_only_own_errors(e)
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
        if _snapshot(outside) != before or files_under(outside) != names:
            raise Finding("something outside the buffer changed")
        with ReplayBuffer.open(buf, mode="r") as ro:
            total = BEFORE if ro.commit == 2 else AFTER
            if ro.commit not in (2, 3) or not _rows_ok(ro, total):
                raise Finding(f"commit {ro.commit} does not read back its rows")

    def _session(self, buf: Path) -> None:
        from rlbuffers import ReplayBuffer

        try:
            with ReplayBuffer.open(buf) as w:
                w.extend(_rows(BEFORE, AFTER - BEFORE))
                w.update_priorities(np.arange(2), np.full(2, 2.0))
                w.save()
        except Finding:
            raise
        except BaseException as e:  # noqa: BLE001
            check_only_own_errors(e)
        try:
            with ReplayBuffer.open(buf, mode="r") as ro:
                if not _rows_ok(ro, BEFORE if ro.commit == 2 else AFTER):
                    raise Finding(f"reader of commit {ro.commit}: wrong rows")
        except Finding:
            raise
        except BaseException as e:  # noqa: BLE001 - junk in readers/ and .working/ only
            raise Finding(f"the reader failed: {type(e).__name__}: {e!s:.300}") from e


def _huge(path: Path) -> None:
    with open(path, "wb") as f:
        f.truncate(2**30)  # sparse: no disk


def _stale(path: Path) -> None:
    path.write_bytes(b'{"commit": 1}')
    os.utime(path, (0, 0))


def _dir(path: Path) -> None:
    path.mkdir()
    (path / "inside").write_bytes(b"x")


#: kind -> how to plant it at ``path`` (``outside``: the victims' directory; ``plant``: the
#: plan entry, with its bytes or JSON)
_MAKERS: dict[str, Any] = {
    "fifo": lambda path, outside, plant: os.mkfifo(path),
    "dir": lambda path, outside, plant: _dir(path),
    "symlink_file": lambda path, outside, plant: os.symlink(outside / "victim.bin", path),
    "symlink_dir": lambda path, outside, plant: os.symlink(outside / "victim_dir", path),
    "symlink_fifo": lambda path, outside, plant: os.symlink(outside / "victim.fifo", path),
    "dangling": lambda path, outside, plant: os.symlink(outside / "nothing-here", path),
    "bad_json": lambda path, outside, plant: path.write_bytes(bytes.fromhex(plant["bytes"])),
    "lease_json": lambda path, outside, plant: path.write_text(json.dumps(plant["json"])),
    "state": lambda path, outside, plant: path.write_text(json.dumps(plant["json"])),
    "huge": lambda path, outside, plant: _huge(path),
    "stale_tmp": lambda path, outside, plant: _stale(path),
    "empty": lambda path, outside, plant: path.write_bytes(b""),
}


class _Args:
    """The arguments of ``rlbuffers verify PATH --json`` (its output is discarded)."""

    def __init__(self, path: str) -> None:
        self.path, self.repair, self.working_dir = path, False, None
        self.storage_options, self.json = None, True


if __name__ == "__main__":
    raise SystemExit(run("tools.fuzz.fuzz_leases", (__doc__ or "").splitlines()[0]))
