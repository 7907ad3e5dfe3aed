"""The critic's reported figure (issue 49): the balanced accuracy of its own verdict with a
95% interval (each recall's Wilson interval combined by MOVER), checked against the formula
written out and against the coverage of the true value on simulated critics."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.heavy import require

require("reasoning_gym", "transformers", "peft", "tokenizers", "datasketch")

from trainers.crsp.evaluate import balanced_accuracy_ci  # noqa: E402
from trainers.statistics import wilson  # noqa: E402


def naive(tp, fn, tn, fp):
    """MOVER for (p1 + p0) / 2 written out from Zou & Donner 2008, Eq. (6)-(7)."""
    p1, p0 = tp / (tp + fn), tn / (tn + fp)
    l1, u1 = wilson(tp, tp + fn)
    l0, u0 = wilson(tn, tn + fp)
    lo = (p1 + p0 - math.sqrt((p1 - l1) ** 2 + (p0 - l0) ** 2)) / 2
    hi = (p1 + p0 + math.sqrt((u1 - p1) ** 2 + (u0 - p0) ** 2)) / 2
    return (p1 + p0) / 2, lo, hi


@given(st.integers(0, 30), st.integers(0, 30), st.integers(0, 30), st.integers(0, 30))
def test_interval_equals_the_formula(tp, fn, tn, fp):
    says = np.array([True] * tp + [False] * fn + [False] * tn + [True] * fp)
    labels = np.array([True] * (tp + fn) + [False] * (tn + fp))
    got = balanced_accuracy_ci(says, labels)
    if tp + fn == 0 or tn + fp == 0:
        assert got is None
        return
    ba, lo, hi = naive(tp, fn, tn, fp)
    assert got["value"] == pytest.approx(ba)
    assert got["ci95"] == pytest.approx([max(0.0, lo), min(1.0, hi)])
    assert got["ci95"][0] <= got["value"] <= got["ci95"][1]
    assert got["tpr"]["k"] == tp and got["tnr"]["k"] == tn and got["n"] == len(labels)


def test_a_constant_verdict_is_at_one_half_and_its_interval_holds_it():
    labels = np.array([True] * 30 + [False] * 170)
    got = balanced_accuracy_ci(np.zeros(200, bool), labels)  # always "incorrect"
    assert got["value"] == 0.5 and got["ci95"][0] < 0.5 < got["ci95"][1]
    assert got["says_correct"] == 0.0


def test_coverage_on_simulated_critics_is_near_95_percent():
    rng = np.random.default_rng(0)
    tpr, tnr, n1, n0, hits = 0.7, 0.6, 60, 140, 0
    for _ in range(2000):
        labels = np.array([True] * n1 + [False] * n0)
        says = np.where(labels, rng.random(n1 + n0) < tpr, rng.random(n1 + n0) >= tnr)
        lo, hi = balanced_accuracy_ci(says, labels)["ci95"]
        hits += lo <= (tpr + tnr) / 2 <= hi
    assert 0.93 <= hits / 2000 <= 0.975
