"""plan_placement on made-up device budgets, apply_placement, bad input named."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from rlbuffers.memory import ModelSpec, apply_placement, plan_placement

GIB = 2**30


def guidance_models():
    """The hierarchical guidance trainer's six models (sizes in GiB as it measured)."""
    return {"policy": ModelSpec(14 * GIB, "trained"), "guidance": ModelSpec(12 * GIB, "trained"),
            "critic": ModelSpec(6 * GIB, "trained"), "value": ModelSpec(3 * GIB, "trained"),
            "reference": ModelSpec(7 * GIB, "frozen"),
            "target_critic": ModelSpec(2 * GIB, "periodic")}


def test_short_accelerator_keeps_trained_models_and_moves_the_rest_to_cpu(caplog):
    models = guidance_models()
    with caplog.at_level(logging.INFO, logger="rlbuffers.memory.placement"):
        plan = plan_placement(models, {"cuda:0": 40 * GIB, "cpu": 60 * GIB})
    # trained first (35 GiB); the 7 GiB reference does not fit the 5 GiB left, the 2 GiB
    # target critic does
    assert {n for n, d in plan.device.items() if d == "cuda:0"} == {
        "policy", "guidance", "critic", "value", "target_critic"}
    assert plan.device["reference"] == "cpu"
    assert plan.bytes_per_device == {"cuda:0": 37 * GIB, "cpu": 7 * GIB}
    assert plan.unplaced == []
    assert "reference" in caplog.text and "cpu" in caplog.text
    json.dumps(plan.state_dict())


def test_room_left_puts_frozen_before_periodic_on_the_accelerator():
    plan = plan_placement(guidance_models(), {"cuda:0": 43 * GIB, "cpu": 60 * GIB})
    assert plan.bytes_per_device["cuda:0"] == 42 * GIB
    assert plan.device["reference"] == "cuda:0" and plan.device["target_critic"] == "cpu"


def test_two_accelerators_balance_and_nothing_fits_is_reported(caplog):
    models = guidance_models()
    plan = plan_placement(models, {"cuda:0": 24 * GIB, "cuda:1": 24 * GIB, "cpu": 4 * GIB})
    for dev in ("cuda:0", "cuda:1"):
        assert plan.bytes_per_device[dev] <= 24 * GIB
    assert plan.device["policy"] != plan.device["guidance"]
    with caplog.at_level(logging.WARNING, logger="rlbuffers.memory.placement"):
        small = plan_placement(models, {"cpu": 10 * GIB})
    assert set(small.unplaced) == {"policy", "guidance", "reference", "target_critic"}
    assert small.bytes_per_device == {"cpu": 9 * GIB}
    assert "NOT PLACED" in small.table(models) and "do not fit" in caplog.text


def test_cpu_only_plan_and_apply():
    mods = {"a": torch.nn.Linear(2, 2), "b": torch.nn.Linear(2, 2)}
    plan = plan_placement({"a": ModelSpec(48, "trained"), "b": ModelSpec(48, "frozen")},
                          {"cpu": 1000})
    moved = apply_placement(mods, plan)
    assert all(next(m.parameters()).device.type == "cpu" for m in moved.values())
    plan.device.pop("b")
    with pytest.raises(ValueError, match=r"modules: not placed by the plan: \['b'\]"):
        apply_placement(mods, plan)


def test_spec_from_module_counts_training_state_only_when_trained():
    m = torch.nn.Linear(10, 10)  # 110 parameters
    assert ModelSpec.from_module(m, "trained").bytes == 110 * 4 * 4  # weights, grads, 2 adam
    assert ModelSpec.from_module(m, "frozen").bytes == 110 * 4


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="bytes: expected >= 0, got -1"):
        ModelSpec(-1, "trained")
    with pytest.raises(ValueError, match="role: expected one of"):
        ModelSpec(1, "teacher")
    with pytest.raises(ValueError, match=r"devices\['cuda:0'\]: expected >= 0 bytes, got -5"):
        plan_placement({}, {"cuda:0": -5})
    with pytest.raises(ValueError, match="devices: expected at least one"):
        plan_placement({}, {})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_apply_moves_to_cuda():
    plan = plan_placement({"a": ModelSpec(24, "trained")}, {"cuda:0": 10**6, "cpu": 10**6})
    moved = apply_placement({"a": torch.nn.Linear(2, 2)}, plan)
    assert next(moved["a"].parameters()).device.type == "cuda"
