"""Real Atari transitions for benchmarks: Pong with the standard DQN preprocessing
(frame skip 4, 84x84 grayscale, 4 stacked frames: uint8 [4, 84, 84], 28,224 bytes)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np


def pong_transitions(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """``n`` transitions of a random policy on ``ALE/Pong-v5``.

    Returns:
        ``obs``: uint8[n, 4, 84, 84], ``action``: int64[n], ``reward``: float32[n],
        ``terminated``: bool[n], ``truncated``: bool[n].
    """
    import ale_py
    from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation

    gym.register_envs(ale_py)
    env = FrameStackObservation(
        AtariPreprocessing(gym.make("ALE/Pong-v5", frameskip=1), frame_skip=4, screen_size=84,
                           grayscale_obs=True),
        4,
    )
    rng = np.random.default_rng(seed)
    out = {
        "obs": np.empty((n, 4, 84, 84), np.uint8),
        "action": np.empty(n, np.int64),
        "reward": np.empty(n, np.float32),
        "terminated": np.empty(n, bool),
        "truncated": np.empty(n, bool),
    }
    obs, _ = env.reset(seed=seed)
    for i in range(n):
        a = int(rng.integers(env.action_space.n))
        nxt, r, term, trunc, _ = env.step(a)
        out["obs"][i], out["action"][i], out["reward"][i] = obs, a, r
        out["terminated"][i], out["truncated"][i] = term, trunc
        obs = env.reset()[0] if term or trunc else nxt
    env.close()
    return out


def tiled(source: dict[str, np.ndarray], start: int, n: int) -> dict[str, np.ndarray]:
    """Transitions ``start .. start + n`` of an endless repetition of ``source``."""
    m = len(source["action"])
    idx = (start + np.arange(n)) % m
    return {k: v[idx] for k, v in source.items()}
