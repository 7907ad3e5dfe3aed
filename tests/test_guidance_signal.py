"""Issue 34 B, guidance with a real signal: group-relative advantages of the improvement over
K hints per turn-1 answer (equal to a naive computation, zero-sum per group), the guidance
model trained only on wrong turn-1 answers' hints, K hints end to end on the tiny model with a
scripted score, the critic's TD error in the row, the micro-batch plan following the measured
activation bytes, the held-out problems disjoint from training, and the hint effect's paired
interval."""

from __future__ import annotations

import statistics

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.heavy import require

require("reasoning_gym", "transformers", "peft", "tokenizers")

from rlbuffers import ReplayBuffer  # noqa: E402
from tests.test_guidance import args, make_tiny_bert, rows  # noqa: E402
from tests.tiny_lm import make_tiny_lm_dir  # noqa: E402
from trainers.config import parse_config  # noqa: E402
from trainers.guidance import advantages as gadv  # noqa: E402
from trainers.guidance import critic as gcritic  # noqa: E402
from trainers.guidance import evaluation as geval  # noqa: E402
from trainers.guidance import policy as gpolicy  # noqa: E402
from trainers.guidance import train  # noqa: E402
from trainers.guidance.config import Config  # noqa: E402
from trainers.llm.evaluation import content_keys, held_out, training_keys  # noqa: E402
from trainers.llm.tasks import task_problems  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    return make_tiny_lm_dir(d / "lm"), make_tiny_bert(d / "bert")


def naive_group(values: list[float], scale: str) -> list[float]:
    mean = sum(values) / len(values)
    sd = statistics.stdev(values)
    if sd < 1e-6:
        return [0.0] * len(values)
    return [(v - mean) / (sd if scale == "group" else 1.0) for v in values]


# ----- advantages ----------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(e=st.integers(1, 5), k=st.integers(2, 5), scale=st.sampled_from(["group", "none"]),
       data=st.data())
def test_improvement_advantages_sum_to_zero_per_group_and_equal_a_naive_computation(
        e, k, scale, data):
    c1 = np.array(data.draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=e, max_size=e)),
                  np.float32)
    c2 = np.array(data.draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=e * k,
                                     max_size=e * k)), np.float32).reshape(e, k)
    adv, flat = gadv.improvement_advantages(c1, c2, scale)
    assert adv.shape == (e, k) and adv.dtype == np.float32
    np.testing.assert_allclose(adv.sum(1), 0.0, atol=1e-5)
    for i in range(e):
        want = naive_group([float(c2[i, j] - c1[i]) for j in range(k)], scale)
        np.testing.assert_allclose(adv[i], want, rtol=1e-5, atol=1e-6)
    assert flat == pytest.approx(np.mean([len(set(c2[i])) == 1 for i in range(e)]))


def test_role_utterances_train_guidance_only_on_wrong_turn1_answers():
    c1 = np.array([1, 0, 0, 1], np.float32)
    c2 = np.array([[1, 0, 1], [1, 0, 0], [0, 0, 0], [1, 1, 1]], np.float32)
    pick, group, a_hint, flat = gadv.role_utterances(c1, c2, "group")
    assert pick["guidance"] == [(1, 1), (1, 3), (1, 5), (2, 1), (2, 3), (2, 5)]
    np.testing.assert_allclose(group["guidance"], a_hint[[1, 2]].reshape(-1))
    assert pick["agent"][:4] == [(0, 0), (1, 0), (2, 0), (3, 0)]
    assert pick["agent"][4:] == [(i, u) for i in range(4) for u in (2, 4, 6)]
    np.testing.assert_allclose(group["agent"][:4], c1 - 0.5)
    np.testing.assert_allclose(group["agent"][4:], a_hint.reshape(-1))
    assert flat == 0.5
    out = gadv.outcomes(c1, c2, a_hint)
    assert (out["fixes"], out["breaks"], out["guidance_groups"],
            out["guidance_signal_groups"]) == (1, 1, 2, 1)
    assert out["hint_effect"] == pytest.approx(6 / 12 - 0.5)
    c1_all_right = np.ones(4, np.float32)
    pick, group, _, _ = gadv.role_utterances(c1_all_right, c2, "group")
    assert pick["guidance"] == [] and len(group["guidance"]) == 0


def test_critic_advantage_mixed_only_when_trusted():
    g, c = np.array([1.0, -1.0]), np.array([0.2, 0.6])
    np.testing.assert_allclose(gadv.mixed(g, c, 0.25, trusted=True), [0.8, -0.6])
    np.testing.assert_allclose(gadv.mixed(g, c, 0.25, trusted=False), g)
    np.testing.assert_allclose(gadv.mixed(g, c, 0.0, trusted=True), g)


@pytest.mark.parametrize("flag, value, match", [
    ("--hints-per-answer", "1", "--hints-per-answer: expected >= 2, got 1"),
    ("--critic-mix", "2", "--critic-mix: expected in \\[0, 1\\]"),
    ("--scale-rewards", "batch", "--scale-rewards: expected 'group' or 'none'"),
])
def test_bad_signal_settings_are_named(tmp_path, flag, value, match):
    with pytest.raises(ValueError, match=match):
        train.main(["--run-dir", str(tmp_path / "x"), flag, value])


# ----- end to end: K hints, a scripted score -------------------------------------------------

def test_k_hints_per_answer_end_to_end_with_a_scripted_score(tiny, tmp_path, monkeypatch):
    """4 problems, K = 3 hints each, ``--hint-reward turn2`` (issue 34's rule; issue 49's
    default is tested in test_guidance_frozen.py): the buffer holds turn 1 + 3 (hint,
    revision) pairs per problem; the guidance step gets exactly the hints of the wrong turn-1
    answers with their
    naive group advantages of the improvement; the agent step gets turn 1 (correctness less
    the mean) and the revisions; fixes, breaks and the TD error are in the row."""
    calls: list[tuple[int, str]] = []

    def scripted(problems, index, text, **_):  # even problems: always right; odd: by the text
        calls.append((index, text))
        return float(index % 2 == 0 or sum(map(ord, text)) % 2 == 0)

    seen: dict[str, dict[str, torch.Tensor]] = {}
    real_step = train.policy_step

    def recording_step(policies, role, opt, amb, batch, cfg):
        seen[role] = {k: v.clone() for k, v in batch.items()}
        return real_step(policies, role, opt, amb, batch, cfg)

    monkeypatch.setattr(train, "score", scripted)
    monkeypatch.setattr(train, "policy_step", recording_step)
    K, E = 3, 4
    cfg = parse_config(Config, args(tiny, tmp_path / "k", "--iterations", "1",
                                    "--hints-per-answer", str(K), "--episodes-per-iteration",
                                    str(E), "--critic-steps", "3", "--hint-reward", "turn2",
                                    "--keep-hint", "off"),
                       prog="guidance", description="", resumable=set())
    run = train.build(cfg)
    try:
        row = train.iterate(run)
        buf = run.buf
        b = buf[np.arange(len(buf))]
    finally:
        run.close()
    assert len(b["turn"]) == E * (1 + 2 * K) == row["buffer_utterances"]
    c = np.array([s for _, s in [(i, scripted(None, i, t)) for i, t in calls[:E * (1 + K)]]],
                 np.float32).reshape(E, 1 + K)
    c1, c2 = c[:, 0], c[:, 1:]
    np.testing.assert_array_equal(b["correctness"][b["turn"] == 0], c1)
    np.testing.assert_array_equal(b["correctness"][b["turn"] == 2], c2.reshape(-1))
    wrong = [i for i in range(E) if c1[i] == 0]
    assert wrong and len(wrong) < E  # the script gives both kinds
    # the guidance batch: the wrong answers' hints, in order, with naive group advantages
    hints = [j for j in np.flatnonzero(b["turn"] == 1) if b["episode"][j] in wrong]
    g = seen["guidance"]
    assert len(g["input_ids"]) == len(hints) == len(wrong) * K
    for r, j in enumerate(hints):
        n = int(g["attention_mask"][r].sum())
        want = np.concatenate([b["observation_ids"][j], b["action_ids"][j]])
        np.testing.assert_array_equal(g["input_ids"][r, :n].numpy(), want)
    want_adv = [a for i in wrong for a in naive_group(list(c2[i] - c1[i]), "group")]
    np.testing.assert_allclose(g["advantage"].numpy(), want_adv, rtol=1e-5, atol=1e-6)
    # the agent batch: turn 1 with its direct reward less the mean, then the revisions
    a = seen["agent"]
    want_agent = list(c1 - c1.mean()) + [x for i in range(E)
                                         for x in naive_group(list(c2[i] - c1[i]), "group")]
    np.testing.assert_allclose(a["advantage"].numpy(), want_agent, rtol=1e-5, atol=1e-6)
    assert row["fixes"] == int(sum((c1[i] == 0) * (c2[i] == 1).sum() for i in range(E)))
    assert row["breaks"] == int(sum((c1[i] == 1) * (c2[i] == 0).sum() for i in range(E)))
    assert row["guidance_groups"] == len(wrong) and row["hints"] == E * K
    assert row["turn1_accuracy"] == pytest.approx(c1.mean())
    assert row["turn2_accuracy"] == pytest.approx(c2.mean())
    assert np.isfinite(row["td_error"]) and row["td_error"] > 0
    assert np.isfinite(row["td_error_after"]) and row["critic_mixed"] is False


def test_td_error_in_every_row_and_the_curve(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(train, "score", lambda problems, index, text, **_: float(len(text) % 2))
    train.main(args(tiny, tmp_path / "td", "--iterations", "2", "--hints-per-answer", "2"))
    got = rows(tmp_path / "td")
    assert [r["iteration"] for r in got] == [1, 2]
    for r in got:
        assert np.isfinite(r["td_error"]) and np.isfinite(r["td_error_after"])
    assert (tmp_path / "td" / "curve.png").stat().st_size > 0
    with ReplayBuffer.open(tmp_path / "td" / "buffer", mode="r") as buf:
        assert len(buf) == 2 * 3 * 5


def test_td_error_equals_a_naive_per_utterance_mean(tiny):
    lm, bert = tiny
    cfg = Config(model=str(lm), critic_model=str(bert), critic_hidden=16)
    critic, target, ctok = gcritic.make_critic(cfg)
    with torch.no_grad():
        for p in target.parameters():
            p.add_(0.05 * torch.randn_like(p))
    tok = ctok  # the critic reads token ids decoded by ``tok``: the encoder's own here
    texts = ["what is 2 + 3?", "5", "add them", "7 - 1", "it is 6"]
    ids = [np.asarray(tok.encode(t, add_special_tokens=False), np.int32) for t in texts]
    rows_ = {"observation_ids": ids[:3], "action_ids": ids[1:4],
             "next_observation_ids": [ids[2], ids[3], np.zeros(0, np.int32)],
             "reward": np.array([0.0, 1.0, 0.5], np.float32),
             "done": np.array([False, False, True]), "turn": np.array([0, 1, 2])}
    got = gcritic.td_error(critic, target, rows_, ctok, tok, 64, 0.9, chunk=2)
    want = []
    for i in range(3):
        one = {k: v[i:i + 1] for k, v in rows_.items()}
        loss, _ = gcritic.td_loss(critic, target, gcritic.rows_batch(one, ctok, tok, 64), 0.9)
        want.append(float(loss.detach()) / 2)
    assert got == pytest.approx(np.mean(want), rel=1e-5)


# ----- the micro-batch plan from measured bytes ----------------------------------------------

def test_micro_batch_plan_follows_the_measured_step_memory(tiny):
    lm, _ = tiny
    from rlbuffers.memory.budget import StepCost
    from trainers.llm.model import load_causal_lm

    model, _ = load_causal_lm(lm)
    fixed, per = 5_000_000, 1_000  # bytes per token: 100_000 per 100-token utterance
    cost = StepCost(fixed_bytes=fixed, bytes_per_token=per)
    amb, plan = gpolicy.micro_batches("agent", model, fixed + int(3.5 * 100 * per), 10, 100,
                                      cost)
    assert plan["activation_bytes_per_item"] == 100 * per
    assert plan["micro_batch"] == amb.micro_batch == 3  # 3 fit: 4 steps of 3, 3, 3, 1
    _, plan = gpolicy.micro_batches("agent", model, fixed + 7 * 100 * per, 10, 100, cost)
    assert plan["micro_batch"] == 5  # 7 fit: 2 steps of 5
    _, plan = gpolicy.micro_batches("agent", model, fixed + 7 * 100 * per, 10, 50, cost)
    assert plan["micro_batch"] == 10  # half as long: 14 fit, the whole batch
    _, plan = gpolicy.micro_batches("agent", model, fixed + 50 * per, 10, 100, cost)
    assert plan["micro_batch"] == 1  # not even one fits: 1, AdaptiveMicroBatch watches
    _, plan = gpolicy.micro_batches("agent", model, None, 10, 100, None)
    assert plan["micro_batch"] == 10  # no budget: whole batches


def test_build_plans_from_the_measured_step_on_the_longest_utterances(tiny, tmp_path,
                                                                      monkeypatch):
    """The trainer measures the real step (probe_activation_bytes, once) on padded pairs of
    the agent's longest utterances, counted from the templates (not a fixed 512-token prompt),
    and plans both roles from the bytes per token it measured."""
    from rlbuffers.memory.budget import StepCost

    monkeypatch.setattr(train, "score", lambda problems, index, text, **_: 0.0)
    # a budget the real steps of the tiny model fit under with room (their true peaks, ~1-17
    # MB, vary with the allocator), and a faked per-token cost that makes it bind the plan
    BUDGET, PER_TOKEN = 2**26, 32_000
    probed = []

    def fake_probe(step_fn, make_batch, *, sizes, tokens_per_item=None, device=None):
        batches = [make_batch(n) for n in sizes]
        step_fn(batches[0])  # the real step runs on the probe's batch
        probed.append(([(b["attention_mask"].sum(1).tolist(), int(b["target"].sum()))
                        for b in batches], tokens_per_item))
        return StepCost(fixed_bytes=1000, bytes_per_token=PER_TOKEN)

    monkeypatch.setattr(gpolicy, "probe_activation_bytes", fake_probe)

    class NoPeak:  # the one-utterance step first measured (issue 49) reads 0: the probe runs
        peak_extra_bytes = 0

        def __init__(self, device=None):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(gpolicy, "PeakMemory", NoPeak)
    cfg = parse_config(Config, args(tiny, tmp_path / "mb", "--iterations", "1",
                                    "--memory-budget", str(BUDGET), "--hints-per-answer", "2"),
                       prog="guidance", description="", resumable=set())
    run = train.build(cfg)
    try:
        plans = run.plans
        train.iterate(run)
        b = run.buf[np.arange(len(run.buf))]
    finally:
        run.close()
    agent, guide = plans["utterance_tokens_planned_agent"], plans[
        "utterance_tokens_planned_guidance"]
    assert agent != 512 + 2 * 8 + 6
    # once, on rows of `agent` tokens (padded: every second a token shorter), 8-token answers
    assert probed == [([([agent], 8), ([agent, agent - 1, agent], 24)], agent)]
    assert plans["activation_bytes_per_utterance_agent"] == PER_TOKEN * agent
    assert plans["activation_bytes_per_utterance_guidance"] == PER_TOKEN * guide

    def even(fits, items):  # plan_micro_batch: the fewest steps, split evenly
        steps = -(-items // min(fits, items))
        return -(-items // steps)

    assert plans["micro_batch_planned_agent"] == even((BUDGET - 1000) // (PER_TOKEN * agent), 3 * 3)
    assert plans["micro_batch_planned_guidance"] == even((BUDGET - 1000) // (PER_TOKEN * guide),
                                                         3 * 2)
    # the planned lengths bound the real utterances
    lens = [len(o) + len(a) for o, a in zip(b["observation_ids"], b["action_ids"], strict=True)]
    assert max(x for x, t in zip(lens, b["turn"], strict=True) if t != 1) <= agent
    assert max(x for x, t in zip(lens, b["turn"], strict=True) if t == 1) <= guide


def test_default_memory_budget_is_1_5_gib_and_auto_reads_the_device():
    assert Config().memory_budget == str(3 * 2**29)
    assert train.update_budget(Config().memory_budget, torch.device("cpu")) == 3 * 2**29
    assert train.update_budget("auto", torch.device("cpu")) > 0


# ----- held-out problems and the hint's effect -----------------------------------------------

def test_held_out_problems_are_disjoint_from_training_by_content():
    """Guidance's held-out set is the shared ``trainers.llm.evaluation.held_out``."""
    config = '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}'
    train_set = task_problems("basic_arithmetic", 150, 1, config)
    # (reasoning-gym seeds item i with seed + i: seed 1000 shares no seeds with 1..150)
    kept_problems, report = held_out("basic_arithmetic", config, train_set, 20, 1000)
    seen = {k for k in training_keys(train_set) if k[0] == "text"}
    kept = [k for p in kept_problems for k in content_keys(p["question"]) if k[0] == "text"]
    assert len(kept_problems) == 20 == report["size"] and report["overlap"] == 0
    assert not set(kept) & seen and len(set(kept)) == 20
    assert report["dropped_training"] > 0  # a small space: some candidates were training ones
    with pytest.raises(ValueError, match="--eval-size: expected at most the number of "
                                         "basic_arithmetic problems disjoint"):
        held_out("basic_arithmetic", config, train_set, 5000, 1000, max_draws=1)
    assert content_keys("  Calculate 5 +\n 3. ") == content_keys("calculate 5 + 3.")
    assert ("text", "calculate5+3") in content_keys("  Calculate 5 +\n 3. ")


def test_paired_difference_interval_covers_the_true_difference():
    rng = np.random.default_rng(0)
    probs = [0.10, 0.05, 0.15, 0.70]  # both right, break, fix, both wrong: true diff 0.10
    hits = 0
    for _ in range(1000):
        kind = rng.choice(4, size=100, p=probs)
        first, second = np.isin(kind, [0, 1]), np.isin(kind, [0, 2])
        diff, lo, hi = geval.paired_difference(first, second)
        assert lo <= diff <= hi and diff == pytest.approx(second.mean() - first.mean())
        hits += lo <= 0.10 <= hi
    assert 0.93 <= hits / 1000 <= 0.975
    d, lo, hi = geval.paired_difference(np.array([1, 0, 0, 1], bool), np.array([1, 1, 0, 0],
                                                                               bool))
    d2, lo2, hi2 = geval.paired_difference(np.array([1, 1, 0, 0], bool),
                                           np.array([1, 0, 0, 1], bool))
    assert d == d2 == 0 and (lo, hi) == pytest.approx((-hi2, -lo2))
    out = geval.summarise(np.array([[1, 1], [0, 1], [1, 0], [0, 0], [0, 1]], bool))
    assert (out["fixes"], out["breaks"]) == (2, 1)
    assert out["hint_effect"]["turn2_minus_turn1"] == pytest.approx(0.2)


# ----- rewards and the held-out evaluation on the shared module --------------------------------

def test_a_wrong_number_scores_zero_like_no_answer_unless_partial_credit():
    """Turn-1 and turn-2 rewards (``train.score``) against reasoning-gym's metadata: the
    right number (``answer_value``) 1, a wrong number 0 (reasoning-gym's own score is 0.01),
    no number 0; ``partial_credit`` keeps reasoning-gym's 0.01."""
    problems = task_problems("gsm_symbolic", 3, 0)
    for i in range(len(problems)):
        value = problems[i]["metadata"]["answer_value"]
        right, wrong = f"so <answer>{value}</answer>", f"it is {value + 1}"
        assert problems.score_answer(str(value + 1), problems[i]) == 0.01
        assert train.score(problems, i, right) == 1.0 == train.score(problems, i, f"{value}")
        assert train.score(problems, i, wrong) == 0.0 == train.score(problems, i, "no idea")
        assert train.score(problems, i, wrong, partial_credit=True) == 0.01
        assert train.score(problems, i, right, partial_credit=True) == 1.0
    assert parse_config(Config, ["--partial-credit"], prog="guidance", description="",
                        resumable=set()).partial_credit is True
    assert Config().partial_credit is False


def test_guidance_evaluation_scores_each_turn_with_the_shared_module():
    """Scripted two-turn episodes: each turn's result is the shared ``accuracy`` of the
    shared ``score_completions`` (a wrong number 0), the hint's effect the paired difference
    of the same per-question results, and the overlap is counted against the training keys."""
    from trainers.llm.evaluation import accuracy, score_completions, task_correct

    problems = list(task_problems("gsm_symbolic", 5, 3))
    v = [p["metadata"]["answer_value"] for p in problems]
    turn1 = [f"<answer>{v[0]}</answer>", f"{v[1] + 1}", "none", f"{v[3]}", f"{v[4] + 2}"]
    turn2 = [f"<answer>{v[0]}</answer>", f"{v[1]}", f"{v[2] + 5}", "none", f"{v[4]}"]

    def play_greedy(questions):
        assert questions == [p["question"] for p in problems]
        return {"texts": [[a, "a hint", b] for a, b in zip(turn1, turn2, strict=True)],
                "actions": [[np.zeros(3 + i), np.zeros(2), np.zeros(5)] for i in range(5)]}

    correct = task_correct("gsm_symbolic", "{}")
    keys = training_keys(problems[3:4])  # problem 3 is a "training" problem
    got = geval.evaluate(play_greedy, problems, correct, train_keys=keys)
    for name, texts, lengths in (("turn1", turn1, [3, 4, 5, 6, 7]), ("turn2", turn2, [5] * 5)):
        want = accuracy(score_completions(texts, problems, correct), problems,
                        completion_tokens=lengths, train_keys=keys)
        assert got[name] == want and got[name]["overlap"] == 1
    assert got["turn1"]["accuracy"] == 0.4 and got["turn2"]["accuracy"] == 0.6  # wrong: 0
    assert (got["fixes"], got["breaks"]) == (2, 1)
    diff, lo, hi = geval.paired_difference(np.array([1, 0, 0, 1, 0], bool),
                                           np.array([1, 1, 0, 0, 1], bool))
    assert got["hint_effect"] == {"turn2_minus_turn1": diff, "ci95": [lo, hi],
                                  "mcnemar_p": geval.mcnemar_exact(1, 2), "n": 5}
    assert diff == pytest.approx(0.2)
    with pytest.raises(ValueError, match="problems: expected at least one problem, got 0"):
        geval.evaluate(play_greedy, [], correct)
