"""GRPO's policy update: one optimizer step on packed groups (the clipped surrogate with a k3
KL penalty, :mod:`trainers.llm.policy_loss`), and the mu > 1 iterations that re-read whole
groups from the buffer (Shao et al. 2024, Sec. 4.1: the importance ratio against the stored
behaviour log-probs)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rlbuffers import ReplayBuffer
from rlbuffers.memory import AdaptiveMicroBatch
from trainers.grpo.config import Config
from trainers.grpo.rollout import per_token_inputs
from trainers.llm.device import to_device
from trainers.llm.packed_logprobs import packed_batch
from trainers.llm.policy_loss import accumulate_gradients, clip_and_step


def update(model: Any, opt: torch.optim.Optimizer, amb: AdaptiveMicroBatch,
           batch: dict[str, torch.Tensor], cfg: Config, n_tokens: int,
           record_behaviour: bool) -> dict[str, Any]:
    """One optimizer step on packed rows (``batch``, on the model's device): clipped
    surrogate + beta * k3 KL, token weights in ``batch['weight']``, gradients clipped to
    ``--max-grad-norm``. With ``record_behaviour`` the batch's ``old`` log-probs are the
    current ones (ratio 1, as in the first of the mu iterations) and are returned as
    ``behaviour`` (float32[n_tokens], CPU); else ``behaviour`` is None. Also returns
    ``loss``, ``kl``, ``clip_fraction``, ``micro_batch``, ``retries`` and ``grad_norm``. A
    batch with ``generation`` log-probs (groups from ``--generation-workers``) is corrected by
    ``--is-truncation`` (then also ``is_ratio_mean`` and ``is_clipped_fraction``)."""
    packing = cfg.packing(cfg.pack_tokens, cfg.train_dtype)
    out = accumulate_gradients(model, amb, batch, cfg.policy_loss(), packing, n_tokens,
                               record_behaviour,
                               cfg.is_truncation if "generation" in batch else 0.0)
    params = [p for p in model.parameters() if p.requires_grad]
    return {**out, "grad_norm": clip_and_step(params, opt, cfg.max_grad_norm)}


def reuse_iteration(cfg: Config, model: Any, opt: torch.optim.Optimizer,
                    amb: AdaptiveMicroBatch, buf: ReplayBuffer, pad_id: int,
                    device: torch.device) -> dict[str, Any]:
    """One more update on ``--prompts-per-step`` whole groups re-read from the buffer (its
    ``GroupSampler``), with the ratio against their stored behaviour log-probs and their
    stored reference log-probs. Returns :func:`update`'s statistics (no ``behaviour``)."""
    s = buf.sample(cfg.prompts_per_step)
    flat = lambda name: [x for grp in s[name] for x in grp]  # noqa: E731
    prompts = [grp[0].astype(np.int64) for grp in s["prompt_ids"]]  # a group shares its prompt
    groups = [[c.astype(np.int64) for c in grp] for grp in s["completion_ids"]]
    comp_lens = [len(c) for grp in groups for c in grp]
    per_token = per_token_inputs(comp_lens, s["advantage"].reshape(-1), cfg.loss_norm,
                                 cfg.max_completion_tokens)
    per_token["old"] = flat("behaviour_logprobs")
    if cfg.beta:
        per_token["ref"] = flat("ref_logprobs")
    batch = to_device(packed_batch(prompts, groups, cfg.packing(cfg.pack_tokens,
                                                                cfg.train_dtype),
                                   pad_id, per_token, row_tokens=cfg.micro_batch_tokens), device)
    out = update(model, opt, amb, batch, cfg, sum(comp_lens), record_behaviour=False)
    out.pop("behaviour")
    return out
