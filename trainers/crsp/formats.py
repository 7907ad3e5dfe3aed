"""What each CRSP role is asked to write, and how its text is read: the system prompts (each
with one worked example), the opening tag prefilled into the assistant turn (proposer
``<problem>``, critic ``<verdict>``), the closing text a completion is cut at, the critic's
two verdicts, and the format score (partial credit per part of the format, in [0, 1])."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from trainers.llm.tasks import ANSWER_RE, NUMBER_RE, SYSTEM

PROPOSER_SYSTEM = (
    "You write new math word problems. Read the example problem, then write a different "
    "problem of the same kind inside <problem></problem> and its numeric answer inside "
    "<answer></answer>.\n"
    "Example problem: What is 3 + 4?\n"
    "You write: <problem>Tom has 5 pens and buys 2 more. How many pens does he have?</problem>"
    "<answer>7</answer>")
#: The proposer's system prompt with ``--proposer-reward learnability``: a problem whose
#: numbers and operation are stated (so ``trainers.crsp.verify`` can confirm its answer).
PROPOSER_SYSTEM_VERIFIABLE = (
    "You write new math problems. Read the example problem, then write a different problem "
    "of the same kind that states its numbers and its operation inside <problem></problem> "
    "and its correct numeric answer inside <answer></answer>.\n"
    "Example problem: What is 3 + 4?\n"
    "You write: <problem>What is the sum of 12 and 5?</problem><answer>17</answer>")
SOLVER_SYSTEM = (SYSTEM + "\nExample problem: What is 2 + 5?\n"
                 "You write: 2 + 5 = 7. <answer>7</answer>")
CRITIC_SYSTEM = (
    "You check solutions to math problems. First write your verdict, "
    "<verdict>correct</verdict> or <verdict>incorrect</verdict>, then one short sentence why.\n"
    "Example problem: What is 6 + 3?\nExample solution: 6 + 3 = 8. <answer>8</answer>\n"
    "You write: <verdict>incorrect</verdict> 6 + 3 is 9, not 8.")
SYSTEMS = {"proposer": PROPOSER_SYSTEM, "solver": SOLVER_SYSTEM, "critic": CRITIC_SYSTEM}
#: Text appended to the assistant turn of each role's prompt: the completion continues it.
PREFILL = {"proposer": "<problem>", "solver": "", "critic": "<verdict>"}
#: A completion is cut right after the first occurrence of this text (None: at EOS only).
STOP = {"proposer": "</answer>", "solver": "</answer>", "critic": None}
#: The critic's verdict is one of these two continuations of ``<verdict>`` (True: correct).
VERDICTS = {True: "correct</verdict>", False: "incorrect</verdict>"}
PROBLEM_RE = re.compile(r"<problem>(.*?)</problem>", re.S)
REASON_RE = re.compile(r"[^\W_]")  # a letter or a digit


def render(tok: Any, role: str, user: str, verifiable: bool = False) -> str:
    """``role``'s chat prompt of ``user``'s message, assistant header and prefill (text);
    ``verifiable``: the proposer is asked for a problem whose answer can be verified
    (:data:`PROPOSER_SYSTEM_VERIFIABLE`)."""
    system = PROPOSER_SYSTEM_VERIFIABLE if verifiable and role == "proposer" else SYSTEMS[role]
    text = tok.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": user}],
        add_generation_prompt=True, tokenize=False)
    return str(text) + PREFILL[role]


def cut_at_stop(tok: Any, ids: np.ndarray, stop: str | None) -> tuple[np.ndarray, bool]:
    """``(ids[:k], True)`` with ``k`` the fewest tokens whose text holds ``stop`` (the
    completion stops at its closing tag); ``(ids, False)`` when it never does."""
    if stop is None or stop not in tok.decode(ids, skip_special_tokens=True):
        return ids, False
    k = next(k for k in range(1, len(ids) + 1)
             if stop in tok.decode(ids[:k], skip_special_tokens=True))
    return ids[:k], True


def proposal_parts(text: str) -> tuple[str | None, str | None]:
    """``(problem, answer)`` of a proposer text that starts after the prefilled
    ``<problem>``: the problem up to ``</problem>`` (None: no closing tag or empty), and the
    first number inside the following ``<answer></answer>`` (None: none)."""
    found = PROBLEM_RE.search("<problem>" + text)
    if found is None or not found.group(1).strip():
        return None, None
    answers = ANSWER_RE.findall(text[found.end() - len("<problem>"):])
    numbers = NUMBER_RE.findall(answers[0]) if answers else []
    return found.group(1).strip(), numbers[0].replace(",", "") if numbers else None


def has_reason(text: str) -> bool:
    """Whether a critic text (after the prefilled ``<verdict>``) has a reason after its
    ``</verdict>``: some letter or digit, not only spaces or punctuation."""
    _, closed, reason = text.partition("</verdict>")
    return bool(closed) and REASON_RE.search(reason) is not None


def format_score(role: str, text: str, ended: bool) -> float:
    """Partial credit for ``role``'s format, in [0, 1] (``text``: the completion after the
    prefill; ``ended``: it stopped at its closing tag or EOS, not at its length limit).

    - proposer: a closed non-empty ``<problem>``, an ``<answer></answer>`` after it, a number
      in that answer: 1/3 each;
    - solver: an ``<answer></answer>`` (1/2), a number in it (1/2);
    - critic (its verdict is always well formed, chosen between :data:`VERDICTS`): 1 when
      the reason after ``</verdict>`` is non-empty (holds a letter or digit) and ended before
      the length limit, else 0: a verdict followed at once by EOS earns no format credit.
    """
    if role == "proposer":
        problem, answer = proposal_parts(text)
        tagged = problem is not None and bool(ANSWER_RE.search(text.split("</problem>", 1)[1]))
        return (float(problem is not None) + float(tagged) + float(answer is not None)) / 3
    if role == "solver":
        answers = ANSWER_RE.findall(text)
        return 0.5 * bool(answers) + 0.5 * bool(answers and NUMBER_RE.search(answers[-1]))
    if role == "critic":
        return float(ended and has_reason(text))
    raise ValueError(f"role: expected proposer, solver or critic, got {role!r}")


def format_scores(role: str, texts: Sequence[str], ended: Sequence[bool]) -> np.ndarray:
    """:func:`format_score` of each completion (float32[N])."""
    return np.array([format_score(role, t, e) for t, e in zip(texts, ended, strict=True)],
                    np.float32)
