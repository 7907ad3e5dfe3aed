"""The held-out evaluation of the guidance trainer: problems disjoint from the training ones
by content, greedy two-turn episodes (one hint each), turn-1 and turn-2 accuracy with 95%
Wilson intervals, and the hint's effect (turn-2 minus turn-1 accuracy, a paired difference)
with Newcombe's interval, plus the counts of answers turn 2 fixes and breaks."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from trainers.llm.tasks import task_problems, wilson


def normalise(question: str) -> str:
    """A question's text for comparison: lower case, runs of whitespace as one space,
    stripped."""
    return re.sub(r"\s+", " ", question).strip().lower()


def held_out(task: str, n: int, seed: int, config: str, train: Any) -> tuple[Any, list[int],
                                                                              dict[str, int]]:
    """``n`` problems of ``task`` from ``seed`` whose normalised question is no training
    problem's (``train``: the training dataset): candidates are drawn from 4n problems of that
    seed (duplicates dropped too). Returns the candidate dataset, the indices kept and the
    counts ``{"n", "overlap" (kept ones found in training: 0), "dropped" (candidates seen in
    training)}``.

    Raises:
        ValueError: fewer than ``n`` candidates differ from the training problems (the task's
            problem space is too small for ``--eval-size``)."""
    seen = {normalise(train[i]["question"]) for i in range(len(train))}
    pool = task_problems(task, 4 * n, seed, config)
    keep, dropped, kept = [], 0, set()
    for i in range(len(pool)):
        q = normalise(pool[i]["question"])
        if q in seen:
            dropped += 1
        elif q not in kept and len(keep) < n:
            keep.append(i)
            kept.add(q)
    if len(keep) < n:
        raise ValueError(f"--eval-size: expected {n} held-out problems of {task} that are not "
                         f"training problems, got {len(keep)} of {len(pool)} candidates")
    overlap = sum(normalise(pool[i]["question"]) in seen for i in keep)
    return pool, keep, {"n": len(keep), "overlap": overlap, "dropped": dropped}


def paired_difference(first: np.ndarray, second: np.ndarray, z: float = 1.96
                      ) -> tuple[float, float, float]:
    """The difference of two paired proportions ``mean(second) - mean(first)`` (bool[n]
    each, the same items) and its 95% interval by Newcombe's hybrid score method (Newcombe
    1998, "Improved confidence intervals for the difference between binomial proportions based
    on paired data", Statistics in Medicine 17, method 10: the two Wilson intervals combined
    with the phi correlation of the pairs).

    Raises:
        ValueError: empty or unequal lengths."""
    first, second = np.asarray(first, bool), np.asarray(second, bool)
    n = len(first)
    if n == 0 or len(second) != n:
        raise ValueError(f"first, second: expected two equal non-empty lengths, got {n} and "
                         f"{len(second)}")
    a = float((first & second).sum())
    b = float((first & ~second).sum())  # right, then wrong (broken)
    c = float((~first & second).sum())  # wrong, then right (fixed)
    d = n - a - b - c
    p1, p2 = (a + b) / n, (a + c) / n
    l1, u1 = wilson(a + b, n, z)
    l2, u2 = wilson(a + c, n, z)
    den = (a + b) * (c + d) * (a + c) * (b + d)
    phi = (a * d - b * c) / math.sqrt(den) if den > 0 else 0.0
    diff = p2 - p1
    lo = diff - math.sqrt(max(0.0, (p2 - l2) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1)
                              + (u1 - p1) ** 2))
    hi = diff + math.sqrt(max(0.0, (u2 - p2) ** 2 - 2 * phi * (u2 - p2) * (p1 - l1)
                              + (p1 - l1) ** 2))
    return diff, max(-1.0, lo), min(1.0, hi)


def summarise(right: np.ndarray) -> dict[str, Any]:
    """Turn-1 and turn-2 accuracy with Wilson intervals, the hint's effect with Newcombe's
    interval, fixes, breaks, and the shares of them (``hint_uptake``, ``turn2_breaks``) of
    greedy episodes' correctness ``right`` (bool[n, 2]: turn 1, turn 2)."""
    n, out = len(right), {}
    for name, hits in (("turn1", right[:, 0]), ("turn2", right[:, 1])):
        out[name] = {"accuracy": float(hits.mean()), "n": n,
                     "ci95": list(wilson(float(hits.sum()), n))}
    diff, lo, hi = paired_difference(right[:, 0], right[:, 1])
    fixes, breaks = int((~right[:, 0] & right[:, 1]).sum()), int((right[:, 0] &
                                                                  ~right[:, 1]).sum())
    out["hint_effect"] = {"turn2_minus_turn1": diff, "ci95": [lo, hi]}
    out["fixes"], out["breaks"] = fixes, breaks
    out["hint_uptake"], out["turn2_breaks"] = fixes / n, breaks / n
    return out


def evaluate(play_greedy: Callable[[list[str]], dict[str, Any]], problems: Any,
             indices: list[int], score: Callable[[Any, int, str], float]) -> dict[str, Any]:
    """Greedy two-turn episodes with one hint (``play_greedy(questions)``, ``play``'s
    output) on ``problems[indices]``, scored by ``score(problems, index, text)``;
    :func:`summarise` of them."""
    ep = play_greedy([problems[i]["question"] for i in indices])
    right = np.array([[score(problems, i, texts[k]) == 1.0 for k in (0, 2)]
                      for i, texts in zip(indices, ep["texts"], strict=True)], bool)
    return summarise(right.reshape(len(indices), 2))
