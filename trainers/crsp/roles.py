"""CRSP's three roles over one model: the base with a LoRA adapter per role (peft), which role
is active and trainable, each role's parameters, its activation checkpointing, and the role
prompts (system prompt per role, tokenized once per distinct text)."""

from __future__ import annotations

import copy
import logging
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlbuffers.cache import ByteLRUCache
from trainers.crsp.config import Config
from trainers.crsp.formats import render
from trainers.llm.checkpointing import set_gradient_checkpointing

log = logging.getLogger("trainers.crsp.roles")

ROLES = ("proposer", "solver", "critic")
ROLE_ID = {r: i for i, r in enumerate(ROLES)}


def make_model(cfg: Config, device: torch.device | str = "cpu") -> tuple[Any, Any, Any]:
    """``(policy, tokenizer, reference)``: the base with a LoRA adapter per role (initialised
    on the CPU from ``cfg.seed``, so the same on both paths and every device), moved to
    ``device``; ``reference`` is None with ``memory_opt`` (the base with adapters disabled),
    otherwise a full copy of the base, on the CPU (the caller places it: ``place_models``)."""
    from peft import get_peft_model

    from trainers.llm.model import load_causal_lm, lora_config

    base, tok = load_causal_lm(cfg.model or None)
    reference = None if cfg.memory_opt else copy.deepcopy(base).eval()
    lora = lora_config(cfg.lora_rank, cfg.lora_alpha)
    torch.manual_seed(cfg.seed)
    warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated")  # peft
    model = get_peft_model(base, lora, adapter_name=ROLES[0])
    for role in ROLES[1:]:
        model.add_adapter(role, lora)
    return model.to(device), tok, reference


def set_checkpointing(model: Any, cfg: Config, budget: int | None) -> dict[str, Any]:
    """``--gradient-checkpointing`` of the decoder layers (``set_gradient_checkpointing``:
    off, all, selective from ``--checkpoint-layers`` or a measured profile, or auto from the
    ``budget`` bytes) for micro-batches of ``--micro-batch-tokens`` (or ``--pack-tokens``),
    profiled with the first role's adapter active. Returns the plan (plain data: ``mode``,
    ``layers``, and where measured ``saving_bytes`` / ``activation_bytes``)."""
    activate(model, ROLES[0])
    return set_gradient_checkpointing(
        model, cfg.gradient_checkpointing, tokens=cfg.micro_batch_tokens or cfg.pack_tokens,
        budget=budget, layers=cfg.checkpoint_layers, fraction=cfg.activation_fraction)


def activate(model: Any, role: str, all_trainable: bool = False) -> None:
    """Make ``role``'s adapter the active one (only it trainable, unless ``all_trainable``:
    the naive path keeps every role's graph alive and backpropagates once)."""
    model.set_adapter(role)
    if all_trainable:
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.requires_grad_(True)


def role_parameters(model: Any, role: str) -> list[torch.nn.Parameter]:
    """The LoRA parameters of ``role``'s adapter."""
    return [p for n, p in model.named_parameters() if f".{role}." in n and "lora_" in n]


@dataclass
class Prompts:
    """Role prompts rendered with the chat template and tokenized once per distinct text
    (a byte-bounded LRU); prompts over ``max_tokens`` keep their last tokens (counted)."""

    tok: Any
    max_tokens: int
    cache: ByteLRUCache
    truncated: int = 0
    verifiable: bool = False
    """The proposer's prompt asks for a verifiable problem (``--proposer-reward
    learnability``: ``formats.PROPOSER_SYSTEM_VERIFIABLE``)."""

    def __call__(self, role: str, user: str) -> np.ndarray:
        """int64 token ids of ``role``'s system prompt, ``user``'s message and the role's
        prefilled opening tag (``trainers.crsp.formats``)."""
        key = (role, user)
        ids = self.cache.get(key)
        if ids is None:
            text = render(self.tok, role, user, self.verifiable)
            ids = np.asarray(self.tok(text, add_special_tokens=False)["input_ids"], np.int64)
            self.cache.put(key, ids)
        if len(ids) > self.max_tokens:
            self.truncated += 1
            return ids[-self.max_tokens:]
        return ids
