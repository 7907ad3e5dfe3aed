"""GRPO's held-out evaluation (``trainers/llm/evaluation.py``): the task's problems disjoint
from the training problems, ASDiv as a transfer set, each result with a 95% Wilson interval;
before the first step, every ``--eval-every`` steps (task only) and after the last."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from trainers.llm.evaluation import (
    HELD_OUT_SEED,
    CorrectFn,
    Key,
    evaluate,
    held_out,
    numeric_correct,
    task_correct,
    training_keys,
)
from trainers.llm.settings import Sampling
from trainers.llm.tasks import asdiv_problems
from trainers.summary import format_eval

log = logging.getLogger("trainers.grpo")


@dataclass
class EvalSets:
    """The held-out sets of a run: ``task`` problems (disjoint from training by content),
    their ``report`` (``held_out``'s), ``asdiv`` problems, the training ``keys`` and the
    task's ``correct`` function."""

    task: list[dict[str, Any]]
    report: dict[str, Any]
    asdiv: list[dict[str, Any]]
    keys: set[Key]
    correct: CorrectFn = field(repr=False)


def eval_sets(task: str, task_config: str, train_problems: Any, eval_size: int,
              eval_asdiv: int, seed: int) -> EvalSets:
    """Build the held-out sets of a run (``eval_size`` task problems, ``eval_asdiv`` ASDiv
    problems, -1 all) and log the held-out report.

    Raises:
        ValueError: the task has fewer than ``eval_size`` problems disjoint from training
            (``--eval-size`` / ``--train-size`` named).
    """
    keys = training_keys(train_problems)
    problems, report = held_out(task, task_config, train_problems, eval_size,
                                seed + HELD_OUT_SEED) if eval_size else ([], {})
    if report:
        log.info("held-out set: %d %s problems, overlap with the %d training problems %d "
                 "(%d candidates, %d dropped as training problems); a set drawn with another "
                 "seed alone would have shared %d questions / %d operand keys of %d",
                 len(problems), task, report["train_problems"], report["overlap"],
                 report["candidates"], report["dropped_training"],
                 report["seed_scheme_overlap"]["question"],
                 report["seed_scheme_overlap"]["operands"], report["seed_scheme_overlap"]["n"])
    asdiv = asdiv_problems(eval_asdiv) if eval_asdiv else []
    return EvalSets(problems, report, asdiv, keys, task_correct(task, task_config))


def announce(sets: EvalSets, steps: int, eval_every: int, max_tokens: int) -> str:
    """Log (INFO) and return what the run will evaluate, before anything is: ``held-out
    evaluations: 20 task problems before step 1 and after step 3 (greedy, up to 64 tokens
    each; --no-evaluate skips them)`` (a short run spends much of its time there); nothing
    without held-out sets (``--no-evaluate``, ``--eval-size 0``)."""
    if not (sets.task or sets.asdiv):
        return ""
    sizes = " + ".join(f"{len(s)} {name} problems" for name, s in
                       (("task", sets.task), ("asdiv", sets.asdiv)) if s)
    every = f", every {eval_every} steps ({len(sets.task)} task problems)" if eval_every else ""
    line = (f"held-out evaluations: {sizes} before step 1{every} and after step "
            f"{steps} (greedy, up to {max_tokens} tokens each; --no-evaluate skips them)")
    log.info("%s", line)
    return line


def evaluate_sets(model: Any, tok: Any, sampling: Sampling, sets: EvalSets, *,
                  asdiv: bool = True, label: str = "") -> dict[str, Any]:
    """Greedy accuracy on the held-out task problems and (``asdiv``) ASDiv: ``{"task": ...,
    "asdiv": ...}`` for the non-empty sets, each ``evaluation.evaluate``'s result (accuracy,
    n, ci95, overlap, answered, formatted, completion_tokens_mean)."""
    out: dict[str, Any] = {}
    if sets.task:
        out["task"] = evaluate(model, tok, sets.task, sampling, sets.correct,
                               train_keys=sets.keys, progress=f"held-out evaluation {label}: "
                               f"{len(sets.task)} task problems")
    if asdiv and sets.asdiv:
        out["asdiv"] = evaluate(model, tok, sets.asdiv, sampling, numeric_correct,
                                train_keys=sets.keys, progress=f"held-out evaluation {label}: "
                                f"{len(sets.asdiv)} asdiv problems")
    if out:
        log.info("held-out accuracy %s: %s", label, format_eval(out))
    return out


def point(step: int, result: dict[str, Any]) -> dict[str, Any]:
    """A held-out point's fields in a metrics row: ``eval_accuracy``, ``eval_ci95_low``,
    ``eval_ci95_high``, ``eval_n``, ``eval_overlap`` (``step`` too)."""
    return {"step": step, "eval_accuracy": result["accuracy"],
            "eval_ci95_low": result["ci95"][0], "eval_ci95_high": result["ci95"][1],
            "eval_n": result["n"], "eval_overlap": result["overlap"]}
