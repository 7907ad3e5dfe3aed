"""CRSP's ``--no-memory-opt`` path, the comparison baseline: the same per-role losses as
``trainers.crsp.update`` computed the naive way (a full reference copy, full ``[B, T, V]``
logits, all three roles' graphs alive at once, one full batch padded to a fixed length)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from trainers.crsp.roles import ROLES, activate
from trainers.crsp.rollout import RoleBatch
from trainers.llm.settings import PolicyLoss


def naive_grads(model: Any, reference: Any, batches: dict[str, RoleBatch], loss: PolicyLoss,
                temperature: float, fixed_tokens: int, pad_id: int
                ) -> dict[str, dict[str, Any]]:
    """The per-role TR-RPG losses the naive way: every sequence (prompt + completion, one copy
    of the prompt each) right-padded to ``fixed_tokens`` (``--max-prompt-tokens`` + the
    longest completion limit; what ``RoleBatch.training`` lists, each completion with its
    prompt), full ``[B, T, V]`` logits and log-softmax at ``temperature``,
    reference log-probs from the model copy ``reference`` (on its own device), the three
    roles' graphs all alive, one backward of their sum into every adapter's ``.grad``.
    Returns per role ``loss`` and ``ref`` / ``behaviour`` (flat float32[n tokens], CPU)."""
    device = model.device
    ref_device = next(reference.parameters()).device
    eps_hi = loss.epsilon_high or loss.epsilon
    total, out = None, {}
    for role in ROLES:
        b = batches[role]
        if not b.completions:
            continue
        activate(model, role, all_trainable=True)
        group_prompts, groups, advantage, weight = b.training()
        comps = [c for g in groups for c in g]
        prompts = [p for p, g in zip(group_prompts, groups, strict=True) for _ in g]
        ids = torch.full((len(comps), fixed_tokens), pad_id, dtype=torch.long)
        att = torch.zeros((len(comps), fixed_tokens), dtype=torch.long)
        comp_mask = torch.zeros((len(comps), fixed_tokens - 1), dtype=torch.bool)
        adv = torch.zeros((len(comps), fixed_tokens - 1))
        w = torch.zeros((len(comps), fixed_tokens - 1))
        for i, (p, c) in enumerate(zip(prompts, comps, strict=True)):
            seq = torch.from_numpy(np.concatenate([p, c]))
            ids[i, :len(seq)], att[i, :len(seq)] = seq, 1
            comp_mask[i, len(p) - 1:len(seq) - 1] = True
            adv[i, len(p) - 1:len(seq) - 1] = torch.from_numpy(advantage[i])
            w[i, len(p) - 1:len(seq) - 1] = torch.from_numpy(weight[i])
        ids, att, comp_mask = ids.to(device), att.to(device), comp_mask.to(device)
        model.train()
        logits = model(input_ids=ids, attention_mask=att).logits.float() / temperature
        lp = torch.log_softmax(logits[:, :-1], -1).gather(2, ids[:, 1:, None])[..., 0]
        with torch.no_grad():
            ref_logits = reference(input_ids=ids.to(ref_device),
                                   attention_mask=att.to(ref_device)).logits.float()
            ref = torch.log_softmax(ref_logits[:, :-1] / temperature, -1).gather(
                2, ids.to(ref_device)[:, 1:, None])[..., 0].to(device)
        adv, w = adv.to(device), w.to(device)
        ratio = torch.exp(lp - lp.detach())
        surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - loss.epsilon, 1 + eps_hi) * adv)
        d = ref - lp
        per_token = -surrogate + loss.beta * (torch.exp(d) - d - 1)
        role_loss = (per_token * w).sum()  # the per-token weights of RoleBatch.training
        total = role_loss if total is None else total + role_loss
        out[role] = {"loss": float(role_loss.detach()), "ref": ref[comp_mask].detach().cpu(),
                     "behaviour": lp[comp_mask].detach().cpu()}
    if total is not None:
        total.backward()
    return out
