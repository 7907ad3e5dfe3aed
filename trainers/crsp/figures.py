"""The critic's and the proposer's held-out figures, from verdicts, margins and labels: a
proportion with its Wilson interval, the balanced accuracy of a verdict with its MOVER
interval (the reported critic figure, issue 49), the margin's AUC, the calibrated threshold
(Youden's J) and the class-balanced set (used by ``trainers.crsp.evaluate``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from trainers.crsp.rewards import balanced_accuracy
from trainers.statistics import wilson


def proportion(k: float, n: int) -> dict[str, Any]:
    """``k`` of ``n`` with its 95% Wilson interval (plain data)."""
    lo, hi = wilson(k, n) if n else (0.0, 0.0)
    return {"k": k, "n": n, "rate": k / n if n else 0.0, "wilson95": [lo, hi]}


def auc(scores: np.ndarray, labels: np.ndarray) -> dict[str, Any]:
    """Area under the ROC curve of ``scores`` (float[n], higher: more likely correct) against
    ``labels`` (bool[n], both classes present): the probability that a correct attempt scores
    above an incorrect one, ties counted half (the Mann-Whitney U / (n1 n0)), with the 95%
    interval of Hanley & McNeil 1982 ("The meaning and use of the area under a ROC curve",
    Radiology 143, eq. 1-3). Threshold-free: 0.5 for a critic that does not look at the
    attempt, whatever verdict it prefers."""
    s, y = np.asarray(scores, np.float64), np.asarray(labels, bool)
    pos, neg = s[y], s[~y]
    diff = pos[:, None] - neg[None, :]
    a = float(((diff > 0) + 0.5 * (diff == 0)).mean())
    n1, n0 = len(pos), len(neg)
    q1, q2 = a / (2 - a), 2 * a * a / (1 + a)
    se = np.sqrt((a * (1 - a) + (n1 - 1) * (q1 - a * a) + (n0 - 1) * (q2 - a * a)) / (n1 * n0))
    return {"auc": a, "ci95": [max(0.0, a - 1.96 * se), min(1.0, a + 1.96 * se)],
            "n_correct": n1, "n_incorrect": n0}


def balanced_accuracy_ci(says: np.ndarray, labels: np.ndarray) -> dict[str, Any] | None:
    """Balanced accuracy ``BA = (TPR + TNR) / 2`` of verdicts ``says`` against ``labels``
    (bool[n] each, True: correct) with its 95% interval: each recall's Wilson interval
    combined by MOVER (method of variance estimates recovery: Zou & Donner 2008,
    "Construction of confidence limits about effect measures: a general approach", Stat.
    Med. 27; the square-and-add of Newcombe 1998, method 10, for a sum instead of a
    difference): ``BA - sqrt((TPR - l1)^2 + (TNR - l0)^2) / 2``, ``BA + sqrt((u1 - TPR)^2 +
    (u0 - TNR)^2) / 2``. It treats the two recalls as independent: exact on attempts of
    distinct problems (one attempt per problem); on the balanced set, where a problem gives
    one attempt of each class, the recalls may correlate. None when a class is missing."""
    y, v = np.asarray(labels, bool), np.asarray(says, bool)
    n1, n0 = int(y.sum()), int((~y).sum())
    if not n1 or not n0:
        return None
    tp, tn = int((v & y).sum()), int((~v & ~y).sum())
    (l1, u1), (l0, u0) = wilson(tp, n1), wilson(tn, n0)
    tpr, tnr = tp / n1, tn / n0
    ba = (tpr + tnr) / 2
    lo = ba - 0.5 * float(np.hypot(tpr - l1, tnr - l0))
    hi = ba + 0.5 * float(np.hypot(u1 - tpr, u0 - tnr))
    return {"value": ba, "ci95": [max(0.0, lo), min(1.0, hi)], "n": n1 + n0,
            "tpr": proportion(tp, n1), "tnr": proportion(tn, n0),
            "says_correct": float(v.mean()), "interval": "MOVER of Wilson recalls"}


def critic_figures(says: np.ndarray, labels: np.ndarray, margin: np.ndarray | None = None
                   ) -> dict[str, Any]:
    """Verdict accuracy, the majority-class rate and balanced accuracy of ``says`` against
    ``labels`` (bool[n] each; True: correct), and with ``margin`` (float[n], the verdict
    log-prob margin ``L_correct - L_incorrect``) its :func:`auc`."""
    n, k = len(labels), int(labels.sum())
    both = 0 < k < n
    return {"accuracy": proportion(int((says == labels).sum()), n),
            "majority_rate": proportion(max(k, n - k), n),
            "balanced_accuracy": balanced_accuracy(says, labels) if both else None,
            "says_correct": float(says.mean()) if n else 0.0,
            "attempts_correct": proportion(k, n),
            **({"auc": auc(margin, labels)} if margin is not None and both else {})}


def youden_threshold(margin: np.ndarray, labels: np.ndarray) -> dict[str, Any]:
    """The verdict threshold ``tau`` that maximises balanced accuracy (equivalently Youden's
    ``J = TPR + TNR - 1``: Youden 1950, "Index for rating diagnostic tests") of ``margin >
    tau`` against ``labels`` (float[n], bool[n]): over every distinct cut of the sorted
    margins, ``tau`` the midpoint between the two margins it falls between (below the
    smallest: everything "correct"; at the largest: everything "incorrect"); the lowest such
    ``tau`` on ties. Returns ``{"tau", "balanced_accuracy", "n"}``; ``tau`` 0.0 and
    ``balanced_accuracy`` None when a class is missing.

    Raises:
        ValueError: ``margin`` and ``labels`` of different lengths.
    """
    m, y = np.asarray(margin, np.float64), np.asarray(labels, bool)
    if m.shape != y.shape or m.ndim != 1:
        raise ValueError(f"margin / labels: expected float[n] and bool[n], got {m.shape} and "
                         f"{y.shape}")
    n1 = int(y.sum())
    n0 = len(y) - n1
    if not n1 or not n0:
        return {"tau": 0.0, "balanced_accuracy": None, "n": len(y)}
    order = np.argsort(m, kind="stable")
    ms, ys = m[order], y[order]
    # Cut after the first i sorted margins (i = 0..n): those say "incorrect", the rest
    # "correct"; only cuts between distinct margins are realisable by a threshold.
    below_neg = np.concatenate([[0], np.cumsum(~ys)])  # true negatives
    below_pos = np.concatenate([[0], np.cumsum(ys)])  # false negatives
    ba = 0.5 * ((n1 - below_pos) / n1 + below_neg / n0)
    ok = np.ones(len(ms) + 1, bool)
    ok[1:-1] = ms[1:] > ms[:-1]
    i = int(np.flatnonzero(ok)[np.argmax(ba[ok])])
    tau = (ms[0] - 1.0 if i == 0 else ms[-1] if i == len(ms)
           else 0.5 * (ms[i - 1] + ms[i]))
    return {"tau": float(tau), "balanced_accuracy": float(ba[i]), "n": len(y)}


def balanced_set(labels: np.ndarray) -> np.ndarray:
    """Indices ``(problem, attempt)`` (int[2m, 2]) of a class-balanced set from ``labels``
    (bool[P, K]: attempt k of problem p was correct): each problem's first correct and first
    incorrect attempt, then the first ``m`` of each class by problem order, ``m`` the smaller
    class's count."""
    firsts: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
    for p, row in enumerate(labels):
        for y in (True, False):
            hit = np.flatnonzero(row == y)
            if len(hit):
                firsts[y].append((p, int(hit[0])))
    m = min(len(firsts[True]), len(firsts[False]))
    return np.array(firsts[True][:m] + firsts[False][:m], np.int64).reshape(-1, 2)
