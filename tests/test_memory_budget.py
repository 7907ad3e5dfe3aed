"""Budgets and plans: training bytes from parameters, a step cost fitted from known
allocations, micro-batch plans, and the hardware budget."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlbuffers.memory import (
    StepCost,
    auto_budget,
    estimate_training_bytes,
    plan_micro_batch,
    probe_activation_bytes,
    sample_open_blocks,
)
from rlbuffers.memory import budget as budget_mod
from rlbuffers.memory.errors import MemoryBudgetError

MIB = 2**20


def test_training_bytes_count_weights_grads_and_adam_states():
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Linear(20, 3))
    n = 10 * 20 + 20 + 20 * 3 + 3
    est = estimate_training_bytes(model)
    assert (est.weights, est.gradients, est.optimizer_state) == (4 * n, 4 * n, 8 * n)
    assert est.total == 16 * n and est.trainable_params == n
    frozen = estimate_training_bytes(model, trainable={"1.weight", "1.bias"}, optimizer="sgd",
                                     dtype=torch.bfloat16)
    assert (frozen.weights, frozen.gradients, frozen.optimizer_state) == (2 * n, 2 * 63, 0)
    model[0].weight.requires_grad_(False)
    assert estimate_training_bytes(model).trainable_params == n - 200


def test_tied_weights_are_counted_once():
    emb = torch.nn.Embedding(50, 8)
    head = torch.nn.Linear(8, 50, bias=False)
    head.weight = emb.weight
    est = estimate_training_bytes(torch.nn.ModuleDict({"emb": emb, "head": head}))
    assert est.weights == 50 * 8 * 4


def test_training_bytes_bad_input_is_named():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="optimizer: expected one of"):
        estimate_training_bytes(model, optimizer="lion")
    with pytest.raises(ValueError, match=r"trainable: names not in the model: \['nope'\]"):
        estimate_training_bytes(model, trainable={"nope"})


def test_probe_fits_a_known_per_item_cost():
    # blocks over glibc's largest mmap threshold (32 MiB), so each goes back to the OS when
    # freed and every run starts from the same RSS
    def step(batch):
        fixed = np.ones(40 * MIB, dtype=np.uint8)
        per_item = np.ones(batch * 48 * MIB, dtype=np.uint8)
        sample_open_blocks()  # the high point: exact under an earlier process peak too
        return int(fixed[-1]) + int(per_item[-1])

    cost = probe_activation_bytes(step, lambda n: n, sizes=(1, 3))
    assert 46 * MIB < cost.bytes_per_item < 50 * MIB
    assert 36 * MIB < cost.fixed_bytes < 44 * MIB
    per_token = probe_activation_bytes(step, lambda n: n, sizes=(1, 3), tokens_per_item=8)
    assert 46 * MIB < per_token.bytes_per_token * 8 < 50 * MIB
    assert per_token.bytes_per_item == 0
    with pytest.raises(ValueError, match=r"sizes: expected two increasing counts >= 1, "
                                         r"got \(2, 2\)"):
        probe_activation_bytes(step, lambda n: n, sizes=(2, 2))


def test_plan_fills_the_budget_and_splits_evenly():
    cost = StepCost(fixed_bytes=100, bytes_per_item=10, bytes_per_token=1)
    plan = plan_micro_batch(200, cost=cost, target_batch=32)
    assert (plan.micro_batch, plan.accumulation_steps) == (8, 4)  # (200-100)//10 = 10 -> 8x4
    assert plan.predicted_peak_bytes == 180 <= 200
    tok = plan_micro_batch(200, cost=cost, target_batch=32, tokens_per_item=15)
    assert (tok.micro_batch, tok.accumulation_steps) == (4, 8)  # 25 bytes per item
    capped = plan_micro_batch(10**9, cost=cost, target_batch=32, max_micro_batch=5)
    assert (capped.micro_batch, capped.accumulation_steps) == (5, 7)
    assert plan_micro_batch(0, cost=StepCost(), target_batch=3).micro_batch == 3


def test_plan_bad_input_is_named():
    cost = StepCost(fixed_bytes=100, bytes_per_item=10)
    with pytest.raises(ValueError, match="budget_bytes: expected >= 0, got -5"):
        plan_micro_batch(-5, cost=cost, target_batch=4)
    with pytest.raises(ValueError, match="target_batch: expected >= 1, got 0"):
        plan_micro_batch(500, cost=cost, target_batch=0)
    with pytest.raises(MemoryBudgetError, match="budget_bytes: 105 does not fit one item"):
        plan_micro_batch(105, cost=cost, target_batch=4)
    with pytest.raises(ValueError, match="bytes_per_item: expected >= 0, got -1"):
        StepCost(bytes_per_item=-1)


def test_auto_budget_takes_available_memory_less_the_margins(monkeypatch):
    monkeypatch.setattr(budget_mod, "available_bytes", lambda: 10_000 * MIB)
    assert auto_budget(safety_fraction=0.1, safety_bytes=512 * MIB) == 8_488 * MIB
    assert auto_budget(safety_fraction=0.0, safety_bytes=20_000 * MIB) == 0
    with pytest.raises(ValueError, match=r"safety_fraction: expected in \[0, 1\), got 1.0"):
        auto_budget(safety_fraction=1.0)
    with pytest.raises(ValueError, match="safety_bytes: expected >= 0, got -1"):
        auto_budget(safety_bytes=-1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_budget_on_cuda_counts_free_device_memory():
    free, total = torch.cuda.mem_get_info(0)
    got = auto_budget(device="cuda:0", safety_fraction=0.0, safety_bytes=0)
    assert free <= got <= total
