"""CRSP (Cognition via Rewarded Self-Play): three roles of one LM trained against each other.

A *proposer* turns a seed problem (reasoning-gym, read from a memory-mapped token store:
trajectory seeding) into a new problem with its answer; a *solver* answers seed and proposed
problems (``--solver-samples`` attempts each); a *critic* judges attempts with a verdict.
Rewards are multi-dimensional (``trainers/crsp_rewards.py``: correctness, critique agreement,
solvability band, creativity against a MinHash sketch, length; intrinsic terms weighted by a
decaying alpha; each role normalised by running statistics).

Update, per role (TR-RPG: a trust-region, KL-regularised policy gradient): per token,
``-min(w * A, clip(w, 1 - eps, 1 + eps_high) * A) + beta * k3`` with ``w`` the importance
ratio to the behaviour policy (PPO's clipped surrogate, Schulman et al. 2017, Eq. 7) and
``k3 = exp(ref - logp) - (ref - logp) - 1``, the unnormalised reverse KL to the reference
(Schulman 2020; Zhang et al. 2025, "On the Design of KL-Regularized Policy Gradient Algorithms
for LLM Reasoning", arXiv 2505.17508, Sec. 3, which shows k3 is the unnormalised KL), mean over
each completion's tokens then over the role's completions.

Memory (``--memory-opt``, the default): one frozen base shared by the three roles, each a LoRA
adapter (peft), the reference is the base with adapters disabled (no copy); roles are updated
one after another (one role's activations at a time); groups packed with the prompt once per
row (``pack_shared_prefix``); per-token log-probs from the chunked LM head (never
``[B, T, V]``); ``AdaptiveMicroBatch`` micro-batches with gradient accumulation; role prompts
tokenized through a byte-bounded LRU. ``--no-memory-opt`` computes the same losses the naive
way (the comparison baseline): a full copy of the model as reference, full ``[B, T, V]``
logits, all three roles' graphs alive at once, one full batch padded to a fixed length.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlbuffers.cache import ByteLRUCache
from rlbuffers.memory import AdaptiveMicroBatch, RunningMeanStd
from trainers.crsp_config import Config
from trainers.crsp_rewards import (
    ROLES,
    NoveltySketch,
    alpha_schedule,
    length_reward,
    normalise,
    parse_proposal,
    parse_verdict,
    solvability,
)
from trainers.generation import generate
from trainers.grpo import accumulate_gradients, packed_batch, reference_logprobs
from trainers.math_tasks import SYSTEM, extract_answer, numeric_match

log = logging.getLogger("trainers.crsp")
ROLE_ID = {r: i for i, r in enumerate(ROLES)}
PROPOSER_SYSTEM = ("You write new math word problems. Read the example, then write a different "
                   "problem of the same kind inside <problem></problem> and its numeric answer "
                   "inside <answer></answer>.")
CRITIC_SYSTEM = ("You check solutions to math problems. Explain briefly whether the final "
                 "answer is right, then write <verdict>correct</verdict> or "
                 "<verdict>incorrect</verdict>.")
SYSTEMS = {"proposer": PROPOSER_SYSTEM, "solver": SYSTEM, "critic": CRITIC_SYSTEM}


# ------------------------------------------------------------------------------------------
# Model: one base, three adapters (and, on the naive path, a reference copy)
# ------------------------------------------------------------------------------------------
def make_model(cfg: Config) -> tuple[Any, Any, Any]:
    """``(policy, tokenizer, reference)``: the base with a LoRA adapter per role (the same
    initialisation for a given seed on both paths); ``reference`` is None with
    ``memory_opt`` (the base with adapters disabled), a full copy of the base otherwise."""
    from peft import LoraConfig, get_peft_model

    from trainers.lm import load_causal_lm

    base, tok = load_causal_lm(cfg.model or None)
    reference = None if cfg.memory_opt else copy.deepcopy(base).eval()
    lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                      "up_proj", "down_proj"])
    torch.manual_seed(cfg.seed)
    model = get_peft_model(base, lora, adapter_name=ROLES[0])
    for role in ROLES[1:]:
        model.add_adapter(role, lora)
    set_checkpointing(model, cfg)
    return model, tok, reference


def set_checkpointing(model: Any, cfg: Config) -> None:
    """Activation checkpointing of all decoder layers, none, or the selected ones."""
    if cfg.gradient_checkpointing == "off":
        return
    from torch.utils.checkpoint import checkpoint

    layers = model.get_base_model().model.layers
    chosen = range(len(layers)) if cfg.gradient_checkpointing == "all" else (
        [int(i) for i in cfg.checkpoint_layers.split(",")] if cfg.checkpoint_layers
        else range(0, len(layers), 2))
    for i in chosen:
        layer = layers[i]
        forward = layer.forward

        def wrapped(*args: Any, _forward: Any = forward, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _forward(*args, **kwargs)
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        layer.forward = wrapped


def activate(model: Any, role: str, all_trainable: bool = False) -> None:
    """Make ``role``'s adapter the active one (only it trainable, unless ``all_trainable``:
    the naive path keeps every role's graph alive and backpropagates once)."""
    model.set_adapter(role)
    if all_trainable:
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.requires_grad_(True)


# ------------------------------------------------------------------------------------------
# Prompts
# ------------------------------------------------------------------------------------------
@dataclass
class Prompts:
    """Role prompts rendered with the chat template and tokenized once per distinct text
    (a byte-bounded LRU); prompts over ``max_tokens`` keep their last tokens (counted)."""

    tok: Any
    max_tokens: int
    cache: ByteLRUCache
    truncated: int = 0

    def __call__(self, role: str, user: str) -> np.ndarray:
        key = (role, user)
        ids = self.cache.get(key)
        if ids is None:
            text = self.tok.apply_chat_template(
                [{"role": "system", "content": SYSTEMS[role]}, {"role": "user", "content": user}],
                add_generation_prompt=True, tokenize=False)
            ids = np.asarray(self.tok(text, add_special_tokens=False)["input_ids"], np.int64)
            self.cache.put(key, ids)
        if len(ids) > self.max_tokens:
            self.truncated += 1
            return ids[-self.max_tokens:]
        return ids


# ------------------------------------------------------------------------------------------
# Rollouts and rewards
# ------------------------------------------------------------------------------------------
@dataclass
class RoleBatch:
    """One role's utterances of a step: prompts, each with its group of completions (flat
    order: group by group), per completion reward parts, total reward and advantage."""

    prompts: list[np.ndarray] = field(default_factory=list)
    groups: list[list[np.ndarray]] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)
    parts: dict[str, list[float]] = field(default_factory=dict)
    reward: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    advantage: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))

    def add(self, prompt: np.ndarray, completions: list[tuple[np.ndarray, bool]]) -> None:
        self.prompts.append(prompt)
        self.groups.append([c for c, _ in completions])
        self.truncated += [t for _, t in completions]

    @property
    def completions(self) -> list[np.ndarray]:
        return [c for g in self.groups for c in g]


def sample(model: Any, tok: Any, cfg: Config, role: str, prompts: list[np.ndarray], n: int,
           max_new: int) -> list[list[tuple[np.ndarray, bool]]]:
    """``n`` completions of each prompt by ``role``'s adapter, grouped per prompt."""
    activate(model, role)
    flat = generate(model, tok, prompts, cfg, n_per_prompt=n, max_new=max_new)
    return [flat[i * n:(i + 1) * n] for i in range(len(prompts))]


def rollout(cfg: Config, model: Any, tok: Any, prompts: Prompts, seeds: list[dict[str, Any]],
            score: Any, sketch: NoveltySketch, stats: dict[str, RunningMeanStd], step: int
            ) -> tuple[dict[str, RoleBatch], dict[str, float]]:
    """Generate every role's utterances for ``seeds`` and reward them. ``score(answer,
    entry)`` is reasoning-gym's verifier of a seed problem."""
    alpha = alpha_schedule(cfg.alpha0, cfg.alpha_decay)(step)
    out = {r: RoleBatch() for r in ROLES}
    text = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    # Proposer: one new problem per seed.
    p_prompts = [prompts("proposer", "Example:\n" + s["question"]) for s in seeds]
    for p, comps in zip(p_prompts, sample(model, tok, cfg, "proposer", p_prompts, 1,
                                          cfg.proposer_tokens), strict=True):
        out["proposer"].add(p, comps)
    proposals = [parse_proposal(text(c)) for c in out["proposer"].completions]
    # Solver: attempts on every seed and every well-formed proposal.
    problems = [(s["question"], s, None) for s in seeds] + [
        (q, None, a) for q, a in (x for x in proposals if x is not None)]
    s_prompts = [prompts("solver", q) for q, _, _ in problems]
    attempts = sample(model, tok, cfg, "solver", s_prompts, cfg.solver_samples, cfg.solver_tokens)
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
    for p, comps, kj in zip(c_prompts, sample(model, tok, cfg, "critic", c_prompts, 1,
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


# ------------------------------------------------------------------------------------------
# Losses: the optimised path and the naive one, the same numbers
# ------------------------------------------------------------------------------------------
def role_tensors(b: RoleBatch, cfg: Config, pad_id: int) -> dict[str, torch.Tensor]:
    """Packed rows of one role (shared prefix), with advantages and sequence-mean weights."""
    comps = b.completions
    per_token = {"advantage": [np.full(len(c), a, np.float32) for c, a in
                               zip(comps, b.advantage, strict=True)],
                 "weight": [np.full(len(c), 1.0 / (len(c) * len(comps)), np.float32)
                            for c in comps]}
    return packed_batch(b.prompts, b.groups, cfg, pad_id, per_token)  # type: ignore[arg-type]


def optimised_grads(model: Any, batches: dict[str, RoleBatch], cfg: Config, pad_id: int,
                    amb: AdaptiveMicroBatch, on_role: Any = lambda role: None
                    ) -> dict[str, dict[str, Any]]:
    """Per role, one after another: reference log-probs (adapters off), then the TR-RPG loss
    backpropagated micro-batch by micro-batch into that role's adapter (``.grad``), then
    ``on_role(role)`` (the trainer's optimizer step of that role: the next role's
    micro-batches start from zeroed gradients)."""
    out = {}
    for role in ROLES:
        b = batches[role]
        if not b.completions:
            continue
        activate(model, role)
        batch = role_tensors(b, cfg, pad_id)
        n = sum(len(c) for c in b.completions)
        ref = reference_logprobs(model, batch, cfg, Path())  # type: ignore[arg-type]
        batch["ref"] = torch.zeros_like(batch["advantage"])
        batch["ref"][batch["mask"]] = ref[batch["index"][batch["mask"]]]
        model.train()
        res = accumulate_gradients(model, amb, batch, cfg, n, record_behaviour=True)
        out[role] = {**res, "ref": ref}
        on_role(role)
    return out


def naive_grads(model: Any, reference: Any, batches: dict[str, RoleBatch], cfg: Config,
                pad_id: int) -> dict[str, dict[str, Any]]:
    """The same losses computed the naive way: every sequence (prompt + completion, one copy of
    the prompt each) right-padded to the fixed length ``max_prompt_tokens + longest
    completion``, full ``[B, T, V]`` logits and log-softmax, reference log-probs from the
    model copy, the three roles' graphs all alive, one backward of their sum."""
    fixed = cfg.max_prompt_tokens + cfg.max_completion_tokens
    total, out = None, {}
    for role in ROLES:
        b = batches[role]
        comps = b.completions
        if not comps:
            continue
        activate(model, role, all_trainable=True)
        prompts = [p for p, g in zip(b.prompts, b.groups, strict=True) for _ in g]
        ids = torch.full((len(comps), fixed), pad_id, dtype=torch.long)
        att = torch.zeros((len(comps), fixed), dtype=torch.long)
        comp_mask = torch.zeros((len(comps), fixed - 1), dtype=torch.bool)
        for i, (p, c) in enumerate(zip(prompts, comps, strict=True)):
            seq = torch.from_numpy(np.concatenate([p, c]))
            ids[i, :len(seq)], att[i, :len(seq)] = seq, 1
            comp_mask[i, len(p) - 1:len(seq) - 1] = True
        model.train()
        logits = model(input_ids=ids, attention_mask=att).logits.float() / cfg.temperature
        lp = torch.log_softmax(logits[:, :-1], -1).gather(2, ids[:, 1:, None])[..., 0]
        with torch.no_grad():
            ref_logits = reference(input_ids=ids, attention_mask=att).logits.float()
            ref = torch.log_softmax(ref_logits[:, :-1] / cfg.temperature, -1).gather(
                2, ids[:, 1:, None])[..., 0]
        adv = torch.from_numpy(b.advantage)[:, None]
        ratio = torch.exp(lp - lp.detach())
        eps_hi = cfg.epsilon_high or cfg.epsilon
        surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - cfg.epsilon, 1 + eps_hi) * adv)
        d = ref - lp
        per_token = -surrogate + cfg.beta * (torch.exp(d) - d - 1)
        m = comp_mask.float()
        loss = ((per_token * m).sum(1) / m.sum(1)).mean()
        total = loss if total is None else total + loss
        out[role] = {"loss": float(loss.detach()), "ref": ref[comp_mask].detach(),
                     "behaviour": lp[comp_mask].detach()}
    if total is not None:
        total.backward()
    return out


def role_parameters(model: Any, role: str) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if f".{role}." in n and "lora_" in n]
