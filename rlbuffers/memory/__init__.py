"""Memory toolkit: figures and limits, a monitor, and tools that keep LLM-RL training loops
inside their memory (chunked log-probs, adaptive micro-batches, budgets, placement, chunked
Polyak updates, running statistics). See ``docs/memory.md``.

The torch-based names are imported on first use, so ``rlbuffers`` without torch (the
replay buffer only needs the figures and limits) still imports this package.
"""

from __future__ import annotations

from rlbuffers.lazy import lazy_attributes
from rlbuffers.memory.cgroup import cgroup_available_bytes, cgroup_limit_bytes
from rlbuffers.memory.limits import available_bytes, memory_limit_bytes
from rlbuffers.memory.monitor import MemoryMonitor, MemorySnapshot
from rlbuffers.memory.process import peak_rss_bytes, rss_bytes
from rlbuffers.memory.stats import RunningMeanStd, cached_schedule

#: name -> module of the names that need torch (imported lazily).
_LAZY = {
    "token_logprobs": "rlbuffers.memory.logprobs",
    "causal_lm_token_logprobs": "rlbuffers.memory.causal_lm",
    "polyak_update_": "rlbuffers.memory.polyak",
    "AdaptiveMicroBatch": "rlbuffers.memory.micro_batch",
    "MicroBatchStats": "rlbuffers.memory.micro_batch",
    "MicroBatchGiveUp": "rlbuffers.memory.micro_batch",
    "StepCost": "rlbuffers.memory.budget",
    "estimate_training_bytes": "rlbuffers.memory.budget",
    "probe_activation_bytes": "rlbuffers.memory.budget",
    "plan_micro_batch": "rlbuffers.memory.budget",
    "auto_budget": "rlbuffers.memory.budget",
    "MicroBatchPlan": "rlbuffers.memory.budget",
    "ModelSpec": "rlbuffers.memory.placement",
    "PlacementPlan": "rlbuffers.memory.placement",
    "plan_placement": "rlbuffers.memory.placement",
    "apply_placement": "rlbuffers.memory.placement",
    "PeakMemory": "rlbuffers.memory.peak",
    "sample_open_blocks": "rlbuffers.memory.peak",
    "tensor_summary": "rlbuffers.memory.census",
    "reference_logprobs": "rlbuffers.memory.reference",
    "reference_bytes_saved": "rlbuffers.memory.reference",
    "MemoryBudgetError": "rlbuffers.memory.errors",
    "TrainingBytes": "rlbuffers.memory.budget",
    "ActivationProfile": "rlbuffers.memory.activations",
    "LayerActivations": "rlbuffers.memory.activations",
    "profile_activations": "rlbuffers.memory.activations",
    "select_checkpoint_layers": "rlbuffers.memory.activations",
    "enable_prefix_attention": "rlbuffers.memory.prefix_attention",
    "plan_prefix_attention": "rlbuffers.memory.prefix_attention",
    "PrefixPlan": "rlbuffers.memory.prefix_attention",
}


__getattr__ = lazy_attributes(__name__, _LAZY)


__all__ = [
    "MemoryMonitor",
    "MemorySnapshot",
    "RunningMeanStd",
    "available_bytes",
    "cached_schedule",
    "cgroup_available_bytes",
    "cgroup_limit_bytes",
    "memory_limit_bytes",
    "peak_rss_bytes",
    "rss_bytes",
    *_LAZY,
]
