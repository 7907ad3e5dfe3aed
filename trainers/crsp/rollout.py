"""One CRSP step's rollout: the proposer writes a new problem from each seed problem, the
solver attempts every seed and well-formed proposed problem (``--solver-samples`` each), the
critic judges the first ``--critiques-per-problem`` attempts of each; then every utterance is
rewarded (``trainers.crsp.rewards``) and each role's rewards normalised into advantages."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlbuffers.memory import RunningMeanStd
from trainers.crsp.config import Config, longest_completion
from trainers.crsp.rewards import (
    NoveltySketch,
    alpha_schedule,
    length_reward,
    normalise,
    parse_proposal,
    parse_verdict,
    solvability,
)
from trainers.crsp.roles import ROLES, Prompts, activate
from trainers.llm.generation import generate
from trainers.llm.settings import Sampling
from trainers.llm.tasks import extract_answer, numeric_match


@dataclass
class RoleBatch:
    """One role's utterances of a step: prompts (int64 token arrays), each with its group of
    completions (flat order: group by group), per completion reward parts, total reward and
    advantage (float32[N], N completions)."""

    prompts: list[np.ndarray] = field(default_factory=list)
    groups: list[list[np.ndarray]] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)
    parts: dict[str, list[float]] = field(default_factory=dict)
    reward: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    advantage: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))

    def add(self, prompt: np.ndarray, completions: list[tuple[np.ndarray, bool]]) -> None:
        """Append a prompt and its group of ``(completion, truncated)``."""
        self.prompts.append(prompt)
        self.groups.append([c for c, _ in completions])
        self.truncated += [t for _, t in completions]

    @property
    def completions(self) -> list[np.ndarray]:
        return [c for g in self.groups for c in g]


def sample(model: Any, tok: Any, sampling: Sampling, role: str, prompts: list[np.ndarray],
           n: int, max_new: int) -> list[list[tuple[np.ndarray, bool]]]:
    """``n`` completions (at most ``max_new`` tokens) of each prompt by ``role``'s adapter,
    grouped per prompt."""
    activate(model, role)
    flat = generate(model, tok, prompts, sampling, n_per_prompt=n, max_new=max_new)
    return [flat[i * n:(i + 1) * n] for i in range(len(prompts))]


def rollout(cfg: Config, model: Any, tok: Any, prompts: Prompts, seeds: list[dict[str, Any]],
            score: Any, sketch: NoveltySketch, stats: dict[str, RunningMeanStd], step: int
            ) -> tuple[dict[str, RoleBatch], dict[str, float]]:
    """Generate every role's utterances for ``seeds`` and reward them. ``score(answer,
    entry)`` is reasoning-gym's verifier of a seed problem. Returns the role batches and the
    step's metrics (rewards per role, seed accuracy, proposals' validity and novelty)."""
    alpha = alpha_schedule(cfg.alpha0, cfg.alpha_decay)(step)
    sampling = cfg.sampling(longest_completion(cfg))  # the budget read now
    out = {r: RoleBatch() for r in ROLES}
    text = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    # Proposer: one new problem per seed.
    p_prompts = [prompts("proposer", "Example:\n" + s["question"]) for s in seeds]
    for p, comps in zip(p_prompts, sample(model, tok, sampling, "proposer", p_prompts, 1,
                                          cfg.proposer_tokens), strict=True):
        out["proposer"].add(p, comps)
    proposals = [parse_proposal(text(c)) for c in out["proposer"].completions]
    # Solver: attempts on every seed and every well-formed proposal.
    problems = [(s["question"], s.get("entry", s), None) for s in seeds] + [
        (q, None, a) for q, a in (x for x in proposals if x is not None)]
    s_prompts = [np.asarray(s["prompt_ids"], np.int64) if "prompt_ids" in s  # the token store
                 else prompts("solver", s["question"]) for s in seeds]
    s_prompts += [prompts("solver", q) for q, _, _ in problems[len(seeds):]]
    attempts = sample(model, tok, sampling, "solver", s_prompts, cfg.solver_samples,
                      cfg.solver_tokens)
    outcome: list[list[float]] = []
    for p, comps, (_, entry, answer) in zip(s_prompts, attempts, problems, strict=True):
        out["solver"].add(p, comps)
        got = [extract_answer(text(c))[0] for c, _ in comps]
        outcome.append([0.0 if not g else float(score(g, entry) == 1.0) if entry is not None
                        else numeric_match(g, answer) for g in got])
    # Critic: verdicts on the first attempts of each problem.
    c_prompts, judged = [], []
    for k, ((q, _, _), comps) in enumerate(zip(problems, attempts, strict=True)):
        for j in range(cfg.critiques_per_problem):
            c_prompts.append(prompts("critic", f"Problem:\n{q}\n\nSolution:\n{text(comps[j][0])}"))
            judged.append((k, j))
    verdicts: dict[tuple[int, int], bool | None] = {}
    for p, comps, kj in zip(c_prompts, sample(model, tok, sampling, "critic", c_prompts, 1,
                                               cfg.critic_tokens), judged, strict=True):
        out["critic"].add(p, comps)
        verdicts[kj] = parse_verdict(text(comps[0][0]))
    # Rewards.
    n_seed = len(seeds)
    solver_r = [o if k < n_seed or (k, j) not in verdicts else
                0.5 * o + 0.5 * float(verdicts[(k, j)] is True)
                for k, row in enumerate(outcome) for j, o in enumerate(row)]
    critic_r = [float(verdicts[(k, j)] is bool(outcome[k][j])) for k, j in judged]
    rates = iter([float(np.mean(row)) for row in outcome[n_seed:]])
    valid = [x is not None for x in proposals]
    band = np.array([solvability(np.array([next(rates)]))[0] if v else 0.0 for v in valid])
    new_problems = [x[0] for x in proposals if x is not None]
    novelty = np.zeros(len(proposals), np.float32)
    novelty[np.flatnonzero(valid)] = sketch.novelty(new_problems)
    sketch.add(new_problems)
    extrinsic = {"proposer": band, "solver": np.array(solver_r), "critic": np.array(critic_r)}
    for role in ROLES:
        b = out[role]
        lengths = [len(c) for c in b.completions]
        b.parts = {"extrinsic": extrinsic[role].tolist(),
                   "length": length_reward(lengths, cfg.length_target).tolist()}
        intrinsic = np.asarray(b.parts["length"])
        if role == "proposer":
            b.parts["creativity"] = novelty.tolist()
            intrinsic = intrinsic + novelty
        b.reward = (extrinsic[role] + alpha * intrinsic).astype(np.float32)
        b.advantage = normalise(stats, role, b.reward)
    metrics = {"alpha": alpha, "proposals_valid": float(np.mean(valid)),
               "seed_accuracy": float(np.mean(outcome[:n_seed])),
               "proposed_solve_rate": float(np.mean(outcome[n_seed:])) if outcome[n_seed:]
               else 0.0, "critic_agreement": float(np.mean(critic_r)) if critic_r else 0.0,
               "novelty": float(novelty[valid].mean()) if any(valid) else 0.0,
               "truncated_prompts": prompts.truncated}
    for role in ROLES:
        metrics[f"{role}_reward"] = float(out[role].reward.mean())
    return out, metrics
