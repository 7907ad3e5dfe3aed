"""Where the guidance trainer's models live: the trained ones (the policy model with the agent
and guidance adapters, the naive layout's guidance copy, the critic) on the ``--device``, the
frozen reference copy (naive layout) and the periodic target critic where
``plan_placement`` has room (the accelerator, else the CPU)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from rlbuffers.memory.errors import MemoryBudgetError
from rlbuffers.memory.placement import PlacementPlan
from trainers.guidance.rollout import Policies
from trainers.llm.device import place_models

log = logging.getLogger("trainers.guidance.placement")


def placed_models(policies: Policies, critic: torch.nn.Module, target: torch.nn.Module
                  ) -> tuple[dict[str, torch.nn.Module], dict[str, str]]:
    """The distinct models to place and their roles: ``policy`` (the base with both adapters,
    or the agent's copy; trained), ``guidance_copy`` (naive layout; trained),
    ``reference_copy`` (naive layout; frozen), ``critic`` (trained), ``target_critic``
    (periodic). The shared layout's reference is the policy with adapters disabled: nothing
    to place."""
    modules = {**policies.unique_models(), "critic": critic, "target_critic": target}
    roles = {name: "frozen" if name == "reference_copy" else
             "periodic" if name == "target_critic" else "trained" for name in modules}
    return modules, roles


def check_trained_on(plan: PlacementPlan, roles: dict[str, str], device: torch.device) -> None:
    """Raise unless ``plan`` puts every trained model on ``device`` (the trained weights,
    their optimizer state and the batches share one device).

    Raises:
        MemoryBudgetError: a trained model planned elsewhere (named with its planned device
            and the budgets).
    """
    off = {n: plan.device.get(n, "nowhere") for n, r in roles.items()
           if r == "trained" and plan.device.get(n) != str(device)}
    if off:
        raise MemoryBudgetError(f"--device {device}: trained models planned elsewhere {off} "
                                f"(budgets {plan.budgets} bytes)")


def place(policies: Policies, critic: torch.nn.Module, target: torch.nn.Module,
          device: torch.device, cpu_bytes: int) -> PlacementPlan:
    """Plan the placement of :func:`placed_models` (``cpu_bytes`` on the CPU, the free memory
    of a CUDA ``device``), check that the trained models land on ``device``, move every model
    where the plan says; the plan is logged (INFO) as a table.

    Raises:
        MemoryBudgetError: a trained model fits on no device, or not on ``device``.
    """
    modules, roles = placed_models(policies, critic, target)
    _, plan = place_models(modules, roles, device, cpu_bytes)
    check_trained_on(plan, roles, device)
    layout = "naive layout" if policies.reference_model is not None else \
        "shared layout (agent and guidance adapters over one base; reference: adapters off)"
    log.info("%s on %s: %s", layout, device, ", ".join(f"{n} -> {d}"
                                                      for n, d in plan.device.items()))
    return plan


def describe(plan: PlacementPlan) -> dict[str, Any]:
    """The plan's numbers for the metrics row: device per model, bytes per device, budgets."""
    return {"placement": dict(plan.device), "placement_bytes": dict(plan.bytes_per_device),
            "placement_budgets": dict(plan.budgets)}
