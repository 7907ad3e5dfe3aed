"""``rlbuffers inspect``: text, JSON and --verify, also while a writer is running; polite
errors (``rlbuffers: error:``, exit 2, ``--debug`` traceback); strict JSON with NaN/inf
counts; table columns that never run together."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

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
    assert "commit      1 at" in out
    row = next(line for line in out.splitlines() if line.startswith("obs "))
    assert row.split()[:4] == ["obs", "(4,", "8,", "8)"] and "uint8" in row
    assert "blosc-zstd" in row
    assert "reward      mean 14.5" in out and "max 29" in out
    assert "priorities  mean" in out and "max 30" in out
    assert '"trainer_generation": 3' in out


def test_inspect_json_and_verify(tmp_path, capsys):
    _make(tmp_path / "b")
    assert main(["inspect", str(tmp_path / "b"), "--json", "--verify"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["size"], r["capacity"], r["commit"]) == (30, 50, 1)
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
                        sampler=PrioritizedSampler(), seed=0, keep_commits=8).close()
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
            seen.add(r["commit"])
        assert len(seen) > 1  # the writer committed while we were reading
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()


def test_table_columns_never_run_together_and_chunks_are_clamped(tmp_path, capsys):
    long = "a_field_name_longer_than_sixteen"
    buf = ReplayBuffer.create(tmp_path / "b", capacity=10, fields={
        long: FieldSpec((None,), "float32"), "reward": FieldSpec((), "float32")},
        chunk_transitions=1_048_560)
    buf.extend({long: [np.arange(300, dtype=np.float32)] * 4, "reward": np.ones(4)})
    buf.save()
    buf.close()
    assert main(["inspect", str(tmp_path / "b")]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("field"))
    header = lines[head]
    for line in lines[head + 1:head + 3]:  # every cell starts where its header does or ends
        assert line.startswith(long) or line.startswith("reward")
        cells = line.split()
        assert "x" not in cells[-3] and cells[-3] == "10"  # chunk, clamped to the capacity
        assert all("x1" not in c for c in cells)  # ratio and chunk apart
    assert "chunks      10 transitions per base chunk" in "\n".join(lines)
    assert header.split() == ["field", "shape", "dtype", "codec", "stored", "raw", "ratio",
                              "chunk", "NaN", "inf"]


def test_json_is_strict_and_counts_nan_and_inf(tmp_path, capsys):
    buf = ReplayBuffer.create(tmp_path / "b", capacity=8, fields={
        "reward": FieldSpec((), "float32"), "lp": FieldSpec((None,), "float32")})
    buf.extend({"reward": np.array([1.0, np.nan, np.inf, -np.inf, 3.0]),
                "lp": [np.array([np.nan]), np.ones(2), np.zeros(0), np.ones(1), np.ones(1)]})
    buf.save(metadata={"lr": float("nan")})
    buf.close()
    assert main(["inspect", str(tmp_path / "b"), "--json"]) == 0

    r = json.loads(capsys.readouterr().out, parse_constant=_refuse)
    assert r["reward"] == {"count": 2, "mean": 2.0, "std": 1.0, "min": 1.0, "max": 3.0,
                           "nan": 1, "inf": 2}
    assert (r["fields"]["reward"]["nan"], r["fields"]["reward"]["inf"]) == (1, 2)
    assert (r["fields"]["lp"]["nan"], r["fields"]["lp"]["inf"]) == (1, 0)
    assert r["metadata"] == {"lr": None}
    assert main(["inspect", str(tmp_path / "b")]) == 0
    assert "non-finite: 1 NaN, 2 inf" in capsys.readouterr().out


def _polite(argv, capsys, match):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlbuffers: error: ") and match in err and "Traceback" not in err
    assert err.count("\n") == 1, err  # one line: no progress bar, no warning
    return err


def test_errors_are_one_line_and_debug_shows_the_traceback(tmp_path, capsys):
    _make(tmp_path / "b")
    a_file = tmp_path / "file.txt"
    a_file.write_text("hello")
    _polite(["inspect", str(a_file)], capsys, f"{a_file}: not an rlbuffers buffer (a file")
    _polite(["verify", str(a_file)], capsys, "a file, not a directory")
    empty = tmp_path / "empty"
    empty.mkdir()
    _polite(["inspect", str(empty)], capsys, f"{empty}: not an rlbuffers buffer (no manifest")
    _polite(["inspect", str(tmp_path / "missing")], capsys, "missing: not an rlbuffers buffer")
    _polite(["convert", "sb3", str(a_file), str(tmp_path / "out")], capsys, str(a_file))
    _polite(["convert", "sb3", str(tmp_path / "missing.pkl"), str(tmp_path / "o2")], capsys,
            "missing.pkl")
    _polite(["convert", "sb3", str(a_file), str(tmp_path / "o3"), "--codec", "bogus"], capsys,
            "--codec: expected one of blosc-zstd, blosc-lz4, zstd, none, got 'bogus'")
    assert not (tmp_path / "o3").exists()  # refused before anything was read or written
    _polite(["inspect", str(tmp_path / "b"), "--storage-options", "{bad"], capsys,
            "--storage-options: expected JSON")
    _polite(["shards", "ls", str(empty)], capsys, "no shards.json")
    for argv in (["--debug", "inspect", str(empty)], ["inspect", str(empty), "--debug"],
                 ["convert", "sb3", str(a_file), str(tmp_path / "o4"), "--debug"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback (most recent call last)" in err and "rlbuffers: error" not in err


def test_io_errors_name_the_path(tmp_path, capsys, monkeypatch):
    _make(tmp_path / "b")

    def no_space(*a, **k):
        raise OSError(28, "No space left on device")

    import rlbuffers.maintenance.inspection
    monkeypatch.setattr(rlbuffers.maintenance.inspection, "inspect_path", no_space)
    err = _polite(["inspect", str(tmp_path / "b")], capsys, "No space left on device")
    assert f"while working on {tmp_path / 'b'}" in err

    def named(*a, **k):
        raise OSError(28, "No space left on device", "/data/b/versions/g3/obs/c/0")

    monkeypatch.setattr(rlbuffers.maintenance.inspection, "inspect_path", named)
    err = _polite(["inspect", str(tmp_path / "b")], capsys, "'/data/b/versions/g3/obs/c/0'")
    assert "while working on" not in err


def test_reward_with_no_finite_value(tmp_path, capsys):
    buf = ReplayBuffer.create(tmp_path / "b", capacity=4, fields={
        "reward": FieldSpec((), "float64"), "a": FieldSpec((), "int8")})
    buf.extend({"reward": np.array([np.nan, np.inf]), "a": np.array([1, 2])})
    buf.save()
    buf.close()
    assert main(["inspect", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "reward      no finite values (n=0)  non-finite: 1 NaN, 1 inf" in out
    row = next(line for line in out.splitlines() if line.startswith("a "))
    assert row.split()[-2:] == ["-", "-"]  # no counts for integer fields
    assert main(["inspect", str(tmp_path / "b"), "--json"]) == 0
    r = json.loads(capsys.readouterr().out, parse_constant=_refuse)
    assert r["reward"] == {"count": 0, "mean": None, "std": None, "min": None, "max": None,
                           "nan": 1, "inf": 1}


def _refuse(constant):
    raise ValueError(f"not strict JSON: {constant}")


def test_every_command_and_option_has_a_help_line():
    from rlbuffers.cli import build_parser

    def walk(parser, name):
        for action in parser._actions:
            if action.dest in ("help",):
                continue
            if hasattr(action, "choices") and isinstance(action.choices, dict):
                helps = {a.dest: a.help for a in action._choices_actions}
                for sub_name, sub in action.choices.items():
                    assert helps.get(sub_name), f"{name} {sub_name}: no help"
                    walk(sub, f"{name} {sub_name}")
            else:
                assert action.help, f"{name} {action.option_strings or action.dest}: no help"

    walk(build_parser(), "rlbuffers")


def test_version_prints_the_package_version(capsys):
    import rlbuffers

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"rlbuffers {rlbuffers.__version__}"


@pytest.mark.parametrize("argv", [["inspect", "--jso", "x"], ["inspect", "x", "--verif"],
                                  ["verify", "x", "--repai"]])
def test_flags_are_never_abbreviated(tmp_path, argv, capsys):
    """Issue 45: '--jso' was taken for '--json' silently; a prefix is now an unknown flag,
    also in the subcommands' parsers."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "unrecognized arguments: " + next(a for a in argv if a.startswith("--")) in \
        capsys.readouterr().err


def test_trainer_flags_are_never_abbreviated(capsys):
    """Issue 45: 'python -m trainers.erl --generation 1' ran as --generations 1."""
    from trainers.config import parse_config
    from trainers.erl.config import RESUMABLE, Config

    with pytest.raises(SystemExit) as e:
        parse_config(Config, ["--generation", "1"], prog="python -m trainers.erl",
                     description="", resumable=RESUMABLE)
    assert e.value.code == 2
    assert "unrecognized arguments: --generation 1" in capsys.readouterr().err
    assert parse_config(Config, ["--generations", "1"], prog="p", description="",
                        resumable=RESUMABLE).generations == 1
