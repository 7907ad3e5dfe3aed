"""Which model goes on which device, from byte sizes and roles, before anything is loaded.

Trained models take the accelerators first; frozen ones (a reference policy) and periodic
ones (target networks, updated by :func:`polyak_update_`) take what is left and fall back to
CPU when the accelerators are short, as the guidance trainer's hand fix did.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from rlbuffers.memory.budget import estimate_training_bytes

log = logging.getLogger(__name__)
ROLES = ("trained", "frozen", "periodic")
_ORDER = {"trained": 0, "frozen": 1, "periodic": 2}


@dataclass(frozen=True)
class ModelSpec:
    """A model to place.

    Attributes:
        bytes: memory it needs where it lives (weights, plus gradients and optimizer state
            when trained: see :func:`estimate_training_bytes`).
        role: ``"trained"``, ``"frozen"`` or ``"periodic"`` (target networks).

    Raises:
        ValueError: negative bytes or an unknown role.
    """

    bytes: int
    role: str

    @classmethod
    def from_module(cls, module: torch.nn.Module, role: str, *,
                    optimizer: str = "adamw") -> ModelSpec:
        """Spec from a module's parameters: weights, plus gradients and ``optimizer`` state
        when ``role`` is ``"trained"`` (see :func:`estimate_training_bytes`)."""
        est = estimate_training_bytes(module, optimizer=optimizer)
        return cls(est.total if role == "trained" else est.weights, role)

    def __post_init__(self) -> None:
        if self.bytes < 0:
            raise ValueError(f"bytes: expected >= 0, got {self.bytes}")
        if self.role not in ROLES:
            raise ValueError(f"role: expected one of {ROLES}, got {self.role!r}")


@dataclass
class PlacementPlan:
    """Result of :func:`plan_placement`.

    Attributes:
        device: model name -> device (models that did not fit are absent).
        bytes_per_device: device -> bytes placed there.
        budgets: device -> bytes it offered.
        unplaced: names of models that fit nowhere.
    """

    device: dict[str, str] = field(default_factory=dict)
    bytes_per_device: dict[str, int] = field(default_factory=dict)
    budgets: dict[str, int] = field(default_factory=dict)
    unplaced: list[str] = field(default_factory=list)

    def table(self, models: Mapping[str, ModelSpec]) -> str:
        """A plain-text table: model, role, MiB, device."""
        lines = [f"{'model':<20} {'role':<9} {'MiB':>10}  device"]
        for name, spec in models.items():
            dev = self.device.get(name, "NOT PLACED")
            lines.append(f"{name:<20} {spec.role:<9} {spec.bytes / 2**20:>10.1f}  {dev}")
        for dev, budget in self.budgets.items():
            used = self.bytes_per_device.get(dev, 0)
            lines.append(f"{dev}: {used / 2**20:.1f} of {budget / 2**20:.1f} MiB")
        return "\n".join(lines)

    def state_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready)."""
        return {"device": dict(self.device), "bytes_per_device": dict(self.bytes_per_device),
                "budgets": dict(self.budgets), "unplaced": list(self.unplaced)}


def _pick(spec: ModelSpec, free: dict[str, int]) -> str | None:
    """Accelerator with the most room that fits, else CPU if it fits, else None."""
    accel = sorted((d for d in free if d != "cpu" and free[d] >= spec.bytes),
                   key=lambda d: -free[d])
    if accel:
        return accel[0]
    return "cpu" if free.get("cpu", -1) >= spec.bytes else None


def plan_placement(models: Mapping[str, ModelSpec],
                   devices: Mapping[str, int]) -> PlacementPlan:
    """Place models on devices within byte budgets.

    Trained models go first (largest first) to the accelerator with the most room; then
    frozen, then periodic ones, each on an accelerator if one still has room, else on
    ``"cpu"``. Nothing is moved (see :func:`apply_placement`).

    Args:
        models: name -> :class:`ModelSpec`.
        devices: device name (``"cuda:0"``, ``"cpu"``) -> bytes it may hold (made-up budgets
            work, e.g. for tests or planning another machine).

    Returns:
        A :class:`PlacementPlan`, also logged as a table (warning when a model did not fit).

    Raises:
        ValueError: no devices, or a negative device budget (named).
    """
    if not devices:
        raise ValueError("devices: expected at least one device budget, got none")
    for dev, budget in devices.items():
        if budget < 0:
            raise ValueError(f"devices[{dev!r}]: expected >= 0 bytes, got {budget}")
    free = dict(devices)
    plan = PlacementPlan(budgets=dict(devices))
    for name, spec in sorted(models.items(), key=lambda kv: (_ORDER[kv[1].role], -kv[1].bytes)):
        picked = _pick(spec, free)
        if picked is None:
            plan.unplaced.append(name)
            continue
        free[picked] -= spec.bytes
        plan.device[name] = picked
        plan.bytes_per_device[picked] = plan.bytes_per_device.get(picked, 0) + spec.bytes
    level = logging.WARNING if plan.unplaced else logging.INFO
    log.log(level, "placement plan%s:\n%s", " (some models do not fit)" if plan.unplaced
            else "", plan.table(models))
    return plan


def apply_placement(modules: Mapping[str, torch.nn.Module],
                    plan: PlacementPlan) -> dict[str, torch.nn.Module]:
    """Move each module to its planned device (``module.to(device)``).

    Returns:
        name -> the moved module.

    Raises:
        ValueError: a module the plan does not place (unplaced or unknown name).
    """
    missing = sorted(set(modules) - set(plan.device))
    if missing:
        raise ValueError(f"modules: not placed by the plan: {missing}")
    return {name: m.to(plan.device[name]) for name, m in modules.items()}
