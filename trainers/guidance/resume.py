"""Checkpointing a guidance run: what each iteration's commit saves, and the resume that
reads it back as data only (torch files with ``weights_only=True``, safetensors, JSON),
checked against a fresh learner's state before it is applied."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from rlbuffers.safe_load import load_safetensors, load_torch, restoring
from trainers import common
from trainers.common import MONITOR_STATE, check_optimizer, check_state, check_unit
from trainers.guidance.rollout import ROLES

if TYPE_CHECKING:
    from trainers.guidance.train import Learner


def checkpoint_files(learner: Learner) -> dict[str, Any]:
    """``Run.commit``'s ``torch_files`` (the three AdamW states, RNG states), ``writers``
    (both adapters, critic and target critic as safetensors) and ``state`` (trainer state,
    micro-batch and monitor state)."""
    from safetensors.torch import save_file

    L = learner

    def tensors(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
        return {k: torch.as_tensor(v).detach().cpu().contiguous() for k, v in sd.items()}

    writers = {f"{r}.safetensors": (lambda p, r=r: save_file(
        tensors(L.policies.adapter_state(r)), str(p))) for r in ROLES}
    for name, m in (("critic", L.critic), ("target_critic", L.target)):
        writers[f"{name}.safetensors"] = lambda p, m=m: save_file(tensors(m.state_dict()), str(p))
    return {"torch_files": {"optimizers.pt": {k: o.state_dict() for k, o in L.opts.items()},
                            "rng.pt": common.rng_states(L.rng)},
            "writers": writers,
            "state": {"trainer": L.trainer,
                      "micro_batch": {k: a.state_dict() for k, a in L.ambs.items()},
                      "monitor": L.monitor.state_dict()}}


def load_checkpoint(learner: Learner) -> None:
    """Restore the run's last complete checkpoint (weights onto the devices they live on).

    Raises:
        rlbuffers.CorruptCheckpointError: a file is missing, damaged, refused or does not fit
            these models (one line naming it).
    """
    L, ckpt = learner, learner.run.checkpoint
    assert ckpt is not None
    for role in ROLES:
        path = ckpt / f"{role}.safetensors"
        state = load_safetensors(path)
        with restoring(path, f"the {role}'s LoRA adapters"):
            L.policies.load_adapter_state(role, {k: v.numpy() for k, v in state.items()})
    for name, model in (("critic", L.critic), ("target_critic", L.target)):
        path = ckpt / f"{name}.safetensors"
        state = load_safetensors(path)
        with restoring(path, f"the {name}'s weights"):
            model.load_state_dict(state)
    optimizers = load_torch(ckpt / "optimizers.pt", map_location="cpu")
    with restoring(ckpt / "optimizers.pt", f"one AdamW state for each of {sorted(L.opts)}"):
        for k, sd in optimizers.items():
            L.opts[k].load_state_dict(sd)
            check_optimizer(L.opts[k])
    common.load_rng(ckpt / "rng.pt", L.rng)
    state, path = L.run.load_state(), ckpt / "state.json"
    fresh = {**checkpoint_files(L)["state"], "monitor": MONITOR_STATE}
    check_state(state, fresh, path)
    check_unit(state["trainer"], L.run, path)
    with restoring(path, "the state a guidance iteration saves"):
        for k, a in L.ambs.items():
            a.load_state_dict(state["micro_batch"][k])
        L.monitor.load_state_dict(state["monitor"])
    L.trainer = state["trainer"]
