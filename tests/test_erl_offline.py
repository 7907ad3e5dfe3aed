"""ERL with offline data (``--offline-data``, ``--offline-fraction``): a Minari dataset recorded
here is converted once into ``run_dir/offline`` and mixed into every TD3 batch; a run
interrupted after generation 2 and resumed ends exactly like an uninterrupted one (the
mixture's state is in the checkpoint); a buffer directory works as the data too; bad values
are one line naming the flag."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.heavy import require

require("minari", "h5py", "jax", "gymnasium", "mujoco")

from rlbuffers import ReplayBuffer
from tests.offline_data import record
from tests.test_erl import REPO, TIMEOUT_S, TINY, metrics, trainer_cmd

OFFLINE = [*TINY, "--offline-fraction", "0.5", "--learning-starts", "50"]


def _run(run_dir, *args, env, check=True):
    proc = subprocess.run(trainer_cmd(run_dir, *args), cwd=REPO, capture_output=True,
                          text=True, timeout=TIMEOUT_S, env=env)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_offline_data_is_mixed_in_and_resumes_exactly(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "MINARI_DATASETS_PATH": str(tmp_path / "m"),
           "MUJOCO_GL": "egl"}
    os.environ["MINARI_DATASETS_PATH"] = env["MINARI_DATASETS_PATH"]
    try:
        record("erl/cheetah-v0", "HalfCheetah-v5", 300, max_episode_steps=50)
    finally:
        del os.environ["MINARI_DATASETS_PATH"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    _run(ref, *OFFLINE, "--offline-data", "erl/cheetah-v0", "--generations", "3", env=env)
    with ReplayBuffer.open(ref / "offline", mode="r") as off:
        assert len(off) == 300 and off.metadata["converted_from"]["format"] == "minari"
    _run(run, *OFFLINE, "--offline-data", "erl/cheetah-v0", "--generations", "2", env=env)
    out = _run(run, "--resume", "--generations", "3", env=env).stdout
    assert "resumed" in out
    got, want = metrics(run), metrics(ref)
    assert [m["td3_updates"] for m in want][-1] > 0
    for key in ("env_steps", "fitness", "learner_return", "td3_updates", "buffer_size"):
        assert [m[key] for m in got] == [m[key] for m in want], key
    # a buffer directory works as the data: the converted one of the reference run
    other = _run(tmp_path / "b", *OFFLINE, "--offline-data", str(ref / "offline"),
                 "--generations", "1", env=env)
    assert "gen    1/1" in other.stdout
    assert not (tmp_path / "b" / "offline").exists()
    # one line naming the flag
    bad = _run(tmp_path / "c", *OFFLINE, "--offline-data", "no/such-v0", env=env, check=False)
    errors = [line for line in bad.stderr.splitlines() if line.startswith("error:")]
    assert bad.returncode == 2 and len(errors) == 1 and "--offline-data" in errors[0]
    assert "Traceback" not in bad.stderr
    assert not (tmp_path / "c").exists()  # refused before the run directory is made
    bad = subprocess.run([sys.executable, "-m", "trainers.erl", "--run-dir",
                          str(tmp_path / "d"), "--offline-fraction", "1.5"], cwd=REPO,
                         capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert bad.returncode == 2 and "--offline-fraction" in bad.stderr
