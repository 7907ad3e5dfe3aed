"""Small settings types the shared LLM helpers take instead of a whole trainer config: each
holds only what its helper reads, so a helper's inputs are visible at the call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def parse_budget(spec: str, device: Any = None) -> int | None:
    """``--memory-budget``: an integer (bytes), ``"auto"`` (what ``device`` has left less a
    margin, ``rlbuffers.memory.auto_budget``: CUDA free memory on a CUDA device, available
    RAM otherwise) or ``"none"`` (None: no budget).

    Raises:
        ValueError: ``spec`` is none of these (expected and actual named).
    """
    if spec == "none":
        return None
    if spec == "auto":
        from rlbuffers.memory import auto_budget

        return auto_budget(device=device)
    if not spec.isdigit():
        raise ValueError(f"memory_budget: expected an integer (bytes), 'auto' or 'none', "
                         f"got {spec!r}")
    return int(spec)


@dataclass(frozen=True)
class Sampling:
    """How completions are sampled (:func:`trainers.llm.generation.generate`)."""

    max_completion_tokens: int
    """Completion length limit (tokens); a completion cut there is marked truncated."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling (1: off)."""
    generation_batch: int = 64
    """Most sequences per generate call (0: no cap; fewer when the budget allows fewer)."""
    memory_budget: int | None = None
    """Bytes a generate call's KV cache and logits may use (None: no budget)."""
    generate_dtype: str = "float32"
    """Weights' dtype while generating: 'float32', 'bfloat16' or 'float16'."""
    packed_weights: bool = True
    """On CPU, decode with oneDNN-packed linear weights."""


@dataclass(frozen=True)
class Packing:
    """How completions are packed and scored (:mod:`trainers.llm.packed_logprobs`)."""

    pack_tokens: int
    """Most tokens per packed row (>= the longest prompt + completion)."""
    chunk_tokens: int = 512
    """Tokens per chunk of the LM head in ``token_logprobs``."""
    train_dtype: str = "float32"
    """Autocast dtype of the decoder's forward: 'float32', 'bfloat16' or 'float16'."""
    temperature: float = 1.0
    """Log-probs at the sampling temperature (logits divided by it)."""


@dataclass(frozen=True)
class PolicyLoss:
    """The clipped surrogate with a KL penalty (:mod:`trainers.llm.policy_loss`)."""

    epsilon: float = 0.2
    """Importance ratio clipped to [1 - epsilon, 1 + epsilon_high]."""
    epsilon_high: float = 0.0
    """Upper clipping range (0: same as epsilon)."""
    beta: float = 0.04
    """KL coefficient (k3 estimator) to the reference policy; 0: no KL term."""
