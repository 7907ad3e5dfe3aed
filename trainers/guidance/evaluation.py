"""The guidance trainer's own part of the held-out evaluation: the hint's effect. The
held-out problems, the scoring and each turn's accuracy with its Wilson interval are the LLM
trainers' shared ones (``trainers/llm/evaluation.py``: problems disjoint from training by
content, a wrong number scores 0); here the two turns of greedy episodes (one hint each) are
scored per question with ``score_completions``, and the hint's effect is their paired
difference (turn-2 minus turn-1 accuracy on the same problems) with Newcombe's interval, plus
the counts of answers turn 2 fixes and breaks."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from trainers.llm.evaluation import CorrectFn, Key, accuracy, score_completions
from trainers.llm.tasks import wilson


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
    """The paired measures of greedy episodes' per-question correctness ``right`` (bool[n, 2]:
    turn 1, turn 2): the hint's effect (``turn2_minus_turn1`` with Newcombe's ``ci95``),
    ``fixes``, ``breaks`` and their shares of n (``hint_uptake``, ``turn2_breaks``)."""
    right = np.asarray(right, bool)
    n = len(right)
    diff, lo, hi = paired_difference(right[:, 0], right[:, 1])
    fixes = int((~right[:, 0] & right[:, 1]).sum())
    breaks = int((right[:, 0] & ~right[:, 1]).sum())
    return {"hint_effect": {"turn2_minus_turn1": diff, "ci95": [lo, hi]},
            "fixes": fixes, "breaks": breaks,
            "hint_uptake": fixes / n, "turn2_breaks": breaks / n}


def evaluate(play_greedy: Callable[[list[str]], dict[str, Any]],
             problems: list[dict[str, Any]], correct_fn: CorrectFn, *,
             train_keys: set[Key] | None = None) -> dict[str, Any]:
    """Greedy two-turn episodes with one hint (``play_greedy(questions)``: ``rollout.play``'s
    output, utterances turn 1, hint, turn 2) on held-out ``problems`` (dicts, from
    ``trainers.llm.evaluation.held_out``). Each turn is scored per question by the shared
    ``score_completions`` with ``correct_fn`` (1.0 right, else 0.0) and summarised by the
    shared ``accuracy`` (``turn1``, ``turn2``: accuracy, n, Wilson ``ci95``, ``overlap`` with
    ``train_keys``, answered, formatted, completion_tokens_mean); the paired measures
    (:func:`summarise`) are computed on the same per-question results.

    Raises:
        ValueError: ``problems`` is empty."""
    if not problems:
        raise ValueError("problems: expected at least one problem, got 0")
    ep = play_greedy([p["question"] for p in problems])
    out: dict[str, Any] = {}
    right = []
    for name, u in (("turn1", 0), ("turn2", 2)):
        scored = score_completions([t[u] for t in ep["texts"]], problems, correct_fn)
        out[name] = accuracy(scored, problems, train_keys=train_keys,
                             completion_tokens=[len(a[u]) for a in ep["actions"]])
        right.append(scored["correct"] == 1.0)
    return {**out, **summarise(np.stack(right, axis=1))}
