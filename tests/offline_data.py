"""Small Minari datasets recorded here with minari's own ``DataCollector`` (nothing is
downloaded): Pendulum-v1, a Dict-observation env with a Tuple action space and array infos,
and MuJoCo HalfCheetah-v5. Used by tests/test_offline_*.py (the caller has checked that
minari and gymnasium import) and tools/bench/bench_offline.py."""

from __future__ import annotations

import os
import warnings

os.environ.setdefault("MUJOCO_GL", "egl")

import gymnasium as gym
import minari
import numpy as np

DICT_ENV = "RLBuffersTestDict-v0"


class DictEnv(gym.Env):
    """Dict observations (Box float32 / float64 / uint8, Discrete, a nested Tuple), a Tuple
    action space, array infos, and episodes that terminate at random or are truncated by the
    time limit."""

    observation_space = gym.spaces.Dict({
        "pos": gym.spaces.Box(-1.0, 1.0, (3,), np.float32),
        "goal": gym.spaces.Box(-1.0, 1.0, (2,), np.float64),
        "grid": gym.spaces.Box(0, 255, (4, 4), np.uint8),
        "mode": gym.spaces.Discrete(3),
        "extra": gym.spaces.Tuple((gym.spaces.Discrete(2),
                                   gym.spaces.Box(0.0, 1.0, (2,), np.float32))),
    })
    action_space = gym.spaces.Tuple((gym.spaces.Discrete(4),
                                     gym.spaces.Box(-1.0, 1.0, (2,), np.float32)))

    def _obs(self):
        return self.observation_space.sample()

    def _info(self):
        return {"cost": np.float64(self.np_random.random()),
                "vec": self.np_random.random(2).astype(np.float32)}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.observation_space.seed(int(self.np_random.integers(2**31)))
        return self._obs(), self._info()

    def step(self, action):
        reward = float(action[0]) - float(np.sum(action[1]))
        terminated = bool(self.np_random.random() < 0.04)
        return self._obs(), reward, terminated, False, self._info()


if DICT_ENV not in gym.registry:
    gym.register(DICT_ENV, entry_point="tests.offline_data:DictEnv", max_episode_steps=30)


def record(dataset_id: str, env_id: str, steps: int, *, seed: int = 0,
           max_episode_steps: int | None = None, record_infos: bool = False,
           data_format: str = "hdf5") -> minari.MinariDataset:
    """Record ``steps`` random-policy steps of ``env_id`` with ``minari.DataCollector`` as
    the local dataset ``dataset_id`` (under ``MINARI_DATASETS_PATH``)."""
    kwargs = {} if max_episode_steps is None else {"max_episode_steps": max_episode_steps}
    env = minari.DataCollector(gym.make(env_id, **kwargs), record_infos=record_infos,
                               data_format=data_format)
    env.action_space.seed(seed)
    env.reset(seed=seed)
    for _ in range(steps):
        _, _, terminated, truncated, _ = env.step(env.action_space.sample())
        if terminated or truncated:
            env.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # its advice to name an eval env
        # create_dataset drops its first TemporaryDirectory (emptied) without cleanup()
        warnings.simplefilter("ignore", ResourceWarning)
        ds = env.create_dataset(dataset_id, algorithm_name="random", author="rlbuffers tests",
                                author_email="tests@rlbuffers.invalid",
                                code_permalink="tests/offline_data.py",
                                description=f"{steps} random steps of {env_id}")
    # DataCollector.close removes its temporary directory with rmtree but leaves the
    # TemporaryDirectory object to warn when collected: clean it up through the object
    env._tmp_dir.cleanup()
    env.env.close()
    return ds


def assert_episodes_equal(a: minari.MinariDataset, b: minari.MinariDataset) -> int:
    """Every episode of ``a`` and ``b`` equal (observations, actions, rewards, terminations,
    truncations, infos; values and dtypes); returns the steps compared."""
    assert a.total_episodes == b.total_episodes and a.total_steps == b.total_steps
    steps = 0
    for x, y in zip(a.iterate_episodes(), b.iterate_episodes(), strict=True):
        for key in ("observations", "actions", "rewards", "terminations", "truncations",
                    "infos"):
            assert_tree_equal(getattr(x, key), getattr(y, key), f"episode {x.id} {key}")
        steps += len(x)
    return steps


def assert_tree_equal(x, y, where: str) -> None:
    """Nested dict / tuple of arrays equal, leaf by leaf (values, shapes and dtypes)."""
    if isinstance(x, dict):
        assert isinstance(y, dict) and x.keys() == y.keys(), where
        for k in x:
            assert_tree_equal(x[k], y[k], f"{where}.{k}")
    elif isinstance(x, tuple):
        assert isinstance(y, tuple) and len(x) == len(y), where
        for i, (u, v) in enumerate(zip(x, y, strict=True)):
            assert_tree_equal(u, v, f"{where}.{i}")
    else:
        u, v = np.asarray(x), np.asarray(y)
        assert u.dtype == v.dtype and u.shape == v.shape, (where, u.dtype, v.dtype, u.shape,
                                                           v.shape)
        assert np.array_equal(u, v), where
