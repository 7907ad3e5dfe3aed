"""GRPO's rewards: the answer's correctness (reasoning-gym's ``score_answer``) plus a format
reward for an answer written inside ``<answer></answer>``."""

from __future__ import annotations

from typing import Any

import numpy as np

from trainers.llm.tasks import extract_answer


def score_group(problems: Any, indices: list[int], texts: list[str], group_size: int,
                format_reward: float) -> dict[str, np.ndarray]:
    """Rewards of completions (``group_size`` per problem, in order; ``indices``: the problems'
    indices in ``problems``, one per group): reasoning-gym's ``score_answer`` on the extracted
    answer (1.0 correct, 0.01 a wrong number, 0 none) plus ``format_reward`` when the answer
    is formatted. Returns float32 ``correctness``, bool ``formatted`` and float32 ``reward``,
    each ``[len(texts)]``."""
    correct, fmt = [], []
    for k, text in enumerate(texts):
        entry = problems[indices[k // group_size]]
        answer, formatted = extract_answer(text)
        correct.append(float(problems.score_answer(answer, entry)) if answer else 0.0)
        fmt.append(formatted)
    c, f = np.array(correct, np.float32), np.array(fmt, bool)
    return {"correctness": c, "formatted": f, "reward": c + format_reward * f}
