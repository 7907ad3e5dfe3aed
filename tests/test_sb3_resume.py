"""Save + SIGKILL + resume of an SB3 run with ZarrReplayBuffer: the resumed model, buffer and
RNG states sample exactly what the uninterrupted run sampled after the same commit."""

from __future__ import annotations

import json
import os
import pickle
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.heavy import require

require("stable_baselines3", "torch", "gymnasium")

import gymnasium as gym
import torch as th
from stable_baselines3 import DQN
from stable_baselines3.common.env_util import make_vec_env

from rlbuffers.cli import main as cli_main
from rlbuffers.integrations.sb3 import ZarrReplayBuffer, resume
from tests import sb3_resume_child as child

ROOT = Path(__file__).resolve().parent.parent


def run_child(mode: str, run_dir: Path) -> int:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "tests.sb3_resume_child", mode, str(run_dir)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, -signal.SIGKILL), proc.stderr[-3000:]
    return proc.returncode


@pytest.fixture
def keep_global_rng():
    """resume() sets the global RNG states: give the other tests theirs back."""
    state = np.random.get_state(), random.getstate(), th.get_rng_state()
    threads = th.get_num_threads()
    yield
    np.random.set_state(state[0])
    random.setstate(state[1])
    th.set_rng_state(state[2])
    th.set_num_threads(threads)


def test_kill_then_resume_samples_as_uninterrupted(tmp_path, keep_global_rng, capsys):
    (tmp_path / "record").mkdir()
    (tmp_path / "kill").mkdir()
    assert run_child("record", tmp_path / "record") == 0
    assert run_child("kill", tmp_path / "kill") == -signal.SIGKILL
    expected = dict(np.load(tmp_path / "record" / "expected.npz"))
    # the kill came after the commit of step 600; only its zip is kept
    assert sorted(p.name for p in (tmp_path / "kill" / "ckpt").iterdir()) == ["model_600.zip"]

    th.set_num_threads(1)
    model = resume(DQN, tmp_path / "kill" / "buffer", device="cpu")
    buf = model.replay_buffer
    assert isinstance(buf, ZarrReplayBuffer)
    assert model.num_timesteps == child.RECORD_AT == int(expected["num_timesteps"])
    assert (buf.pos, buf.full, buf.size()) == (100, True, 500)  # 600 steps in a ring of 500
    got = child.draw(model)
    assert got.keys() == expected.keys()
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)

    # the buffer is an ordinary rlbuffers buffer: the CLI inspects its commit
    assert cli_main(["inspect", str(tmp_path / "kill" / "buffer"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["size"] == 500 and report["total_added"] == 600
    assert report["metadata"]["num_timesteps"] == 600
    buf.close()


def test_model_load_leaves_the_buffer_alone(tmp_path, keep_global_rng):
    """Plain ``DQN.load`` (e.g. to evaluate) builds a ZarrReplayBuffer at the saved path: it
    must neither fail nor touch the committed buffer."""
    (tmp_path / "kill").mkdir()
    run_child("kill", tmp_path / "kill")
    model = DQN.load(tmp_path / "kill" / "ckpt" / "model_600.zip", device="cpu")
    with pytest.raises(FileExistsError, match="resume"):
        model.replay_buffer.sample(4)
    # what save_replay_buffer pickles: a pointer to the buffer's last commit, nothing written
    pointer = pickle.loads(pickle.dumps(model.replay_buffer))
    assert (pointer.size(), pointer.storage.commit) == (500, 3)
    pointer.close()
    again = resume(DQN, tmp_path / "kill" / "buffer", device="cpu")
    assert len(again.replay_buffer.storage) == 500
    again.replay_buffer.close()


def test_resume_refuses_another_env_count(tmp_path, keep_global_rng):
    (tmp_path / "kill").mkdir()
    run_child("kill", tmp_path / "kill")
    with pytest.raises(ValueError, match="n_envs=1, the model now has n_envs=2"):
        resume(DQN, tmp_path / "kill" / "buffer", device="cpu",
               env=make_vec_env("CartPole-v1", n_envs=2, seed=0))
    env = gym.make("CartPole-v1")
    bare = ZarrReplayBuffer(8, env.observation_space, env.action_space, "cpu",
                            path=tmp_path / "bare")
    bare.commit()   # no CommitCallback: no model zip named
    bare.close()
    with pytest.raises(ValueError, match="names no model zip"):
        resume(DQN, tmp_path / "bare", device="cpu")
