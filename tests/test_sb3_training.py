"""SB3 training with ZarrReplayBuffer equals training with SB3's own buffer: same seeds, same
device (CPU), and the networks end with identical parameters, the buffers with identical
transitions (DQN on CartPole-v1, SAC on Pendulum-v1, DQN with a CNN policy on images)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.heavy import require

require("stable_baselines3", "torch", "gymnasium")

import gymnasium as gym
import torch as th
from gymnasium import spaces
from stable_baselines3 import DQN, SAC
from stable_baselines3.common.env_util import make_vec_env

from rlbuffers.integrations.sb3 import ZarrReplayBuffer


@pytest.fixture(autouse=True)
def one_torch_thread():
    threads = th.get_num_threads()
    th.set_num_threads(1)
    yield
    th.set_num_threads(threads)


def train(algo, env, steps, **kwargs):
    model = algo("MlpPolicy" if "policy" not in kwargs else kwargs.pop("policy"), env,
                 seed=0, device="cpu", **kwargs)
    model.learn(steps)
    return model


def assert_same_training(ours, theirs) -> None:
    a, b = ours.policy.state_dict(), theirs.policy.state_dict()
    assert a.keys() == b.keys()
    for name in b:
        assert th.equal(a[name], b[name]), name
    assert ours.num_timesteps == theirs.num_timesteps and ours._n_updates == theirs._n_updates
    rb, ref = ours.replay_buffer, theirs.replay_buffer
    assert (rb.pos, rb.full) == (ref.pos, ref.full)
    rows = rb.storage[:]
    # SB3 steps oldest first: pos .. end, 0 .. pos - 1 once full; environments in order
    order = np.roll(np.arange(ref.buffer_size), -ref.pos) if ref.full else np.arange(ref.pos)

    def flat(arr, skip=0):
        return arr[order[skip:]].reshape(-1, *arr.shape[2:])

    # with optimize_memory_usage SB3 has overwritten the oldest step's obs (never sampled)
    skip = 1 if ref.optimize_memory_usage and ref.full else 0
    np.testing.assert_array_equal(rows["obs"][skip * ref.n_envs:], flat(ref.observations, skip))
    np.testing.assert_array_equal(rows["action"], flat(ref.actions))
    np.testing.assert_array_equal(rows["reward"], flat(ref.rewards))
    expected_done = flat(ref.dones) * (1 - flat(ref.timeouts))
    np.testing.assert_array_equal(rows["terminated"], expected_done.astype(bool))
    if not ref.optimize_memory_usage:
        np.testing.assert_array_equal(rows["next_obs"], flat(ref.next_observations))
    np.random.seed(7)
    expected = ref.sample(16)
    np.random.seed(7)
    got = rb.sample(16)
    for name in ("observations", "actions", "next_observations", "dones", "rewards"):
        assert th.equal(getattr(got, name), getattr(expected, name)), name


def test_dqn_cartpole_equals_sb3_buffer(tmp_path):
    kwargs = dict(buffer_size=1_000, learning_starts=200, train_freq=4, batch_size=32,
                  target_update_interval=250, policy_kwargs={"net_arch": [32, 32]})
    theirs = train(DQN, "CartPole-v1", 2_000, **kwargs)
    ours = train(DQN, "CartPole-v1", 2_000, **kwargs, replay_buffer_class=ZarrReplayBuffer,
                 replay_buffer_kwargs={"path": tmp_path / "buf"})
    assert isinstance(ours.replay_buffer, ZarrReplayBuffer) and ours.replay_buffer.full
    assert ours._n_updates == (2_000 - 200) // 4
    assert_same_training(ours, theirs)
    assert ours.replay_buffer.storage.episodes > 10
    ours.replay_buffer.close()


def test_dqn_two_envs_equals_sb3_buffer(tmp_path):
    """Two CartPole environments: each step adds two transitions; SB3 samples the env index."""
    envs = [make_vec_env("CartPole-v1", n_envs=2, seed=0) for _ in range(2)]
    kwargs = dict(buffer_size=600, learning_starts=100, train_freq=2, batch_size=32,
                  target_update_interval=100, policy_kwargs={"net_arch": [32, 32]})
    theirs = train(DQN, envs[0], 1_000, **kwargs)
    ours = train(DQN, envs[1], 1_000, **kwargs, replay_buffer_class=ZarrReplayBuffer,
                 replay_buffer_kwargs={"path": tmp_path / "buf"})
    assert ours.replay_buffer.n_envs == 2 and len(ours.replay_buffer.storage) == 600
    assert_same_training(ours, theirs)
    ours.replay_buffer.close()


def test_sac_pendulum_equals_sb3_buffer(tmp_path):
    """Pendulum ends every episode by a time limit: the timeouts path (dones masked)."""
    kwargs = dict(buffer_size=600, learning_starts=100, batch_size=64,
                  policy_kwargs={"net_arch": [32, 32]})
    theirs = train(SAC, "Pendulum-v1", 1_000, **kwargs)
    ours = train(SAC, "Pendulum-v1", 1_000, **kwargs, replay_buffer_class=ZarrReplayBuffer,
                 replay_buffer_kwargs={"path": tmp_path / "buf"})
    assert_same_training(ours, theirs)
    stored = ours.replay_buffer.storage[:]
    assert stored["truncated"].sum() == 3 and not stored["terminated"].any()
    ours.replay_buffer.close()


class TinyImageEnv(gym.Env):
    """36x36 grey frames (NatureCNN's smallest input) whose brightness tracks a counter;
    action 1 raises it, 0 lowers it; an episode ends at either edge or after 30 steps."""

    observation_space = spaces.Box(0, 255, (36, 36, 1), np.uint8)
    action_space = spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.level, self.t = int(self.np_random.integers(3, 6)), 0
        return self._obs(), {}

    def _obs(self):
        return np.full((36, 36, 1), self.level * 25, np.uint8)

    def step(self, action):
        self.level += 1 if action == 1 else -1
        self.t += 1
        terminated = self.level in (0, 10)
        return self._obs(), float(self.level == 10), terminated, self.t >= 30, {}


def test_dqn_cnn_optimize_memory_usage_equals_sb3_buffer(tmp_path):
    """CnnPolicy on uint8 frames, with SB3's optimize_memory_usage (no next_obs stored)."""
    kwargs = dict(policy="CnnPolicy", buffer_size=150, learning_starts=50, train_freq=4,
                  batch_size=16, optimize_memory_usage=True,
                  policy_kwargs={"features_extractor_kwargs": {"features_dim": 16}})
    no_timeouts = {"handle_timeout_termination": False}
    theirs = train(DQN, TinyImageEnv(), 300, **kwargs, replay_buffer_kwargs=no_timeouts)
    ours = train(DQN, TinyImageEnv(), 300, **kwargs, replay_buffer_class=ZarrReplayBuffer,
                 replay_buffer_kwargs={**no_timeouts, "path": tmp_path / "buf"})
    assert "next_obs" not in ours.replay_buffer.storage.fields
    assert_same_training(ours, theirs)
    ours.replay_buffer.close()
