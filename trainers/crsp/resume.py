"""Resuming a CRSP run: its last complete checkpoint read back as data only (torch files
with ``weights_only=True``, safetensors, JSON) and checked against a fresh trainer's state
before it is applied."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlbuffers.errors import CorruptCheckpointError
from rlbuffers.memory import MemoryMonitor
from rlbuffers.safe_load import load_safetensors, load_torch, restoring
from trainers.common import MONITOR_STATE, Run, check_optimizer, check_state, check_unit, load_rng

if TYPE_CHECKING:
    from trainers.crsp.train import Trainer


def load_checkpoint(t: Trainer, run: Run, monitor: MemoryMonitor) -> None:
    """Adapters, optimizers, RNG, trainer and reward state from the run's last complete
    checkpoint (its history becomes ``run.history``).

    Raises:
        rlbuffers.CorruptCheckpointError: a file is missing, damaged, refused (torch files
            are read with ``weights_only=True``) or does not fit this model (one line).
    """
    ckpt = run.checkpoint
    assert ckpt is not None
    restore_adapters(t.model, ckpt / "adapters.safetensors", str(t.device))
    optimizers = load_torch(ckpt / "optimizers.pt", map_location=t.device)
    with restoring(ckpt / "optimizers.pt", f"one AdamW state per role {sorted(t.opts)}"):
        for r, s in optimizers.items():
            t.opts[r].load_state_dict(s)
            check_optimizer(t.opts[r])
    load_rng(ckpt / "rng.pt", t.rng)
    state, path = run.load_state(), ckpt / "state.json"
    fresh = {**t.state_dict(), "monitor": MONITOR_STATE}
    check_state(state, fresh, path)
    check_unit(state["trainer"], run, path)
    for key in ("capacity", "num_perm", "seed"):  # set by the run's config
        if state["sketch"][key] != fresh["sketch"][key]:
            raise CorruptCheckpointError(f"{path}: sketch.{key}: expected "
                                         f"{fresh['sketch'][key]}, got {state['sketch'][key]!r}")
    with restoring(path, "the state a CRSP step saves"):
        t.load_state_dict(state)
        monitor.load_state_dict(state["monitor"])


def restore_adapters(model: Any, path: Path, device: str) -> None:
    """Load the LoRA adapters saved at ``path`` into ``model`` (on ``device``).

    Raises:
        rlbuffers.CorruptCheckpointError: the file is missing, damaged or holds tensors the
            model does not have (one line naming it).
    """
    with restoring(path, "this model's LoRA adapters"):
        unexpected = model.load_state_dict(load_safetensors(path, device=device),
                                           strict=False).unexpected_keys
        if unexpected:
            raise ValueError(f"unexpected adapter keys {unexpected[:3]}")
