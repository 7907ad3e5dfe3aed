"""Snapshot isolation under a live writer: a writer process extends and saves in a loop (with
background saves) while this process opens readers, keeps one long-lived reader, and runs
``rlbuffers inspect --json --verify``, until 30 commits have been read, the long-lived reader
has been behind the writer's head 5 times and 3 inspects passed (a few seconds; at most
120 s), or for RLBUFFERS_ISOLATION_SECONDS seconds when that is set (a soak).
Transition ``i`` holds ``i`` in every field, so every row read can be checked against the
commit the reader holds: 0 mixed reads allowed."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from rlbuffers import PrioritizedSampler, ReplayBuffer
from rlbuffers.errors import SnapshotReclaimedError
from rlbuffers.storage.manifest import COMMIT_KEY
from tests.crash_writer import CAPACITY, CHUNK, FIELDS, batch

ROOT = Path(__file__).resolve().parents[1]
SOAK = os.environ.get("RLBUFFERS_ISOLATION_SECONDS")
SECONDS = float(SOAK) if SOAK else 120.0
COMMITS, HELD_ACROSS, INSPECTS = 30, 5, 3


def _rows_of_commit(buf: ReplayBuffer) -> dict:
    """Read every row; check they are exactly the commit's transitions. Returns them."""
    total = buf.total_added
    assert buf.metadata.get("total", 0) == total  # the commit's manifest and data agree
    rows = buf[:]
    ids = np.arange(max(0, total - CAPACITY), total)
    np.testing.assert_array_equal(rows["value"], ids)
    np.testing.assert_array_equal(rows["frame"][:, 0, 0, 0], (ids % 256).astype(np.uint8))
    want = batch(0, total)["tokens"] if total else []
    for got, i in zip(rows["tokens"], ids, strict=True):
        np.testing.assert_array_equal(got, want[i])
    return rows


def test_readers_see_exactly_one_commit_while_a_writer_saves(tmp_path):
    path = tmp_path / "live"
    ReplayBuffer.create(path, capacity=CAPACITY, fields=FIELDS, chunk_transitions=CHUNK,
                        sampler=PrioritizedSampler(), seed=0, keep_commits=4).close()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    writer = subprocess.Popen([sys.executable, "-m", "tests.crash_writer", str(path), "7"],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    stats = {"fresh reads": 0, "long-lived reads": 0, "inspects": 0, "reclaimed": 0,
             "refreshes": 0}
    commits, held_across = set(), 0
    try:
        assert writer.stdout.readline() == "start\n" and writer.stdout.readline() == "ready\n"
        long = ReplayBuffer.open(path, mode="r")
        first = _rows_of_commit(long)
        started = time.monotonic()
        deadline = started + SECONDS
        while time.monotonic() < deadline and (SOAK or len(commits) < COMMITS
                                                or held_across < HELD_ACROSS
                                                or stats["inspects"] < INSPECTS):
            try:
                with ReplayBuffer.open(path, mode="r") as ro:
                    _rows_of_commit(ro)
                    commits.add(ro.commit)
                stats["fresh reads"] += 1
            except SnapshotReclaimedError:  # four newer commits while we read: allowed
                stats["reclaimed"] += 1
            try:
                again = _rows_of_commit(long)
                np.testing.assert_array_equal(again["value"], first["value"])  # unchanged
                stats["long-lived reads"] += 1
                head = json.loads((path / "manifest.json").read_text())[COMMIT_KEY]
                held_across += head > long.commit
            except SnapshotReclaimedError:
                long.refresh()
                first = _rows_of_commit(long)
                stats["refreshes"] += 1
            if stats["fresh reads"] % 10 == 0:
                res = subprocess.run([sys.executable, "-m", "rlbuffers.cli", "inspect", str(path),
                                      "--json", "--verify"], capture_output=True, text=True,
                                     env=env)
                assert res.returncode == 0, res.stderr
                r = json.loads(res.stdout)
                assert r["corrupt"] == [] and r["size"] == min(r["total_added"], CAPACITY)
                assert r["metadata"].get("total", 0) == r["total_added"]
                stats["inspects"] += 1
        long.close()
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.communicate()
    print(f"isolation over {time.monotonic() - started:.0f} s: {stats}, "
          f"{len(commits)} commits seen, long-lived reader behind the writer's head in "
          f"{held_across} reads; 0 mixed reads")
    assert len(commits) >= COMMITS and held_across >= HELD_ACROSS
    assert stats["inspects"] >= INSPECTS
