"""CRSP's proposer learnability reward and balanced critic batches (issue 49): a proposal earns
``1 - |2p - 1|`` only when the verifier confirms its stated answer (a made-up answer or an
unverifiable story earns nothing, and is not attempted), the solver is scored against the
verified answer, the step's metrics count verified and solvable proposals, and the critic
judges as many correct as incorrect attempts, a short class topped up from earlier steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.heavy import require

require("reasoning_gym", "transformers", "peft", "tokenizers", "datasketch")

from rlbuffers.cache import ByteLRUCache  # noqa: E402
from rlbuffers.memory import RunningMeanStd  # noqa: E402
from tests.tiny_lm import make_tiny_lm_dir  # noqa: E402
from trainers.crsp import roles, rollout  # noqa: E402
from trainers.crsp.config import Config, check_config, legacy_settings  # noqa: E402
from trainers.crsp.judging import Reservoir, round_robin, select  # noqa: E402
from trainers.crsp.rewards import RESERVOIR, NoveltySketch, gated, learnability  # noqa: E402
from trainers.crsp.roles import ROLES  # noqa: E402
from trainers.crsp.verify import proposal_truth, verified_entry  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


@pytest.mark.parametrize("problem, truth", [
    ("What is 45+23?", "68"), ("Calculate 45 + 23.", "68"), ("Add 45 and 23", "68"),
    ("What is the sum of 12 and 5?", "17"), ("Subtract 5 from 12.", "7"),
    ("What is 12 minus 5?", "7"), ("What is the difference between 5 and 12?", "7"),
    ("Divide 12 by 4.", "3"), ("What is the quotient of 7 and 2?", "3.5"),
    ("What is the product of 6 and 7?", "42"), ("Calculate (3 + 4) * 2.", "14"),
    ("Calculate -( 4 + -9 ).", "5"), ("What is 2.5 + 1.5?", "4"),
    # not verifiable: no operation named, a number outside the expression, several numbers
    # for a word form, division by zero, a non-terminating decimal
    ("Jones has 20 jellybeans. How many of them are there?", None),
    ("Tom has 5 pens and buys 2 more. How many pens does he have?", None),
    ("Tom has 3 + 4 apples and eats 2.", None), ("Add 3, 4 and 5.", None),
    ("What is 7 / 0?", None), ("What is 1 / 3?", None), ("What is 5?", None)])
def test_the_verifier_recomputes_explicit_arithmetic_only(problem, truth):
    assert proposal_truth(problem) == truth


def test_a_made_up_answer_is_not_confirmed():
    score = lambda a, e: float(a == e["answer"])  # noqa: E731 - reasoning-gym's rule
    assert verified_entry("What is 45+23?", "68", score)["answer"] == "68"
    assert verified_entry("What is 45+23?", "69", score) is None
    assert verified_entry("Jones has 20 jellybeans. How many?", "20", score) is None
    assert verified_entry("What is 45+23?", None, score) is None


@given(st.lists(st.tuples(st.integers(0, 8), st.booleans()), min_size=1, max_size=20))
def test_learnability_is_r_zeros_uncertainty_reward_on_verified_proposals(rows):
    hits, ok = (np.array(x) for x in zip(*rows, strict=True))
    p = hits / 8
    got = learnability(p, ok)
    want = [1 - 2 * abs(q - 0.5) if v else 0.0 for q, v in zip(p, ok, strict=True)]
    np.testing.assert_allclose(got, want, atol=1e-7)
    assert (got[(hits == 0) | (hits == 8)] == 0).all()  # always / never solved: nothing


def test_learnability_refuses_bad_input():
    with pytest.raises(ValueError, match="success / verified"):
        learnability(np.zeros(3), np.zeros(2, bool))
    with pytest.raises(ValueError, match="rates in \\[0, 1\\]"):
        learnability(np.array([1.5]), np.array([True]))


def test_round_robin_spreads_a_class_over_the_problems():
    outcome = [[1, 1, 0], [0, 1, 1], [1, 0, 0]]
    assert round_robin(outcome, True) == [(0, 0), (1, 1), (2, 0), (0, 1), (1, 2)]
    assert round_robin(outcome, False) == [(0, 2), (1, 0), (2, 1), (2, 2)]


def test_balanced_selection_tops_up_a_short_class_from_earlier_steps():
    res = Reservoir(3)
    texts = [["a0", "a1"], ["b0", "b1"]]
    # Step 1: one correct attempt, three incorrect -> one of each (budget 2 per class).
    got = select("balanced", ["P", "Q"], texts, [[1, 0], [0, 0]], 2, res)
    assert [(j.truth, j.source) for j in got] == [(True, (0, 0)), (False, (0, 1))]
    assert res.items[True] == [["P", "a0"]] and len(res.items[False]) == 3
    # Step 2: every attempt incorrect -> the correct class comes from the reservoir.
    torch.manual_seed(0)
    got = select("balanced", ["R"], [["r0", "r1"]], [[0, 0]], 2, res)
    assert [(j.problem, j.attempt, j.truth, j.source) for j in got] == [
        ("P", "a0", True, None), ("R", "r0", False, (0, 0))]
    # Without a reservoir a one-class step judges nothing; 'first' is the old rule.
    assert select("balanced", ["R"], [["r0"]], [[0]], 1, None) == []
    assert [j.source for j in select("first", ["P", "Q"], texts, [[1, 0], [0, 0]], 1, None)
            ] == [(0, 0), (1, 0)]
    with pytest.raises(ValueError, match="mode"):
        select("bogus", [], [], [], 1, None)


def test_reservoir_state_round_trips_and_keeps_the_newest():
    res = Reservoir(2)
    res.add(True, [("p1", "x"), ("p2", "y"), ("p3", "z")])
    assert res.items[True] == [["p2", "y"], ["p3", "z"]]
    again = Reservoir()
    again.load_state_dict(res.state_dict())
    assert again.state_dict() == res.state_dict()
    with pytest.raises(ValueError, match="capacity"):
        Reservoir(-1)


def test_a_run_created_before_issue_49_keeps_its_rewards_on_resume():
    cfg = Config()
    assert legacy_settings(cfg, {"steps": 3}) == ["--proposer-reward band",
                                                  "--critic-batch first",
                                                  "--proposer-gate none",
                                                  "--proposer-reference base"]
    assert (cfg.proposer_reward, cfg.critic_batch, cfg.proposer_gate) == (
        "band", "first", "none")
    cfg = Config()
    assert legacy_settings(cfg, {"proposer_reward": "learnability",
                                 "critic_batch": "balanced"}) == ["--proposer-gate none",
                                                                  "--proposer-reference base"]
    cfg = Config()
    assert legacy_settings(cfg, {"proposer_reward": "learnability", "critic_batch": "balanced",
                                 "proposer_gate": "solvable",
                                 "proposer_reference": "warmup"}) == []
    assert (cfg.proposer_reward, cfg.critic_batch, cfg.proposer_gate) == (
        "learnability", "balanced", "solvable")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_lm_dir(tmp_path_factory.mktemp("tiny"))


PROPOSALS = ["What is the sum of 12 and 5?</problem><answer>17</answer>",  # verified, p = 1/2
             "What is 4+4?</problem><answer>9</answer>",  # made-up answer
             "Jones has 20 jellybeans. How many?</problem><answer>20</answer>",  # unverifiable
             "Add 1 and 1.</problem><answer>2</answer>"]  # verified, always solved
#: The solver's answers per problem (found in the prompt), cycling over its attempts.
ANSWERS = {"2 + 3": ["5", "5", "1", "1"], "12 and 5": ["17", "3", "17", "4"],
           "1 and 1": ["2"], "4+4": ["8"], "jellybeans": ["20"]}


def scripted(tok, answers):
    seen = {}

    def generate(model, tok_, prompts, sampling, *, n_per_prompt, max_new, greedy=False):
        out = []
        for p in prompts:
            text = tok.decode(p)
            for i in range(n_per_prompt):
                if text.endswith("problem>"):
                    reply = PROPOSALS[i % len(PROPOSALS)]
                elif text.endswith("verdict>"):
                    reply = " Right."
                else:
                    key = next(k for k in answers if k in text.rsplit("<|im_start|>user", 1)[1])
                    n = seen[key] = seen.get(key, -1) + 1
                    reply = f"<answer>{answers[key][n % len(answers[key])]}</answer>"
                ids = np.asarray(tok(reply, add_special_tokens=False)["input_ids"], np.int64)
                out.append((ids[:max_new], len(ids) > max_new))
        return out

    return generate


def test_rollout_rewards_verified_sometimes_solved_proposals_only(tiny_dir, monkeypatch):
    cfg = Config(model=str(tiny_dir), lora_rank=4, max_prompt_tokens=400, proposer_tokens=40,
                 solver_tokens=12, critic_tokens=30, pack_tokens=460, chunk_tokens=64,
                 memory_budget="none", proposer_length_target=20, solver_length_target=6,
                 critic_length_target=6, seeds_per_step=1, proposer_samples=4,
                 solver_samples=4, critiques_per_problem=2, critic_samples=2)
    model, tok, _ = roles.make_model(cfg)
    monkeypatch.setattr(rollout, "generate", scripted(tok, ANSWERS))
    prompts = roles.Prompts(tok, cfg.max_prompt_tokens, ByteLRUCache(1 << 20), verifiable=True)
    stats = {r: RunningMeanStd() for r in ROLES}
    seeds = [{"question": "What is 2 + 3?", "answer": "5"}]
    score = lambda a, e: float(a == e["answer"])  # noqa: E731
    torch.manual_seed(0)
    batches, m = rollout.rollout(cfg, model, tok, prompts, seeds, score, NoveltySketch(8, 16),
                                 stats, step=0)
    # Only the seed and the two verified proposals are attempted (12 attempts).
    assert len(batches["solver"].prompts) == 3
    assert batches["proposer"].parts["extrinsic"] == [1.0, 0.0, 0.0, 0.0]
    assert batches["solver"].parts["extrinsic"] == [1, 1, 0, 0, 1, 0, 1, 0, 1, 1, 1, 1]
    assert (m["proposals"], m["proposals_verified"], m["proposals_solvable"]) == (4, 2, 2)
    assert m["proposer_verified_rate"] == 0.5 and m["proposer_solvable_rate"] == 0.5
    assert m["proposer_learnability"] == 0.25
    # Balanced critic batch: 3 correct and 3 incorrect attempts (ceil(2 * 3 / 2) per class).
    assert m["critic_judged"] == 6 and m["critic_truth_correct"] == 0.5
    assert len(batches["critic"].completions) == 6 * cfg.critic_samples
    assert len(stats[RESERVOIR].items[True]) == 8 and len(stats[RESERVOIR].items[False]) == 4
    # A step whose attempts are all wrong still judges both classes: the correct ones come
    # from the reservoir.
    monkeypatch.setattr(rollout, "generate", scripted(tok, {**ANSWERS, "2 + 3": ["0"],
                                                            "12 and 5": ["0"], "1 and 1": ["0"]}))
    batches, m = rollout.rollout(cfg, model, tok, prompts, seeds, score, NoveltySketch(8, 16),
                                 stats, step=1)
    assert m["proposals_solvable"] == 0 and batches["proposer"].parts["extrinsic"] == [0.0] * 4
    assert m["critic_judged"] == 6 and m["critic_truth_correct"] == 0.5


def test_gated_zeroes_what_does_not_earn_and_refuses_a_shape_mismatch():
    r = np.array([0.5, -0.25, 1.5], np.float64)
    out = gated(r, np.array([True, False, True]))
    assert out.dtype == np.float32 and out.tolist() == [0.5, 0.0, 1.5]
    assert gated(r, None).tolist() == [0.5, -0.25, 1.5]
    with pytest.raises(ValueError, match=r"earns: expected bool\[3\] like the rewards, got \[2\]"):
        gated(r, np.array([True, False]))


def test_the_gate_leaves_reward_to_solvable_proposals_only(tiny_dir, monkeypatch):
    # --proposer-gate solvable (the default): a proposal the verifier does not confirm, or
    # that the solver never solves, earns exactly 0 in all (format, length and creativity
    # included); a solvable one earns what it earns without the gate, term for term.
    def run(gate, answers, step=0):
        cfg = Config(model=str(tiny_dir), lora_rank=4, max_prompt_tokens=400,
                     proposer_tokens=40, solver_tokens=12, critic_tokens=30, pack_tokens=460,
                     chunk_tokens=64, memory_budget="none", proposer_length_target=20,
                     solver_length_target=6, critic_length_target=6, seeds_per_step=1,
                     proposer_samples=4, solver_samples=4, critiques_per_problem=2,
                     critic_samples=2, proposer_gate=gate)
        model, tok, _ = roles.make_model(cfg)
        monkeypatch.setattr(rollout, "generate", scripted(tok, answers))
        prompts = roles.Prompts(tok, cfg.max_prompt_tokens, ByteLRUCache(1 << 20),
                                verifiable=True)
        torch.manual_seed(0)
        return rollout.rollout(cfg, model, tok, prompts,
                               [{"question": "What is 2 + 3?", "answer": "5"}],
                               lambda a, e: float(a == e["answer"]), NoveltySketch(8, 16),
                               {r: RunningMeanStd() for r in ROLES}, step=step)

    (gated, m), (free, m_free) = run("solvable", ANSWERS), run("none", ANSWERS)
    solvable = np.array([True, False, False, True])  # PROPOSALS: made up; unverifiable
    g, f = gated["proposer"], free["proposer"]
    assert g.parts == f.parts  # the terms themselves do not change
    np.testing.assert_array_equal(g.reward, np.where(solvable, f.reward, 0.0))
    assert (f.reward[~solvable] != 0).all()  # without the gate the made-up answer earned
    assert g.reward[0] > g.reward[3] > 0  # p = 1/2 above p = 1 (learnability 1 vs 0)
    assert m["proposer_gated"] == 0.5 and m_free["proposer_gated"] == 0.0
    # The other roles do not see the gate.
    for role in ("solver", "critic"):
        np.testing.assert_array_equal(gated[role].reward, free[role].reward)
    # Nothing solvable: every proposal earns 0, so the group is flat and has no gradient.
    wrong = {**ANSWERS, "12 and 5": ["0"], "1 and 1": ["0"]}
    gated, m = run("solvable", wrong, step=1)
    assert m["proposals_solvable"] == 0 and m["proposer_gated"] == 1.0
    assert (gated["proposer"].reward == 0).all() and (gated["proposer"].advantage == 0).all()
    with pytest.raises(ValueError, match="--proposer-gate: expected one of solvable, none, "
                                         "got 'verified'"):
        check_config(Config(proposer_gate="verified"))


def test_held_out_proposer_figures_count_verified_and_solvable(tiny_dir, monkeypatch):
    from trainers.crsp import evaluate

    cfg = Config(model=str(tiny_dir), lora_rank=4, max_prompt_tokens=400, proposer_tokens=40,
                 solver_tokens=12, memory_budget="none", task="basic_arithmetic")
    model, tok, _ = roles.make_model(cfg)
    calls = {"proposal": 0}
    base = scripted(tok, ANSWERS)

    def fake(model_, tok_, prompts, sampling, *, n_per_prompt, max_new=None, greedy=False,
             on_finished=None):
        if tok.decode(prompts[0]).endswith("problem>"):  # one proposal per problem, in turn
            out = []
            for _ in prompts:
                text = PROPOSALS[calls["proposal"] % len(PROPOSALS)]
                calls["proposal"] += 1
                out.append((np.asarray(tok(text, add_special_tokens=False)["input_ids"]),
                            False))
            return out
        return base(model_, tok_, prompts, sampling, n_per_prompt=n_per_prompt,
                    max_new=max_new or 12)

    monkeypatch.setattr(evaluate, "generate", fake)
    problems = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(8)]
    got = evaluate.proposer_figures(cfg, model, model, tok, problems, 0, 4)
    # 8 proposals: twice each of PROPOSALS; verified: the sum of 12 and 5 (solved 2 of 4
    # times) and 1 + 1 (always solved); the made-up answer and the story are not.
    assert got["n"] == 8 and got["well_formed"]["k"] == 8
    assert got["verified"]["k"] == 4 and got["solvable"]["k"] == 4
    assert got["learnable"]["k"] == 2
