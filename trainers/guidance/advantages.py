"""The advantages of the guidance trainer's utterances, from the outcomes of an iteration.

A problem gets one turn-1 answer and K hints, each followed by a revision (turn 2). The hints
of one answer form a group: a hint's outcome is its improvement ``correct(turn 2) -
correct(turn 1)`` and its advantage is group-relative (GRPO, Shao et al. 2024,
"DeepSeekMath", Sec. 4.1: ``trainers.llm.policy_loss.group_advantages``), a Monte-Carlo
signal that needs no critic. Within a group turn 1 is fixed, so a revision's advantage is the
same number: the revision after a helpful hint is reinforced with it. Turn 1 gets a direct
reward, its correctness, against the iteration's mean (a batch baseline). Once the critic's
TD error on fresh utterances is below a threshold, its advantage ``Q - V`` (ArCHer, Zhou et
al. 2024, Sec. 4) may be mixed in.

Which groups train the guidance policy depends on ``--hint-reward``. With ``improvement``
(the default since issue 49) every group does: on a right turn-1 answer a hint that keeps it
scores 0 and one that breaks it -1, so the guidance model pays for breaks (with the agent
frozen, nobody else can). With ``turn2`` (issue 34) only groups whose turn 1 was wrong train
it: a hint can fix those, and keeping a right answer was left to the agent. Within one group
turn 1 is fixed, so the two rewards give the same group-relative advantages; they differ in
the groups trained and in the revision's reward stored in the buffer (the critic's target).
"""

from __future__ import annotations

import numpy as np

from trainers.llm.policy_loss import group_advantages


def improvement_advantages(turn1: np.ndarray, turn2: np.ndarray, scale: str
                           ) -> tuple[np.ndarray, float]:
    """Group-relative advantages of the improvement ``turn2 - turn1`` within each turn-1
    answer's group of K hints.

    Args:
        turn1: float32[E], turn 1's correctness (0 or 1) per problem.
        turn2: float32[E, K], turn 2's correctness after each hint.
        scale: ``"group"`` (divide by the group's std) or ``"none"``.

    Returns:
        float32[E, K] advantages (each group sums to 0; a group whose improvements are all
        equal gets 0) and the fraction of such groups.

    Raises:
        ValueError: shapes that do not match, or K < 2.
    """
    if turn2.ndim != 2 or turn1.shape != (turn2.shape[0],):
        raise ValueError(f"turn1, turn2: expected shapes [E] and [E, K], got {turn1.shape} "
                         f"and {turn2.shape}")
    e, k = turn2.shape
    adv, flat = group_advantages((turn2 - turn1[:, None]).reshape(-1), k, scale)
    return adv.reshape(e, k), flat


def turn1_advantages(turn1: np.ndarray) -> np.ndarray:
    """Turn 1's direct reward (its correctness, float32[E]) less the iteration's mean."""
    return (turn1 - turn1.mean()).astype(np.float32)


def wrong_groups(turn1: np.ndarray) -> np.ndarray:
    """Indices (int64[G]) of the problems whose turn 1 was wrong: the groups that train the
    guidance policy."""
    return np.flatnonzero(turn1 < 1.0)


def mixed(group: np.ndarray, critic: np.ndarray, mix: float, trusted: bool) -> np.ndarray:
    """``(1 - mix) * group + mix * critic`` when the critic is ``trusted`` (its TD error is
    below the threshold), else ``group`` (float32, the shape of ``group``)."""
    if not trusted or mix == 0.0:
        return group.astype(np.float32)
    return ((1.0 - mix) * group + mix * critic).astype(np.float32)


def guidance_groups(turn1: np.ndarray, hint_reward: str) -> np.ndarray:
    """Indices (int64[G]) of the problems whose hints train the guidance policy: all of them
    with ``hint_reward`` ``improvement``, those with a wrong turn 1 with ``turn2``."""
    return np.arange(len(turn1)) if hint_reward == "improvement" else wrong_groups(turn1)


def revision_rewards(turn1: np.ndarray, turn2: np.ndarray, hint_reward: str) -> np.ndarray:
    """A revision's reward (float32[E, K]): ``turn2 - turn1`` (``improvement``: -1 for a break,
    +1 for a fix, else 0) or ``turn2`` (its correctness)."""
    if hint_reward == "improvement":
        return (turn2 - turn1[:, None]).astype(np.float32)
    return turn2.astype(np.float32)


def role_utterances(turn1: np.ndarray, turn2: np.ndarray, scale: str,
                    hint_reward: str = "turn2"
                    ) -> tuple[dict[str, list[tuple[int, int]]], dict[str, np.ndarray],
                               np.ndarray, float]:
    """Which utterances each role trains on and their group-based advantages.

    ``turn1`` float32[E], ``turn2`` float32[E, K] (correctness). Returns ``pick`` (per role,
    ``(problem, utterance)`` pairs in ``play``'s order: the agent's turn 1s, then its turn 2s;
    the guidance model's hints of :func:`guidance_groups`), ``group`` (per role, float32
    advantages in ``pick``'s order), the hints' advantages float32[E, K] and the fraction of
    flat groups."""
    e, k = turn2.shape
    a_hint, flat = improvement_advantages(turn1, turn2, scale)
    wrong = guidance_groups(turn1, hint_reward)
    pick = {"agent": [(i, 0) for i in range(e)] + [(i, 2 + 2 * j) for i in range(e)
                                                    for j in range(k)],
            "guidance": [(i, 1 + 2 * j) for i in wrong for j in range(k)]}
    group = {"agent": np.concatenate([turn1_advantages(turn1), a_hint.reshape(-1)]),
             "guidance": a_hint[wrong].reshape(-1)}
    return pick, group, a_hint, flat


def outcomes(turn1: np.ndarray, turn2: np.ndarray, a_hint: np.ndarray,
             hint_reward: str = "turn2") -> dict[str, float]:
    """An iteration's metrics of the outcomes: accuracies, the hint's effect (turn-2 minus
    turn-1 accuracy), fixes and breaks (counts and shares of the E*K revisions), the share of
    wrong turn-1 answers' revisions that are right, the groups that train the guidance model
    and those among them with a signal (not all the same improvement)."""
    r1, r2 = turn1 == 1.0, turn2 == 1.0
    fixes, breaks = int((~r1[:, None] & r2).sum()), int((r1[:, None] & ~r2).sum())
    wrong, trained = wrong_groups(turn1), guidance_groups(turn1, hint_reward)
    return {"turn1_accuracy": float(r1.mean()), "turn2_accuracy": float(r2.mean()),
            "hint_effect": float(r2.mean() - r1.mean()), "hints": int(turn2.size),
            "hint_uptake": fixes / turn2.size, "turn2_breaks": breaks / turn2.size,
            "fixes": fixes, "breaks": breaks,
            "fixes_of_wrong": fixes / max(1, len(wrong) * turn2.shape[1]),
            "guidance_groups": len(trained),
            "guidance_signal_groups": int(sum(bool(np.any(a_hint[i] != 0)) for i in trained)),
            "improvement_mean": float((turn2 - turn1[:, None]).mean())}
