"""The guidance trainer's own part of the held-out evaluation: the hint's effect. The
held-out problems, the scoring and each turn's accuracy with its Wilson interval are the LLM
trainers' shared ones (``trainers/llm/evaluation.py``: problems disjoint from training by
content, a wrong number scores 0); here the two turns of greedy episodes (one hint each) are
scored per question with ``score_completions``, and the hint's effect is their paired
difference (turn-2 minus turn-1 accuracy on the same problems) with Newcombe's interval, the
exact McNemar p of the discordant pairs, and the counts of answers turn 2 fixes and breaks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from trainers.llm.evaluation import CorrectFn, Key, accuracy, score_completions
from trainers.statistics import mcnemar_exact, newcombe_paired, paired_counts


def paired_difference(first: np.ndarray, second: np.ndarray, z: float = 1.96
                      ) -> tuple[float, float, float]:
    """The difference of two paired proportions ``mean(second) - mean(first)`` (bool[n]
    each, the same items) and its 95% interval by Newcombe's hybrid score method (Newcombe
    1998, "Improved confidence intervals for the difference between binomial proportions based
    on paired data", Statistics in Medicine 17, method 10;
    :func:`trainers.statistics.newcombe_paired`).

    Raises:
        ValueError: empty or unequal lengths."""
    return newcombe_paired(*paired_counts(first, second), z)


def summarise(right: np.ndarray) -> dict[str, Any]:
    """The paired measures of greedy episodes' per-question correctness ``right`` (bool[n, 2]:
    turn 1, turn 2): the hint's effect (``turn2_minus_turn1`` with Newcombe's ``ci95`` and
    the exact McNemar ``mcnemar_p`` of its discordant pairs), ``fixes``, ``breaks`` and their
    shares of n (``hint_uptake``, ``turn2_breaks``), ``n``."""
    right = np.asarray(right, bool)
    n = len(right)
    diff, lo, hi = paired_difference(right[:, 0], right[:, 1])
    fixes = int((~right[:, 0] & right[:, 1]).sum())
    breaks = int((right[:, 0] & ~right[:, 1]).sum())
    return {"hint_effect": {"turn2_minus_turn1": diff, "ci95": [lo, hi],
                            "mcnemar_p": mcnemar_exact(breaks, fixes), "n": n},
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


def flat(result: dict[str, Any], prefix: str = "eval_") -> dict[str, Any]:
    """An evaluation ``result`` (:func:`evaluate`'s) as flat metrics-row numbers:
    ``eval_turn1_accuracy``, ``eval_turn2_accuracy``, ``eval_hint_effect`` with
    ``eval_hint_effect_ci95_lo`` / ``_hi`` (Newcombe), ``eval_mcnemar_p``, ``eval_fixes``,
    ``eval_breaks``, ``eval_n``."""
    effect = result["hint_effect"]
    return {f"{prefix}turn1_accuracy": result["turn1"]["accuracy"],
            f"{prefix}turn2_accuracy": result["turn2"]["accuracy"],
            f"{prefix}hint_effect": effect["turn2_minus_turn1"],
            f"{prefix}hint_effect_ci95_lo": effect["ci95"][0],
            f"{prefix}hint_effect_ci95_hi": effect["ci95"][1],
            f"{prefix}mcnemar_p": effect["mcnemar_p"], f"{prefix}fixes": result["fixes"],
            f"{prefix}breaks": result["breaks"], f"{prefix}n": effect["n"]}
