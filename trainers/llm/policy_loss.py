"""The policy-gradient parts the LLM trainers share: group-relative advantages (GRPO, Shao et
al. 2024, "DeepSeekMath", Sec. 4.1), per-token loss weights (the normalisations of GRPO, DAPO
and Dr. GRPO), and the clipped surrogate (PPO, Schulman et al. 2017, Eq. 7) with a k3 KL
penalty to the reference policy (Schulman 2020, "Approximating KL divergence") backpropagated
over packed rows micro-batch by micro-batch (gradient accumulation)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rlbuffers.memory import AdaptiveMicroBatch
from trainers.llm.packed_logprobs import packed_logprobs
from trainers.llm.settings import Packing, PolicyLoss

LOSS_NORMS = ("sequence", "token", "constant")


def group_advantages(rewards: np.ndarray, g: int, scale: str) -> tuple[np.ndarray, float]:
    """Group-relative advantages (float32[N], N = groups * g, group members contiguous):
    ``r - mean`` divided by the group's std when ``scale == "group"``; a group whose rewards
    are all equal gets 0 (no signal, no division by 0). Also the fraction of such groups.

    Raises:
        ValueError: ``len(rewards)`` is not a multiple of ``g``, or ``g`` < 2.
    """
    if g < 2 or len(rewards) % g:
        raise ValueError(f"rewards: expected a multiple of the group size {g} (>= 2) values, "
                         f"got {len(rewards)}")
    r = rewards.reshape(-1, g).astype(np.float64)
    std = r.std(axis=1, ddof=1, keepdims=True)
    adv = r - r.mean(axis=1, keepdims=True)
    flat = std[:, 0] < 1e-6
    if scale == "group":
        adv = np.where(flat[:, None], 0.0, adv / np.maximum(std, 1e-6))
    return adv.reshape(-1).astype(np.float32), float(flat.mean())


def token_weights(comp_lens: list[int], norm: str, max_completion_tokens: int
                  ) -> list[np.ndarray]:
    """Each completion token's weight in the loss (float32 arrays, one per completion):
    ``sequence``: mean over tokens, then over completions (GRPO, Eq. 3); ``token``: sum over
    all tokens / number of tokens (DAPO, Yu et al. 2025, Eq. 8); ``constant``: sum /
    (completions * ``max_completion_tokens``) (Dr. GRPO, Liu et al. 2025, Sec. 3.1)."""
    n = len(comp_lens)
    if norm == "sequence":
        return [np.full(k, 1.0 / (k * n), np.float32) for k in comp_lens]
    denom = sum(comp_lens) if norm == "token" else n * max_completion_tokens
    return [np.full(k, 1.0 / denom, np.float32) for k in comp_lens]


def accumulate_gradients(model: Any, amb: AdaptiveMicroBatch, batch: dict[str, torch.Tensor],
                         loss: PolicyLoss, packing: Packing, n_tokens: int,
                         record_behaviour: bool, is_truncation: float = 0.0) -> dict[str, Any]:
    """Backpropagate the clipped surrogate + ``beta`` * k3 KL of packed rows into ``.grad``,
    micro-batch by micro-batch under ``amb`` (no optimizer step). ``batch``: packed rows
    (``trainers.llm.packed_logprobs.packed_batch``) with per-token ``advantage``, ``weight``,
    ``old`` (behaviour log-probs; unless ``record_behaviour``: then the current log-probs
    are the behaviour ones, ratio 1) and ``ref`` (reference log-probs, with ``beta``).

    ``is_truncation`` C > 0 (``--is-truncation``): truncated importance sampling of stale
    groups, per token (TIS: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
    Off-Policy RL Training"; NeMo-RL's ``ClippedPGLossFn`` with
    ``use_importance_sampling_correction`` and ``truncated_importance_sampling_type="tis"``,
    ``nemo_rl/algorithms/loss_functions.py``). ``batch['generation']`` (float32, per token
    like ``old``) holds the log-probs of the weights that generated the tokens (a generation
    worker's, possibly K versions old); each token's clipped surrogate is multiplied by the
    constant ``w = min(exp(old - generation), C)`` (no gradient through ``w``), ``old`` being
    the ratio's denominator above; the KL term is not weighted (as NeMo-RL's). With
    ``batch['generation']`` the returned statistics add ``is_ratio_mean`` (the mean of
    ``exp(old - generation)`` over the tokens, before truncation) and
    ``is_clipped_fraction`` (the fraction of tokens whose ratio exceeded C; 0 when off).
    ``is_truncation`` 0 computes exactly the loss without the correction (the same
    operations), with or without ``batch['generation']``.

    Returns the loss, mean KL, clip fraction, micro-batch statistics and, with
    ``record_behaviour``, the current log-probs (float32[n_tokens], CPU).

    Raises:
        ValueError: ``is_truncation`` < 0, or > 0 without ``batch['generation']``.
    """
    if is_truncation < 0 or (is_truncation > 0 and "generation" not in batch):
        raise ValueError(f"is_truncation: expected 0 (off) or > 0 with batch['generation'] "
                         f"(the generating weights' log-probs), got {is_truncation!r} and "
                         f"keys {sorted(batch)}")
    eps_lo, eps_hi = loss.epsilon, loss.epsilon_high or loss.epsilon
    tis = "generation" in batch  # the generating weights' log-probs: the ratio's statistics
    names = ("logprob", "kl", "clipped") + (("is_ratio", "is_clipped") if tis else ())
    flat = {k: torch.zeros(n_tokens) for k in names}
    rows = len(batch["input_ids"])
    model.train()

    def step_fn(micro: dict[str, torch.Tensor]) -> torch.Tensor:
        m = micro["mask"]
        lp = packed_logprobs(model, micro, packing)
        old = lp.detach() if record_behaviour else micro["old"][m]
        ratio = torch.exp(lp - old)
        adv = micro["advantage"][m]
        clipped = ratio.clamp(1 - eps_lo, 1 + eps_hi)
        per_token = -torch.minimum(ratio * adv, clipped * adv)
        idx = micro["index"][m].cpu()
        if tis:
            is_ratio = torch.exp(old.detach() - micro["generation"][m])
            if is_truncation:  # TIS: the surrogate times min(pi_old / pi_generation, C)
                per_token = per_token * is_ratio.clamp(max=is_truncation)
                flat["is_clipped"][idx] = (is_ratio > is_truncation).float().detach().cpu()
            flat["is_ratio"][idx] = is_ratio.detach().float().cpu()
        if loss.beta:
            d = micro["ref"][m] - lp
            kl = torch.exp(d) - d - 1
            per_token = per_token + loss.beta * kl
            flat["kl"][idx] = kl.detach().cpu()
        flat["logprob"][idx] = lp.detach().cpu()
        flat["clipped"][idx] = ((ratio * adv > clipped * adv).float()).detach().cpu()
        # AdaptiveMicroBatch scales by len(micro) / rows: this makes the sum over all rows.
        return (per_token * micro["weight"][m]).sum() * rows / len(m)

    stats = amb.run(batch, step_fn)
    out = {"loss": stats.loss, "kl": float(flat["kl"].mean()),
           "clip_fraction": float(flat["clipped"].mean()),
           "micro_batch": stats.micro_batch, "retries": stats.retries,
           "behaviour": flat["logprob"] if record_behaviour else None}
    if tis:
        out.update(is_ratio_mean=float(flat["is_ratio"].mean()),
                   is_clipped_fraction=float(flat["is_clipped"].mean()))
    return out


def clip_and_step(params: list[torch.nn.Parameter], opt: torch.optim.Optimizer,
                  max_grad_norm: float) -> float:
    """Clip the gradients of ``params`` (those that have one) by global norm
    (``max_grad_norm``; 0: off), take the optimizer step and clear the gradients. Returns the
    norm before clipping (0.0 when off)."""
    norm = 0.0
    if max_grad_norm:
        norm = float(torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None],
                                                    max_grad_norm))
    opt.step()
    opt.zero_grad(set_to_none=True)
    return norm
