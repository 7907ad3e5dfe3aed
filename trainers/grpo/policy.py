"""The GRPO policy: the causal LM (full fine-tuning or LoRA adapters), where it lives
(``--device``, placed by ``plan_placement``), its memory budget and gradient checkpointing
plan, and its weights in a checkpoint (the whole model, or the adapters only)."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import torch

from rlbuffers.memory.placement import PlacementPlan
from trainers.grpo.config import Config
from trainers.llm.checkpointing import set_gradient_checkpointing
from trainers.llm.device import place_models
from trainers.llm.model import load_causal_lm, lora_config, model_dir

log = logging.getLogger("trainers.grpo.policy")

#: The models GRPO places and their roles: only the policy lives in memory (the reference is
#: the same weights with adapters disabled, or the initial weights memory-mapped from a file
#: while reference log-probs are computed).
ROLES = {"policy": "trained"}


def make_policy(cfg: Config) -> tuple[Any, Any, Path]:
    """``(model, tokenizer, model directory)``: ``--model`` in fp32 on the CPU with, when
    ``--lora-rank`` > 0, peft LoRA adapters (initialised from ``torch.manual_seed(--seed)``)."""
    path = model_dir(cfg.model)
    model, tok = load_causal_lm(path)
    torch.manual_seed(cfg.seed)
    if cfg.lora_rank:
        from peft import get_peft_model

        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated")  # peft
        model = get_peft_model(model, lora_config(cfg.lora_rank, cfg.lora_alpha))
    return model, tok, path


def place_policy(model: Any, device: torch.device) -> tuple[Any, PlacementPlan]:
    """Move the policy (weights; its gradients and AdamW state follow) to ``device`` through
    ``place_models`` with :data:`ROLES` (the CPU may hold all of the machine's RAM). Returns
    the placed model and the plan (logged as a table at INFO).

    Raises:
        rlbuffers.memory.MemoryBudgetError: the policy fits on no device."""
    import psutil

    placed, plan = place_models({"policy": model}, ROLES, device,
                                cpu_bytes=psutil.virtual_memory().total)
    if plan.device["policy"] != str(device):
        log.warning("--device %s: the policy does not fit there; it trains on %s", device,
                    plan.device["policy"])
    return placed["policy"], plan


def gradient_checkpointing(model: Any, cfg: Config, budget: int | None) -> dict[str, Any]:
    """Apply ``--gradient-checkpointing`` for the largest update micro-batch (``--micro-batch-
    tokens``, or one row of ``--pack-tokens`` holding a long group) under ``budget`` bytes;
    returns the plan (``mode``, ``layers`` checkpointed, measured bytes), logged at INFO."""
    tokens = max(cfg.micro_batch_tokens, cfg.pack_tokens)  # a long group's row stands alone
    plan = set_gradient_checkpointing(model, cfg.gradient_checkpointing, tokens=tokens,
                                      budget=budget, train_dtype=cfg.train_dtype,
                                      layers=cfg.checkpoint_layers,
                                      fraction=cfg.activation_fraction)
    log.info("gradient checkpointing %s: %d decoder layers recomputed in backward%s",
             plan["mode"], len(plan["layers"]),
             f" (activations of a {tokens}-token micro-batch: "
             f"{plan['activation_bytes'] / 2**20:,.0f} MiB)" if "activation_bytes" in plan
             else "")
    return plan


def write_reference(model: Any, path: Path) -> None:
    """Save the initial weights (the full fine-tuning reference policy) to ``path``
    (``torch.save``d state dict, CPU tensors), read memory-mapped by
    ``packed_reference_logprobs``."""
    torch.save({k: v.cpu() for k, v in model.state_dict().items()}, path)


def save_weights(model: Any, lora: bool, path: Path) -> None:
    """The trained weights to ``path`` (safetensors): the adapters with ``lora``, else the
    whole model."""
    from safetensors.torch import save_file, save_model

    if lora:
        save_file({n: p.detach() for n, p in model.named_parameters() if p.requires_grad},
                  str(path))
    else:
        save_model(model, str(path))


def load_weights(model: Any, lora: bool, path: Path) -> None:
    """Load what :func:`save_weights` wrote into ``model`` (on its device).

    Raises:
        rlbuffers.CorruptCheckpointError: the file is missing, damaged, not a regular file,
            or holds keys or shapes the model does not have (one line naming it)."""
    from rlbuffers.safe_load import load_safetensors, restoring

    device = str(next(model.parameters()).device)
    if lora:
        with restoring(path, "the adapters of this model"):
            missing = model.load_state_dict(load_safetensors(path), strict=False
                                            ).unexpected_keys
            if missing:
                raise ValueError(f"unexpected adapter keys {missing[:3]}")
    else:
        load_safetensors(path, device=device, into=model)
