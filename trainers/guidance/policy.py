"""The token-level policy gradient of each adapter (ArCHer, Zhou et al. 2024, Sec. 4): every
action token of an utterance gets the utterance's advantage, ``-A log pi + beta k3`` with the
k3 estimator of the KL to the reference (Schulman 2020, "Approximating KL divergence"); the
utterance batches, their log-probs through the chunked LM head, the reference's log-probs, and
the micro-batch plan of a step."""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import torch

from rlbuffers.memory import AdaptiveMicroBatch, PeakMemory, token_logprobs
from rlbuffers.memory.budget import StepCost, plan_micro_batch, probe_activation_bytes
from rlbuffers.memory.errors import MemoryBudgetError
from rlbuffers.memory.oom import free_memory
from rlbuffers.memory.process import trim_heap
from trainers.guidance.config import Config
from trainers.guidance.rollout import Policies
from trainers.llm.device import to_device
from trainers.llm.policy_loss import clip_and_step

log = logging.getLogger("trainers.guidance.policy")
MIB = 2**20


def utterance_batch(obs: list[np.ndarray], acts: list[np.ndarray], pad_id: int,
                    advantage: np.ndarray) -> dict[str, torch.Tensor]:
    """Observation + action per row, right-padded, on the CPU: ``input_ids``,
    ``attention_mask``, ``target`` (bool, action tokens), ``weight`` (``1 / (len(a) N)`` at
    action tokens: mean over tokens, then over utterances), ``index`` (flat action-token
    index), ``ref`` (float32, filled later), all ``[N, T]``; ``advantage`` float32[N]."""
    n, width = len(obs), max(len(o) + len(a) for o, a in zip(obs, acts, strict=True))
    out = {"input_ids": torch.full((n, width), pad_id, dtype=torch.long),
           "attention_mask": torch.zeros((n, width), dtype=torch.long),
           "target": torch.zeros((n, width), dtype=torch.bool),
           "weight": torch.zeros((n, width)), "index": torch.zeros((n, width), dtype=torch.long),
           "ref": torch.zeros((n, width)), "advantage": torch.as_tensor(advantage).float()}
    k = 0
    for i, (o, a) in enumerate(zip(obs, acts, strict=True)):
        p, c = len(o), len(a)
        out["input_ids"][i, :p + c] = torch.from_numpy(np.concatenate([o, a]).astype(np.int64))
        out["attention_mask"][i, :p + c] = 1
        out["target"][i, p:p + c] = True
        out["weight"][i, p:p + c] = 1.0 / (max(c, 1) * n)
        out["index"][i, p:p + c] = torch.arange(k, k + c)
        k += c
    return out


def utterance_logprobs(model: Any, micro: dict[str, torch.Tensor], *, chunk_tokens: int,
                       temperature: float) -> torch.Tensor:
    """Log-probs (float32[n], on ``micro``'s device) of the action tokens (``micro['target']``,
    row-major) from the decoder's hidden states through the chunked LM head (no ``[B, T, V]``
    logits); the model may live on another device than ``micro``."""
    width = int(micro["attention_mask"].sum(1).max())
    dev = model.get_output_embeddings().weight.device
    ids, att = micro["input_ids"][:, :width].to(dev), micro["attention_mask"][:, :width].to(dev)
    hidden = model.get_decoder()(input_ids=ids, attention_mask=att,
                                 use_cache=False).last_hidden_state
    rows, cols = micro["target"][:, :width].nonzero(as_tuple=True)
    rows, cols = rows.to(dev), cols.to(dev)
    head = model.get_output_embeddings()
    return token_logprobs(hidden[rows, cols - 1][None], head.weight, ids[rows, cols][None],
                          chunk_tokens=chunk_tokens, lm_head_bias=head.bias,
                          temperature=temperature)[0].to(micro["target"].device)


@torch.no_grad()
def utterance_reference_logprobs(policies: Policies, batch: dict[str, torch.Tensor], rows: int,
                                 *, chunk_tokens: int, temperature: float) -> None:
    """Fill ``batch['ref']`` at action tokens with the reference policy's log-probs (the base
    with adapters disabled, or the naive layout's copy), ``rows`` rows at a time."""
    with policies.reference() as ref:
        ref.eval()
        for r in range(0, len(batch["input_ids"]), rows):
            micro = {k: v[r:r + rows] for k, v in batch.items()}
            batch["ref"][r:r + rows][micro["target"]] = utterance_logprobs(
                ref, micro, chunk_tokens=chunk_tokens, temperature=temperature)


def policy_step(policies: Policies, role: str, opt: torch.optim.Optimizer,
                amb: AdaptiveMicroBatch, batch: dict[str, torch.Tensor],
                cfg: Config) -> dict[str, Any]:
    """One optimizer step of ``role``'s adapter: per action token ``-A logp + beta k3(ref,
    logp)``, weighted by ``batch['weight']`` (mean over tokens, then over utterances), in
    ``amb``'s micro-batches; gradients clipped to ``cfg.max_grad_norm``. Returns ``loss``,
    ``kl`` (mean k3), ``grad_norm``, ``micro_batch`` and ``retries``."""
    model = policies.use(role)
    model.train()
    rows = len(batch["input_ids"])
    kl = torch.zeros(int(batch["target"].sum()), device=batch["target"].device)

    def step_fn(micro: dict[str, torch.Tensor]) -> torch.Tensor:
        m = micro["target"]
        lp = utterance_logprobs(model, micro, chunk_tokens=cfg.chunk_tokens,
                                temperature=cfg.temperature)
        per = -micro["advantage"][:, None].expand(m.shape)[m] * lp
        if cfg.beta:
            d = micro["ref"][m] - lp
            k3 = torch.exp(d) - d - 1
            per = per + cfg.beta * k3
            kl[micro["index"][m]] = k3.detach()
        # AdaptiveMicroBatch scales by len(micro) / rows: this makes the sum over all rows.
        return (per * micro["weight"][m]).sum() * rows / len(m)

    stats = amb.run(batch, step_fn)
    norm = clip_and_step(policies.adapter_params(role), opt, cfg.max_grad_norm)
    return {"loss": stats.loss, "kl": float(kl.mean()), "grad_norm": norm,
            "micro_batch": stats.micro_batch, "retries": stats.retries}


def utterance_step_cost(policies: Policies, role: str, tokens: int, action_tokens: int,
                        pad_id: int, cfg: Config, budget: int | None = None) -> StepCost:
    """The measured memory of a policy step per token, on utterances of ``tokens`` tokens
    (``action_tokens`` of them the action): ``probe_activation_bytes`` runs ``role``'s real
    step (decoder forward with the attention mask, chunked LM-head log-probs, backward into the
    adapter's gradients) on 1 and 3 such utterances and fits a fixed part and a part per token
    (on a CUDA device its allocator peak, else the process RSS). Every second utterance is one
    token shorter, so the batch is padded as real batches are (a masked attention path costs
    more than an unpadded one). On the CPU the RSS probe reads low (the step reuses pages the
    allocator kept from the previous one: 1 and 2 utterances read 305-413 MiB per 203-token
    SmolLM2-135M utterance where real micro-batches took 457), hence 3, not 2. Measured
    once, on the longest utterances (the agent's): a second probe in the same process reads
    less still. Gradients are zeroed afterwards.

    Within ``budget`` (issue 49): the step on 3 utterances is itself a peak (SmolLM2-135M on
    529-token gsm_symbolic utterances: ~1.3 GiB each, so 3 took the process to 5.2 GB, above
    every later phase). So one utterance is measured first, on the process's first step (no
    warm-up, so no page the allocator kept hides it); when 3 of those would pass ``budget``
    the micro-batch can hold at most 2 and the probe stops there: that one step's extra bytes
    are the cost, all counted per token (fixed part 0), which overstates, never understates,
    a micro-batch's."""
    model = policies.use(role)
    model.train()
    device = next(model.parameters()).device

    def make_batch(n: int) -> dict[str, torch.Tensor]:
        obs = [np.full(tokens - action_tokens - (i % 2), 3, np.int64) for i in range(n)]
        acts = [np.full(action_tokens, 3, np.int64) for _ in range(n)]
        return to_device(utterance_batch(obs, acts, pad_id, np.ones(n)), device)

    def step(micro: dict[str, torch.Tensor]) -> None:
        lp = utterance_logprobs(model, micro, chunk_tokens=cfg.chunk_tokens,
                                temperature=cfg.temperature)
        (lp * micro["weight"][micro["target"]]).sum().backward()
        model.zero_grad(set_to_none=True)

    cuda = device if device.type == "cuda" else None
    if budget is not None:
        free_memory()
        trim_heap()
        with PeakMemory(device=cuda) as peak:
            step(make_batch(1))
        one = peak.peak_extra_bytes
        if 3 * one > budget:
            cost = StepCost(fixed_bytes=0, bytes_per_item=0,
                            bytes_per_token=math.ceil(one / tokens))
            log.info("one %d-token utterance's step took %.1f MiB: 3 would pass the budget "
                     "(%.0f MiB), so no 3-utterance probe; cost %s", tokens, one / MIB,
                     budget / MIB, cost)
            return cost
    return probe_activation_bytes(step, make_batch, sizes=(1, 3), tokens_per_item=tokens,
                                  device=cuda)


def micro_batches(role: str, model: Any, budget: int | None, items: int, tokens_per_item: int,
                  cost: StepCost | None) -> tuple[AdaptiveMicroBatch, dict[str, Any]]:
    """The micro-batches of ``role``'s policy steps (``items`` utterances of at most
    ``tokens_per_item`` tokens) from ``plan_micro_batch`` under ``budget`` bytes with the
    measured ``cost`` (:func:`utterance_step_cost`: bytes per token); ``AdaptiveMicroBatch``
    halves it if the measured peak still goes over the budget. Whole batches when ``budget``
    is None. Returns it and the plan as plain data (logged at INFO)."""
    if budget is None or cost is None:
        plan: dict[str, Any] = {"budget_bytes": None, "micro_batch": items, "items": items}
        amb = AdaptiveMicroBatch(model)
    else:
        try:
            size = plan_micro_batch(budget, cost=cost, target_batch=items,
                                    tokens_per_item=tokens_per_item).micro_batch
        except MemoryBudgetError:
            size = 1
        per_item = cost.bytes_per_item + cost.bytes_per_token * tokens_per_item
        plan = {"budget_bytes": budget, "micro_batch": size, "items": items,
                "fixed_bytes": cost.fixed_bytes, "activation_bytes_per_item": per_item,
                "tokens_per_item": tokens_per_item}
        amb = AdaptiveMicroBatch(model, max_micro_batch=size, budget_bytes=budget,
                                 grow_after=10)
    measured = "-" if budget is None else (f"{plan['fixed_bytes'] / MIB:,.1f} MiB + "
                                           f"{plan['activation_bytes_per_item'] / MIB:,.1f} "
                                           "MiB per utterance")
    log.info("micro-batch plan %s: %d of %d utterances (<= %d tokens each; measured step "
             "memory %s), budget %s", role, plan["micro_batch"], items, tokens_per_item,
             measured, "none" if budget is None else f"{budget / MIB:,.0f} MiB")
    return amb, plan
