"""CRSP's update on the memory-optimised path: per role, one after another, the reference
log-probs (the shared base with adapters disabled, or the role's adapter as the warm-up left
it: ``--proposer-reference warmup``) and the TR-RPG loss (the clipped surrogate
with a k3 KL penalty: ``trainers.llm.policy_loss.accumulate_gradients``) backpropagated over
shared-prefix packed rows micro-batch by micro-batch into that role's adapter; and the
micro-batch size planned from a measured cost and the memory budget."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from rlbuffers.memory import AdaptiveMicroBatch
from rlbuffers.memory.budget import plan_micro_batch, probe_activation_bytes
from trainers.crsp.config import Config
from trainers.crsp.roles import ROLES, activate
from trainers.crsp.rollout import RoleBatch
from trainers.llm.device import to_device
from trainers.llm.packed_logprobs import packed_batch, packed_logprobs, packed_reference_logprobs
from trainers.llm.policy_loss import accumulate_gradients
from trainers.llm.settings import Packing, PolicyLoss

log = logging.getLogger("trainers.crsp.update")
MIB = 2**20


def role_tensors(b: RoleBatch, packing: Packing, pad_id: int) -> dict[str, torch.Tensor]:
    """Packed rows of one role (shared prefix, CPU tensors ``[R, pack_tokens]``) of what it
    trains on (``RoleBatch.training``: its completions, then the critic's verdict
    continuations), with per-token ``advantage`` and loss ``weight``."""
    prompts, groups, adv, weight = b.training()
    return packed_batch(prompts, groups, packing, pad_id, {"advantage": adv, "weight": weight})


def announce(role: str, n_tokens: int, iterations: int = 1) -> None:
    """Log (INFO) the start of a role's part of the update, so the update phase is never
    silent for long: ``update: solver, 1,204 tokens (reference log-probs, 1 pass)...``."""
    log.info("update: %s, %s tokens (reference log-probs, %d pass%s)...", role,
             f"{n_tokens:,}", iterations, "" if iterations == 1 else "es")


@contextmanager
def adapters_swapped(model: Any, tensors: dict[str, torch.Tensor] | None) -> Iterator[None]:
    """For the block, the model's parameters named in ``tensors`` (LoRA tensors, as
    ``named_parameters`` names them) hold those values; afterwards their own values again,
    bit for bit, whatever the block raised. ``tensors`` None or empty: nothing changes.

    Raises:
        KeyError: a name the model has no parameter of.
    """
    if not tensors:
        yield
        return
    params = dict(model.named_parameters())
    missing = [n for n in tensors if n not in params]
    if missing:
        raise KeyError(f"reference adapters: the model has no parameter {missing[0]!r} "
                       f"({len(missing)} of {len(tensors)} missing)")
    saved = {n: params[n].detach().clone() for n in tensors}
    with torch.no_grad():
        for n, v in tensors.items():
            params[n].copy_(v)
    try:
        yield
    finally:
        with torch.no_grad():
            for n, v in saved.items():
                params[n].copy_(v)


def optimised_grads(model: Any, batches: dict[str, RoleBatch], packing: Packing,
                    loss: PolicyLoss, pad_id: int, amb: AdaptiveMicroBatch,
                    on_role: Any = lambda role: None, iterations: int = 1,
                    references: dict[str, dict[str, torch.Tensor]] | None = None
                    ) -> dict[str, dict[str, Any]]:
    """Per role, one after another: reference log-probs (adapters off, or the role's
    ``references[role]`` adapter tensors), then ``iterations`` times the TR-RPG loss
    backpropagated micro-batch by micro-batch into that role's adapter (``.grad``) followed
    by ``on_role(role)`` (the trainer's optimizer step of that role, which zeroes the
    gradients). Batches go to the model's device. Returns per role :func:`role_gradients`'
    statistics."""
    out = {}
    for role in ROLES:
        b = batches[role]
        if not b.completions:
            continue
        activate(model, role)
        announce(role, b.training_tokens(), iterations)
        batch = to_device(role_tensors(b, packing, pad_id), model.device)
        out[role] = role_gradients(model, amb, batch, packing, loss,
                                   b.training_tokens(), iterations,
                                   lambda r=role: on_role(r),
                                   (references or {}).get(role))
        on_role(role)
    return out


def role_gradients(model: Any, amb: AdaptiveMicroBatch, batch: dict[str, torch.Tensor],
                   packing: Packing, loss: PolicyLoss, n_tokens: int, iterations: int = 1,
                   between: Any = lambda: None,
                   reference: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """The active role's update on packed ``batch``: reference log-probs (adapters off; with
    ``reference``, the role's adapter tensors by parameter name, swapped in for the pass:
    :func:`adapters_swapped`), then
    ``iterations`` passes of the TR-RPG loss backpropagated micro-batch by micro-batch into
    its adapter's ``.grad``, ``between()`` (the optimizer step) after each pass but the last.

    The first pass runs the policy that sampled the batch (nothing has stepped since the
    rollout), so its log-probs are the behaviour log-probs (recorded, ratio 1); they are
    stored in the batch as ``old`` and every later pass takes its importance ratio against
    them, so clipping (``epsilon``, ``epsilon_high``) acts on a reused batch (PPO's epochs).

    Returns the first pass's ``accumulate_gradients`` statistics (``loss``: the on-policy
    loss), ``ref`` and ``behaviour`` (float32[n_tokens], flat, CPU), and per pass ``losses``
    and ``clip_fractions`` (0 on the first)."""
    with adapters_swapped(model, reference):
        ref = packed_reference_logprobs(model, batch, packing, None, n_tokens=n_tokens,
                                        adapters_on=bool(reference))
    mask = batch["mask"]
    batch["ref"] = torch.zeros_like(batch["advantage"])
    batch["ref"][mask] = ref.to(mask.device)[batch["index"][mask]]
    model.train()
    passes = []
    for i in range(iterations):
        if i:
            between()
        passes.append(accumulate_gradients(model, amb, batch, loss, packing, n_tokens,
                                           record_behaviour=i == 0))
        if i == 0 and iterations > 1:
            batch["old"] = torch.zeros_like(batch["advantage"])
            batch["old"][mask] = passes[0]["behaviour"].to(mask.device)[batch["index"][mask]]
    return {**passes[0], "ref": ref, "losses": [p["loss"] for p in passes],
            "clip_fractions": [p["clip_fraction"] for p in passes]}


def plan_micro_batch_tokens(model: Any, cfg: Config, packing: Packing, pad_id: int,
                            budget_bytes: int) -> int:
    """Tokens per update micro-batch from the measured budget: the peak extra memory of a
    micro-batch of 1 and of 2 full packed rows (``pack_tokens`` each, forward + backward
    through the chunked log-probs) is measured (``probe_activation_bytes``) and
    ``plan_micro_batch`` takes the most rows that fit ``budget_bytes``, up to the rows of
    the largest role's batch at these settings. Gradients are zeroed afterwards.

    Raises:
        MemoryBudgetError: not even one row fits the budget.
    """
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
        return to_device(role_tensors(b, packing, pad_id), model.device)

    def step(batch: dict[str, torch.Tensor]) -> None:
        lp = packed_logprobs(model, batch, packing)
        (lp * batch["weight"][batch["mask"]]).sum().backward()
        model.zero_grad(set_to_none=True)

    cost = probe_activation_bytes(step, make_batch, sizes=(1, 2))
    solver = 2 * cfg.seeds_per_step * cfg.solver_samples * (cfg.max_prompt_tokens
                                                            + cfg.solver_tokens)
    plan = plan_micro_batch(budget_bytes, cost=cost,
                            target_batch=max(1, -(-solver // cfg.pack_tokens)))
    log.info("micro-batch plan: %s per row, budget %.0f MiB: %d row(s) of %d tokens",
             cost, budget_bytes / MIB, plan.micro_batch, cfg.pack_tokens)
    return plan.micro_batch * cfg.pack_tokens


def micro_batches(model: Any, cfg: Config, packing: Packing, pad_id: int,
                  budget: int | None) -> AdaptiveMicroBatch:
    """The update's micro-batching: ``--micro-batch-tokens`` tokens, or planned (0) from
    ``budget`` bytes (one row of ``--pack-tokens`` without a budget)."""
    tokens = cfg.micro_batch_tokens
    if tokens == 0 and budget is not None and cfg.memory_opt:
        tokens = plan_micro_batch_tokens(model, cfg, packing, pad_id, budget)
        log.info("micro-batches of %d tokens planned from the budget", tokens)
    return AdaptiveMicroBatch(model, budget_bytes=budget, grow_after=10,
                              max_tokens=tokens or cfg.pack_tokens, tokens_key="real")
