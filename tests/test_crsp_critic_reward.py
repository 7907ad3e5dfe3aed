"""The critic's class-balanced verdict reward (trainers/crsp/rewards.py) against a naive
confusion-matrix computation: a verdict that ignores the attempt (always the majority class,
or a coin) earns 0 in expectation on an imbalanced batch, a critic that judges earns more, and
its group advantages no longer push a non-judging critic towards the majority verdict (the
collapse seen in the issue-36 run)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbuffers.memory import RunningMeanStd
from trainers.crsp import rewards as R


def naive_balanced_accuracy(says, labels):
    """(TPR + TNR) / 2 from the confusion matrix, one attempt at a time."""
    tp = fn = tn = fp = 0
    for s, y in zip(says, labels, strict=True):
        if y:
            tp, fn = tp + bool(s), fn + (not s)
        else:
            tn, fp = tn + (not s), fp + bool(s)
    return (tp / (tp + fn) + tn / (tn + fp)) / 2


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.booleans(), min_size=3, max_size=3)),
                min_size=2, max_size=20))
def test_batch_mean_is_youdens_j_of_a_naive_confusion_matrix(rows):
    truth = np.array([y for y, _ in rows])
    if truth.all() or not truth.any():
        truth[0] = not truth[0]  # both classes present
    verdicts = np.array([v for _, v in rows])
    reward = R.balanced_verdict_reward(verdicts, truth, float(truth.mean()))
    flat_truth = np.repeat(truth, 3)
    want = 2 * naive_balanced_accuracy(verdicts.reshape(-1), flat_truth) - 1
    assert reward.mean() == pytest.approx(want, abs=1e-6)
    assert R.balanced_accuracy(verdicts.reshape(-1), flat_truth) == pytest.approx(
        naive_balanced_accuracy(verdicts.reshape(-1), flat_truth))


def test_constant_verdict_earns_nothing_on_an_imbalanced_batch_and_judging_earns_more():
    truth = np.array([True] + [False] * 7)  # the solver right on 1 of 8 attempts
    rate = float(truth.mean())
    always_incorrect = np.zeros((8, 4), bool)
    always_correct = np.ones((8, 4), bool)
    mostly_right = np.tile(truth[:, None], (1, 4))
    mostly_right[:, 0] = ~mostly_right[:, 0]  # 3 of 4 verdicts right on every attempt
    perfect = np.tile(truth[:, None], (1, 4))
    mean = {name: float(R.balanced_verdict_reward(v, truth, rate).mean()) for name, v in
            [("incorrect", always_incorrect), ("correct", always_correct),
             ("mostly_right", mostly_right), ("perfect", perfect)]}
    assert mean["incorrect"] == pytest.approx(0.0, abs=1e-6)
    assert mean["correct"] == pytest.approx(0.0, abs=1e-6)
    assert mean["mostly_right"] == pytest.approx(0.5)
    assert mean["perfect"] == pytest.approx(1.0)
    # The old reward (plain agreement) ranked the constant majority verdict above a critic
    # that judges every attempt 3 times in 4 correctly: the collapse's incentive.
    assert (always_incorrect == truth[:, None]).mean() == 0.875 > \
        (mostly_right == truth[:, None]).mean() == 0.75


@pytest.mark.parametrize("rate", [0.05, 0.3, 0.5, 0.9])
@pytest.mark.parametrize("p_correct", [0.0, 0.2, 0.5, 1.0])
def test_expected_reward_of_a_verdict_that_ignores_the_attempt_is_zero(rate, p_correct):
    """Exact expectation over the four cells (truth ~ rate, verdict ~ p_correct, independent)."""
    expected = 0.0
    for y, v in itertools.product([True, False], repeat=2):
        p = (rate if y else 1 - rate) * (p_correct if v else 1 - p_correct)
        expected += p * float(R.balanced_verdict_reward(np.array([[v]]), np.array([y]), rate)[0])
    assert expected == pytest.approx(0.0, abs=1e-6)  # float32 rewards


def bias_gradient(advantage, verdicts, p=0.5):
    """d/db of sum_k A_k log pi(v_k) for a Bernoulli verdict with logit b (p = sigmoid(b)):
    the push of a policy-gradient step towards saying correct (< 0: towards incorrect)."""
    return float((advantage * (verdicts.reshape(-1) - p)).sum())


def test_group_advantages_keep_the_class_weights_and_do_not_push_to_the_majority():
    truth = np.array([True] + [False] * 7)
    verdicts = np.tile([True, True, False, False], (8, 1))  # a critic that does not judge
    old_reward = (verdicts == truth[:, None]).astype(np.float32).reshape(-1)
    old, _ = R.advantages({"critic": RunningMeanStd()}, "critic", old_reward, 4, "group")
    assert bias_gradient(old, verdicts) < -5  # every "incorrect" group outweighs the one other
    new_reward = R.balanced_verdict_reward(verdicts, truth, float(truth.mean()))
    stats = {"critic": RunningMeanStd()}
    new, flat = R.advantages(stats, "critic", new_reward, 4, "running")
    assert bias_gradient(new, verdicts) == pytest.approx(0.0, abs=1e-5)
    np.testing.assert_allclose(new.reshape(8, 4).sum(1), 0.0, atol=1e-6)  # centred per group
    assert flat == 0.0
    # Naive reference: group-centred rewards over the running std (the rewards seen so far).
    r = new_reward.reshape(8, 4).astype(np.float64)
    want = (r - r.mean(1, keepdims=True)) / new_reward.astype(np.float64).std()
    np.testing.assert_allclose(new, want.reshape(-1), rtol=1e-5)
    # A per-group std would cancel the class weight (every group holds one class).
    per_group, _ = R.advantages({"critic": RunningMeanStd()}, "critic", new_reward, 4, "group")
    assert bias_gradient(per_group, verdicts) < -5


def test_class_rate_is_add_one_smoothed_over_every_judged_attempt():
    truth = RunningMeanStd()
    assert R.class_rate(truth) == 0.5
    truth.update(np.zeros(5))  # a first step with no correct attempt: still in (0, 1)
    assert R.class_rate(truth) == pytest.approx(1 / 7)
    truth.update(np.array([1.0, 1.0, 0.0, 0.0, 0.0]))
    assert R.class_rate(truth) == pytest.approx(3 / 12)


@pytest.mark.parametrize("rate", [0.0, 1.0, -0.1])
def test_a_rate_outside_zero_one_is_refused(rate):
    with pytest.raises(ValueError, match=r"rate: expected a class frequency in \(0, 1\)"):
        R.balanced_verdict_reward(np.ones((1, 2), bool), np.ones(1, bool), rate)


def test_scale_is_checked():
    with pytest.raises(ValueError, match="scale: expected 'group' or 'running', got 'batch'"):
        R.advantages({"critic": RunningMeanStd()}, "critic", np.zeros(4, np.float32), 4,
                     "batch")


def test_rolling_balanced_accuracy_over_steps_equals_the_pooled_verdicts():
    rng = np.random.default_rng(3)
    rows, pooled = [], []
    for step in range(12):  # most steps judge attempts of one class only
        labels = rng.random(6) < (0.4 if step % 8 == 0 else 0.0)
        says = rng.random(6) < 0.5
        pooled.append((says, labels))
        rows.append({"step": step + 1, **R.confusion(says, labels)})
    got = R.rolling_balanced_accuracy(rows, 4)
    defined = 0
    for i, value in enumerate(got):
        says = np.concatenate([s for s, _ in pooled[max(0, i - 3):i + 1]])
        labels = np.concatenate([y for _, y in pooled[max(0, i - 3):i + 1]])
        if labels.any() and not labels.all():
            defined += 1
            assert value == pytest.approx(naive_balanced_accuracy(says, labels))
        else:
            assert value is None
    assert 0 < defined < len(rows)
    # Rows without counts (an older run's) get None and count for nothing.
    assert R.rolling_balanced_accuracy([{"step": 1}, *rows[:1]], 4) == [None, got[0]]


def test_step_class_rate_is_add_one_smoothed_over_the_step():
    assert R.step_class_rate(np.zeros(0, bool)) == 0.5
    assert R.step_class_rate(np.array([True, False, False])) == pytest.approx(2 / 5)
    with pytest.raises(ValueError, match=r"truth: expected bool\[M\], got shape \(2, 2\)"):
        R.step_class_rate(np.zeros((2, 2), bool))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.booleans(), min_size=2, max_size=64).filter(lambda t: 0 < sum(t) < len(t)))
def test_step_weights_balance_the_two_classes_of_the_step(labels):
    """With the step's own rate, the summed verdict weights of the correct and the incorrect
    attempts agree up to the add-one smoothing (exactly: their ratio is
    ``(k/(k+1)) / ((M-k)/(M-k+1))``, within [1/2, 2]), whatever earlier steps judged."""
    truth = np.array(labels, bool)
    m, k = len(truth), int(truth.sum())
    rate = R.step_class_rate(truth)
    reward = R.balanced_verdict_reward(truth[:, None], truth, rate)  # every verdict right
    pos, neg = reward[truth].sum(), reward[~truth].sum()
    np.testing.assert_allclose(pos / neg, (k / (k + 1)) / ((m - k) / (m - k + 1)), rtol=1e-5)
    assert 0.5 <= pos / neg <= 2.0  # unweighted it would be k / (M - k), e.g. 1/63


def naive_window_rate(steps: list[np.ndarray], window: float) -> float:
    """The windowed rate from its definition: an attempt judged ``n`` attempts ago (later
    steps' attempts counted, its own step's not) weighs ``(1 - 1/window) ** n``."""
    judged = correct = 0.0
    for i, truth in enumerate(steps):
        later = sum(len(t) for t in steps[i + 1:])
        weight = (1.0 - 1.0 / window) ** later
        judged += weight * len(truth)
        correct += weight * truth.sum()
    return (correct + 1.0) / (judged + 2.0)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.booleans(), max_size=40), min_size=1, max_size=30),
       st.floats(1.0, 1000.0), st.integers(0, 29))
def test_class_window_equals_its_definition_and_resumes_exactly(steps, window, cut):
    steps = [np.array(s, bool) for s in steps]
    w = R.ClassWindow(window)
    resumed = None
    for i, truth in enumerate(steps):
        if i == cut:  # a checkpoint here: a fresh window loaded from its state_dict
            resumed = R.ClassWindow(window)
            resumed.load_state_dict(w.state_dict())
            w = resumed
        w.update(truth)
        assert w.rate == pytest.approx(naive_window_rate(steps[:i + 1], window), rel=1e-9)
        assert 0.0 < w.rate < 1.0


def test_window_weights_balance_a_run_of_one_class_steps_where_step_weights_do_not():
    """The issue-36 failure: most steps judge incorrect attempts only, a few hold both. Over
    the run (6% correct), the summed verdict weights of the two classes (every verdict right)
    are within 3/2 of each other with the window's rate (0.76: the rate counts the step's
    own attempts, so a burst of correct ones lowers its own weight); with the step's own
    rate the incorrect class weighs 4.4x the correct one."""
    rng = np.random.default_rng(0)
    steps = [rng.random(32) < (0.25 if s % 4 == 0 else 0.0) for s in range(60)]
    totals = {}
    for mode in ("window", "step"):
        w, pos, neg = R.ClassWindow(256.0), 0.0, 0.0
        for truth in steps:
            w.update(truth)
            rate = w.rate if mode == "window" else R.step_class_rate(truth)
            reward = R.balanced_verdict_reward(truth[:, None], truth, rate)
            pos, neg = pos + reward[truth].sum(), neg + reward[~truth].sum()
        totals[mode] = pos / neg
    assert 2 / 3 <= totals["window"] <= 3 / 2, totals
    assert totals["step"] < 0.25, totals


def test_class_window_refuses_bad_input():
    with pytest.raises(ValueError, match="window: expected >= 1 judged attempts, got 0.5"):
        R.ClassWindow(0.5)
    with pytest.raises(ValueError, match=r"truth: expected bool\[M\], got shape \(2, 2\)"):
        R.ClassWindow().update(np.zeros((2, 2), bool))
