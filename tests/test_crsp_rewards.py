"""CRSP rewards (trainers/crsp/rewards.py) against naive references: parsing, solvability band,
mini-batched length reward, cached alpha decay, the bounded MinHash novelty sketch against exact
Jaccard similarity, and running normalisation against the whole history."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.heavy import require

require("datasketch")

from rlbuffers.memory import RunningMeanStd  # noqa: E402
from trainers.crsp import rewards as R  # noqa: E402


@pytest.mark.parametrize("text, want", [
    ("<problem>Tom has 3 apples. How many?</problem> <answer>3</answer>",
     ("Tom has 3 apples. How many?", "3")),
    ("<problem>a</problem><answer>x</answer><problem>b</problem><answer>1,200</answer>",
     ("b", "1200")),
    ("<problem>  </problem><answer>3</answer>", None),
    ("<problem>q</problem> no answer", None),
    ("<answer>4</answer>", None),
])
def test_parse_proposal(text, want):
    assert R.parse_proposal(text) == want


@pytest.mark.parametrize("text, want", [
    ("looks right <verdict>correct</verdict>", True),
    ("<verdict>correct</verdict> then <verdict> Incorrect </verdict>", False),
    ("no tag", None),
])
def test_parse_verdict(text, want):
    assert R.parse_verdict(text) is want


def test_solvability_band():
    np.testing.assert_array_equal(R.solvability(np.array([0.0, 0.25, 1.0, 0.5])),
                                  [0, 1, 0, 1])


@settings(max_examples=50, deadline=None)
@given(lengths=st.lists(st.integers(0, 500), max_size=60), target=st.integers(1, 300),
       mini=st.integers(1, 7))
def test_length_reward_in_mini_batches_equals_the_whole_batch(lengths, target, mini):
    want = np.clip(-np.abs(np.array(lengths, float) - target) / target, -1, 0)
    np.testing.assert_allclose(R.length_reward(lengths, target, mini), want, rtol=1e-6)


def test_alpha_schedule_is_cached_and_decays():
    a = R.alpha_schedule(0.5, 0.9)
    assert a(0) == 0.5 and a(3) == pytest.approx(0.5 * 0.9**3)
    a(3)
    assert a.cache_info().hits == 1
    with pytest.raises(ValueError, match=r"decay: expected in \(0, 1\], got 1.5"):
        R.alpha_schedule(0.5, 1.5)


def exact_jaccard(a, b):
    def sh(t):
        w = t.lower().split()
        return {" ".join(w[i:i + 3]) for i in range(max(1, len(w) - 2))}
    x, y = sh(a), sh(b)
    return len(x & y) / len(x | y)


def test_novelty_estimates_jaccard_and_stays_bounded():
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(200)]
    texts = [" ".join(rng.choice(words, 30)) for _ in range(40)]
    sketch = R.NoveltySketch(capacity=16, num_perm=256)
    assert sketch.novelty(["anything"]).tolist() == [1.0]
    sketch.add(texts[:10])
    near = texts[3].split()
    near[-3:] = ["x1", "x2", "x3"]
    query = [" ".join(near), texts[20]]
    want = [1 - max(exact_jaccard(q, t) for t in texts[:10]) for q in query]
    np.testing.assert_allclose(sketch.novelty(query), want, atol=0.1)  # MinHash error ~1/16
    assert sketch.novelty([texts[3]])[0] == 0.0
    sketch.add(texts[10:40])  # the ring keeps the newest 16: texts 24..39
    assert sketch.signatures.nbytes == 16 * 256 * 4
    assert sketch.novelty([texts[3]])[0] > 0.5 and sketch.novelty([texts[39]])[0] == 0.0
    again = R.NoveltySketch()
    again.load_state_dict(sketch.state_dict())
    np.testing.assert_array_equal(again.signatures, sketch.signatures)
    assert again.count == 40


def test_running_normalisation_equals_the_whole_history():
    rng = np.random.default_rng(1)
    stats = {"solver": RunningMeanStd()}
    seen = []
    for _ in range(5):
        r = rng.normal(2, 3, 17)
        seen.append(r)
        adv = R.normalise(stats, "solver", r)
        allr = np.concatenate(seen)
        np.testing.assert_allclose(adv, (r - allr.mean()) / np.sqrt(allr.var() + 1e-8),
                                   rtol=1e-6)


def test_novelty_is_measured_against_the_seed_example_too():
    sketch = R.NoveltySketch(8, 64)
    seed = "Tom has 3 apples and buys 4 more. How many apples does he have?"
    assert sketch.novelty([seed])[0] == 1.0  # an empty sketch: nothing to compare with
    assert sketch.novelty([seed], [seed])[0] == 0.0  # the example copied
    other = "A train leaves at noon at 60 miles per hour. How far has it gone by three?"
    assert sketch.novelty([other], [seed])[0] > 0.8


@pytest.mark.parametrize("role, text, ended, want", [
    ("proposer", "Ann has 2. How many?</problem><answer>2</answer>", True, 1.0),
    ("proposer", "Ann has 2. How many?</problem><answer>two</answer>", True, 2 / 3),
    ("proposer", "Ann has 2. How many?</problem>", False, 1 / 3),
    ("proposer", "no closing tag <answer>2</answer>", True, 0.0),
    ("solver", "2 + 2 = 4 <answer>4</answer>", True, 1.0),
    ("solver", "<answer>four</answer>", True, 0.5),
    ("solver", "it is 4", True, 0.0),
    ("critic", "correct</verdict> fine", True, 1.0),
    ("critic", "correct</verdict> and on and on", False, 0.0),
    ("critic", "incorrect</verdict>", True, 0.0),  # EOS right after the verdict: no reason
    ("critic", "incorrect</verdict> .", True, 0.0),  # punctuation is not a reason
    ("critic", "incorrect</verdict> 6 + 3 is 9, not 8.", True, 1.0),
])
def test_format_score_gives_partial_credit(role, text, ended, want):
    from trainers.crsp.formats import format_score

    assert format_score(role, text, ended) == pytest.approx(want)
