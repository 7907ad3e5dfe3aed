"""GRPO's rollout buffer: one completion per transition, a group one episode (``done`` on its
last member), with the behaviour and reference log-probs that the mu > 1 iterations reuse;
and the packed per-token inputs of the loss built from a step's groups."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import numpy as np

from rlbuffers import FieldSpec, GroupSampler
from trainers.llm.policy_loss import token_weights


def buffer_fields() -> dict[str, FieldSpec]:
    """The buffer's fields: ragged ``prompt_ids`` / ``completion_ids`` (int32) and per-token
    ``behaviour_logprobs`` / ``ref_logprobs`` (float32; empty without a KL term); per
    completion ``reward``, ``correctness``, ``advantage``, ``group``, ``policy_version``,
    ``step``, ``completion_truncated`` and ``done``."""
    return {"prompt_ids": FieldSpec((None,), "int32"),
            "completion_ids": FieldSpec((None,), "int32"),
            "behaviour_logprobs": FieldSpec((None,), "float32"),
            "ref_logprobs": FieldSpec((None,), "float32"),
            "reward": FieldSpec((), "float32"), "correctness": FieldSpec((), "float32"),
            "advantage": FieldSpec((), "float32"), "group": FieldSpec((), "int64"),
            "policy_version": FieldSpec((), "int64"), "step": FieldSpec((), "int64"),
            "completion_truncated": FieldSpec((), "bool"), "done": FieldSpec((), "bool")}


def group_sampler(group_size: int, newest: int) -> GroupSampler:
    """Whole groups of ``group_size`` from the newest ``newest`` groups (the mu > 1
    iterations' sampler)."""
    return GroupSampler(group_size, newest=newest)


def per_token_inputs(comp_lens: list[int], advantages: np.ndarray, loss_norm: str,
                     max_completion_tokens: int) -> dict[str, list[np.ndarray]]:
    """Each completion's per-token ``advantage`` (its group-relative advantage on every token)
    and loss ``weight`` (``--loss-norm``), float32 arrays of the completions' lengths."""
    return {"advantage": [np.full(n, a, np.float32)
                          for n, a in zip(comp_lens, advantages, strict=True)],
            "weight": token_weights(comp_lens, loss_norm, max_completion_tokens)}


def rollout_rows(prompts: list[np.ndarray], completions: list[np.ndarray],
                 truncated: np.ndarray, scores: dict[str, np.ndarray], advantages: np.ndarray,
                 behaviour: np.ndarray, ref: np.ndarray | None, *, group_size: int,
                 first_group: int, step: int) -> dict[str, Any]:
    """A step's completions as buffer rows (``ReplayBuffer.extend``): ``behaviour`` and
    ``ref`` are the flat per-token log-probs (float32[total completion tokens]; ``ref`` None
    without a KL term), groups numbered from ``first_group``, ``policy_version`` the step
    before ``step`` (the weights that sampled them)."""
    n = len(completions)
    cuts = np.cumsum([0] + [len(c) for c in completions])
    empty = np.zeros(0, np.float32)
    return {"prompt_ids": [prompts[k // group_size].astype(np.int32) for k in range(n)],
            "completion_ids": [c.astype(np.int32) for c in completions],
            "behaviour_logprobs": [behaviour[a:b] for a, b in pairwise(cuts)],
            "ref_logprobs": [ref[a:b] if ref is not None else empty for a, b in pairwise(cuts)],
            "reward": scores["reward"], "correctness": scores["correctness"],
            "advantage": advantages,
            "group": np.repeat(np.arange(first_group, first_group + len(prompts)), group_size),
            "policy_version": np.full(n, step - 1), "step": np.full(n, step),
            "completion_truncated": truncated,
            "done": np.tile(np.arange(group_size) == group_size - 1, len(prompts))}
