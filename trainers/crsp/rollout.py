"""One CRSP step's rollout: the proposer writes ``--proposer-samples`` new problems from each
seed problem, the solver attempts every seed and well-formed proposed problem
(``--solver-samples`` each), the critic judges the first ``--critiques-per-problem`` attempts
of each (``--critic-samples`` verdicts each, every verdict chosen between the two verdict
continuations' log-probs, then its reason generated); then every utterance is rewarded
(``trainers.crsp.rewards``) and each role's rewards turned into group-relative advantages."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rlbuffers.memory import RunningMeanStd
from rlbuffers.memory.micro_batch import split_tokens
from trainers.crsp.config import Config, group_size, length_target, longest_completion
from trainers.crsp.formats import STOP, VERDICTS, cut_at_stop, format_scores, proposal_parts
from trainers.crsp.judging import Reservoir, judged_labels, select
from trainers.crsp.rewards import (
    RESERVOIR,
    TRUTH,
    WINDOW,
    ClassWindow,
    NoveltySketch,
    advantages,
    alpha_schedule,
    balanced_accuracy,
    balanced_verdict_reward,
    class_rate,
    confusion,
    gated,
    learnability,
    length_reward,
    solvability,
    step_class_rate,
)
from trainers.crsp.roles import ROLES, Prompts, activate
from trainers.crsp.verdict import verdict_advantages, verdict_loss
from trainers.crsp.verify import entry_score, verified_entry
from trainers.llm.device import to_device
from trainers.llm.generation import generate
from trainers.llm.packed_logprobs import packed_batch, packed_logprobs
from trainers.llm.settings import Packing, Sampling
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
    skip: list[int] = field(default_factory=list)
    """Per completion, leading tokens left out of the loss (the critic's verdict when the
    verdict term trains it); empty: none."""
    verdict_options: list[np.ndarray] = field(default_factory=list)
    """The two verdict continuations' token ids (correct, incorrect); empty: no verdict
    term."""
    verdict_advantage: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.float32))
    """float32[len(prompts), 2]: the verdict term's advantages (``verdict.py``)."""
    verdict_coef: float = 1.0
    """The verdict term's weight (``--verdict-coef``)."""

    def add(self, prompt: np.ndarray, completions: list[tuple[np.ndarray, bool]]) -> None:
        """Append a prompt and its group of ``(completion, truncated)``."""
        self.prompts.append(prompt)
        self.groups.append([c for c, _ in completions])
        self.truncated += [t for _, t in completions]

    @property
    def completions(self) -> list[np.ndarray]:
        return [c for g in self.groups for c in g]

    def training(self) -> tuple[list[np.ndarray], list[list[np.ndarray]], list[np.ndarray],
                                list[np.ndarray]]:
        """What the update trains on: ``(prompts, groups, advantage, weight)``, the last two
        per completion per token (float32[len]). First the sampled completions (loss weight:
        a mean over each one's tokens past its ``skip``, then over the completions), then,
        with a verdict term, every prompt once more with the two verdict continuations as
        its group (advantages ``verdict_advantage``, weight ``verdict_coef / len(prompts)``
        per token: a sum over a continuation's tokens, a mean over the judged attempts)."""
        comps = self.completions
        skip = self.skip or [0] * len(comps)
        adv = [np.full(len(c), a, np.float32) for c, a in zip(comps, self.advantage,
                                                               strict=True)]
        weight = []
        for c, s in zip(comps, skip, strict=True):
            w = np.full(len(c), 1.0 / (max(len(c) - s, 1) * len(comps)), np.float32)
            w[:s] = 0.0
            weight.append(w)
        prompts, groups = list(self.prompts), list(self.groups)
        if len(self.verdict_advantage):
            m = len(self.verdict_advantage)
            for p, row in zip(self.prompts, self.verdict_advantage, strict=True):
                prompts.append(p)
                groups.append(list(self.verdict_options))
                adv += [np.full(len(o), a, np.float32)
                        for o, a in zip(self.verdict_options, row, strict=True)]
                weight += [np.full(len(o), self.verdict_coef / m, np.float32)
                           for o in self.verdict_options]
        return prompts, groups, adv, weight

    def training_tokens(self) -> int:
        """Completion tokens the update scores (:meth:`training`), counted without building
        its arrays."""
        return (sum(len(c) for g in self.groups for c in g) + len(self.verdict_advantage)
                * sum(len(o) for o in self.verdict_options))


def sample(model: Any, tok: Any, sampling: Sampling, role: str, prompts: list[np.ndarray],
           n: int, max_new: int) -> list[list[tuple[np.ndarray, bool]]]:
    """``n`` completions (at most ``max_new`` tokens) of each prompt by ``role``'s adapter,
    grouped per prompt, each cut right after its role's closing tag (``formats.STOP``);
    ``truncated``: it reached ``max_new`` without its closing tag or EOS."""
    activate(model, role)
    flat = [(c, t) if not hit else (cut, False) for c, t in
            generate(model, tok, prompts, sampling, n_per_prompt=n, max_new=max_new)
            for cut, hit in [cut_at_stop(tok, c, STOP[role])]]
    return [flat[i * n:(i + 1) * n] for i in range(len(prompts))]


def verdict_ids(tok: Any) -> dict[bool, np.ndarray]:
    """Token ids of the two verdict continuations (``formats.VERDICTS``)."""
    return {v: np.asarray(tok(t, add_special_tokens=False)["input_ids"], np.int64)
            for v, t in VERDICTS.items()}


@torch.no_grad()
def verdict_logprobs(model: Any, tok: Any, prompts: list[np.ndarray], packing: Packing
                     ) -> np.ndarray:
    """float64[N, 2]: the critic's log-prob of each verdict continuation (correct,
    incorrect) after each prompt (which ends with the prefilled ``<verdict>``): the sum of
    its tokens' log-probs, both packed after the prompt once."""
    activate(model, "critic")
    model.eval()
    options = verdict_ids(tok)
    pair = [options[True], options[False]]
    batch = to_device(packed_batch(prompts, [pair] * len(prompts), packing,
                                   tok.pad_token_id, {}), model.device)
    flat = torch.zeros(int(batch["mask"].sum()))
    for rows in split_tokens(batch["real"].sum(1).tolist(), 2 * packing.pack_tokens):
        micro = {k: v[rows] for k, v in batch.items()}
        flat[micro["index"][micro["mask"]].cpu()] = packed_logprobs(model, micro, packing).cpu()
    cuts = np.cumsum([0] + [len(o) for _ in prompts for o in pair])
    sums = np.add.reduceat(flat.double().numpy(), cuts[:-1])
    return sums.reshape(len(prompts), 2)


def choose_verdicts(logprobs: np.ndarray, k: int) -> np.ndarray:
    """bool[N, k]: ``k`` verdicts per prompt (True: correct) drawn from the softmax over the
    two continuations' log-probs (``torch``'s global generator: checkpointed)."""
    p_correct = torch.sigmoid(torch.from_numpy(logprobs[:, 0] - logprobs[:, 1]))
    return (torch.rand(len(logprobs), k, dtype=torch.float64) < p_correct[:, None]).numpy()


def outcomes(attempts: list[list[tuple[np.ndarray, bool]]],
             problems: list[tuple[str, Any, str | None]], n_seed: int, score: Any,
             text: Any) -> list[list[float]]:
    """Per problem, 1.0 / 0.0 per solver attempt: seed problems (the first ``n_seed``) by the
    task's verifier ``score(answer, entry)``; a verified proposal (an entry) by the verifier
    against its recomputed answer (``verify.entry_score``); an unverified one (``band``) by
    agreement with its stated answer. No answer scores 0."""
    out = []
    for k, (comps, (_, entry, answer)) in enumerate(zip(attempts, problems, strict=True)):
        got = [extract_answer(text(c))[0] for c, _ in comps]
        out.append([0.0 if not g else float(score(g, entry) == 1.0) if k < n_seed
                    else float(entry_score(score, g, entry) == 1.0) if entry is not None
                    else numeric_match(g, answer) for g in got])
    return out


def reservoir(cfg: Config, stats: dict[str, Any]) -> Reservoir | None:
    """``stats[RESERVOIR]`` (created when missing) with ``--critic-batch balanced``, else
    None."""
    if cfg.critic_batch != "balanced":
        return None
    return stats.setdefault(RESERVOIR, Reservoir(cfg.critic_reservoir))


def proposer_rewards(mode: str, valid: np.ndarray, verified: np.ndarray,
                     attempted: np.ndarray, rows: list[list[float]]
                     ) -> tuple[np.ndarray, np.ndarray]:
    """The proposer's extrinsic rewards (float32[N]) and the solver's success rate on each
    proposal (float64[N], 0 where not attempted) from ``rows``, the outcomes of the attempted
    proposals in order: :func:`rewards.learnability` (``learnability``) or the solvability
    band of a well-formed proposal (``band``)."""
    success = np.zeros(len(valid))
    success[attempted] = [float(np.mean(row)) for row in rows]
    if mode == "learnability":
        return learnability(success, verified), success
    return np.where(valid, solvability(success), 0.0).astype(np.float32), success


def critic_class_rate(cfg: Config, stats: dict[str, Any], truth: np.ndarray) -> float:
    """The frequency of correct judged attempts that the critic's class weights use
    (``--critic-class-weights``), after adding the step's ``truth`` (bool[M]) to the window
    (``stats[WINDOW]``, created when missing; the running ``stats[TRUTH]`` is updated by the
    caller)."""
    window = stats.setdefault(WINDOW, ClassWindow(cfg.critic_class_window))
    window.update(truth)
    if cfg.critic_class_weights == "step":
        return step_class_rate(truth)
    if cfg.critic_class_weights == "window":
        return window.rate
    return class_rate(stats[TRUTH])


def rollout(cfg: Config, model: Any, tok: Any, prompts: Prompts, seeds: list[dict[str, Any]],
            score: Any, sketch: NoveltySketch, stats: dict[str, Any],
            alpha: Any = None, *, step: int) -> tuple[dict[str, RoleBatch], dict[str, Any]]:
    """Generate every role's utterances for ``seeds`` and reward them. ``score(answer,
    entry)`` is reasoning-gym's verifier of a seed problem; ``alpha`` the run's cached
    schedule ``step -> weight of the intrinsic terms`` (None: one built here). Returns the
    role batches and the step's metrics (rewards, format scores and flat-group fractions per
    role, seed accuracy, proposals' validity and novelty, the critic's agreement, verdict
    distribution against the ground truth, balanced accuracy and majority-class rate).
    ``stats`` also keeps the class frequencies of the judged attempts that the critic's
    verdict reward is balanced with: running (``rewards.TRUTH``) and windowed
    (``rewards.WINDOW``, a ``ClassWindow``, created here when missing), and with
    ``--critic-batch balanced`` the earlier attempts that top up the critic's batch
    (``rewards.RESERVOIR``, a ``judging.Reservoir``, created here when missing)."""
    alpha = alpha or alpha_schedule(cfg.alpha0, cfg.alpha_decay)
    sampling = cfg.sampling(longest_completion(cfg), generate_dtype=cfg.generate_dtype)
    packing = cfg.packing(cfg.pack_tokens, cfg.train_dtype)
    out = {r: RoleBatch() for r in ROLES}
    text = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    # Proposer: --proposer-samples new problems per seed (a group each).
    p_prompts = [prompts("proposer", "Problem:\n" + s["question"]) for s in seeds]
    for p, comps in zip(p_prompts, sample(model, tok, sampling, "proposer", p_prompts,
                                          cfg.proposer_samples, cfg.proposer_tokens),
                        strict=True):
        out["proposer"].add(p, comps)
    parts = [proposal_parts(text(c)) for c in out["proposer"].completions]
    valid = np.array([q is not None and a is not None for q, a in parts])
    source = [i // cfg.proposer_samples for i in range(len(parts))]  # the seed of each
    # The verifier recomputes each well-formed proposal's answer (trainers/crsp/verify.py).
    entries = [verified_entry(q, a, score) if v else None
               for (q, a), v in zip(parts, valid, strict=True)]
    verified = np.array([e is not None for e in entries])
    learn = cfg.proposer_reward == "learnability"
    attempted = verified if learn else valid  # band: every well-formed proposal, unverified
    # Solver: attempts on every seed and every attempted proposal.
    problems = [(s["question"], s.get("entry", s), None) for s in seeds] + [
        (q, e, None) if learn else (q, None, a)
        for (q, a), e, v in zip(parts, entries, attempted, strict=True) if v]
    s_prompts = [np.asarray(s["prompt_ids"], np.int64) if "prompt_ids" in s  # the token store
                 else prompts("solver", s["question"]) for s in seeds]
    s_prompts += [prompts("solver", q) for q, _, _ in problems[len(seeds):]]
    attempts = sample(model, tok, sampling, "solver", s_prompts, cfg.solver_samples,
                      cfg.solver_tokens)
    n_seed = len(seeds)
    for p, comps in zip(s_prompts, attempts, strict=True):
        out["solver"].add(p, comps)
    outcome = outcomes(attempts, problems, n_seed, score, text)
    # Critic: --critic-samples verdicts (then a reason each) per judged attempt.
    judged = select(cfg.critic_batch, [q for q, _, _ in problems],
                    [[text(c) for c, _ in comps] for comps in attempts], outcome,
                    cfg.critiques_per_problem, reservoir(cfg, stats))
    c_prompts = [prompts("critic", f"Problem:\n{j.problem}\n\nSolution:\n{j.attempt}")
                 for j in judged]
    options = verdict_ids(tok)
    v_logprobs = verdict_logprobs(model, tok, c_prompts, packing) if judged \
        else np.zeros((0, 2))
    verdicts = choose_verdicts(v_logprobs, cfg.critic_samples)
    reason_prompts = [np.concatenate([p, options[bool(v)]])
                      for p, row in zip(c_prompts, verdicts, strict=True) for v in row]
    room = cfg.critic_tokens - max(len(o) for o in options.values())
    if room < 1:
        raise ValueError(f"--critic-tokens: expected more than the longest verdict "
                         f"({cfg.critic_tokens - room} tokens), got "
                         f"{cfg.critic_tokens}")
    reasons = sample(model, tok, sampling, "critic", reason_prompts, 1, room) \
        if reason_prompts else []
    for i, p in enumerate(c_prompts):
        group = reasons[i * cfg.critic_samples:(i + 1) * cfg.critic_samples]
        out["critic"].add(p, [(np.concatenate([options[bool(v)], r[0][0]]), r[0][1])
                              for v, r in zip(verdicts[i], group, strict=True)])
    # Rewards: extrinsic per role. The solver: correctness (band: on a proposal, half its
    # agreement with the stated answer, half the critic's verdicts on the attempt).
    says_correct = {jd.source: float(verdicts[i].mean()) for i, jd in enumerate(judged)}
    solver_r = [o if learn or k < n_seed or (k, j) not in says_correct else
                0.5 * o + 0.5 * says_correct[(k, j)]
                for k, row in enumerate(outcome) for j, o in enumerate(row)]
    truth = judged_labels(judged)
    stats.setdefault(TRUTH, RunningMeanStd()).update(truth.astype(np.float64))
    agree = (verdicts == truth[:, None]).astype(np.float32).reshape(-1)
    rate = critic_class_rate(cfg, stats, truth)
    critic_r = balanced_verdict_reward(verdicts, truth, rate)
    term = cfg.verdict_loss != "sampled" and len(judged) > 0
    if term:  # the verdict is trained over both continuations, the reason by its rewards
        c = out["critic"]
        c.verdict_options, c.verdict_coef = [options[True], options[False]], cfg.verdict_coef
        c.verdict_advantage = verdict_advantages(v_logprobs, truth, rate, cfg.verdict_loss)
        c.skip = [len(options[bool(v)]) for row in verdicts for v in row]
    proposer_r, success = proposer_rewards(cfg.proposer_reward, valid, verified, attempted,
                                           outcome[n_seed:])
    solvable = verified & (success > 0)  # the verified answer reached at least once
    novelty = np.zeros(len(parts), np.float32)
    new_problems = [q for (q, _), v in zip(parts, valid, strict=True) if v]
    novelty[valid] = sketch.novelty(new_problems, [seeds[source[i]]["question"]
                                                   for i in np.flatnonzero(valid)])
    sketch.add(new_problems)
    # --proposer-gate solvable: a proposal that is not solvable earns nothing at all.
    earns = {"proposer": solvable if cfg.proposer_gate == "solvable" else None,
             "solver": None, "critic": None}
    extrinsic = {"proposer": proposer_r, "solver": np.array(solver_r, np.float32),
                 "critic": critic_r}
    metrics: dict[str, Any] = {}
    for role in ROLES:
        b = out[role]
        a = alpha(step)  # the cached schedule: computed once per step, read per role
        ends = [not t for t in b.truncated]
        b.parts = {"extrinsic": extrinsic[role].tolist(),
                   "format": format_scores(role, [text(c) for c in b.completions],
                                           ends).tolist(),
                   "length": length_reward([len(c) for c in b.completions],
                                           length_target(cfg, role)).tolist()}
        intrinsic = np.asarray(b.parts["length"])
        if role == "proposer":
            b.parts["creativity"] = novelty.tolist()
            intrinsic = intrinsic + novelty
        b.reward = gated(extrinsic[role] + cfg.format_weight * np.asarray(b.parts["format"])
                         + a * intrinsic, earns[role])
        if role == "critic" and term:  # the reason's advantage: its own rewards only
            b.advantage, metrics["critic_flat_groups"] = advantages(
                stats, role, b.reward - extrinsic[role], group_size(cfg, role), "group")
        elif len(b.reward):  # the critic's class weights must survive: one scale per step
            b.advantage, metrics[f"{role}_flat_groups"] = advantages(
                stats, role, b.reward, group_size(cfg, role),
                "running" if role == "critic" else "group")
        metrics[f"{role}_reward"] = float(b.reward.mean()) if len(b.reward) else 0.0
        metrics[f"{role}_format"] = float(np.mean(b.parts["format"])) if len(b.reward) else 0.0
    from_seed = [j.source is not None and j.source[0] < n_seed for j in judged]
    seed_truth = truth[from_seed]
    seed_agree = agree.reshape(len(judged), -1)[from_seed] if judged else np.zeros((0, 1))
    says, labels = verdicts.reshape(-1), np.repeat(truth, verdicts.shape[1])
    metrics.update({
        "alpha": alpha(step), "proposals_valid": float(np.mean(valid)),
        # Issue 49: proposals whose stated answer the verifier confirms, and those of them
        # whose verified answer the solver reaches at least once (counts: Wilson intervals
        # over steps; rates over every proposal of the step).
        "proposals": len(parts), "proposals_verified": int(verified.sum()),
        "proposals_solvable": int(solvable.sum()),
        "proposer_verified_rate": float(np.mean(verified)) if len(parts) else 0.0,
        "proposer_solvable_rate": float(np.mean(solvable)) if len(parts) else 0.0,
        "proposer_gated": float(np.mean(~solvable)) if cfg.proposer_gate == "solvable"
        and len(parts) else 0.0,
        "proposer_learnability": float(np.mean(learnability(success, verified)))
        if len(parts) else 0.0, "critic_judged": len(judged),
        "seed_accuracy": float(np.mean(outcome[:n_seed])),
        "proposed_solve_rate": float(np.mean(outcome[n_seed:])) if outcome[n_seed:] else 0.0,
        "critic_agreement": float(np.mean(agree)) if len(agree) else 0.0,
        "critic_seed_agreement": float(seed_agree.mean()) if seed_agree.size else 0.0,
        "critic_seed_majority": float(max(seed_truth.mean(), 1 - seed_truth.mean()))
        if seed_truth.size else 0.0,
        # The verdict distribution against the ground truth: a collapse to one verdict
        # shows as says_correct -> 0 or 1 and balanced accuracy -> 0.5.
        "critic_says_correct": float(verdicts.mean()) if verdicts.size else 0.0,
        "critic_truth_correct": float(truth.mean()) if truth.size else 0.0,
        # None on a step whose judged attempts are all of one class (it is not defined).
        "critic_balanced_accuracy": balanced_accuracy(says, labels)
        if labels.any() and not labels.all() else None,
        **confusion(says, labels), "critic_class_rate": rate,
        # The verdict distribution itself (it moves before sampled verdicts do).
        "critic_p_correct": float(np.mean(1.0 / (1.0 + np.exp(
            v_logprobs[:, 1] - v_logprobs[:, 0])))) if judged else 0.0,
        "critic_verdict_loss": float(verdict_loss(v_logprobs, truth, rate, cfg.verdict_loss
                                                  ).mean()) if term else None,
        "novelty": float(novelty[valid].mean()) if valid.any() else 0.0,
        "truncated_prompts": prompts.truncated,
        # Every question the proposer wrote this step (answer or not): metrics.jsonl keeps
        # them all, so the held-out evaluation excludes them after the buffer's capacity
        # has overwritten the step's utterances.
        "proposed_questions": [q for q, _ in parts if q]})
    return out, metrics
