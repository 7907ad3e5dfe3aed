"""Evaluation independent of the thread count (issue 49): greedy decoding runs on
``generation.EVAL_THREADS`` threads whatever the caller set, so the same greedy evaluation at 1
and at 2 threads gives the same tokens, and the caller's thread count is put back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.heavy import require

require("reasoning_gym", "transformers", "tokenizers")

from tests.tiny_lm import make_tiny_lm_dir  # noqa: E402
from trainers.llm.evaluation import evaluate  # noqa: E402
from trainers.llm.generation import EVAL_THREADS, fixed_threads, generate  # noqa: E402
from trainers.llm.model import load_causal_lm  # noqa: E402
from trainers.llm.settings import Sampling  # noqa: E402
from trainers.llm.tasks import render, task_problems  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_causal_lm(make_tiny_lm_dir(tmp_path_factory.mktemp("tiny")))


def greedy_at(model, tok, prompts, threads, seen):
    """Greedy tokens with the caller at ``threads`` threads; ``seen`` collects the thread
    count every forward of the model ran with."""
    hook = model.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    try:
        with fixed_threads(threads):
            out = generate(model, tok, prompts, Sampling(max_completion_tokens=24,
                                                         generation_batch=5),
                           n_per_prompt=1, greedy=True)
            assert torch.get_num_threads() == threads  # the caller's count is back
    finally:
        hook.remove()
    return out


def test_greedy_tokens_are_the_same_at_one_and_two_threads(tiny):
    model, tok = tiny
    problems = task_problems("basic_arithmetic", 12, 3)
    prompts = [np.asarray(tok(render(tok, p["question"]), add_special_tokens=False)
                          ["input_ids"], np.int64) for p in problems]
    seen1, seen2 = [], []
    one = greedy_at(model, tok, prompts, 1, seen1)
    two = greedy_at(model, tok, prompts, 2, seen2)
    assert len(one) == len(two) == 12
    for (a, ta), (b, tb) in zip(one, two, strict=True):
        np.testing.assert_array_equal(a, b)
        assert ta == tb
    # Every decoding forward ran on EVAL_THREADS, whatever the caller had set.
    assert seen1 and seen2 and set(seen1) == set(seen2) == {EVAL_THREADS}


def test_sampling_keeps_the_callers_threads(tiny):
    model, tok = tiny
    prompt = [np.asarray(tok("What is 2 + 3?", add_special_tokens=False)["input_ids"])]
    seen = []
    hook = model.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    try:
        with fixed_threads(2):
            generate(model, tok, prompt, Sampling(max_completion_tokens=4), n_per_prompt=2)
    finally:
        hook.remove()
    assert set(seen) == {2}


def test_the_held_out_evaluation_is_the_same_at_one_and_two_threads(tiny):
    model, tok = tiny
    problems = [dict(p) for p in task_problems("basic_arithmetic", 10, 11)]
    correct = lambda a, p: float(a == p["answer"])  # noqa: E731
    results = []
    for threads in (1, 2):
        with fixed_threads(threads):
            results.append(evaluate(model, tok, problems, Sampling(max_completion_tokens=16),
                                    correct))
    assert results[0] == results[1]


def test_fixed_threads_puts_the_count_back_on_error():
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="boom"), fixed_threads(1):
        raise RuntimeError("boom")
    assert torch.get_num_threads() == before
