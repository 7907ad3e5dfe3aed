"""Held-out evaluation shared by the LLM trainers: problems disjoint from training by content,
greedy accuracy with a 95% Wilson interval, and transfer sets (ASDiv).

A held-out set drawn from the task with another seed is not held out when the task's problem
space is small: single-digit addition with 2,000 training problems repeats most of its
questions under any seed. Here a problem's identity is its *content*, not its seed and index:

- ``content_keys(question)``: the question's normalised text (lower case, whitespace and
  punctuation removed) and, when it holds numbers, its operand key: the sorted numbers
  (signs kept) with the distinct operations the question names, whatever its wording
  (``trainers.llm.operations``: symbols between operands, spaced or not, and operation
  words such as add / plus / sum, minus / subtract / difference, times / multiply /
  product, divide / quotient). ``Calculate 3 + 5.``, ``Calculate 5 + 3.``, ``What is
  3+5?``, ``Add 3 and 5`` and ``What is the sum of 5 and 3?`` share the operand key, and so
  do ``-( 4 + -9 )`` and ``4 + -9``: conservative, a candidate is dropped if *any* of its
  keys is a training problem's key (a word problem naming the numbers of a sum drops that
  sum from the held-out set).
- ``held_out(task, task_config, train_problems, size, seed)``: draws candidates from the task
  (at most ``max_draws`` draws of ``chunk = max(2 * size, 256)``, with seeds ``seed, seed +
  chunk, ...``: reasoning-gym seeds item i with ``seed + i``, so the draws never repeat),
  drops every candidate sharing a key with a training problem or with an already kept
  candidate, and returns ``(problems, report)``; ``report`` has the recomputed ``overlap``
  (0), how many candidates were drawn and dropped, and ``seed_scheme_overlap``: how many of
  the first ``size`` problems of seed ``seed`` (the old "disjoint seed" set) were training
  problems by text and by operand key.
  Raises ``ValueError`` naming ``--eval-size`` and ``--train-size`` when fewer than ``size``
  disjoint problems turn up.
- ``evaluate(model, tok, problems, sampling, correct_fn, *, train_keys=None, progress=None)``:
  one greedy completion per problem (``sampling``'s ``max_completion_tokens`` and batch
  plan), the answer extracted by ``tasks.extract_answer`` (inside ``<answer></answer>``, else
  the last number) and scored by ``correct_fn(answer, problem) -> 1.0 | 0.0``. Returns
  ``{"accuracy", "n", "ci95": [lo, hi], "overlap", "answered", "formatted",
  "completion_tokens_mean"}``; ``overlap`` is the number of ``problems`` sharing a content
  key with ``train_keys`` (``None`` when not given).
- ``score_completions(texts, problems, correct_fn)``: the per-question results of one
  completion per problem (``correct``, ``answered``, ``formatted``), and ``accuracy(scored,
  problems, ...)``: their accuracy, Wilson interval and overlap (``evaluate``'s result); a
  trainer with its own episodes (guidance's two turns) scores each turn with these.
- ``correctness(problems, entry, answer, partial_credit)``: the reward of an answer under
  reasoning-gym's ``score_answer``: 1.0 right, 0.0 for a wrong number and for no answer alike
  (``partial_credit``: the score itself, 0.01 for a wrong number); ``task_correct(task,
  task_config)``: the task's ``correct_fn`` (``correctness`` without partial credit);
  ``numeric_correct``: the ``correct_fn`` of ASDiv-style ``{"question", "answer"}`` dicts
  (equal first numbers).
- ``training_keys(problems)``: the union of the problems' content keys; ``HELD_OUT_SEED``:
  the held-out candidates' seed offset from the run's seed.

A trainer builds the set once at start (from its training problems), calls ``evaluate``
before training, every ``--eval-every`` steps and after, and writes the report and the
results to ``eval.json``; an interval point goes into its metrics row with its interval.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

from trainers.llm.generation import generate
from trainers.llm.operations import operations
from trainers.llm.settings import Sampling
from trainers.llm.tasks import extract_answer, numeric_match, render, task_problems
from trainers.statistics import wilson

Key = tuple[Any, ...]
CorrectFn = Callable[[str | None, dict[str, Any]], float]

#: The held-out set's seed offset from the run's seed (the candidates' first seed).
HELD_OUT_SEED = 1_000_003

_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?")
_NOT_WORD = re.compile(r"[^0-9a-z+\-*/×÷]+")


def content_keys(question: str) -> frozenset[Key]:
    """The content keys of a question: ``("text", normalised text)`` and, when it holds
    numbers, ``("operands", sorted numbers, operations)`` (numbers as floats, so ``7`` and
    ``7.0`` agree; ``operations``: the sorted distinct operator symbols the question names
    by symbol or word, ``trainers.llm.operations.operations``)."""
    q = question.lower()
    keys: set[Key] = {("text", _NOT_WORD.sub("", q))}
    numbers = [float(n) for n in _NUMBER.findall(q)]
    if numbers:
        keys.add(("operands", tuple(sorted(numbers)), operations(q)))
    return frozenset(keys)


def training_keys(problems: Iterable[dict[str, Any]]) -> set[Key]:
    """The union of the content keys of ``problems`` (dicts with a ``"question"``)."""
    out: set[Key] = set()
    for p in problems:
        out |= content_keys(p["question"])
    return out


def overlap(problems: Iterable[dict[str, Any]], keys: set[Key]) -> int:
    """How many of ``problems`` share a content key with ``keys``."""
    return sum(1 for p in problems if content_keys(p["question"]) & keys)


def held_out(task: str, task_config: str, train_problems: Iterable[dict[str, Any]], size: int,
             seed: int, *, max_draws: int = 8) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``size`` problems of reasoning-gym's ``task`` (``task_config``: JSON keyword arguments)
    that share no content key with ``train_problems`` nor with each other, drawn with seeds
    ``seed, seed + chunk, ...`` (at most ``max_draws`` draws of ``chunk = max(2 * size,
    256)`` candidates). Returns the problems (dicts) and a report: ``overlap`` (recomputed on the
    result: 0), ``candidates`` drawn, ``dropped_training`` (sharing a key with a training
    problem), ``dropped_duplicate``, ``generation_failed`` (candidates the task could not
    make: :func:`generated`), ``train_problems``, and ``seed_scheme_overlap``
    (``{"question", "operands", "n"}``: the first ``size`` candidates of seed ``seed``, i.e.
    a held-out set drawn with another seed and nothing else, that are training problems by
    normalised text / by operand key).

    Raises:
        ValueError: ``size`` < 1, or fewer than ``size`` disjoint problems were found
            (``--eval-size`` and ``--train-size`` named, with the count found).
    """
    if size < 1:
        raise ValueError(f"--eval-size: expected >= 1, got {size}")
    train = list(train_problems)
    keys = training_keys(train)
    texts = {k for k in keys if k[0] == "text"}
    operands = {k for k in keys if k[0] == "operands"}
    chunk = max(2 * size, 256)
    kept: list[dict[str, Any]] = []
    seen: set[Key] = set()
    drawn = dropped_training = dropped_duplicate = failed = 0
    first: list[dict[str, Any]] = []
    for draw in range(max_draws):
        # reasoning-gym seeds item i with seed + i: draws of seeds ``chunk`` apart never repeat
        candidates, unmade = generated(task_problems(task, chunk, seed + draw * chunk,
                                                     task_config))
        failed += unmade
        if draw == 0:
            first = candidates[:size]
        for p in candidates:
            drawn += 1
            k = content_keys(p["question"])
            if k & keys:
                dropped_training += 1
            elif k & seen:
                dropped_duplicate += 1
            else:
                kept.append(dict(p))
                seen |= k
                if len(kept) == size:
                    break
        if len(kept) == size:
            break
    if len(kept) < size:
        raise ValueError(
            f"--eval-size: expected at most the number of {task} problems disjoint from the "
            f"training problems, got {size}: {len(kept)} disjoint problems in {drawn} "
            f"candidates ({dropped_training} are training problems of --train-size "
            f"{len(train)}, {dropped_duplicate} repeats); lower --eval-size or --train-size, "
            f"or widen --task-config")
    report = {
        "task": task, "task_config": json.loads(task_config), "seed": seed, "size": size,
        "train_problems": len(train), "candidates": drawn,
        "dropped_training": dropped_training, "dropped_duplicate": dropped_duplicate,
        "generation_failed": failed,
        "overlap": overlap(kept, keys),
        "seed_scheme_overlap": {
            "n": len(first),
            "question": sum(1 for p in first if content_keys(p["question"]) & texts),
            "operands": sum(1 for p in first if content_keys(p["question"]) & operands)},
    }
    return kept, report


def generated(dataset: Any) -> tuple[list[dict[str, Any]], int]:
    """The problems of a reasoning-gym ``dataset`` that it can make, and how many it could
    not (``basic_arithmetic`` raises ZeroDivisionError for a few seeds, where its expression
    divides by zero: a held-out draw of tens of thousands of candidates meets one)."""
    made, failed = [], 0
    for i in range(len(dataset)):
        try:
            made.append(dataset[i])
        except Exception:  # noqa: BLE001 - the dataset's own bug, whatever its type
            failed += 1
    return made, failed


def correctness(problems: Any, entry: dict[str, Any], answer: str | None,
                partial_credit: bool = False) -> float:
    """An answer's correctness (a reward) under reasoning-gym's ``problems.score_answer``:
    1.0 right, else 0.0, so a wrong number scores what no answer scores (``partial_credit``:
    the score itself, e.g. 0.01 for a wrong number of ``gsm_symbolic``); 0.0 without an
    answer (``None``)."""
    if answer is None:
        return 0.0
    score = float(problems.score_answer(answer, entry))
    return score if partial_credit else float(score == 1.0)


def task_correct(task: str, task_config: str) -> CorrectFn:
    """The ``correct_fn`` of reasoning-gym's ``task``: :func:`correctness` without partial
    credit (1.0 when ``score_answer`` is 1.0, else 0.0: a wrong number and no answer alike)."""
    scorer = task_problems(task, 1, 0, task_config)

    def correct(answer: str | None, problem: dict[str, Any]) -> float:
        return correctness(scorer, problem, answer)

    return correct


def numeric_correct(answer: str | None, problem: dict[str, Any]) -> float:
    """The ``correct_fn`` of ``{"question", "answer"}`` dicts (ASDiv): equal first numbers."""
    return numeric_match(answer, str(problem["answer"]))


def score_completions(texts: Sequence[str], problems: Sequence[dict[str, Any]],
                      correct_fn: CorrectFn) -> dict[str, np.ndarray]:
    """Per-question results of one completion per problem (``texts[i]`` answers
    ``problems[i]``): the answer extracted by ``tasks.extract_answer``, scored by
    ``correct_fn``. Returns ``correct`` float64 ``[n]`` (0.0 without an answer), ``answered``
    bool ``[n]`` (an answer was extracted) and ``formatted`` bool ``[n]`` (inside
    ``<answer></answer>``).

    Raises:
        ValueError: ``texts`` and ``problems`` differ in length.
    """
    if len(texts) != len(problems):
        raise ValueError(f"texts: expected one completion per problem ({len(problems)}), got "
                         f"{len(texts)}")
    correct, answered, formatted = [], [], []
    for text, p in zip(texts, problems, strict=True):
        answer, tagged = extract_answer(text)
        correct.append(correct_fn(answer, p) if answer is not None else 0.0)
        answered.append(answer is not None)
        formatted.append(tagged)
    return {"correct": np.asarray(correct, np.float64), "answered": np.asarray(answered, bool),
            "formatted": np.asarray(formatted, bool)}


def accuracy(scored: dict[str, np.ndarray], problems: Sequence[dict[str, Any]], *,
             completion_tokens: Sequence[int], train_keys: set[Key] | None = None
             ) -> dict[str, Any]:
    """The result of per-question results ``scored`` (:func:`score_completions`' of
    ``problems``; ``completion_tokens``: each completion's length in tokens): ``{"accuracy",
    "n", "ci95": [lo, hi]`` (Wilson score interval, 95%), ``"overlap"`` (problems sharing a
    content key with ``train_keys``; ``None`` without them), ``"answered"``, ``"formatted"``
    (fractions), ``"completion_tokens_mean"}``.

    Raises:
        ValueError: no problem.
    """
    k, n = float(scored["correct"].sum()), len(scored["correct"])
    if n == 0:
        raise ValueError("problems: expected at least one problem, got 0")
    return {"accuracy": k / n, "n": n, "ci95": [round(x, 6) for x in wilson(k, n)],
            "overlap": None if train_keys is None else overlap(problems, train_keys),
            "answered": float(np.mean(scored["answered"])),
            "formatted": float(np.mean(scored["formatted"])),
            "completion_tokens_mean": float(np.mean(completion_tokens))}


@torch.no_grad()
def evaluate(model: Any, tok: Any, problems: list[dict[str, Any]], sampling: Sampling,
             correct_fn: CorrectFn, *, train_keys: set[Key] | None = None,
             progress: str | None = None, chunk: int = 64) -> dict[str, Any]:
    """Greedy accuracy of ``model`` on ``problems`` (dicts with a ``"question"``; one
    completion each, up to ``sampling.max_completion_tokens``, generated ``chunk`` prompts
    at a time): :func:`accuracy` of :func:`score_completions`. ``progress``: the label of
    the lines logged while it runs (``trainers.phases.heartbeat``), now and every few
    seconds with the problems done: ``<progress> 16 s: 7 of 20 problems done...``.

    Raises:
        ValueError: ``problems`` is empty.
    """
    scored, lengths = greedy_scores(model, tok, problems, sampling, correct_fn,
                                    progress=progress, chunk=chunk)
    return accuracy(scored, problems, completion_tokens=lengths, train_keys=train_keys)


@torch.no_grad()
def greedy_scores(model: Any, tok: Any, problems: list[dict[str, Any]], sampling: Sampling,
                  correct_fn: CorrectFn, *, progress: str | None = None, chunk: int = 64
                  ) -> tuple[dict[str, np.ndarray], list[int]]:
    """:func:`evaluate`'s per-problem results before they are summed: :func:`score_completions`
    of one greedy completion per problem (``correct`` float64 ``[n]`` ...) and each
    completion's length in tokens (for paired comparisons of two checkpoints on the same
    problems).

    Raises:
        ValueError: ``problems`` is empty.
    """
    from trainers.phases import Count, heartbeat

    if not problems:
        raise ValueError("problems: expected at least one problem, got 0")
    count = Count(len(problems), "problems done")
    with heartbeat(progress, count=count) if progress else contextlib.nullcontext():
        texts, lengths = _greedy(model, tok, problems, sampling, chunk, count)
    return score_completions(texts, problems, correct_fn), lengths


def _greedy(model: Any, tok: Any, problems: list[dict[str, Any]], sampling: Sampling,
            chunk: int, count: Any) -> tuple[list[str], list[int]]:
    """One greedy completion per problem, ``chunk`` prompts per generate call: the texts and
    their lengths in tokens (``count.add`` told as completions finish)."""
    texts, lengths = [], []
    for s in range(0, len(problems), chunk):
        part = problems[s:s + chunk]
        prompts = [np.asarray(tok(render(tok, p["question"]), add_special_tokens=False)
                              ["input_ids"], np.int64) for p in part]
        outs = generate(model, tok, prompts, sampling, n_per_prompt=1, greedy=True,
                        on_finished=count.add)
        for completion, _ in outs:
            texts.append(tok.decode(completion, skip_special_tokens=True))
            lengths.append(len(completion))
    return texts, lengths


def separated(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two results' 95% intervals are disjoint."""
    return bool(a["ci95"][1] < b["ci95"][0] or b["ci95"][1] < a["ci95"][0])

