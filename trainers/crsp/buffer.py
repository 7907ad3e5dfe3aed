"""The rollout buffer of CRSP: one utterance (a role's completion) per transition; a step's
utterances of a role and prompt form a group (``done`` on its last member)."""

from __future__ import annotations

from typing import Any

import numpy as np

from rlbuffers import FieldSpec
from trainers.crsp.roles import ROLE_ID, ROLES
from trainers.crsp.rollout import RoleBatch

#: Fields stored per utterance as token arrays (ragged); the others are per-row scalars.
RAGGED = ("prompt_ids", "completion_ids", "behaviour_logprobs", "ref_logprobs")


def buffer_fields() -> dict[str, FieldSpec]:
    """The buffer's fields: token ids (int32), per-token behaviour / reference log-probs
    (float32), the role (int8, index in ``ROLES``), group id, reward parts, advantage, step,
    truncation and ``done``."""
    return {"prompt_ids": FieldSpec((None,), "int32"),
            "completion_ids": FieldSpec((None,), "int32"),
            "behaviour_logprobs": FieldSpec((None,), "float32"),
            "ref_logprobs": FieldSpec((None,), "float32"),
            "role": FieldSpec((), "int8"), "group": FieldSpec((), "int64"),
            "reward": FieldSpec((), "float32"), "extrinsic": FieldSpec((), "float32"),
            "length_reward": FieldSpec((), "float32"), "creativity": FieldSpec((), "float32"),
            "advantage": FieldSpec((), "float32"), "step": FieldSpec((), "int64"),
            "completion_truncated": FieldSpec((), "bool"), "done": FieldSpec((), "bool")}


def utterances(batches: dict[str, RoleBatch], grads: dict[str, dict[str, Any]], step: int,
               first_group: int) -> dict[str, Any]:
    """Every role's utterances of a step as one ``buffer.extend`` batch (groups numbered
    from ``first_group``; ``grads``: per role the flat CPU ``behaviour`` and ``ref``
    log-probs of the update)."""
    cols: dict[str, list[Any]] = {k: [] for k in buffer_fields()}
    group = first_group
    for role in ROLES:
        b = batches[role]
        if not b.completions:
            continue
        lens = [len(c) for c in b.completions]
        cuts = np.cumsum([0] + lens)
        behaviour = grads[role]["behaviour"].numpy()
        ref = grads[role]["ref"].numpy()
        k = 0
        for prompt, comps in zip(b.prompts, b.groups, strict=True):
            for j, c in enumerate(comps):
                cols["prompt_ids"].append(prompt.astype(np.int32))
                cols["completion_ids"].append(c.astype(np.int32))
                cols["behaviour_logprobs"].append(behaviour[cuts[k]:cuts[k + 1]])
                cols["ref_logprobs"].append(ref[cuts[k]:cuts[k + 1]])
                cols["role"].append(ROLE_ID[role])
                cols["group"].append(group)
                cols["done"].append(j == len(comps) - 1)
                k += 1
            group += 1
        cols["reward"] += b.reward.tolist()
        cols["advantage"] += b.advantage.tolist()
        cols["extrinsic"] += b.parts["extrinsic"]
        cols["length_reward"] += b.parts["length"]
        cols["creativity"] += b.parts.get("creativity", [0.0] * len(lens))
        cols["completion_truncated"] += b.truncated
    cols["step"] = [step] * len(cols["role"])
    return {k: v if k in RAGGED else np.asarray(v) for k, v in cols.items()}
