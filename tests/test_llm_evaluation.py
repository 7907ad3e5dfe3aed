"""Held-out evaluation of the LLM trainers (trainers/llm/evaluation.py) and GRPO's rewards
(trainers/grpo/rewards.py): held-out problems disjoint from training by content on a task with
a tiny problem space (or refused), accuracy and Wilson intervals against the formula,
rewards that give a wrong answer what they give no answer, and GRPO's held-out points in
metrics.jsonl / eval.json across a resume."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tests.heavy import require

require("reasoning_gym", "transformers", "peft", "tokenizers")

from tests.tiny_lm import make_tiny_lm_dir  # noqa: E402
from trainers.grpo import train  # noqa: E402
from trainers.grpo.rewards import score_group  # noqa: E402
from trainers.llm import evaluation  # noqa: E402
from trainers.llm.evaluation import (  # noqa: E402
    content_keys,
    evaluate,
    held_out,
    numeric_correct,
    overlap,
    task_correct,
)
from trainers.llm.policy_loss import group_advantages  # noqa: E402
from trainers.llm.settings import Sampling  # noqa: E402
from trainers.llm.tasks import task_problems  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

#: 1-digit + of 2 terms, no negation or parentheses: reasoning-gym draws operands 0..10, so
#: 121 ordered operand pairs, 66 unordered.
TINY = json.dumps({"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                   "operators": ["+"], "allow_negation": False, "allow_parentheses": False})


def operands(problem):
    """The naive reference key: the unordered operand pair parsed from reasoning-gym's own
    metadata expression (not from the question text)."""
    a, op, b = problem["metadata"]["expression"].split()
    assert op == "+"
    return tuple(sorted((int(a), int(b))))


def test_content_keys_match_reordered_and_restyled_problems():
    assert content_keys("Calculate 3 + 5.") & content_keys("calculate  5 + 3 .")
    assert content_keys("Calculate 3 + 5.") & content_keys("What is 3 + 5?")  # operands
    assert not content_keys("Calculate 3 + 5.") & content_keys("Calculate 3 * 5.")
    assert not content_keys("Calculate 3 + 5.") & content_keys("Calculate 3 + -5.")
    assert content_keys("Solve it.") == {("text", "solveit")}  # no numbers: text only


def test_held_out_excludes_every_training_problem_of_a_tiny_task():
    space = {operands(p) for p in task_problems("basic_arithmetic", 3000, 1, TINY)}
    assert len(space) == 66
    train_problems = list(task_problems("basic_arithmetic", 30, 0, TINY))
    train_pairs = {operands(p) for p in train_problems}
    assert 15 < len(train_pairs) < 50  # some pairs left for the held-out set
    problems, report = held_out("basic_arithmetic", TINY, train_problems,
                                len(space - train_pairs), seed=7)
    pairs = [operands(p) for p in problems]
    assert not set(pairs) & train_pairs  # disjoint by content
    assert len(set(pairs)) == len(pairs)  # and distinct among themselves
    assert set(pairs) == space - train_pairs  # every pair left, found in the bounded draws
    assert not {p["question"] for p in problems} & {p["question"] for p in train_problems}
    assert report["overlap"] == 0 == overlap(problems, evaluation.training_keys(train_problems))
    assert report["dropped_training"] > 0
    # a set drawn with another seed alone repeats training problems
    naive = list(task_problems("basic_arithmetic", report["seed_scheme_overlap"]["n"], 7, TINY))
    assert report["seed_scheme_overlap"]["operands"] == sum(operands(p) in train_pairs
                                                            for p in naive) > 0


def test_held_out_refuses_when_no_disjoint_problem_is_left():
    train_problems = task_problems("basic_arithmetic", 2000, 0, TINY)  # every pair
    with pytest.raises(ValueError, match=r"--eval-size: .* got 10: 0 disjoint problems .*"
                                         r"--train-size 2000"):
        held_out("basic_arithmetic", TINY, train_problems, 10, seed=1, max_draws=2)
    with pytest.raises(ValueError, match="--eval-size: expected >= 1, got 0"):
        held_out("basic_arithmetic", TINY, train_problems, 0, seed=1)


class FakeTok:
    """A tokenizer whose completions are indices into ``texts`` (no model needed)."""

    def __init__(self, texts):
        self.texts = texts

    def apply_chat_template(self, messages, **_):
        return messages[-1]["content"]

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return self.texts[int(ids[0])]


def test_evaluate_counts_right_answers_with_wilson_interval(monkeypatch):
    problems = [{"question": f"Calculate {a} + 1.", "answer": str(a + 1)} for a in range(7)]
    texts = ["so <answer>1</answer>", "2", "it is 4", "no idea", "<answer>5</answer> or 6",
             "6", "8"]
    calls = []

    def fake_generate(model, tok, prompts, sampling, *, n_per_prompt, greedy, on_finished):
        assert greedy and n_per_prompt == 1
        calls.append(len(prompts))
        start = sum(calls[:-1])
        return [(np.array([start + i]), False) for i in range(len(prompts))]

    monkeypatch.setattr(evaluation, "generate", fake_generate)
    keys = evaluation.training_keys([{"question": "Calculate 1 + 2."}])  # problem 2's operands
    got = evaluate(None, FakeTok(texts), problems, Sampling(max_completion_tokens=8),
                   numeric_correct, train_keys=keys, chunk=3)
    assert calls == [3, 3, 1]
    k, n, z = 4, 7, 1.96  # right: problems 0, 1, 4, 5 ("4" for 2 + 1 and "8" for 6 + 1 wrong)
    p = k / n
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    lo, hi = ((p + z * z / (2 * n)) - half) / (1 + z * z / n), \
        ((p + z * z / (2 * n)) + half) / (1 + z * z / n)
    assert got["accuracy"] == k / n and got["n"] == n
    assert got["ci95"] == pytest.approx([lo, hi], abs=1e-6)
    assert got["overlap"] == 1 and got["answered"] == 6 / 7 and got["formatted"] == 2 / 7


def test_evaluation_heartbeats_say_how_many_problems_are_done(monkeypatch):
    """Issue 45: the lines logged while an evaluation runs say "k of n problems done"; the
    fake generation waits until a heartbeat has said 3 of 5 (it waits on the log, not on a
    clock: heartbeats every 10 ms here)."""
    import functools
    import logging
    import threading

    from trainers import phases

    said, seen = [], threading.Event()

    class Watch(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())
            if "3 of 5 problems done" in said[-1]:
                seen.set()

    def fake_generate(model, tok, prompts, sampling, *, n_per_prompt, greedy, on_finished):
        on_finished(3)
        assert seen.wait(30), said
        on_finished(len(prompts) - 3)
        return [(np.array([i]), False) for i in range(len(prompts))]

    monkeypatch.setattr(evaluation, "generate", fake_generate)
    monkeypatch.setattr(phases, "heartbeat", functools.partial(phases.heartbeat, every_s=0.01))
    logger = logging.getLogger("trainers.phases")
    watch = Watch(logging.INFO)
    logger.addHandler(watch)
    level = logger.level
    logger.setLevel(logging.INFO)  # setLevel, not the attribute: it clears isEnabledFor's cache
    try:
        problems = [{"question": f"Calculate {a} + 1.", "answer": str(a + 1)} for a in range(5)]
        got = evaluate(None, FakeTok(["1"] * 5), problems, Sampling(max_completion_tokens=8),
                       numeric_correct, progress="held-out evaluation before: 5 task problems")
    finally:
        logger.removeHandler(watch)
        logger.setLevel(level)
    assert got["n"] == 5
    assert said[0] == "held-out evaluation before: 5 task problems..."
    assert any(line.startswith("held-out evaluation before: 5 task problems ")
               and line.endswith(" s: 3 of 5 problems done...") for line in said), said


def test_wilson_intervals_print_and_save_no_negative_zero(tmp_path):
    """Issue 45: 0 of n right gave a low end of -1e-17, printed as -0.000 and saved as -0.0."""
    from trainers.summary import fixed, format_eval, json_bytes

    result = evaluation.accuracy({"correct": np.zeros(20), "answered": np.ones(20, bool),
                                  "formatted": np.ones(20, bool)},
                                 [{"question": "q"}] * 20, completion_tokens=[1] * 20)
    assert result["ci95"][0] == 0.0 and str(result["ci95"][0]) == "0.0"
    assert format_eval({"task": result}).startswith("task 0.000 [0.000, 0.161] (n=20)")
    text = json_bytes({"a": -0.0, "b": [-0.0, (0.0, -0.0)], "c": {"d": -0.0}}).decode()
    assert "-0" not in text
    assert fixed(-0.0004) == "0.000" and fixed(-0.0006) == "-0.001"
    assert fixed(-0.0, 2) == "0.00"
    assert 0.99 < evaluation.wilson(20, 20)[1] <= 1.0


def test_held_out_skips_candidates_the_task_cannot_make(monkeypatch):
    """Issue 45: reasoning-gym's basic_arithmetic divides by zero for a few seeds, so a large
    --eval-size (tens of thousands of candidates) ended in a ZeroDivisionError traceback; such
    a candidate is skipped and counted."""

    class Flaky:
        def __init__(self, size, seed):
            self.size, self.seed = size, seed

        def __len__(self):
            return self.size

        def __getitem__(self, i):
            if (self.seed + i) % 7 == 3:
                raise ZeroDivisionError("integer division or modulo by zero")
            return {"question": f"Calculate {self.seed + i} + 1.", "answer": "0"}

    monkeypatch.setattr(evaluation, "task_problems",
                        lambda task, size, seed, config="{}": Flaky(size, seed))
    problems, report = held_out("basic_arithmetic", "{}", [], 300, 0)
    assert len(problems) == 300 and report["generation_failed"] > 0
    assert all((int(p["question"].split()[1])) % 7 != 3 for p in problems)


def test_task_correct_gives_a_wrong_number_zero():
    problems = task_problems("gsm_symbolic", 3, 0)
    correct = task_correct("gsm_symbolic", "{}")
    p = problems[0]
    assert problems.score_answer(str(int(p["answer"]) + 1), p) == 0.01  # reasoning-gym's
    assert correct(str(int(p["answer"]) + 1), p) == 0.0
    assert correct(p["answer"], p) == 1.0 and correct(None, p) == 0.0


def test_score_completions_and_accuracy_per_question():
    """The per-question results a trainer with its own episodes (guidance) scores with, and
    their accuracy against a naive count and the Wilson formula (``evaluate``'s fields)."""
    problems = [{"question": f"Calculate {a} * 2.", "answer": str(2 * a)} for a in range(5)]
    texts = ["<answer>0</answer>", "3", "none", "so 6", "<answer>9</answer>"]
    scored = evaluation.score_completions(texts, problems, numeric_correct)
    np.testing.assert_array_equal(scored["correct"], [1, 0, 0, 1, 0])
    np.testing.assert_array_equal(scored["answered"], [1, 1, 0, 1, 1])
    np.testing.assert_array_equal(scored["formatted"], [1, 0, 0, 0, 1])
    keys = evaluation.training_keys(problems[:2])
    got = evaluation.accuracy(scored, problems, completion_tokens=[1, 2, 3, 4, 5],
                              train_keys=keys)
    lo, hi = evaluation.wilson(2, 5)
    assert got == {"accuracy": 0.4, "n": 5, "ci95": [round(lo, 6), round(hi, 6)],
                   "overlap": 2, "answered": 0.8, "formatted": 0.4,
                   "completion_tokens_mean": 3.0}
    assert evaluation.accuracy(scored, problems, completion_tokens=[1] * 5)["overlap"] is None
    with pytest.raises(ValueError, match="texts: expected one completion per problem"):
        evaluation.score_completions(texts[:4], problems, numeric_correct)
    with pytest.raises(ValueError, match="problems: expected at least one problem, got 0"):
        evaluation.accuracy(evaluation.score_completions([], [], numeric_correct), [],
                            completion_tokens=[])


def test_correctness_is_the_shared_reward_without_partial_credit():
    problems = task_problems("gsm_symbolic", 2, 0)
    p = problems[1]
    wrong = str(p["metadata"]["answer_value"] + 1)
    assert problems.score_answer(wrong, p) == 0.01  # reasoning-gym's partial credit
    assert evaluation.correctness(problems, p, wrong) == 0.0
    assert evaluation.correctness(problems, p, wrong, partial_credit=True) == 0.01
    assert evaluation.correctness(problems, p, p["answer"]) == 1.0
    assert evaluation.correctness(problems, p, None, partial_credit=True) == 0.0


class Problems:
    """reasoning-gym's scoring: 1.0 right, 0.01 a wrong answer."""

    def __getitem__(self, i):
        return {"answer": str(i)}

    def score_answer(self, answer, entry):
        return 1.0 if answer == entry["answer"] else 0.01


def test_a_wrong_answer_scores_as_no_answer_unless_partial_credit():
    texts = ["3", "no number", "<answer>4</answer>", "5", "2", "<answer>2</answer>"]
    plain = score_group(Problems(), [1, 2], texts, 3, 0.1)
    np.testing.assert_array_equal(plain["correctness"], [0, 0, 0, 0, 1, 1])
    np.testing.assert_array_equal(plain["formatted"], [0, 0, 1, 0, 0, 1])
    np.testing.assert_allclose(plain["reward"], [0, 0, 0.1, 0, 1, 1.1])
    partial = score_group(Problems(), [1, 2], texts, 3, 0.1, partial_credit=True)
    np.testing.assert_allclose(partial["correctness"], [0.01, 0, 0.01, 0.01, 1, 1])
    np.testing.assert_allclose(partial["reward"], [0.01, 0, 0.11, 0.01, 1, 1.1])
    # a group with no right answer and no format: no advantage for emitting a number
    group = score_group(Problems(), [1], ["3", "no number", "7"], 3, 0.1)
    adv, flat = group_advantages(group["reward"], 3, "group")
    assert flat == 1 and not adv.any()
    adv, _ = group_advantages(score_group(Problems(), [1], ["3", "no number", "7"], 3, 0.1,
                                          partial_credit=True)["reward"], 3, "group")
    assert abs(adv).max() > 0.5  # what partial credit pays for a number


ARGS = ["--task", "basic_arithmetic", "--train-size", "40", "--prompts-per-step", "2",
        "--group-size", "3", "--max-completion-tokens", "8", "--max-prompt-tokens", "120",
        "--pack-tokens", "200", "--memory-budget", "none", "--train-threads", "1",
        "--lr", "1e-2", "--lora-rank", "4", "--eval-size", "4", "--eval-every", "2"]


def test_grpo_held_out_points_in_metrics_and_eval_json_across_resume(tmp_path):
    run = tmp_path / "r"
    model = make_tiny_lm_dir(tmp_path / "tiny")
    train.main([*ARGS, "--model", str(model), "--run-dir", str(run), "--steps", "2"])
    first = json.loads((run / "eval.json").read_text())
    train.main([*ARGS, "--model", str(model), "--run-dir", str(run), "--steps", "3",
                "--resume"])
    ev = json.loads((run / "eval.json").read_text())
    assert ev["held_out"]["overlap"] == 0 and ev["held_out"]["size"] == 4
    assert [p["step"] for p in first["points"]] == [0, 2]
    assert first["after"]["task"]["from_point"] == 2  # the step-2 point, not evaluated again
    assert [p["step"] for p in ev["points"]] == [0, 2, 3]  # resumed: step 3 evaluated after
    assert ev["before"] == first["before"] and ev["before"]["task"]["n"] == 4
    assert ev["before"]["task"]["overlap"] == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert "eval_accuracy" not in rows[0] and "eval_accuracy" not in rows[2]
    lo, acc, hi = rows[1]["eval_ci95_low"], rows[1]["eval_accuracy"], rows[1]["eval_ci95_high"]
    assert lo <= acc <= hi and rows[1]["eval_n"] == 4 and "seconds_evaluate" in rows[1]
    assert ev["points"][1]["eval_accuracy"] == acc
    assert (run / "curve.png").stat().st_size > 0


def test_grpo_refuses_an_eval_size_the_task_cannot_hold_out(tmp_path):
    with pytest.raises(ValueError, match="--eval-size: .* --train-size 40"):
        train.main(["--task", "basic_arithmetic", "--task-config", TINY, "--train-size", "40",
                    "--eval-size", "50", "--run-dir", str(tmp_path / "x"),
                    "--model", str(make_tiny_lm_dir(tmp_path / "tiny"))])
    assert not (tmp_path / "x").exists()  # refused before the run directory is made
