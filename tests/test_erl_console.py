"""Issue 45, what the console says around a run (ERL, the quickest trainer, as a person runs
it): Ctrl-C exits 130 with one line saying how to resume, `--resume` with a target below the
finished generation is refused in one line and leaves config.json alone (an equal target is
a no-op saying so), an allocation a huge setting asks for is one line, not a traceback."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.heavy import require

require("gymnasium", "mujoco")

from tests.test_erl import TIMEOUT_S, TINY, metrics, trainer_cmd  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "MUJOCO_GL": "egl"}


def run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S,
                          env=ENV)


def test_ctrl_c_exits_130_with_one_line_saying_how_to_resume(tmp_path):
    """SIGINT once generation 1's line is out (the process is then inside the loop: the
    line is printed there); the wait is on the output, not on a clock."""
    run_dir = tmp_path / "run"
    # SIGINT at its default in the child, whatever this process inherited (a job a shell
    # started in the background has it ignored, and Python then installs no handler).
    proc = subprocess.Popen(trainer_cmd(run_dir, *TINY, "--generations", "1000"), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout is not None and proc.stderr is not None
    try:
        for line in proc.stdout:
            if line.startswith("gen    1/"):
                break
        else:
            pytest.fail(f"no generation line: {proc.stderr.read()[-2000:]}")
        proc.send_signal(signal.SIGINT)
        err = proc.stderr.read()
        proc.wait(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    done = metrics(run_dir)[-1]["generation"]
    assert last == (f"interrupted; generation {done} is the last complete one (of 1000): "
                    f"continue with python3 -m trainers.erl --resume --run-dir {run_dir}")
    command = shlex.split(last.split("continue with ", 1)[1])
    assert command[:3] == ["python3", "-m", "trainers.erl"]  # as the README writes it
    out = run([sys.executable, *command[1:], "--generations", str(done + 1)])
    assert out.returncode == 0 and f"gen {done + 1:4d}/{done + 1}" in out.stdout, out.stderr


def test_resume_with_a_lower_target_is_refused_and_an_equal_one_is_a_no_op(tmp_path):
    run_dir = tmp_path / "run"
    assert run(trainer_cmd(run_dir, *TINY, "--generations", "2")).returncode == 0
    config = (run_dir / "config.json").read_bytes()

    lower = run(trainer_cmd(run_dir, "--resume", "--generations", "1"))
    assert lower.returncode == 2 and "Traceback" not in lower.stderr
    assert lower.stderr.strip().splitlines()[-1] == (
        f"error: --generations 1: {run_dir} has already completed generation 2; a target "
        "below it is refused (config.json is unchanged)")
    assert (run_dir / "config.json").read_bytes() == config
    assert json.loads(config)["generations"] == 2

    equal = run(trainer_cmd(run_dir, "--resume", "--generations", "2"))
    assert equal.returncode == 0 and equal.stdout == ""
    assert equal.stderr.strip().splitlines()[-1] == (
        f"{run_dir}: generation 2 of 2 is complete, nothing to train (raise --generations "
        "to continue)")
    assert (run_dir / "config.json").read_bytes() == config
    assert [r["generation"] for r in metrics(run_dir)] == [1, 2]


def test_an_allocation_too_large_for_the_machine_is_one_line(tmp_path):
    out = run(trainer_cmd(tmp_path / "run", *TINY, "--hidden", "99999999999",
                          "--generations", "1"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: out of memory (") and "too large for this machine" in last


@pytest.mark.parametrize("made", [False, True])
def test_ctrl_c_during_setup_exits_130_saying_what_to_run(tmp_path, monkeypatch, capsys, made):
    """Before the loop (loading, placing, opening the run) there is no unit to name: the
    line gives the same command, with --resume once the run directory holds a run."""
    import types

    from trainers.config import run_main

    def main():
        raise KeyboardInterrupt

    monkeypatch.setitem(sys.modules, "fake_trainer.train", types.SimpleNamespace(main=main))
    run_dir = tmp_path / "my run"
    if made:
        run_dir.mkdir()
        (run_dir / "config.json").write_text("{}")
    monkeypatch.setattr(sys, "argv", ["x", "--run-dir", str(run_dir), "--steps", "3"])
    with pytest.raises(SystemExit) as stop:
        run_main("fake_trainer.train")
    assert stop.value.code == 130
    resume = " --resume" if made else ""
    assert capsys.readouterr().err.splitlines()[-1] == (
        "interrupted during setup, before the training loop; to go on: run python3 -m "
        f"fake_trainer --run-dir {shlex.quote(str(run_dir))} --steps 3{resume}")


def test_a_damaged_run_directory_file_is_one_line_on_the_console(tmp_path):
    """An rlbuffers error (here config.json is not a JSON object) through the console entry:
    one line, exit code 2 (the out-of-memory net must not swallow it into a traceback)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text("[1]")
    out = run(trainer_cmd(run_dir, "--resume"))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == (
        f"error: {run_dir / 'config.json'}: top level: expected a JSON object, got a JSON list "
        "([1])")
