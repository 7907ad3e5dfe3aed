"""``convert_sb3(..., frame_stack_axis=...)`` / ``rlbuffers convert sb3 --frame-stack-axis`` on
SB3 buffers of frame-stacked observations (``VecFrameStack``): the converted buffer stores
one frame per transition, and its rebuilt stacks and next observations equal SB3's arrays
bit for bit, environment by environment, including a DQN run whose environments were reset
mid-episode by a second ``learn``."""

from __future__ import annotations

import numpy as np
import pytest

from tests.heavy import require

require("stable_baselines3", "gymnasium", "zarr")

import zarr  # noqa: E402
from stable_baselines3 import DQN  # noqa: E402
from stable_baselines3.common.buffers import ReplayBuffer as SB3ReplayBuffer  # noqa: E402
from stable_baselines3.common.save_util import save_to_pkl  # noqa: E402

from rlbuffers import FieldError, ReplayBuffer  # noqa: E402
from rlbuffers.cli import main as cli_main  # noqa: E402
from rlbuffers.integrations.sb3.convert import convert_sb3  # noqa: E402
from tests.test_sb3_framestack import frame_stacked_env, steps  # noqa: E402


def oldest_first(rb) -> np.ndarray:
    """Valid ring rows of an SB3 buffer (no optimize_memory_usage), oldest first."""
    if not rb.full:
        return np.arange(rb.pos)
    return (rb.pos + np.arange(rb.buffer_size)) % rb.buffer_size


def expected_by_env(rb) -> dict[str, np.ndarray]:
    """SB3's transitions environment by environment, each oldest first (the order the
    frame-stacked conversion writes)."""
    rows = oldest_first(rb)

    def env_major(a):
        return np.concatenate([a[rows, e] for e in range(rb.n_envs)])

    timeout = env_major(rb.timeouts) != 0
    out = {"obs": env_major(rb.observations), "next_obs": env_major(rb.next_observations),
           "action": env_major(rb.actions), "reward": env_major(rb.rewards),
           "truncated": timeout, "terminated": (env_major(rb.dones) != 0) & ~timeout}
    if rb.n_envs > 1:
        out["env"] = np.repeat(np.arange(rb.n_envs), len(rows))
    return out


def assert_converted(rb, path, axis: int) -> dict[str, np.ndarray]:
    want = expected_by_env(rb)
    with ReplayBuffer.open(path, mode="r") as buf:
        got = buf[np.arange(len(buf))]
        assert set(buf.fields) == set(want)
        assert buf.fields["obs"].stack_axis == axis and buf.fields["next_obs"].stack_axis == axis
        capacity = buf.capacity
    for k, v in want.items():
        assert got[k].dtype == v.dtype or k in ("terminated", "truncated", "env"), k
        np.testing.assert_array_equal(got[k], v.reshape(got[k].shape), err_msg=k)
    frame = list(rb.observations.shape[2:])
    del frame[axis]
    # one frame per transition on disk; no next_obs array
    group = zarr.open_group(path, mode="r")
    assert group["obs"].shape == (capacity, *frame) and "next_obs" not in group
    return got


def test_dqn_two_envs_restarted_through_the_cli(tmp_path):
    """A real DQN run (MlpPolicy on 4 stacked 5x5 frames, 2 envs, ring wrapped), then a
    second ``learn`` that resets the environments mid-episode."""
    venv = frame_stacked_env(2, False, p_end=0.1, limit=7)
    model = DQN("MlpPolicy", venv, buffer_size=60, learning_starts=10, batch_size=8,
                policy_kwargs={"net_arch": [16]}, seed=0)
    model.learn(60)
    model.learn(20)   # reset_num_timesteps=True: venv.reset() mid-episode
    rb = model.replay_buffer
    assert model._n_updates > 0 and rb.full
    rows = oldest_first(rb)
    obs, dones = rb.observations[rows], rb.dones[rows]
    restarted = ~(obs[1:, :, :-1] == obs[:-1, :, 1:]).reshape(len(rows) - 1, 2, -1).all(-1)
    assert (restarted & (dones[:-1] == 0)).any()   # a stack that restarts mid-episode
    model.save_replay_buffer(tmp_path / "rb.pkl")
    argv = ["convert", "sb3", str(tmp_path / "rb.pkl"), str(tmp_path / "out"), "--quiet",
            "--frame-stack-axis", "0"]
    assert cli_main(argv) == 0
    got = assert_converted(model.replay_buffer, tmp_path / "out", 0)
    assert got["terminated"].any() and got["truncated"].any()


@pytest.mark.parametrize("n_envs", [1, 2])
def test_channel_last_buffer(tmp_path, n_envs):
    """SB3's ReplayBuffer fed as off-policy training does (``terminal_observation`` at episode
    ends), channel-last stacks ``(5, 5, 4)``, a restart without an episode end, not full."""
    venv = frame_stacked_env(n_envs, True)
    rb = SB3ReplayBuffer(40, venv.observation_space, venv.action_space, "cpu", n_envs=n_envs)
    for args in [*steps(venv, 7), *steps(frame_stacked_env(n_envs, True), 9)]:
        rb.add(*args)
    save_to_pkl(tmp_path / "rb.pkl", rb)
    convert_sb3(tmp_path / "rb.pkl", tmp_path / "out", frame_stack_axis=-1).close()
    got = assert_converted(rb, tmp_path / "out", 2)
    with ReplayBuffer.open(tmp_path / "out", mode="r") as buf:
        assert buf.metadata["converted_from"]["frame_stack_axis"] == 2
        # per env: the restart ends an episode, and so does the end of each env's stream
        assert buf.episodes >= n_envs * 2 + int(got["terminated"].sum() + got["truncated"].sum())


def test_refused(tmp_path):
    venv = frame_stacked_env(2, False)
    space, act = venv.observation_space, venv.action_space
    rb = SB3ReplayBuffer(20, space, act, "cpu", n_envs=2)
    for args in steps(venv, 6):
        rb.add(*args)
    save_to_pkl(tmp_path / "rb.pkl", rb)
    for axis in (3, -4, 1.5):
        with pytest.raises(ValueError, match="frame_stack_axis"):
            convert_sb3(tmp_path / "rb.pkl", tmp_path / "a", frame_stack_axis=axis)
    with pytest.raises(ValueError, match="capacity"):
        convert_sb3(tmp_path / "rb.pkl", tmp_path / "a", frame_stack_axis=0, capacity=8)
    # stacks along another axis than the one named: not consecutive frames
    with pytest.raises(FieldError):
        convert_sb3(tmp_path / "rb.pkl", tmp_path / "a", frame_stack_axis=1)
    assert not (tmp_path / "a").exists()
    opt = SB3ReplayBuffer(20, space, act, "cpu", n_envs=2, optimize_memory_usage=True,
                          handle_timeout_termination=False)
    for args in steps(venv, 3):
        opt.add(*args)
    save_to_pkl(tmp_path / "opt.pkl", opt)
    with pytest.raises(ValueError, match="optimize_memory_usage"):
        convert_sb3(tmp_path / "opt.pkl", tmp_path / "b", frame_stack_axis=0)
