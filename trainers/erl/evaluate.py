"""Deterministic evaluation of ERL's learner: TD3's actor, no exploration noise, on its own env.

Every ``--eval-every`` generations (and once before the first, generation 0) the trainer runs
``--eval-episodes`` episodes of the learner's actor as it is after that generation's TD3
updates: actions are the actor's output clipped to the action box, nothing is drawn from any
random number generator, and the env is a separate instance whose resets use seeds of their
own (:func:`eval_seed`: the same ``--eval-episodes`` start states at every evaluation). So an
evaluation touches neither the training env, nor the buffer, nor the trainer's torch, numpy or
Python RNG streams: a run with evaluation trains exactly as the same run without it, and an
evaluation's result depends only on the learner's weights (the same after ``--resume``).

Its rows (:func:`eval_row`) go into the trainer state of every checkpoint (``evals``), into
``run_dir/eval.jsonl`` (rewritten from the checkpoint at every commit and on ``--resume``, so it
holds exactly the committed evaluations) and, as ``eval_return_mean`` / ``eval_return_std``,
into that generation's ``metrics.jsonl`` row and TensorBoard.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from trainers.erl.rollout import Actor

#: Third word of the eval reset seeds' ``SeedSequence`` entropy (training episodes use
#: ``SeedSequence([seed, episode])``, two words, so the streams never meet): "EVAL" in ASCII.
EVAL_STREAM = 0x4556414C


def eval_seed(seed: int, k: int) -> int:
    """Env reset seed of the ``k``-th evaluation episode of a run of ``--seed seed``."""
    return int(np.random.SeedSequence([seed, EVAL_STREAM, k]).generate_state(1)[0])


@torch.no_grad()
def episode_return(env: gym.Env, actor: Actor, seed: int) -> float:
    """Return of one episode of ``actor`` acting greedily (its action, clipped to the box)
    from ``env.reset(seed=seed)``; draws no random number."""
    low, high = env.action_space.low, env.action_space.high
    obs, _ = env.reset(seed=seed)
    total, done = 0.0, False
    while not done:
        action = actor(torch.as_tensor(obs, dtype=torch.float32)).numpy()
        obs, reward, terminated, truncated, _ = env.step(
            np.clip(action, low, high).astype(np.float32))
        total += float(reward)
        done = terminated or truncated
    return total


def evaluate(env: gym.Env, actor: Actor, seed: int, episodes: int) -> list[float]:
    """Returns of ``episodes`` deterministic episodes of ``actor`` (seeds :func:`eval_seed`)."""
    return [episode_return(env, actor, eval_seed(seed, k)) for k in range(episodes)]


def eval_row(generation: int, env_steps: int, td3_updates: int,
             returns: list[float]) -> dict[str, Any]:
    """One line of ``eval.jsonl``: ``generation``, ``env_steps``, ``td3_updates``, ``n``
    (episodes), ``mean`` and ``std`` (sample std, ddof 1; 0 for one episode) of ``returns``
    and the ``returns`` themselves. Nothing timed: a row depends only on the learner's
    weights."""
    n = len(returns)
    std = float(np.std(returns, ddof=1)) if n > 1 else 0.0
    return {"generation": generation, "env_steps": env_steps, "td3_updates": td3_updates,
            "n": n, "mean": float(np.mean(returns)), "std": std,
            "returns": [float(r) for r in returns]}


def metrics_fields(row: dict[str, Any] | None) -> dict[str, float]:
    """What an evaluation adds to its generation's ``metrics.jsonl`` row (and TensorBoard);
    nothing for a generation without one (``row`` None)."""
    if row is None:
        return {}
    return {"eval_return_mean": row["mean"], "eval_return_std": row["std"]}


def write_evals(path: Path, rows: list[dict[str, Any]]) -> None:
    """Replace ``eval.jsonl`` by ``rows`` (one JSON object a line, atomically)."""
    from trainers.common import write_atomic

    write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows).encode())


def check_evals(value: Any, path: Path) -> list[dict[str, Any]]:
    """The ``evals`` of a checkpoint's trainer state (absent in runs from before evaluation:
    none), checked to be a list of rows with an integer ``generation`` and a number ``mean``.

    Raises:
        rlbuffers.CorruptCheckpointError: another shape (one line naming ``path``).
    """
    from trainers.common import check_state

    if value is None:
        return []
    check_state(value, [{"generation": 0, "mean": 0.0, "returns": [0.0]}], path,
                "trainer.evals")
    return [dict(r) for r in value]


class Evaluation:
    """The run's evaluations (a context manager closing the evaluation's env): made after the
    run is opened (a new run evaluates its untrained learner first, generation 0; ``eval.jsonl``
    is rewritten to hold exactly the checkpoint's evaluations, ``trainer["evals"]``), then
    :meth:`after_generation` before each commit and :meth:`save` after it. With
    ``--eval-every 0`` every method does nothing."""

    def __init__(self, cfg: Any, run: Any, trainer: dict[str, Any], actor: Actor) -> None:
        self.cfg, self.trainer, self.actor = cfg, trainer, actor
        self.path = run.dir / "eval.jsonl"
        self.env: gym.Env | None = None
        if not cfg.eval_every:
            return
        from trainers.erl.rollout import make_env

        self.env = make_env(cfg.env, cfg.max_episode_steps)  # never the training env
        if not trainer["evals"] and trainer["generation"] == 0:
            trainer["evals"] = [eval_row(0, 0, 0, self.run_episodes())]
            run.tensorboard(0, metrics_fields(trainer["evals"][0]))
        self.save()

    def run_episodes(self) -> list[float]:
        assert self.env is not None
        return evaluate(self.env, self.actor, self.cfg.seed, self.cfg.eval_episodes)

    def after_generation(self, gen: int, td3_updates: int, phases: Any) -> dict[str, Any] | None:
        """Evaluate the learner after generation ``gen`` if it is one of every
        ``--eval-every`` (call it after the generation's env steps are counted in the trainer
        state): its row, also appended to ``trainer["evals"]``; else None."""
        if self.env is None or gen % self.cfg.eval_every:
            return None
        with phases("eval"):
            returns = self.run_episodes()
        row = eval_row(gen, self.trainer["env_steps"], td3_updates, returns)
        self.trainer["evals"].append(row)
        return row

    def save(self) -> None:
        """Rewrite ``eval.jsonl`` from ``trainer["evals"]`` (after a commit)."""
        if self.env is not None:
            write_evals(self.path, self.trainer["evals"])

    def __enter__(self) -> Evaluation:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.env is not None:
            self.env.close()
