"""Reference-policy log-probs from the *same* weights as the policy (peft LoRA adapters
disabled) instead of a second copy of the model."""

from __future__ import annotations

import logging
from typing import Any, cast

import torch

from rlbuffers.memory.causal_lm import causal_lm_token_logprobs

log = logging.getLogger(__name__)


def reference_bytes_saved(model: torch.nn.Module) -> int:
    """Bytes a separate reference copy would take: the base weights (parameters that are
    not LoRA adapters, i.e. whose name holds no ``lora_``)."""
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters()
               if "lora_" not in name)


def reference_logprobs(model: torch.nn.Module, input_ids: torch.Tensor,
                       **kwargs: Any) -> torch.Tensor:
    """Per-token log-probs of the base model under a peft model's adapters, without grad.

    Runs :func:`causal_lm_token_logprobs` inside ``with model.disable_adapter():``, so the
    reference policy (the frozen base, as in GRPO/PPO's KL term) shares the policy's
    weights; :func:`reference_bytes_saved` says what a copy would have cost.

    Args:
        model: a ``peft`` model (``PeftModel``) wrapping a causal LM.
        input_ids: ``int64[B, T]``; ``kwargs`` go to :func:`causal_lm_token_logprobs`
            (``with_entropy`` is not allowed).

    Returns:
        ``float32[B, T - 1]`` (or ``[B, logits_to_keep]``), no grad.

    Raises:
        TypeError: ``model`` has no ``disable_adapter`` (not a peft model).
        ValueError: ``with_entropy`` given, and what :func:`causal_lm_token_logprobs` raises.
    """
    if not hasattr(model, "disable_adapter"):
        raise TypeError(f"model: expected a peft model with disable_adapter(), got "
                        f"{type(model).__name__}")
    if kwargs.get("with_entropy"):
        raise ValueError("with_entropy: expected False for reference log-probs, got True")
    peft_model = cast(Any, model)  # peft is untyped
    with torch.no_grad(), peft_model.disable_adapter():
        return cast(torch.Tensor, causal_lm_token_logprobs(model, input_ids, **kwargs))
