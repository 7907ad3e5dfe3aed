"""Held-out evaluation: greedy accuracy on the task's held-out problems (and ASDiv), each with
a 95% Wilson interval."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from trainers.llm.generation import generate
from trainers.llm.settings import Sampling
from trainers.llm.tasks import extract_answer, numeric_match, render, wilson
from trainers.phases import heartbeat


@torch.no_grad()
def evaluate(model: Any, tok: Any, sampling: Sampling, problems: Any,
             asdiv: list[dict[str, Any]]) -> dict[str, Any]:
    """Greedy accuracy (one completion per problem, ``sampling``'s length limit and batch) on
    ``problems`` (a reasoning-gym dataset: its ``score_answer`` == 1 counts) and ``asdiv``
    (numeric match). Returns ``{set: {"accuracy", "n", "ci95": [lo, hi]}}`` for the non-empty
    sets."""
    out: dict[str, Any] = {}
    sets = [("task", problems, lambda a, e: float(problems.score_answer(a, e) == 1.0))]
    sets += [("asdiv", asdiv, lambda a, e: numeric_match(a, e["answer"]))] if asdiv else []
    for name, items, correct in sets:
        if not items or not len(items):
            continue
        prompts = [np.array(tok(render(tok, e["question"]), add_special_tokens=False)
                            ["input_ids"]) for e in items]
        with heartbeat(f"held-out evaluation: {len(prompts)} {name} problems"):
            texts = [tok.decode(c, skip_special_tokens=True)
                     for c, _ in generate(model, tok, prompts, sampling, n_per_prompt=1,
                                          greedy=True)]
        hits = [correct(extract_answer(t)[0], e) if extract_answer(t)[0] else 0.0
                for t, e in zip(texts, items, strict=True)]
        k, n = float(sum(hits)), len(hits)
        out[name] = {"accuracy": k / n, "n": n, "ci95": list(wilson(k, n))}
    return out
