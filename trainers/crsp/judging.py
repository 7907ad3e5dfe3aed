"""Which solver attempts the critic judges in a step (``--critic-batch``).

- ``balanced`` (the default since issue 49): as many correct as incorrect attempts, every one
  with ground truth (a seed problem, scored by the task's verifier, or a proposal whose answer
  the verifier confirmed). Of the step's attempts, up to ``m = ceil(critiques_per_problem *
  problems / 2)`` of each class, taken round-robin over the problems (each problem's first
  attempt of the class, then its second ...), so one problem does not fill a class; a class
  short of ``m`` is topped up from a :class:`Reservoir` of earlier steps' attempts of that
  class, and both classes are then cut to the smaller count. Why: in the 44-step issue-36
  run 94% of the judged attempts were incorrect and 26 of 44 steps judged one class only, so
  the verdict was pushed to "incorrect" with nothing against it (its margin learned to rank,
  AUC 0.48 -> 0.65, while its verdict stayed at the majority class).
- ``first``: the first ``--critiques-per-problem`` attempts of every problem (runs before
  issue 49)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

#: ``--critic-batch`` choices.
CRITIC_BATCHES = ("balanced", "first")


@dataclass(frozen=True)
class Judged:
    """An attempt the critic judges: its problem's text, the attempt's text, its class
    (``truth``: the verifier's label) and where it comes from (``(problem, attempt)`` of this
    step, None for one drawn from the :class:`Reservoir`)."""

    problem: str
    attempt: str
    truth: bool
    source: tuple[int, int] | None


class Reservoir:
    """The newest ``capacity`` attempts of each class (problem and attempt texts) from earlier
    steps, to top up a class a step is short of (plain data: checkpointed)."""

    def __init__(self, capacity: int = 64) -> None:
        if capacity < 0:
            raise ValueError(f"capacity: expected >= 0 attempts per class, got {capacity}")
        self.capacity = capacity
        self.items: dict[bool, list[list[str]]] = {True: [], False: []}

    def add(self, truth: bool, items: list[tuple[str, str]]) -> None:
        """Keep ``items`` (problem, attempt) of class ``truth``; the oldest drop out."""
        kept = self.items[truth] + [[p, a] for p, a in items]
        self.items[truth] = kept[max(0, len(kept) - self.capacity):]

    def draw(self, truth: bool, n: int) -> list[Judged]:
        """Up to ``n`` attempts of class ``truth``, uniformly without replacement (torch's
        global generator: checkpointed with the run's RNG)."""
        pool = self.items[truth]
        pick = torch.randperm(len(pool))[:n].tolist() if n > 0 and pool else []
        return [Judged(pool[i][0], pool[i][1], truth, None) for i in pick]

    def state_dict(self) -> dict[str, Any]:
        return {"capacity": self.capacity, "correct": self.items[True],
                "incorrect": self.items[False]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.capacity = int(state["capacity"])
        self.items = {True: [list(x) for x in state["correct"]],
                      False: [list(x) for x in state["incorrect"]]}


def round_robin(outcome: list[list[float]], truth: bool) -> list[tuple[int, int]]:
    """``(problem, attempt)`` of every attempt of class ``truth`` in ``outcome`` (per problem,
    1.0 / 0.0 per attempt), each problem's first such attempt first, then its second ..."""
    per = [[j for j, o in enumerate(row) if bool(o) == truth] for row in outcome]
    return [(k, js[r]) for r in range(max(map(len, per), default=0))
            for k, js in enumerate(per) if r < len(js)]


def select(mode: str, problems: list[str], texts: list[list[str]],
           outcome: list[list[float]], per_problem: int, reservoir: Reservoir | None
           ) -> list[Judged]:
    """The step's judged attempts (module docstring) of ``problems`` (texts), their attempts
    ``texts[k][j]`` and labels ``outcome[k][j]`` (1.0: correct); ``per_problem``:
    ``--critiques-per-problem``. With ``balanced`` the step's attempts are added to the
    ``reservoir`` afterwards.

    Raises:
        ValueError: an unknown ``mode``.
    """
    if mode == "first":
        return [Judged(problems[k], texts[k][j], bool(outcome[k][j]), (k, j))
                for k in range(len(problems)) for j in range(min(per_problem, len(texts[k])))]
    if mode != "balanced":
        raise ValueError(f"mode: expected one of {CRITIC_BATCHES}, got {mode!r}")
    m = math.ceil(per_problem * len(problems) / 2)
    chosen: dict[bool, list[Judged]] = {}
    for y in (True, False):
        here = [Judged(problems[k], texts[k][j], y, (k, j))
                for k, j in round_robin(outcome, y)[:m]]
        extra = reservoir.draw(y, m - len(here)) if reservoir is not None else []
        chosen[y] = here + extra
    n = min(len(chosen[True]), len(chosen[False]))
    if reservoir is not None:
        for y in (True, False):
            reservoir.add(y, [(problems[k], texts[k][j]) for k, j in round_robin(outcome, y)])
    return chosen[True][:n] + chosen[False][:n]


def judged_labels(judged: list[Judged]) -> np.ndarray:
    """bool[M]: the class of each judged attempt."""
    return np.array([j.truth for j in judged], bool)
