"""ERL's actor network and its episodes, on whichever rollout worker runs them.

:func:`episode_job` is the job ``trainers/erl/train.py`` submits to its rollout pool
(``rlbuffers.rollouts``): in the learner's process (``InProcessPool``) or on a Ray actor, on
this machine or another (``RayPool``). It lives in this small module, which imports only torch,
gymnasium and numpy (the package's ``__init__`` imports nothing), so that workers import it by
name without the trainer's buffer and checkpoint code.
"""

from __future__ import annotations

import sys
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn


class Actor(nn.Module):
    """Deterministic policy: obs float32[B, obs_dim] -> action float32[B, act_dim] in the
    env's action box. LayerNorm after each hidden layer keeps evolved weights well scaled."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: int, low: np.ndarray,
                 high: np.ndarray) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(obs_dim, hidden), nn.LayerNorm(hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.LayerNorm(hidden), nn.ReLU(),
            nn.Linear(hidden, act_dim), nn.Tanh(),
        )
        self.register_buffer("scale", torch.as_tensor((high - low) / 2, dtype=torch.float32))
        self.register_buffer("center", torch.as_tensor((high + low) / 2, dtype=torch.float32))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.center + self.scale * self.net(obs)


@torch.no_grad()
def rollout(env: gym.Env, actor: Actor | None, seed: int, rng: np.random.Generator,
            noise_std: float = 0.0) -> tuple[float, dict[str, np.ndarray]]:
    """Run one episode; ``actor=None`` acts uniformly at random.

    Returns (episode return, transitions for ``buf.extend``): ``obs``/``next_obs``
    float32[T, obs_dim], ``action`` float32[T, act_dim], ``reward`` float32[T],
    ``terminated``/``truncated`` bool[T]. ``noise_std`` adds N(0, (noise_std * half the action
    range)^2) to the actor's actions. ``rng`` is drawn from only for random actions and noise.
    """
    low, high = env.action_space.low, env.action_space.high
    obs, _ = env.reset(seed=seed)
    keys = ("obs", "action", "reward", "next_obs", "terminated", "truncated")
    rows: dict[str, list[Any]] = {k: [] for k in keys}
    total, done = 0.0, False
    while not done:
        if actor is None:
            action = rng.uniform(low, high).astype(np.float32)
        else:
            action = actor(torch.as_tensor(obs, dtype=torch.float32)).numpy()
            if noise_std > 0:
                action = action + rng.normal(0.0, noise_std * (high - low) / 2)
            action = np.clip(action, low, high).astype(np.float32)
        next_obs, reward, terminated, truncated, _ = env.step(action)
        for k, v in zip(keys, (obs, action, reward, next_obs, terminated, truncated), strict=True):
            rows[k].append(v)
        total += float(reward)
        obs, done = next_obs, terminated or truncated
    dtypes = {"terminated": np.bool_, "truncated": np.bool_}
    return total, {k: np.asarray(v, dtype=dtypes.get(k, np.float32)) for k, v in rows.items()}


def actor_weights(actor: Actor) -> dict[str, np.ndarray]:
    """A copy of ``actor.state_dict()`` as float32 numpy arrays (what :func:`episode_job` gets;
    numpy so that Ray's object store hands it to workers without a copy)."""
    return {k: v.detach().numpy().copy() for k, v in actor.state_dict().items()}


#: Per worker process: the env (one per env id and episode limit) and the actor module it
#: reuses from job to job; every episode resets the env with its own seed.
_CACHE: dict[tuple[Any, ...], Any] = {}


#: MuJoCo warnings we cannot fix, dropped by their exact text: gymnasium's MuJoCo XML models
#: (HalfCheetah-v5 ...) use the 'settotalmass' compiler attribute that MuJoCo 3.3+ deprecates.
IGNORED_MUJOCO_WARNINGS = ("compiler attribute 'settotalmass' is deprecated",)


def make_env(env_id: str, max_episode_steps: int) -> gym.Env:
    """``gym.make`` with MuJoCo's warnings in :data:`IGNORED_MUJOCO_WARNINGS` dropped while the
    model compiles (MuJoCo's other warnings still print, as ``WARNING: <text>`` on stderr)."""
    try:
        import mujoco
    except ImportError:
        return gym.make(env_id, max_episode_steps=max_episode_steps)

    def warn(text: str) -> None:
        if not any(text.startswith(m) for m in IGNORED_MUJOCO_WARNINGS):
            print(f"WARNING: {text}", file=sys.stderr, flush=True)

    previous = mujoco.get_mju_user_warning()
    mujoco.set_mju_user_warning(warn)
    try:
        return gym.make(env_id, max_episode_steps=max_episode_steps)
    finally:
        mujoco.set_mju_user_warning(previous)


def _env(env_id: str, max_episode_steps: int) -> gym.Env:
    key = ("env", env_id, max_episode_steps)
    if key not in _CACHE:
        _CACHE[key] = make_env(env_id, max_episode_steps)
    return _CACHE[key]


def _actor(env: gym.Env, hidden: int, weights: dict[str, np.ndarray]) -> Actor:
    key = ("actor", id(env), hidden)
    if key not in _CACHE:
        with torch.random.fork_rng(devices=[]):  # in the learner's process (InProcessPool),
            # initialising a network must not draw from the learner's torch RNG stream
            _CACHE[key] = Actor(env.observation_space.shape[0], env.action_space.shape[0],
                                hidden, env.action_space.low, env.action_space.high)
    actor = _CACHE[key]
    actor.load_state_dict({k: torch.tensor(v) for k, v in weights.items()})  # copies: Ray's
    return actor  # arrays are read-only views of its object store


def episode_job(weights: dict[str, Any], spec: dict[str, Any], seed: int, who: int | None,
                rng_state: dict[str, Any] | None = None,
                noise_std: float = 0.0) -> dict[str, Any]:
    """One episode on a rollout worker: the job ``trainers/erl/train.py`` submits.

    Args:
        weights: this generation's ``{"population": [actor_weights, ...], "learner":
            actor_weights}`` (what the pool's ``set_weights`` was given).
        spec: ``{"env": env id, "max_episode_steps": int, "hidden": int}``.
        seed: the env reset seed of this episode.
        who: index into ``weights["population"]``, ``-1`` for the learner's actor, None for
            uniformly random actions.
        rng_state: ``bit_generator.state`` of the numpy Generator drawing random actions and
            exploration noise (the trainer's own stream, so that the run is the same on any
            number of workers); None when the episode draws nothing (no noise, an actor).
        noise_std: exploration noise, as in :func:`rollout`.

    Returns:
        ``{"return": float, "rows": transitions (see rollout), "rng_state": the generator's
        state after the episode (None if none was given)}``.

    Raises:
        ValueError: an episode that needs random numbers got no ``rng_state``.
    """
    if rng_state is None and (who is None or noise_std > 0):
        raise ValueError("rng_state: an episode with random actions or noise needs the "
                         "generator's state, got None")
    env = _env(spec["env"], spec["max_episode_steps"])
    actor = None
    if who is not None:
        actor = _actor(env, spec["hidden"],
                       weights["learner"] if who == -1 else weights["population"][who])
    rng = np.random.default_rng()
    if rng_state is not None:
        rng.bit_generator.state = rng_state
    ret, rows = rollout(env, actor, seed, rng, noise_std)
    return {"return": ret, "rows": rows,
            "rng_state": rng.bit_generator.state if rng_state is not None else None}
