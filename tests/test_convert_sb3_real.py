"""``convert_sb3`` on replay buffers written by real Stable-Baselines3 training runs (DQN on
CartPole and Atari Pong with ``optimize_memory_usage`` on and off, SAC on MuJoCo, a
``DictReplayBuffer``), compared transition by transition with SB3's own ``_get_samples``.

A trained model's action space carries its ``np.random.Generator``; the restricted unpickler
keeps it as inert data (it used to fail on every trained buffer)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.heavy import require

require("stable_baselines3", "gymnasium", "ale_py", "mujoco")

import gymnasium as gym  # noqa: E402
from gymnasium import spaces  # noqa: E402
from stable_baselines3 import DQN, SAC  # noqa: E402
from stable_baselines3.common.buffers import ReplayBuffer as SB3ReplayBuffer  # noqa: E402
from stable_baselines3.common.save_util import save_to_pkl  # noqa: E402

from rlbuffers import ReplayBuffer  # noqa: E402
from rlbuffers.cli import main as cli_main  # noqa: E402
from rlbuffers.convert import convert_sb3  # noqa: E402


def oldest_first(rb) -> np.ndarray:
    """Valid ring rows of an SB3 buffer, oldest first (SB3's own sampling range)."""
    if not rb.full:
        return np.arange(rb.pos)
    first = 1 if rb.optimize_memory_usage else 0  # row pos's next observation is overwritten
    return (rb.pos + np.arange(first, rb.buffer_size)) % rb.buffer_size


def assert_same_transitions(rb, path):
    """Every transition of the converted buffer equals SB3's sample of the same row."""
    rows = oldest_first(rb)
    want = rb._get_samples(rows)  # n_envs == 1: env index 0
    with ReplayBuffer.open(path, mode="r") as buf:
        got = buf[np.arange(len(buf))]
        assert len(buf) == len(rows)
    if isinstance(want.observations, dict):
        for k in want.observations:
            np.testing.assert_array_equal(got[f"obs.{k}"], want.observations[k].numpy())
            np.testing.assert_array_equal(got[f"next_obs.{k}"],
                                          want.next_observations[k].numpy())
    else:
        np.testing.assert_array_equal(got["obs"], want.observations.numpy())
        np.testing.assert_array_equal(got["next_obs"], want.next_observations.numpy())
    actions = want.actions.numpy()
    np.testing.assert_array_equal(got["action"], actions.reshape(got["action"].shape))
    np.testing.assert_array_equal(got["reward"], want.rewards.numpy().reshape(-1))
    # SB3's dones are termination only (timeouts masked out when it handles them)
    np.testing.assert_array_equal(got["terminated"], want.dones.numpy().reshape(-1) != 0)
    assert got["truncated"].tolist() == (rb.timeouts[rows, 0] != 0).tolist()


def train_and_convert(model, steps, tmp_path):
    model.learn(total_timesteps=steps)
    model.save_replay_buffer(tmp_path / "rb.pkl")
    rb = model.replay_buffer
    assert rb.full  # the ring wrapped: the harder case
    convert_sb3(tmp_path / "rb.pkl", tmp_path / "out").close()
    assert_same_transitions(rb, tmp_path / "out")
    return rb


@pytest.mark.parametrize("optimize", [False, True])
def test_dqn_cartpole(tmp_path, optimize):
    model = DQN("MlpPolicy", "CartPole-v1", buffer_size=300, learning_starts=50, batch_size=16,
                optimize_memory_usage=optimize, policy_kwargs={"net_arch": [16]}, seed=0,
                replay_buffer_kwargs={"handle_timeout_termination": not optimize})
    train_and_convert(model, 500, tmp_path)


@pytest.mark.parametrize("optimize", [False, True])
def test_dqn_atari_pong(tmp_path, optimize):
    import ale_py

    gym.register_envs(ale_py)
    env = gym.make("ALE/Pong-v5", obs_type="grayscale", frameskip=4)  # uint8 (210, 160)
    half = spaces.Box(0, 255, (105, 80), np.uint8)  # every other pixel (no opencv needed)
    env = gym.wrappers.TransformObservation(env, lambda o: o[::2, ::2], half)
    env = gym.wrappers.FrameStackObservation(env, 4)  # uint8 (4, 105, 80)
    model = DQN("CnnPolicy", env, buffer_size=150, learning_starts=100, batch_size=8,
                train_freq=8, optimize_memory_usage=optimize, seed=0,
                replay_buffer_kwargs={"handle_timeout_termination": not optimize},
                policy_kwargs={"net_arch": [16]})
    rb = train_and_convert(model, 200, tmp_path)
    assert rb.observations.dtype == np.uint8 and rb.observations.shape[2:] == (4, 105, 80)


def test_sac_mujoco(tmp_path):
    model = SAC("MlpPolicy", "InvertedPendulum-v5", buffer_size=120, learning_starts=50,
                batch_size=16, policy_kwargs={"net_arch": [16]}, seed=0)
    train_and_convert(model, 160, tmp_path)


class DictObs(gym.Wrapper):
    """CartPole with a dict observation (position part, velocity part)."""

    def __init__(self, env):
        super().__init__(env)
        box = spaces.Box(-np.inf, np.inf, (2,), np.float32)
        self.observation_space = spaces.Dict({"pos": box, "vel": box})

    def _split(self, o):
        return {"pos": o[[0, 2]], "vel": o[[1, 3]]}

    def reset(self, **kw):
        o, info = self.env.reset(**kw)
        return self._split(o), info

    def step(self, a):
        o, r, term, trunc, info = self.env.step(a)
        return self._split(o), r, term, trunc, info


def test_dict_replay_buffer(tmp_path):
    model = DQN("MultiInputPolicy", DictObs(gym.make("CartPole-v1")), buffer_size=200,
                learning_starts=50, batch_size=16, policy_kwargs={"net_arch": [16]}, seed=0)
    rb = train_and_convert(model, 300, tmp_path)
    assert type(rb).__name__ == "DictReplayBuffer"
    assert cli_main(["inspect", str(tmp_path / "out")]) == 0


def test_a_buffer_whose_action_space_was_sampled(tmp_path):
    """The smallest reproduction: the pickled action space carries a used Generator."""
    env = gym.make("CartPole-v1")
    env.action_space.sample()
    rb = SB3ReplayBuffer(3, env.observation_space, env.action_space, device="cpu")
    o = np.zeros((1, 4), np.float32)
    for i in range(3):
        rb.add(o + i, o + i + 1, np.array([i % 2]), np.array([float(i)]), np.array([i == 2]),
               [{}])
    save_to_pkl(tmp_path / "rb.pkl", rb)
    assert cli_main(["convert", "sb3", str(tmp_path / "rb.pkl"), str(tmp_path / "out"),
                     "--quiet"]) == 0
    assert_same_transitions(rb, tmp_path / "out")
