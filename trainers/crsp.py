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
import dataclasses
import itertools
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from rlbuffers import FieldSpec, ReplayBuffer
from rlbuffers.cache import ByteLRUCache
from rlbuffers.checkpoint import Checkpoints, create_run, load_state
from rlbuffers.memory import AdaptiveMicroBatch, MemoryMonitor, RunningMeanStd, auto_budget
from rlbuffers.memory.activations import profile_activations, select_checkpoint_layers
from rlbuffers.memory.budget import plan_micro_batch, probe_activation_bytes
from rlbuffers.memory.process import trim_heap
from rlbuffers.memory.reference import reference_bytes_saved
from rlbuffers.stream.sources import IndexSource
from rlbuffers.stream.stages import BlockShuffle, Stage
from rlbuffers.stream.token_store import TokenStore
from trainers.common import (
    pyplot,
    restore_metrics,
    rng_states,
    save_figure,
    set_rng_states,
    start,
)
from trainers.crsp_config import RESUMABLE, Config, check_config
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
from trainers.grpo import accumulate_gradients
from trainers.math_tasks import SYSTEM, extract_answer, numeric_match, task_problems
from trainers.packed_logprobs import packed_batch, reference_logprobs

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
    model.checkpoint_plan = set_checkpointing(model, cfg)
    return model, tok, reference


def checkpoint_plan(model: Any, cfg: Config, profile_tokens: int = 128) -> dict[str, Any]:
    """Measure the saved-for-backward bytes of each decoder layer on one row of
    ``profile_tokens`` tokens (``profile_activations``; short, so that the forward's freed
    temporaries do not stay in the heap for the run) and choose the fewest layers whose
    checkpointing keeps at most ``activation_fraction`` of them (``select_checkpoint_layers``;
    the bytes grow with the tokens, so the choice holds for longer micro-batches). Returns
    plain data: the profile, the chosen layers and the bytes saved, scaled to a micro-batch
    of ``micro_batch_tokens`` (or ``pack_tokens``)."""
    layers = list(model.get_base_model().model.layers)
    tokens = cfg.micro_batch_tokens or cfg.pack_tokens
    ids = torch.zeros((1, min(profile_tokens, tokens)), dtype=torch.long)
    activate(model, ROLES[0])
    model.train()
    prof = profile_activations(
        layers, lambda: model(input_ids=ids, logits_to_keep=1).logits.sum(),
        exclude=model.parameters())
    trim_heap()  # the profile's activations are freed: give their pages back
    chosen = select_checkpoint_layers(prof, int(cfg.activation_fraction * prof.total_bytes))
    scale = tokens / ids.shape[1]
    saving = int(scale * sum(prof.layers[i].checkpoint_saving_bytes for i in chosen))
    log.info("activation profile (%d tokens): %.1f MiB saved for backward, %.1f MiB per "
             "layer; checkpointing layers %s saves %.1f MiB per %d-token micro-batch",
             ids.shape[1], prof.total_bytes / 2**20, prof.layers[-1].saved_bytes / 2**20,
             chosen, saving / 2**20, tokens)
    return {"profile": prof.state_dict(), "profile_tokens": int(ids.shape[1]),
            "layers": chosen, "saving_bytes": saving}


def set_checkpointing(model: Any, cfg: Config) -> dict[str, Any] | None:
    """Activation checkpointing of all decoder layers, none, or selected ones: those
    ``--checkpoint-layers`` names, or with ``auto`` those a measured profile chooses
    (``checkpoint_plan``, returned)."""
    if cfg.gradient_checkpointing == "off":
        return None
    from torch.utils.checkpoint import checkpoint

    layers = model.get_base_model().model.layers
    plan = None
    if cfg.gradient_checkpointing == "all":
        chosen = list(range(len(layers)))
    elif cfg.checkpoint_layers == "auto":
        plan = checkpoint_plan(model, cfg)
        chosen = plan["layers"]
    else:
        chosen = [int(i) for i in cfg.checkpoint_layers.split(",")]
    for i in chosen:
        layer = layers[i]
        forward = layer.forward

        def wrapped(*args: Any, _forward: Any = forward, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _forward(*args, **kwargs)
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        layer.forward = wrapped
    return plan


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
    problems = [(s["question"], s.get("entry", s), None) for s in seeds] + [
        (q, None, a) for q, a in (x for x in proposals if x is not None)]
    s_prompts = [np.asarray(s["prompt_ids"], np.int64) if "prompt_ids" in s  # the token store
                 else prompts("solver", s["question"]) for s in seeds]
    s_prompts += [prompts("solver", q) for q, _, _ in problems[len(seeds):]]
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
        out[role] = role_gradients(model, amb, role_tensors(b, cfg, pad_id), cfg,
                                   sum(len(c) for c in b.completions))
        on_role(role)
    return out


def role_gradients(model: Any, amb: AdaptiveMicroBatch, batch: dict[str, torch.Tensor],
                   cfg: Config, n_tokens: int) -> dict[str, Any]:
    """The active role's step on packed ``batch``: reference log-probs (adapters off), then
    the TR-RPG loss backpropagated micro-batch by micro-batch into its adapter's ``.grad``.
    Returns ``accumulate_gradients``' statistics and ``ref`` (float32[n_tokens], flat)."""
    ref = reference_logprobs(model, batch, cfg, None, n_tokens=n_tokens)  # type: ignore
    batch["ref"] = torch.zeros_like(batch["advantage"])
    batch["ref"][batch["mask"]] = ref[batch["index"][batch["mask"]]]
    model.train()
    res = accumulate_gradients(model, amb, batch, cfg, n_tokens, record_behaviour=True)
    return {**res, "ref": ref}


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


def plan_micro_batch_tokens(model: Any, cfg: Config, pad_id: int, budget_bytes: int) -> int:
    """Tokens per update micro-batch from the measured budget: the peak extra memory of a
    micro-batch of 1 and of 2 full packed rows (``pack_tokens`` each, forward + backward
    through the chunked log-probs) is measured (``probe_activation_bytes``) and
    ``plan_micro_batch`` takes the most rows that fit ``budget_bytes``, up to the rows of
    the largest role's batch at these settings. Gradients are zeroed afterwards.

    Raises:
        MemoryBudgetError: not even one row fits the budget.
    """
    from trainers.packed_logprobs import packed_logprobs

    half = cfg.pack_tokens // 2
    activate(model, ROLES[0])
    model.train()

    def make_batch(n: int) -> dict[str, torch.Tensor]:
        b = RoleBatch()
        for _ in range(n):  # a prompt and two completions fill one row
            comp = np.full(half // 2, 3, np.int64)
            b.add(np.full(cfg.pack_tokens - 2 * len(comp), 3, np.int64),
                  [(comp, False), (comp, False)])
        b.advantage = np.ones(len(b.completions), np.float32)
        return role_tensors(b, cfg, pad_id)

    def step(batch: dict[str, torch.Tensor]) -> None:
        lp = packed_logprobs(model, batch, cfg)
        (lp * batch["weight"][batch["mask"]]).sum().backward()
        model.zero_grad(set_to_none=True)

    cost = probe_activation_bytes(step, make_batch, sizes=(1, 2))
    solver = 2 * cfg.seeds_per_step * cfg.solver_samples * (cfg.max_prompt_tokens
                                                            + cfg.solver_tokens)
    plan = plan_micro_batch(budget_bytes, cost=cost,
                            target_batch=max(1, -(-solver // cfg.pack_tokens)))
    log.info("micro-batch plan: %s per row, budget %.0f MiB: %d row(s) of %d tokens",
             cost, budget_bytes / 2**20, plan.micro_batch, cfg.pack_tokens)
    return plan.micro_batch * cfg.pack_tokens


def micro_batches(model: Any, cfg: Config, tok: Any, budget: int | None) -> AdaptiveMicroBatch:
    """The update's micro-batching: ``--micro-batch-tokens`` tokens, or planned (0)."""
    tokens = cfg.micro_batch_tokens
    if tokens == 0 and budget is not None and cfg.memory_opt:
        tokens = plan_micro_batch_tokens(model, cfg, tok.pad_token_id, budget)
        print(f"micro-batches of {tokens} tokens planned from the budget", flush=True)
    return AdaptiveMicroBatch(model, budget_bytes=budget, grow_after=10,
                              max_tokens=tokens or cfg.pack_tokens, tokens_key="real")


def role_parameters(model: Any, role: str) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if f".{role}." in n and "lora_" in n]


# ------------------------------------------------------------------------------------------
# The buffer of utterances, checkpoints, the loop
# ------------------------------------------------------------------------------------------
def buffer_fields() -> dict[str, FieldSpec]:
    """One utterance (a role's completion) per transition; a step's utterances of a role and
    prompt form a group (``done`` on its last member)."""
    return {"prompt_ids": FieldSpec((None,), "int32"),
            "completion_ids": FieldSpec((None,), "int32"),
            "behaviour_logprobs": FieldSpec((None,), "float32"),
            "ref_logprobs": FieldSpec((None,), "float32"),
            "role": FieldSpec((), "int8"), "group": FieldSpec((), "int64"),
            "reward": FieldSpec((), "float32"), "extrinsic": FieldSpec((), "float32"),
            "length_reward": FieldSpec((), "float32"), "creativity": FieldSpec((), "float32"),
            "advantage": FieldSpec((), "float32"), "step": FieldSpec((), "int64"),
            "completion_truncated": FieldSpec((), "bool"), "done": FieldSpec((), "bool")}


def utterances(batches: dict[str, RoleBatch], grads: dict[str, dict[str, Any]], step: int,
               first_group: int) -> dict[str, Any]:
    """Every role's utterances of a step as one ``buffer.extend`` batch."""
    cols: dict[str, list[Any]] = {k: [] for k in buffer_fields()}
    group = first_group
    for role in ROLES:
        b = batches[role]
        if not b.completions:
            continue
        lens = [len(c) for c in b.completions]
        cuts = np.cumsum([0] + lens)
        behaviour = grads[role]["behaviour"].numpy()
        ref = grads[role]["ref"].numpy()
        k = 0
        for prompt, comps in zip(b.prompts, b.groups, strict=True):
            for j, c in enumerate(comps):
                cols["prompt_ids"].append(prompt.astype(np.int32))
                cols["completion_ids"].append(c.astype(np.int32))
                cols["behaviour_logprobs"].append(behaviour[cuts[k]:cuts[k + 1]])
                cols["ref_logprobs"].append(ref[cuts[k]:cuts[k + 1]])
                cols["role"].append(ROLE_ID[role])
                cols["group"].append(group)
                cols["done"].append(j == len(comps) - 1)
                k += 1
            group += 1
        cols["reward"] += b.reward.tolist()
        cols["advantage"] += b.advantage.tolist()
        cols["extrinsic"] += b.parts["extrinsic"]
        cols["length_reward"] += b.parts["length"]
        cols["creativity"] += b.parts.get("creativity", [0.0] * len(lens))
        cols["completion_truncated"] += b.truncated
    cols["step"] = [step] * len(cols["role"])
    return {k: v if k in ("prompt_ids", "completion_ids", "behaviour_logprobs",
                          "ref_logprobs") else np.asarray(v) for k, v in cols.items()}


@dataclass
class Trainer:
    """Everything a step changes besides the model and the buffer (checkpointed)."""

    cfg: Config
    model: Any
    tok: Any
    reference: Any
    opts: dict[str, torch.optim.Optimizer]
    amb: AdaptiveMicroBatch
    prompts: Prompts
    sketch: NoveltySketch
    stats: dict[str, RunningMeanStd]
    rng: np.random.Generator
    state: dict[str, Any]  # step, groups, data order (plain data)
    fsdp_units: list[Any] | None = None  # the sharded decoder layers under torchrun

    def state_dict(self) -> dict[str, Any]:
        return {"trainer": self.state, "sketch": self.sketch.state_dict(),
                "stats": {r: s.state_dict() for r, s in self.stats.items()},
                "micro_batch": self.amb.state_dict(), "truncated_prompts": self.prompts.truncated}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state["trainer"]
        self.sketch.load_state_dict(state["sketch"])
        for r, s in state["stats"].items():
            self.stats[r].load_state_dict(s)
        self.amb.load_state_dict(state["micro_batch"])
        self.prompts.truncated = state["truncated_prompts"]

    def step_role(self, role: str) -> None:
        params = role_parameters(self.model, role)
        if self.cfg.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm)
        self.opts[role].step()
        self.opts[role].zero_grad(set_to_none=True)


def seed_stream(n: int, cfg: Config) -> Stage:
    """Indices of the seed problems (rows of the token store ``DIR/seeds``), streamed without
    end: ``rlbuffers.stream``'s ``IndexSource`` (a seeded permutation per pass) through a
    ``BlockShuffle`` of ``--seed-shuffle-buffer`` samples. Its ``state_dict()`` (a few
    integers) resumes it exactly."""
    stage: Stage = IndexSource(range(n), seed=cfg.seed, cycle=True)
    if cfg.seed_shuffle_buffer > 1:
        stage = BlockShuffle(stage, cfg.seed_shuffle_buffer, seed=cfg.seed)
    return stage


def train_step(t: Trainer, buf: ReplayBuffer | None, store: TokenStore, problems: Any,
               monitor: MemoryMonitor) -> dict[str, Any]:
    """Rollout of all roles, rewards, the update of each role, the buffer; returns the
    metrics row (the caller checkpoints and commits)."""
    cfg, step, times, peaks = t.cfg, t.state["step"] + 1, {}, {}
    stream = seed_stream(len(store), cfg)
    if t.state["data"]:
        stream.load_state_dict(t.state["data"])
    indices = list(itertools.islice(stream, cfg.seeds_per_step))
    t.state["data"] = stream.state_dict()
    seeds = [{"question": problems[i]["question"], "entry": problems[i],
              "prompt_ids": store[i]}  # the solver's prompt, memory-mapped
             for i in indices]
    for name in ("rollout", "update", "buffer"):
        times[name] = 0.0
    with monitor.phase("rollout") as pk:
        t0 = time.perf_counter()
        if t.fsdp_units is None:
            batches, row = rollout(cfg, t.model, t.tok, t.prompts, seeds,
                                   problems.score_answer, t.sketch, t.stats, step - 1)
        else:
            from trainers.crsp_fsdp import rollout_on_rank0
            batches, row = rollout_on_rank0(t, seeds, problems.score_answer, step - 1)
        times["rollout"], peaks["rollout"] = time.perf_counter() - t0, pk
    with monitor.phase("update") as pk:
        t0 = time.perf_counter()
        if t.fsdp_units is not None:
            from trainers.crsp_fsdp import sharded_grads
            grads = sharded_grads(t.model, batches, cfg, t.tok.pad_token_id, t.amb,
                                  t.step_role)
        elif cfg.memory_opt:
            grads = optimised_grads(t.model, batches, cfg, t.tok.pad_token_id, t.amb,
                                    t.step_role)
        else:
            grads = naive_grads(t.model, t.reference, batches, cfg, t.tok.pad_token_id)
            for role in grads:
                t.step_role(role)
        times["update"], peaks["update"] = time.perf_counter() - t0, pk
        trim_heap()
    with monitor.phase("buffer") as pk:
        if buf is not None:  # None on ranks > 0: rank 0 owns the run directory
            buf.extend(utterances(batches, grads, step, t.state["groups"]))
        peaks["buffer"] = pk
    t.state["groups"] += sum(len(batches[r].prompts) for r in ROLES)
    row.update({"step": step, **{f"{r}_loss": grads[r]["loss"] for r in grads},
                **{f"{r}_kl": float(grads[r].get("kl", 0.0)) for r in grads},
                "utterances": int(sum(len(batches[r].completions) for r in ROLES)),
                "ranks": torch.distributed.get_world_size() if t.fsdp_units else 1,
                **{f"seconds_{k}": v for k, v in times.items()},
                **{f"peak_rss_{k}_bytes": v.peak_rss_bytes for k, v in peaks.items()}})
    return row


def plot_curve(path: Path, history: list[dict[str, Any]]) -> None:
    plt = pyplot()
    steps = [h["step"] for h in history]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=80)
    for role in ROLES:
        ax.plot(steps, [h[f"{role}_reward"] for h in history], label=f"{role} reward")
    ax.plot(steps, [h["seed_accuracy"] for h in history], "--", label="solver accuracy (seeds)")
    ax.set(xlabel="step", ylabel="mean reward", title="CRSP per-role rewards")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def load_checkpoint(t: Trainer, ckpt: Path, monitor: MemoryMonitor) -> list[dict[str, Any]]:
    """Adapters, optimizers, RNG and trainer state from a complete checkpoint; returns the
    metrics history it holds."""
    from safetensors.torch import load_file

    t.model.load_state_dict(load_file(str(ckpt / "adapters.safetensors")), strict=False)
    for r, s in torch.load(ckpt / "optimizers.pt", weights_only=True).items():
        t.opts[r].load_state_dict(s)
    set_rng_states(torch.load(ckpt / "rng.pt", weights_only=False), t.rng)
    state = load_state(ckpt)
    t.load_state_dict(state)
    monitor.load_state_dict(state["monitor"])
    return state["history"]


def commit_step(t: Trainer, buf: ReplayBuffer, ckpts: Checkpoints, monitor: MemoryMonitor,
                history: list[dict[str, Any]], row: dict[str, Any], t0: float) -> None:
    """Checkpoint the step, then commit the buffer (the commit point), then append ``row``
    to ``history``, ``metrics.jsonl`` and the curve."""
    from safetensors.torch import save_file

    save_t0 = time.perf_counter()
    run_dir = Path(t.cfg.run_dir)
    adapters = {n: p.detach() for n, p in t.model.named_parameters() if "lora_" in n}
    ckpts.write(t.state["step"], torch_files={
        "optimizers.pt": {r: o.state_dict() for r, o in t.opts.items()},
        "rng.pt": rng_states(t.rng)},
        writers={"adapters.safetensors": lambda p, a=adapters: save_file(a, str(p))},
        state={**t.state_dict(), "history": history + [row],
               "monitor": monitor.state_dict()})
    row["save_bytes"] = buf.save(metadata={"trainer_step": t.state["step"]}).bytes_written
    ckpts.prune(t.state["step"])
    row["seconds_save"] = time.perf_counter() - save_t0
    row["step_seconds"] = time.perf_counter() - t0
    row["peak_rss_bytes"] = max(v for k, v in row.items() if k.startswith("peak_rss_"))
    history.append(row)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    plot_curve(run_dir / "curve.png", history)


def open_trainer(cfg: Config, rank: int, world: int
                 ) -> tuple[Trainer, ReplayBuffer | None, Checkpoints, MemoryMonitor,
                            list[dict[str, Any]]]:
    """Model, run directory (created by rank 0 unless resuming), buffer (rank 0; None on
    the others), optimizers and the trainer, restored from the last complete checkpoint."""
    monitor = MemoryMonitor()  # logs RAM, the cgroup limit, CPUs and CUDA devices
    model, tok, reference = make_model(cfg)
    from trainers.grpo import prompt_store
    from trainers.lm import smollm2_dir

    model_dir = Path(cfg.model) if cfg.model else smollm2_dir()
    run_dir = Path(cfg.run_dir)
    ckpts = Checkpoints(run_dir / "ckpt", prefix="step", keep=cfg.keep_checkpoints)
    if not cfg.resume and rank == 0:
        def make(d: Path) -> None:
            (d / "ckpt").mkdir()
            prompt_store(cfg, tok, model_dir, d / "seeds")  # type: ignore[arg-type]
            ReplayBuffer.create(d / "buffer", capacity=cfg.buffer_capacity,
                                fields=buffer_fields(), seed=cfg.seed).close()

        create_run(run_dir, dataclasses.asdict(cfg), make)
    if world > 1:
        import torch.distributed as dist
        dist.barrier()  # rank 0 has created the run
    buf: ReplayBuffer | None = ReplayBuffer.open(run_dir / "buffer",
                                                 mode="r+" if rank == 0 else "r")
    opts = {r: torch.optim.AdamW(role_parameters(model, r), lr=cfg.lr, weight_decay=0.0,
                                 fused=True)
            for r in ROLES}
    budget = None if cfg.memory_budget == "none" else (
        auto_budget() if cfg.memory_budget == "auto" else int(cfg.memory_budget))
    amb = micro_batches(model, cfg, tok, budget if world == 1 else None)  # ranks must agree
    units = None
    if world > 1:
        from trainers.crsp_fsdp import shard_base
        units = shard_base(model)
    t = Trainer(cfg, model, tok, reference, opts, amb,
                Prompts(tok, cfg.max_prompt_tokens, ByteLRUCache(cfg.prompt_cache_bytes)),
                NoveltySketch(cfg.sketch_capacity, cfg.sketch_perm, cfg.seed),
                {r: RunningMeanStd() for r in ROLES}, np.random.default_rng(cfg.seed),
                {"step": 0, "groups": 0, "data": {}}, units)
    monitor.record_saving("shared_reference", reference_bytes_saved(model) * (
        1 if cfg.memory_opt else 0))
    if model.checkpoint_plan:  # per micro-batch of --micro-batch-tokens
        monitor.record_saving("selective_checkpointing", model.checkpoint_plan["saving_bytes"])
    history: list[dict[str, Any]] = []
    step = int(buf.metadata.get("trainer_step", 0))
    if rank == 0:
        ckpts.prune(step)
    else:  # ranks > 0 only read where the run stands
        buf.close()
        buf = None
    ckpt = ckpts.latest(step)
    if ckpt is not None:
        history = load_checkpoint(t, ckpt, monitor)
        if rank == 0:
            restore_metrics(run_dir / "metrics.jsonl", history, "step")
            print(f"resumed {run_dir} at step {t.state['step']}", flush=True)
    return t, buf, ckpts, monitor, history


def main(argv: list[str] | None = None) -> None:
    cfg = start(Config, argv, module="trainers.crsp", doc=__doc__, resumable=RESUMABLE,
                check=check_config)
    torch.set_num_threads(cfg.threads or os.cpu_count() or 1)
    rank, world = 0, int(os.environ.get("WORLD_SIZE", "1"))  # WORLD_SIZE: set by torchrun
    if world > 1:
        if not cfg.memory_opt:
            sys.exit("--no-memory-opt runs on one process only (it is the 1-rank baseline)")
        from trainers.crsp_fsdp import init_distributed
        rank, world = init_distributed()
    t, buf, ckpts, monitor, history = open_trainer(cfg, rank, world)
    run_dir = Path(cfg.run_dir)
    store = TokenStore(run_dir / "seeds")
    problems = task_problems(cfg.task, cfg.train_size, cfg.seed, cfg.task_config)
    summary_asked = threading.Event()  # kill -USR1 PID: a tensor summary after this step
    in_main = threading.current_thread() is threading.main_thread()
    old_handler = signal.signal(signal.SIGUSR1, lambda *_: summary_asked.set()) if in_main \
        else None
    finished = False
    try:
        bar = tqdm(total=cfg.steps, initial=t.state["step"], desc="CRSP steps", unit="step",
                   disable=rank != 0)
        while t.state["step"] < cfg.steps:
            t0 = time.perf_counter()
            row = train_step(t, buf, store, problems, monitor)
            t.state["step"] = row["step"]
            if cfg.tensor_summary or summary_asked.is_set():
                summary_asked.clear()
                row["tensors"] = monitor.tensor_summary(top_k=5).to_dict()
                print(f"step {row['step']}: live tensors "
                      f"{row['tensors']['total_bytes'] / 2**20:,.1f} MiB: "
                      + ", ".join(f"{g['owner']} {g['dtype']} {g['bytes'] / 2**20:,.1f} MiB"
                                  for g in row["tensors"]["groups"]), flush=True)
            if rank == 0:  # rank 0 owns the run directory
                commit_step(t, buf, ckpts, monitor, history, row, t0)
                bar.set_postfix({f"{r[:4]}": f"{row[f'{r}_reward']:.2f}" for r in ROLES})
                bar.update(1)
        bar.close()
        finished = True
    except KeyboardInterrupt:
        last = buf.metadata.get("trainer_step", 0) if buf is not None else "?"
        sys.exit(f"interrupted; step {last} is the last complete one: continue with --resume "
                 f"--run-dir {cfg.run_dir}")
    finally:
        if buf is not None:
            buf.close()
        if in_main:
            signal.signal(signal.SIGUSR1, old_handler)
        if world > 1:
            from trainers.crsp_fsdp import close_distributed
            close_distributed(finished)


if __name__ == "__main__":
    main()
