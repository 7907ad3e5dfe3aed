"""``--device`` for the LLM trainers: which device trains, where each model goes
(``rlbuffers.memory.plan_placement``: trained weights on the accelerator, frozen / periodic
models where the plan has room), and the process-group backend that matches the tensors
(NCCL only for CUDA tensors, gloo otherwise)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from rlbuffers.memory.placement import ModelSpec, PlacementPlan, apply_placement, plan_placement

log = logging.getLogger("trainers.llm.device")


def resolve_device(spec: str) -> torch.device:
    """``--device``: ``auto`` (``cuda:0`` when CUDA is available, else ``cpu``), ``cpu``,
    ``cuda`` or ``cuda:N``.

    Raises:
        trainers.config.ConfigError: (a ValueError: one line on the console) an unknown
            value, or CUDA asked for where none (or not device N) is available (the flag, the
            expected and the actual value named).
    """
    from trainers.config import ConfigError

    if spec == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "cuda" or (spec.startswith("cuda:") and spec[5:].isdigit()):
        index = int(spec[5:]) if ":" in spec else 0
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if index >= count:
            raise ConfigError(f"--device: expected a CUDA device below {count} (this machine "
                              f"has {count}), got {spec!r}")
        return torch.device("cuda", index)
    raise ConfigError(f"--device: expected 'auto', 'cpu', 'cuda' or 'cuda:N', got {spec!r}")


def device_budgets(device: torch.device, cpu_bytes: int) -> dict[str, int]:
    """The byte budgets :func:`plan_placement` may fill: ``cpu_bytes`` on the CPU, and on a
    CUDA ``device`` its free memory (``torch.cuda.mem_get_info``) less 10%."""
    budgets = {"cpu": int(cpu_bytes)}
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budgets[str(device)] = int(free * 0.9)
    return budgets


def place_models(modules: Mapping[str, torch.nn.Module], roles: Mapping[str, str],
                 device: torch.device, cpu_bytes: int) -> tuple[dict[str, torch.nn.Module],
                                                                  PlacementPlan]:
    """Plan (``plan_placement`` over :func:`device_budgets`) and apply the placement of
    ``modules`` (name -> module; ``roles``: name -> ``trained`` / ``frozen`` / ``periodic``).
    On a CPU ``device`` everything stays on the CPU. Returns the moved modules and the plan
    (logged as a table at INFO).

    Raises:
        rlbuffers.memory.MemoryBudgetError: a trained model fits on no device.
    """
    specs = {name: ModelSpec.from_module(m, roles[name]) for name, m in modules.items()}
    plan = plan_placement(specs, device_budgets(device, cpu_bytes))
    trained_off = [n for n in plan.unplaced if roles[n] == "trained"]
    if trained_off:
        from rlbuffers.memory.errors import MemoryBudgetError

        raise MemoryBudgetError(f"models: {trained_off} fit on no device "
                                f"(budgets {plan.budgets})")
    for name in plan.unplaced:  # frozen / periodic: on the CPU, past the plan's budget
        plan.device[name] = "cpu"
        log.warning("%s does not fit the CPU budget either; kept on the CPU", name)
    return apply_placement(modules, plan), plan


def distributed_backend(device: torch.device) -> str:
    """``nccl`` when the tensors a process group carries live on CUDA, ``gloo`` otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def to_device(batch: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """``batch`` with every tensor moved to ``device`` (non-blocking), other values as is."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
            for k, v in batch.items()}
