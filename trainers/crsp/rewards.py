"""CRSP's multi-dimensional rewards, each computed with bounded memory.

Roles (Cognition via Rewarded Self-Play): a *proposer* writes a new problem with its answer
from a seed problem, a *solver* answers problems, a *critic* judges a solution. Per role:

- solver: correctness on seed problems (reasoning-gym's verifier); on proposed problems, half
  agreement with the proposer's answer and half the critic's verdicts on that attempt (the
  fraction saying correct);
- critic: agreement of its verdict with the outcome (the verifier on seed problems, the
  proposer's answer on proposed ones);
- proposer: solvability in a band (the solver's success rate on the problem is neither 0 nor
  1) plus *creativity*, the novelty of the problem against a bounded sketch of earlier ones
  and against its own seed example (MinHash signatures, Broder 1997, via ``datasketch``, in a
  ring of fixed size);
- every role: a format term (``trainers.crsp.formats.format_score``, partial credit, weight
  ``--format-weight``, no decay) and a length term, ``-|tokens - target| / target`` clipped
  to [-1, 0], with each role's target within its own completion limit.

Intrinsic terms (creativity, length) are weighted by ``alpha(step) = alpha0 * decay**step``
(one cached schedule per run, read once per role each step). Advantages are group-relative
(``trainers.llm.policy_loss.group_advantages``: each role samples several completions per
prompt); a role with one completion per prompt is normalised with running mean / std (Chan
et al. 1979 parallel moments: ``rlbuffers.memory.RunningMeanStd``) instead.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from rlbuffers.memory.stats import RunningMeanStd, cached_schedule

PROBLEM_RE = re.compile(r"<problem>(.*?)</problem>", re.S)
VERDICT_RE = re.compile(r"<verdict>\s*(correct|incorrect)\s*</verdict>", re.S | re.I)


def parse_proposal(text: str) -> tuple[str, str] | None:
    """``(problem, answer)`` from a proposer completion: the last ``<problem>`` and the last
    ``<answer>`` holding a number; None when either is missing."""
    from trainers.llm.tasks import ANSWER_RE, NUMBER_RE

    problems, answers = PROBLEM_RE.findall(text), ANSWER_RE.findall(text)
    if not problems or not answers or not problems[-1].strip():
        return None
    numbers = NUMBER_RE.findall(answers[-1])
    return (problems[-1].strip(), numbers[0].replace(",", "")) if numbers else None


def parse_verdict(text: str) -> bool | None:
    """The critic's verdict: True (correct), False (incorrect), None (no verdict tag)."""
    found = VERDICT_RE.findall(text)
    return found[-1].lower() == "correct" if found else None


def solvability(success: np.ndarray) -> np.ndarray:
    """1.0 where the solver's success rate (float[N] in [0, 1]) is strictly inside (0, 1)."""
    s = np.asarray(success, np.float64)
    return ((s > 0) & (s < 1)).astype(np.float32)


def length_reward(lengths: Sequence[int], target: int, mini_batch: int = 1024) -> np.ndarray:
    """``-|n - target| / target`` clipped to [-1, 0] per completion (float32[N]).

    One vectorised pass over the N integers; ``mini_batch`` bounds the temporary for a
    caller with millions of lengths. A CRSP step passes one role's completions (tens), so
    there it is a single batch."""
    if target < 1:
        raise ValueError(f"target: expected >= 1 token, got {target}")
    n = np.asarray(lengths, np.int64)
    out = np.empty(len(n), np.float32)
    for i in range(0, len(n), mini_batch):
        part = n[i:i + mini_batch]
        np.clip(-np.abs(part - target) / target, -1.0, 0.0, out=out[i:i + mini_batch],
                casting="unsafe")
    return out


def alpha_schedule(alpha0: float, decay: float) -> Any:
    """``step -> alpha0 * decay**step``, each value computed once (cached)."""
    if not 0 < decay <= 1:
        raise ValueError(f"decay: expected in (0, 1], got {decay}")
    return cached_schedule(lambda step: alpha0 * decay ** step)


class NoveltySketch:
    """Bounded, streaming sketch of earlier problems for the creativity reward: the MinHash
    signatures (``num_perm`` 32-bit hash values each, word 3-shingles) of the newest
    ``capacity`` problems in a ring. Memory: ``capacity * num_perm * 4`` bytes (1,024 x 64:
    256 KiB), whatever the number of problems seen.

    ``novelty(texts)`` is ``1 - max estimated Jaccard similarity`` to the sketch (1.0 against
    an empty sketch); ``add(texts)`` inserts them (the oldest drop out).
    """

    def __init__(self, capacity: int = 1024, num_perm: int = 64, seed: int = 1) -> None:
        if capacity < 1 or num_perm < 1:
            raise ValueError(f"capacity and num_perm: expected >= 1, got {capacity}, {num_perm}")
        self.capacity, self.num_perm, self.seed = capacity, num_perm, seed
        self.signatures = np.zeros((capacity, num_perm), np.uint32)
        self.count = 0  # problems added so far (the ring holds min(count, capacity))

    def signature(self, text: str) -> np.ndarray:
        from datasketch import MinHash

        words = text.lower().split()
        shingles = {" ".join(words[i:i + 3]) for i in range(max(1, len(words) - 2))}
        m = MinHash(num_perm=self.num_perm, seed=self.seed)
        m.update_batch([s.encode() for s in shingles])
        return np.asarray(m.hashvalues, np.uint32)

    def novelty(self, texts: Sequence[str], examples: Sequence[str] | None = None
                ) -> np.ndarray:
        """float32[N]: 1 - the largest estimated Jaccard similarity of each text to the
        sketch and, with ``examples`` (one per text: the seed problem it was written
        from), to its own example, so copying the example scores no creativity."""
        held = self.signatures[:min(self.count, self.capacity)]
        out = np.ones(len(texts), np.float32)
        for i, t in enumerate(texts):
            sig = self.signature(t)
            rows = held if examples is None else np.vstack([held, self.signature(examples[i])])
            if len(rows):
                out[i] = 1.0 - float((rows == sig).mean(axis=1).max())
        return out

    def add(self, texts: Sequence[str]) -> None:
        for t in texts:
            self.signatures[self.count % self.capacity] = self.signature(t)
            self.count += 1

    def state_dict(self) -> dict[str, Any]:
        """Plain data (the signatures as a nested list of ints)."""
        return {"capacity": self.capacity, "num_perm": self.num_perm, "seed": self.seed,
                "count": self.count, "signatures": self.signatures.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.__init__(state["capacity"], state["num_perm"], state["seed"])  # type: ignore[misc]
        self.count = int(state["count"])
        self.signatures[:] = np.asarray(state["signatures"], np.uint32)


def advantages(stats: dict[str, RunningMeanStd], role: str, rewards: np.ndarray, group: int
               ) -> tuple[np.ndarray, float]:
    """``role``'s advantages (float32[N], groups of ``group`` contiguous completions) and the
    fraction of groups whose rewards were all equal: group-relative
    (``group_advantages``, scaled by the group's std; they sum to 0 in every group) when
    ``group`` >= 2, else running normalisation (:func:`normalise`; fraction 0). Either way
    ``stats[role]`` is updated with the rewards."""
    from trainers.llm.policy_loss import group_advantages

    if group >= 2:  # the running statistics still follow the role's rewards (logged)
        stats[role].update(np.asarray(rewards, np.float64))
        return group_advantages(np.asarray(rewards, np.float32), group, "group")
    return normalise(stats, role, rewards), 0.0


def normalise(stats: dict[str, RunningMeanStd], role: str, rewards: np.ndarray) -> np.ndarray:
    """Advantages of one role's rewards: update its running statistics with this batch, then
    ``(r - mean) / std`` (float32[N])."""
    stats[role].update(np.asarray(rewards, np.float64))
    return np.asarray(stats[role].normalize(np.asarray(rewards, np.float64)), np.float32)
