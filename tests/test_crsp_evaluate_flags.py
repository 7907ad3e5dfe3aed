"""Issue 45: ``python3 -m trainers.crsp.evaluate`` checks its flags before anything loads and
says what is wrong in one line (exit code 2), as the trainers do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.heavy import require

require("transformers", "peft", "reasoning_gym")

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


@pytest.fixture
def run_dir(tmp_path):
    """A run directory with a config.json and one kept checkpoint (step 2)."""
    from trainers.crsp.config import Config

    d = tmp_path / "run"
    (d / "ckpt" / "step-2").mkdir(parents=True)
    (d / "ckpt" / "step-2" / "adapters.safetensors").write_bytes(b"")
    (d / "config.json").write_text(json.dumps({"steps": 2, "seed": 0}))
    assert Config().steps  # the saved config's other fields take their defaults
    return d


@pytest.mark.parametrize("flags, expected", [
    (["--steps", "0,x"], "--steps: expected comma-separated step numbers (0: the initial "
                         "model; warmup: after the format warm-up), got '0,x'"),
    (["--steps", "0,3"], "--steps: expected steps whose checkpoint the run keeps (0, "
                         "ckpt/step-N or, after a warm-up, warmup in {run}), got 3 "
                         "({run}/ckpt/step-3/adapters.safetensors is missing)"),
    (["--attempts-from", "5"], "--attempts-from: expected steps whose checkpoint the run keeps"),
    (["--eval-size", "0"], "--eval-size: expected >= 1, got 0"),
    (["--critic-attempts", "0"], "--critic-attempts: expected >= 1, got 0"),
    (["--calibration-size", "-1"], "--calibration-size: expected >= 0, got -1"),
    (["--window", "0"], "--window: expected >= 1, got 0"),
    (["--threads", "0"], "--threads: expected in [1, 1024], got 0"),
])
def test_a_bad_flag_is_refused_before_anything_loads(run_dir, flags, expected):
    from trainers.config import ConfigError
    from trainers.crsp import evaluate

    with pytest.raises(ConfigError) as refused:
        evaluate.main(["--run-dir", str(run_dir), "--steps", "0,2", *flags])
    assert str(refused.value).startswith(expected.format(run=run_dir)), str(refused.value)


def test_on_the_console_an_error_is_one_line(run_dir, tmp_path):
    for argv, expected in (
            (["--run-dir", str(run_dir), "--steps", "7"], "error: --steps: expected steps whose "
                                                         "checkpoint the run keeps"),
            (["--run-dir", str(tmp_path / "none")], f"error: {tmp_path / 'none' / 'config.json'}"),
            (["--run-dir", str(run_dir), "--step", "1"], "python3 -m trainers.crsp.evaluate: "
                                                         "error: unrecognized arguments: --step")):
        out = subprocess.run([sys.executable, "-m", "trainers.crsp.evaluate", *argv], cwd=REPO,
                             capture_output=True, text=True, env=ENV, timeout=300)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
        assert out.stderr.strip().splitlines()[-1].startswith(expected), out.stderr[-500:]
