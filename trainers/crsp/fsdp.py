"""CRSP's update with the shared base sharded across ranks (PyTorch FSDP2, ``fully_shard``): gloo
with CPU tensors, NCCL with CUDA ones (``distributed_backend``; under torchrun with CUDA each
rank trains on ``cuda:LOCAL_RANK``). The frozen weights of every decoder layer are a sharded
unit, so a rank holds ``1 / world`` of them (SmolLM2-135M: 79% of the parameters; the tied
embeddings / LM head stay replicated); the roles' adapters are replicated (ignored by FSDP, a few
MB). Each rank runs its share of a role's packed rows; the adapter gradients are summed across
ranks, which makes them the 1-rank gradients of the whole batch. Roles stay sequential, as in the
1-rank path.

Collectives must match across ranks, so every rank runs the same number of micro-batches:
ranks short of rows run a copy of a row with zero loss weight (exact zero gradients).
Rollout generation is not sharded (each decoding step would all-gather every layer): every
rank all-gathers the base once per step (:func:`unsharded_for_rollout`), rank 0 keeps the
full weights while it generates and scores the rollout, the others free theirs at once and
receive the rollout by broadcast (:func:`rollout_on_rank0`). Launch:
``torchrun --standalone --nproc-per-node N -m trainers.crsp --run-dir DIR ...``; rank 0 owns
the run directory (buffer, checkpoints, metrics), every rank resumes from its checkpoints.
``tests/test_crsp_fsdp.py`` checks the update on 2 ranks and a 2-rank run of the trainer
against a 1-rank run.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from rlbuffers.memory import AdaptiveMicroBatch
from trainers.crsp.roles import ROLES, activate, role_parameters
from trainers.crsp.rollout import RoleBatch
from trainers.crsp.update import announce, role_gradients, role_tensors
from trainers.llm.device import distributed_backend, resolve_device, to_device
from trainers.llm.settings import Packing, PolicyLoss


def shard_base(model: Any) -> list[Any]:
    """``fully_shard`` the frozen base weights of each decoder layer of a peft model; the
    three roles' adapters are left out of the shards (``ignored_params``: replicated, their
    gradients summed by :func:`sync_adapter_grads`), so switching and disabling adapters
    never touches FSDP's state. The embeddings, final norm and LM head stay replicated too:
    the chunked LM head reads its weight outside any module's forward, and they are frozen.
    Returns the units."""
    from torch.distributed.fsdp import fully_shard

    units = []
    for layer in model.get_base_model().model.layers:
        adapters = {p for n, p in layer.named_parameters() if "lora_" in n}
        units.append(fully_shard(layer, ignored_params=adapters))
    return units


def rank_device(spec: str) -> torch.device:
    """``--device`` of a ``torchrun`` rank: ``resolve_device(spec)``, except that a CUDA
    device becomes ``cuda:LOCAL_RANK`` (one GPU per rank).

    Raises:
        ValueError: ``resolve_device``'s, for a device that is not there.
    """
    device = resolve_device(spec)
    if device.type == "cuda":
        device = resolve_device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
    return device


def init_distributed(device: torch.device) -> tuple[int, int]:
    """The process group of a ``torchrun`` launch (``RANK``, ``WORLD_SIZE`` and the
    rendezvous from its environment) for tensors on ``device``: NCCL with a CUDA device (made
    the current one), gloo otherwise (``distributed_backend``). Returns (rank, world)."""
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(distributed_backend(device))
    return dist.get_rank(), dist.get_world_size()


def close_distributed(finished: bool) -> None:
    """Tear the process group down; a run that ``finished`` first meets its peers at a
    barrier, so no rank destroys its group while another still runs a collective (gloo aborts
    a rank whose peer left mid-teardown). After an error, no barrier: a peer may be gone."""
    import torch.distributed as dist

    if finished:
        dist.barrier()
    dist.destroy_process_group()


@contextmanager
def unsharded_for_rollout(units: list[Any], rank: int) -> Iterator[None]:
    """For the block, rank 0 holds the full base weights and its forwards run no collective
    (every unit all-gathered once, a collective all ranks join; resharding after forward
    off, FSDP2's documented switch for evaluation); the other ranks free the gathered
    weights at once. Afterwards every unit is sharded again."""
    for unit in units:
        unit.set_reshard_after_forward(False)
        unit.unshard()
    try:
        if rank != 0:
            for unit in units:
                unit.reshard()
        yield
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(True)


def rollout_on_rank0(units: list[Any], run_rollout: Callable[[], Any]) -> Any:
    """``run_rollout()`` (``trainers.crsp.rollout.rollout`` of the step) run by rank 0 on
    unsharded weights; its result (role batches and metrics) is broadcast, so every rank
    updates on the same rollout. The reward state (the novelty sketch, the running
    statistics) advances on rank 0, which checkpoints it."""
    import torch.distributed as dist

    rank = dist.get_rank()
    with unsharded_for_rollout(units, rank):
        out = [run_rollout() if rank == 0 else None]
    dist.broadcast_object_list(out, src=0)
    return out[0]


def sync_adapter_grads(model: Any, role: str) -> None:
    """Sum ``role``'s adapter gradients over the ranks (one flat all-reduce)."""
    import torch.distributed as dist

    params = [p for p in role_parameters(model, role) if p.grad is not None]
    if not params:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
        offset += p.numel()


def local_rows(batch: dict[str, torch.Tensor], rank: int, world: int, n_tokens: int
               ) -> dict[str, torch.Tensor]:
    """Rows ``rank, rank + world, ...`` of a packed batch, padded to ``ceil(R / world)`` rows
    with copies of row 0 whose weight is 0 and whose tokens point at the scratch slot
    ``n_tokens`` of the flat arrays (so they change no statistic)."""
    rows = len(batch["input_ids"])
    per_rank = -(-rows // world)
    mine = list(range(rank, rows, world))
    out = {k: v[mine] for k, v in batch.items()}
    missing = per_rank - len(mine)
    if missing:
        pad = {k: v[:1].repeat(missing, *([1] * (v.dim() - 1))) for k, v in batch.items()}
        pad["weight"] = torch.zeros_like(pad["weight"])
        pad["index"] = torch.where(pad["mask"], n_tokens, -1)
        out = {k: torch.cat([out[k], pad[k]]) for k in out}
    return out


def sharded_grads(model: Any, batches: dict[str, RoleBatch], packing: Packing,
                  loss: PolicyLoss, pad_id: int, amb: AdaptiveMicroBatch,
                  on_role: Any = lambda role: None) -> dict[str, dict[str, Any]]:
    """:func:`trainers.crsp.update.optimised_grads` on this rank's rows of every role: per
    role the loss and the flat reference / behaviour log-probs of the whole batch (summed
    across ranks; CPU), gradients in the sharded parameters' ``.grad``, then
    ``on_role(role)``."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    device = model.device
    out = {}
    for role in ROLES:
        b = batches[role]
        if not b.completions:
            continue
        activate(model, role)
        n = b.training_tokens()
        announce(role, n)
        batch = to_device(local_rows(role_tensors(b, packing, pad_id), rank, world, n), device)
        res = role_gradients(model, amb, batch, packing, loss, n + 1)  # slot n: padding's
        flat = torch.stack([res["ref"], res["behaviour"]]).to(device)
        flat[:, n] = 0.0  # the padding rows' scratch slot
        dist.all_reduce(flat)
        flat = flat.cpu()
        total = torch.tensor([res["loss"]], dtype=torch.float64, device=device)
        dist.all_reduce(total)
        out[role] = {**res, "loss": float(total[0]), "ref": flat[0, :n],
                     "behaviour": flat[1, :n]}
        sync_adapter_grads(model, role)
        on_role(role)
    return out


def gather_grads(model: Any) -> dict[str, np.ndarray]:
    """Full (unsharded) gradients of every parameter that has one, by name (CPU arrays)."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            out[name] = g.detach().cpu().numpy().copy()
    return out
