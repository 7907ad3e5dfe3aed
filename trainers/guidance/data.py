"""The guidance trainer's data: problems in a seeded, resumable order, and episodes as replay
buffer rows (one utterance per transition, three per episode)."""

from __future__ import annotations

from typing import Any

import numpy as np

from rlbuffers import FieldSpec


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
    """One utterance per transition; an episode is three (``done`` on the last)."""
    ragged = FieldSpec((None,), "int32")
    return {"observation_ids": ragged, "action_ids": ragged, "next_observation_ids": ragged,
            "turn": FieldSpec((), "int8"), "episode": FieldSpec((), "int64"),
            "iteration": FieldSpec((), "int64"), "reward": FieldSpec((), "float32"),
            "correctness": FieldSpec((), "float32"), "length_limited": FieldSpec((), "bool"),
            "done": FieldSpec((), "bool")}


def episode_rows(episodes: list[dict[str, Any]], scores: np.ndarray, first: int,
                 iteration: int) -> dict[str, Any]:
    """Buffer rows of episodes (3 utterances each, episode ids from ``first``); ``scores``
    float32[E, 2] (turn 1, turn 2); the reward is turn 2's score, at the last utterance."""
    empty = np.zeros(0, np.int32)
    rows: dict[str, list[Any]] = {k: [] for k in buffer_fields()}
    for e, ep in enumerate(episodes):
        for k in range(3):
            rows["observation_ids"].append(ep["observations"][k])
            rows["action_ids"].append(ep["actions"][k])
            rows["next_observation_ids"].append(ep["observations"][k + 1] if k < 2 else empty)
            rows["turn"].append(k)
            rows["episode"].append(first + e)
            rows["iteration"].append(iteration)
            rows["reward"].append(scores[e, 1] if k == 2 else 0.0)
            rows["correctness"].append(scores[e, k // 2] if k != 1 else np.nan)
            rows["length_limited"].append(ep["truncated"][k])
            rows["done"].append(k == 2)
    return {k: v if k.endswith("_ids") else np.asarray(v, dtype=buffer_fields()[k].dtype)
            for k, v in rows.items()}
