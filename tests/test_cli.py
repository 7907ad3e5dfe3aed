"""``rlbuffers inspect``: text, JSON and --verify, also while a writer is running."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from rlbuffers import FieldSpec, PrioritizedSampler, ReplayBuffer
from rlbuffers.cli import main
from tests.crash_writer import CAPACITY, CHUNK, FIELDS

ROOT = Path(__file__).resolve().parents[1]


def _make(path):
    fields = {"obs": FieldSpec((4, 8, 8), "uint8"), "reward": FieldSpec((), "float32"),
              "terminated": FieldSpec((), "bool")}
    buf = ReplayBuffer.create(path, capacity=50, fields=fields, chunk_transitions=8,
                              sampler=PrioritizedSampler(alpha=0.5))
    n = 30
    buf.extend({"obs": np.zeros((n, 4, 8, 8), np.uint8), "reward": np.arange(n, dtype=np.float32),
                "terminated": np.arange(n) % 10 == 9})
    buf.update_priorities(np.arange(n), np.arange(n) + 1.0)
    buf.save(metadata={"trainer_generation": 3})
    buf.close()


def test_inspect_text(tmp_path, capsys):
    _make(tmp_path / "b")
    assert main(["inspect", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "30 / 50 transitions (30 added, 3 episodes ended)" in out
    assert "last commit generation 1" in out
    assert "obs             (4, 8, 8)" in out and "uint8" in out and "blosc-zstd" in out
    assert "reward      mean 14.5" in out and "max 29" in out
    assert "priorities  mean" in out and "max 30" in out
    assert '"trainer_generation": 3' in out


def test_inspect_json_and_verify(tmp_path, capsys):
    _make(tmp_path / "b")
    assert main(["inspect", str(tmp_path / "b"), "--json", "--verify"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["size"], r["capacity"], r["generation"]) == (30, 50, 1)
    assert r["fields"]["obs"]["shape"] == [4, 8, 8] and r["fields"]["obs"]["dtype"] == "uint8"
    assert r["fields"]["obs"]["raw_bytes"] == 30 * 256
    assert r["fields"]["obs"]["stored_bytes"] < r["fields"]["obs"]["raw_bytes"]
    assert r["corrupt"] == []
    assert r["reward"]["count"] == 30 and r["reward"]["min"] == 0.0


def test_inspect_errors(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nothing")]) == 2
    assert "not an rlbuffers buffer" in capsys.readouterr().err


def test_inspect_while_writer_runs(tmp_path):
    path = tmp_path / "live"
    # the writer saves every few ms: keep enough commits for a --verify pass to finish on one
    ReplayBuffer.create(path, capacity=CAPACITY, fields=FIELDS, chunk_transitions=CHUNK,
                        sampler=PrioritizedSampler(), seed=0, keep_generations=8).close()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "tests.crash_writer", str(path), "0"],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        lines = (proc.stdout.readline(), proc.stdout.readline())
        assert lines == ("start\n", "ready\n")  # opened
        seen = set()
        for _ in range(8):
            res = subprocess.run([sys.executable, "-m", "rlbuffers.cli", "inspect", str(path),
                                  "--json", "--verify"], capture_output=True, text=True, env=env)
            assert res.returncode == 0, res.stderr
            r = json.loads(res.stdout)
            assert r["corrupt"] == [] and r["size"] == min(r["total_added"], CAPACITY)
            assert r["metadata"].get("total", 0) == r["total_added"]
            seen.add(r["generation"])
        assert len(seen) > 1  # the writer committed while we were reading
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
