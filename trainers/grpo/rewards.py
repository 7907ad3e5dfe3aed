"""GRPO's rewards: ``reward = correctness + format_reward * formatted``.

``correctness`` is 1.0 for a right answer and 0 for a wrong one and for no answer alike, so a
group whose completions are all wrong has equal rewards (no advantage) instead of paying for
merely emitting a number: reasoning-gym's ``score_answer`` gives a wrong number 0.01, which
in a group with no right answer made group-normalised advantages of about +-0.87 between a
completion with a number and one without. ``--partial-credit`` keeps ``score_answer``'s value
(0.01 for a wrong number, or a task's own partial scores). ``formatted`` is whether the
answer is written inside ``<answer></answer>``; ``--format-reward`` (0.1) is its weight, a
separate term that rewards the format whatever the answer. ``correctness`` is the LLM
trainers' shared reward (``trainers.llm.evaluation.correctness``; guidance uses it too)."""

from __future__ import annotations

from typing import Any

import numpy as np

from trainers.llm.evaluation import correctness
from trainers.llm.tasks import extract_answer


def score_group(problems: Any, indices: list[int], texts: list[str], group_size: int,
                format_reward: float, partial_credit: bool = False) -> dict[str, np.ndarray]:
    """Rewards of completions (``group_size`` per problem, in order; ``indices``: the problems'
    indices in ``problems``, one per group): ``correctness`` (see :func:`correctness`) plus
    ``format_reward`` when the answer is inside ``<answer></answer>``. Returns float32
    ``correctness``, bool ``formatted`` and float32 ``reward``, each ``[len(texts)]``."""
    correct, fmt = [], []
    for k, text in enumerate(texts):
        answer, formatted = extract_answer(text)
        correct.append(correctness(problems, problems[indices[k // group_size]], answer,
                                   partial_credit))
        fmt.append(formatted)
    c, f = np.array(correct, np.float32), np.array(fmt, bool)
    return {"correctness": c, "formatted": f, "reward": c + format_reward * f}
