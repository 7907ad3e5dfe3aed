"""The guidance trainer's data: problems in a seeded, resumable order, and episodes as replay
buffer rows (one utterance per transition, three per episode)."""

from __future__ import annotations

from typing import Any

import numpy as np

from rlbuffers import FieldSpec, ReplayBuffer
from trainers.curves import Series, plot_curve


def next_problems(n: int, size: int, seed: int, data: dict[str, int]) -> list[int]:
    """The next ``n`` indices of ``size`` problems; advances ``data`` (``epoch``,
    ``position``) through permutations seeded by (``seed``, epoch), so a resume rebuilds
    them."""
    out: list[int] = []
    while len(out) < n:
        order = np.random.default_rng([seed, data["epoch"]]).permutation(size)
        take = order[data["position"]:data["position"] + n - len(out)]
        out += take.tolist()
        data["position"] += len(take)
        if data["position"] >= len(order):
            data["epoch"], data["position"] = data["epoch"] + 1, 0
    return out


def buffer_fields() -> dict[str, FieldSpec]:
    """One utterance per transition: a problem's turn 1 (``turn`` 0, ``hint`` -1), then per
    hint k its hint (``turn`` 1) and revision (``turn`` 2, ``done``), ``hint`` k; ``episode``
    is the problem's (its turn-1 answer's) id, shared by its K two-turn episodes."""
    ragged = FieldSpec((None,), "int32")
    return {"observation_ids": ragged, "action_ids": ragged, "next_observation_ids": ragged,
            "turn": FieldSpec((), "int8"), "hint": FieldSpec((), "int16"),
            "episode": FieldSpec((), "int64"), "iteration": FieldSpec((), "int64"),
            "reward": FieldSpec((), "float32"), "correctness": FieldSpec((), "float32"),
            "length_limited": FieldSpec((), "bool"), "done": FieldSpec((), "bool")}


def episode_rows(episodes: list[dict[str, Any]], scores: np.ndarray, first: int,
                 iteration: int, hint_reward: str = "turn2") -> dict[str, Any]:
    """Buffer rows of problems (``1 + 2K`` utterances each in :func:`~trainers.guidance.
    rollout.play`'s order, ids from ``first``); ``scores`` float32[E, 1 + K] (turn 1, then
    turn 2 after each hint). Rewards: turn 1 its own correctness (a direct reward), a hint 0,
    a turn 2 its correctness (``hint_reward`` ``turn2``) or its improvement ``correct(turn 2)
    - correct(turn 1)`` (``improvement``); ``correctness`` is each answer's score; a hint's
    next observation is its revision's prompt, turn 1's the guidance prompt (the same for
    every hint)."""
    empty = np.zeros(0, np.int32)
    rows: dict[str, list[Any]] = {k: [] for k in buffer_fields()}
    for e, ep in enumerate(episodes):
        hints = (len(ep["actions"]) - 1) // 2
        for u in range(1 + 2 * hints):
            turn, k = (0, -1) if u == 0 else (1 if u % 2 else 2, (u - 1) // 2)
            rows["observation_ids"].append(ep["observations"][u])
            rows["action_ids"].append(ep["actions"][u])
            rows["next_observation_ids"].append(ep["observations"][u + 1] if turn < 2 else empty)
            rows["turn"].append(turn)
            rows["hint"].append(k)
            rows["episode"].append(first + e)
            rows["iteration"].append(iteration)
            score = scores[e, 0] if turn == 0 else scores[e, 1 + k]
            gain = score - scores[e, 0] if hint_reward == "improvement" else score
            rows["reward"].append(0.0 if turn == 1 else score if turn == 0 else gain)
            rows["correctness"].append(np.nan if turn == 1 else score)
            rows["length_limited"].append(ep["truncated"][u])
            rows["done"].append(turn == 2)
    return {k: v if k.endswith("_ids") else np.asarray(v, dtype=buffer_fields()[k].dtype)
            for k, v in rows.items()}


def create_buffer(cfg: Any, run_dir: Any) -> None:
    """The new run's utterance buffer (3 utterances per episode kept)."""
    ReplayBuffer.create(run_dir / "buffer", capacity=3 * cfg.buffer_episodes,
                        fields=buffer_fields(), seed=cfg.seed).close()


def draw_curve(path: Any, history: list[dict[str, Any]], *, task: str) -> None:
    """curve.png: turn-1 / turn-2 accuracy, hint uptake and breaks; the critic's TD error on
    fresh utterances and its loss on the right."""
    plot_curve(path, history, x="iteration", xlabel=f"iteration (guidance on {task})",
               series=[Series("turn1_accuracy", "turn 1 accuracy"),
                       Series("turn2_accuracy", "turn 2 accuracy"),
                       Series("hint_uptake", "hint uptake (turn 2 fixes)"),
                       Series("turn2_breaks", "turn 2 breaks"),
                       Series("td_error", "critic TD error (fresh)", right=True),
                       Series("critic_loss", "critic loss", right=True)],
               ylabel="accuracy / share", title="two-turn guidance",
               right_label="critic TD error / loss")
