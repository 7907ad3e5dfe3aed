"""Reader leases (``rlbuffers/storage/lease.py``): an open reader's commit is never reclaimed,
whatever the writer does; a closed or dead reader's commit is. The live test runs a writer that
commits every few milliseconds with ``keep_commits=1`` (each save reclaims the commit before)
against fresh and long-lived readers until 60 commits and 150 fresh reads (3 refreshes of the
long-lived reader) have been seen (a few seconds; at most 120 s), or for RLBUFFERS_LEASE_SECONDS
seconds when that is set (a soak): 0 mixed reads and 0 reclaimed (this used to be 1 of 1,154
reads with keep_commits=2)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

from rlbuffers import FieldSpec, ReplayBuffer

REPO = Path(__file__).resolve().parents[1]
SOAK = os.environ.get("RLBUFFERS_LEASE_SECONDS")
SECONDS = float(SOAK) if SOAK else 120.0
COMMITS, FRESH_READS = 60, 150
FIELDS = {"value": FieldSpec((), "int64"), "tokens": FieldSpec((None,), "int32")}
CAPACITY, CHUNK = 48, 8


def _batch(first: int, n: int) -> dict:
    ids = np.arange(first, first + n)
    return {"value": ids, "tokens": [np.full(i % 5, i, np.int32) for i in ids]}


def _check(buf: ReplayBuffer) -> None:
    """Every row is exactly the transition its commit says (``metadata["total"]``)."""
    total = buf.total_added
    assert buf.metadata.get("total", 0) == total
    rows = buf[:]
    ids = np.arange(max(0, total - CAPACITY), total)
    np.testing.assert_array_equal(rows["value"], ids)
    for got, i in zip(rows["tokens"], ids.tolist(), strict=True):
        np.testing.assert_array_equal(got, np.full(i % 5, i, np.int32))


def _child(code: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_open_reader_keeps_its_commit_closed_reader_releases_it(tmp_path):
    path = tmp_path / "b"
    w = ReplayBuffer.create(path, capacity=CAPACITY, fields=FIELDS, chunk_transitions=CHUNK,
                            keep_commits=1)
    w.extend(_batch(0, 40))
    w.save(metadata={"total": 40})
    ro = ReplayBuffer.open(path, mode="r")
    for k in range(5):  # every chunk rewritten each time; keep_commits=1
        w.extend(_batch(40 + 48 * k, 48))
        w.save(metadata={"total": 88 + 48 * k})
    assert ro.commit == 1 and (path / "history" / "g1.json").exists()
    _check(ro)
    ro.refresh()  # moves its lease: commit 1 is free now
    assert ro.commit == 6
    w.extend(_batch(280, 1))
    assert w.save(metadata={"total": 281}).bytes_reclaimed > 0
    assert sorted(os.listdir(path / "history")) == ["g6.json", "g7.json"]  # 6: ro's lease
    ro.close()
    assert os.listdir(path / "readers") == []
    w.extend(_batch(281, 1))
    w.save(metadata={"total": 282})
    assert sorted(os.listdir(path / "history")) == ["g8.json"]
    w.close()


def test_a_dead_readers_lease_is_detected(tmp_path):
    path = tmp_path / "b"
    w = ReplayBuffer.create(path, capacity=CAPACITY, fields=FIELDS, chunk_transitions=CHUNK,
                            keep_commits=1)
    w.extend(_batch(0, 40))
    w.save(metadata={"total": 40})
    reader = _child(f"""
        import time
        from rlbuffers import ReplayBuffer
        ro = ReplayBuffer.open({str(path)!r}, mode="r")
        print(ro.commit, flush=True)
        time.sleep(600)
    """)
    try:
        assert reader.stdout.readline().strip() == "1", reader.stderr.read()
        w.extend(_batch(40, 48))
        w.save(metadata={"total": 88})
        assert (path / "history" / "g1.json").exists()  # live reader: kept
    finally:
        reader.send_signal(signal.SIGKILL)
        reader.communicate()
    assert len(os.listdir(path / "readers")) == 1  # its lease file is left behind...
    w.extend(_batch(88, 48))
    w.save(metadata={"total": 136})
    assert os.listdir(path / "readers") == []  # ...and deleted: its flock was free
    assert sorted(os.listdir(path / "history")) == ["g3.json"]
    w.close()


def test_no_reader_loses_its_commit_to_a_writer_saving_in_a_loop(tmp_path):
    path = tmp_path / "live"
    ReplayBuffer.create(path, capacity=CAPACITY, fields=FIELDS, chunk_transitions=CHUNK,
                        keep_commits=1).close()
    writer = _child(f"""
        import numpy as np
        from rlbuffers import ReplayBuffer
        from tests.test_reader_leases import _batch
        buf = ReplayBuffer.open({str(path)!r})
        print("ready", flush=True)
        rng = np.random.default_rng(0)
        while True:
            buf.extend(_batch(buf.total_added, int(rng.integers(1, 30))))
            buf.save(metadata={{"total": buf.total_added}})
    """)
    stats = {"fresh reads": 0, "long-lived reads": 0, "refreshes": 0}
    commits = set()
    try:
        assert writer.stdout.readline() == "ready\n", writer.stderr.read()
        long = ReplayBuffer.open(path, mode="r")
        first = long.commit
        started = time.monotonic()
        deadline = started + SECONDS
        while time.monotonic() < deadline and (SOAK or len(commits) < COMMITS
                                                or stats["fresh reads"] < FRESH_READS):
            with ReplayBuffer.open(path, mode="r") as ro:  # SnapshotReclaimedError fails it
                _check(ro)
                commits.add(ro.commit)
            stats["fresh reads"] += 1
            _check(long)
            stats["long-lived reads"] += 1
            if stats["fresh reads"] % 50 == 0:
                long.refresh()
                stats["refreshes"] += 1
        long.close()
        assert writer.poll() is None, writer.stderr.read()
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.communicate()
    print(f"leases over {time.monotonic() - started:.0f} s: {stats}, {len(commits)} commits "
          f"seen, first {first}; 0 mixed reads, 0 reclaimed")
    assert len(commits) >= COMMITS and stats["fresh reads"] >= FRESH_READS


# -- issue 44: what else may be in readers/, and forked children --------------------------

def _saved_buffer(path: Path) -> None:
    with ReplayBuffer.create(path, capacity=CAPACITY, fields=FIELDS, chunk_transitions=CHUNK,
                             keep_commits=1) as w:
        w.extend(_batch(0, 20))
        w.save(metadata={"total": 20})


def _write_and_save(path: Path) -> None:
    with ReplayBuffer.open(path) as w:
        w.extend(_batch(w.total_added, 9))
        w.save(metadata={"total": w.total_added})


def test_fifos_in_readers_do_not_hang_the_writer(tmp_path):
    """L1: a FIFO named like a lease (or a stale temporary lease) hung every open(r+) and
    save in the lease scan, with the writer lock held. The writer runs in a child process
    with a timeout (a signal cannot be relied on to interrupt a blocked open in a process
    with threads)."""
    path = tmp_path / "b"
    _saved_buffer(path)
    (path / "readers").mkdir(exist_ok=True)
    os.mkfifo(path / "readers" / "x.lease")
    os.mkfifo(path / "readers" / ".tmp-stale")
    os.utime(path / "readers" / ".tmp-stale", (0, 0), follow_symlinks=False)  # stale
    child = _child(f"""
        from pathlib import Path
        from tests.test_reader_leases import _check, _write_and_save
        from rlbuffers import ReplayBuffer
        _write_and_save(Path({str(path)!r}))
        with ReplayBuffer.open({str(path)!r}, mode="r") as ro:
            _check(ro)
        print("done", flush=True)
    """)
    try:
        out, err = child.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        raise AssertionError("open(r+) / save with FIFOs in readers/ hung") from None
    assert out == "done\n", err
    assert (path / "readers" / "x.lease").exists()  # ignored, not deleted by the writer


def test_a_directory_named_like_a_lease_does_not_stop_writers(tmp_path):
    """L2: a directory ``readers/x.lease`` made every open(r+) and save raise
    IsADirectoryError."""
    path = tmp_path / "b"
    _saved_buffer(path)
    (path / "readers" / "x.lease").mkdir(parents=True)
    (path / "readers" / "bad.lease").write_text("{not json")
    os.symlink(tmp_path, path / "readers" / "link.lease")
    _write_and_save(path)
    _write_and_save(path)
    with ReplayBuffer.open(path, mode="r") as ro:
        assert ro.commit == 3
        _check(ro)


def test_verify_lists_what_is_not_a_lease_and_repair_removes_it(tmp_path, capsys):
    from rlbuffers.cli import main

    path = tmp_path / "b"
    _saved_buffer(path)
    readers = path / "readers"
    (readers / "x.lease").mkdir(parents=True)
    os.mkfifo(readers / "f.lease")
    os.symlink(tmp_path / "nowhere", readers / "s.lease")
    (readers / "notes.txt").write_text("hi")
    held = ReplayBuffer.open(path, mode="r")  # a live lease: not listed, not removed
    assert main(["verify", str(path)]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("not a lease")]
    assert len(lines) == 4, lines
    assert any("f.lease: a FIFO" in ln for ln in lines), lines
    assert any("x.lease: a directory" in ln for ln in lines), lines
    assert any("s.lease: a symlink" in ln for ln in lines), lines
    assert any("notes.txt: a regular file with an unexpected name" in ln for ln in lines)
    assert main(["verify", str(path), "--repair"]) == 0
    out = capsys.readouterr().out
    assert out.count("removed ") == 4, out
    assert [p.suffix for p in readers.iterdir()] == [".lease"]  # the live reader's
    assert (tmp_path / "b").exists() and not (tmp_path / "nowhere").exists()
    held.close()
    assert list(readers.iterdir()) == []


def test_a_forked_child_closing_its_inherited_reader_keeps_the_parents_lease(tmp_path):
    """L3: a forked child that closed the reader it inherited deleted the parent's lease;
    the writer then reclaimed the parent's commit (SnapshotReclaimedError on its next read)."""
    path = tmp_path / "b"
    _saved_buffer(path)
    ro = ReplayBuffer.open(path, mode="r")
    assert ro.commit == 1  # nothing read yet: every read below goes to disk
    pid = os.fork()
    if pid == 0:  # the child: close what it inherited, exit without the parent's cleanup
        code = 0
        try:
            ro.close()
        except BaseException:
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert len(list((path / "readers").glob("*.lease"))) == 1
    keep_commits = 1
    for _ in range(keep_commits + 1):
        _write_and_save(path)
    assert (path / "history" / "g1.json").exists()
    _check(ro)  # SnapshotReclaimedError before the fix
    ro.refresh()
    assert ro.commit == 3
    _check(ro)
    ro.close()
