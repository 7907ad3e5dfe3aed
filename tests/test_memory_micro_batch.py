"""AdaptiveMicroBatch: accumulated gradients equal one full batch's after out-of-memory
fallbacks, no item dropped or counted twice, soft budgets (predicted and measured), growth,
token mode, state round trip and bad input."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from rlbuffers.memory import AdaptiveMicroBatch, StepCost, sample_open_blocks
from rlbuffers.memory.errors import MemoryBudgetError

MIB = 2**20
N = 12


def make_problem(seed=0, n=N):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 1))
    batch = {"x": torch.randn(n, 5), "y": torch.randn(n, 1), "idx": torch.arange(n)}
    return model, batch


def full_batch_grads(model, batch):
    model.zero_grad()
    torch.nn.functional.mse_loss(model(batch["x"]), batch["y"]).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


class Step:
    """mse step that raises ``error`` on micro-batches over ``limit`` items and records
    which items each successful micro-batch covered."""

    def __init__(self, model, limit, error=torch.OutOfMemoryError):
        self.model, self.limit, self.error = model, limit, error
        self.seen, self.sizes = [], []

    def __call__(self, micro):
        n = len(micro["x"])
        self.sizes.append(n)
        if n > self.limit:
            raise self.error("CUDA out of memory. Tried to allocate 2.00 GiB")
        self.seen.append(micro["idx"].tolist())
        return torch.nn.functional.mse_loss(self.model(micro["x"]), micro["y"])


def assert_grads_equal(model, want):
    for p, g in zip(model.parameters(), want, strict=True):
        torch.testing.assert_close(p.grad, g, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("error", [torch.OutOfMemoryError, MemoryError,
                                   lambda m: RuntimeError("[enforce fail at alloc_cpu.cpp:121]"
                                                          " DefaultCPUAllocator: can't allocate"
                                                          " memory: you tried to allocate 1")])
def test_oom_halves_and_redoes_the_same_batch_with_full_batch_gradients(error, caplog):
    model, batch = make_problem()
    want = full_batch_grads(model, batch)
    step = Step(model, limit=3, error=error)
    amb = AdaptiveMicroBatch(model, max_micro_batch=N)
    with caplog.at_level(logging.WARNING, logger="rlbuffers.memory.micro_batch"):
        stats = amb.run(batch, step)
    assert stats.retries == 2 and stats.micro_batch == 3 == amb.micro_batch
    assert stats.micro_steps == 4
    assert_grads_equal(model, want)
    # the successful attempt covered every item exactly once
    assert sorted(i for ids in step.seen[-4:] for i in ids) == list(range(N))
    msgs = [r.getMessage() for r in caplog.records]
    assert any("micro-batch 12 -> 6" in m for m in msgs)
    assert any("micro-batch 6 -> 3" in m for m in msgs)
    with torch.no_grad():
        want_loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"]).item()
    assert stats.loss == pytest.approx(want_loss, rel=1e-5)


def test_uneven_split_still_gives_full_batch_gradients():
    model, batch = make_problem(n=11)
    want = full_batch_grads(model, batch)
    AdaptiveMicroBatch(model, max_micro_batch=4).run(batch, Step(model, limit=4))
    assert_grads_equal(model, want)


def test_a_smaller_batch_runs_whole_without_lowering_the_kept_size():
    model, batch = make_problem()
    amb = AdaptiveMicroBatch(model, max_micro_batch=8)
    small = {k: v[:3] for k, v in batch.items()}
    step = Step(model, limit=8)
    amb.run(small, step)
    assert step.sizes == [3] and amb.micro_batch == 8
    want = full_batch_grads(model, batch)
    amb.run(batch, step)
    assert step.sizes[1:] == [8, 4]
    assert_grads_equal(model, want)


def test_other_errors_propagate_and_micro_batch_one_gives_up():
    model, batch = make_problem()
    amb = AdaptiveMicroBatch(model, max_micro_batch=4)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        amb.run(batch, lambda micro: (_ for _ in ()).throw(RuntimeError("shape mismatch")))
    with pytest.raises(MemoryBudgetError, match="out of memory at micro-batch 1"):
        amb.run(batch, Step(model, limit=0))
    assert amb.micro_batch == 1


def test_grows_back_after_clean_runs_and_state_round_trips():
    model, batch = make_problem()
    step = Step(model, limit=3)
    amb = AdaptiveMicroBatch(model, max_micro_batch=N, grow_after=2)
    amb.run(batch, step)
    assert amb.micro_batch == 3
    step.limit = N  # memory was freed elsewhere
    amb.run(batch, step)
    assert amb.micro_batch == 6  # after 2 clean runs
    state = json.loads(json.dumps(amb.state_dict()))
    other = AdaptiveMicroBatch(model, max_micro_batch=N, grow_after=2)
    other.load_state_dict(state)
    assert other.state_dict() == amb.state_dict()
    other.run(batch, step)
    other.run(batch, step)
    assert other.micro_batch == N  # capped at max_micro_batch


def test_token_mode_bounds_tokens_and_keeps_gradients():
    model, batch = make_problem()
    lengths = torch.tensor([5, 9, 2, 7, 3, 8, 1, 6, 4, 9, 2, 5])
    batch["attention_mask"] = (torch.arange(10)[None] < lengths[:, None]).long()
    want = full_batch_grads(model, {k: batch[k] for k in ("x", "y")})
    token_sums = []

    def step(micro):
        toks = int(micro["attention_mask"].sum())
        token_sums.append(toks)
        if toks > 20:
            raise torch.OutOfMemoryError("out of memory")
        return torch.nn.functional.mse_loss(model(micro["x"]), micro["y"])

    amb = AdaptiveMicroBatch(model, max_tokens=64)
    stats = amb.run(batch, step)
    assert amb.max_tokens == 16 and stats.max_tokens == 16 and stats.retries == 2
    assert_grads_equal(model, want)
    last = token_sums[-stats.micro_steps:]
    assert sum(last) == int(lengths.sum()) and max(last) <= 16


def test_predicted_soft_limit_halves_before_running():
    model, batch = make_problem()
    step = Step(model, limit=N)
    amb = AdaptiveMicroBatch(model, max_micro_batch=N, budget_bytes=35 * MIB,
                             cost=StepCost(bytes_per_item=10 * MIB))
    stats = amb.run(batch, step)
    assert stats.micro_batch == 3 and stats.retries == 2
    assert max(step.sizes) == 3  # nothing over budget was ever run


def test_budget_and_cost_choose_the_first_size():
    model, _ = make_problem()
    amb = AdaptiveMicroBatch(model, budget_bytes=100 * MIB,
                             cost=StepCost(fixed_bytes=20 * MIB, bytes_per_item=16 * MIB))
    assert amb.micro_batch == 5


def test_measured_soft_limit_with_a_known_allocation():
    model, batch = make_problem()
    want = full_batch_grads(model, batch)

    def step(micro):
        block = np.ones(len(micro["x"]) * 16 * MIB, dtype=np.uint8)  # 16 MiB per item
        sample_open_blocks()  # the high point: exact under an earlier process peak too
        loss = torch.nn.functional.mse_loss(model(micro["x"]), micro["y"])
        return loss + float(block[-1]) * 0

    amb = AdaptiveMicroBatch(model, max_micro_batch=8, budget_bytes=40 * MIB)
    stats = amb.run(batch, step)
    assert stats.micro_batch == 2 and stats.retries == 2
    assert 30 * MIB < stats.peak_extra_bytes <= 40 * MIB
    assert_grads_equal(model, want)


@pytest.mark.parametrize("kwargs, match", [
    ({"max_micro_batch": 0}, "max_micro_batch: expected an int >= 1 or None, got 0"),
    ({"max_tokens": -3}, "max_tokens: expected an int >= 1 or None, got -3"),
    ({"grow_after": 0}, "grow_after: expected an int >= 1 or None, got 0"),
    ({"budget_bytes": -1}, "budget_bytes: expected >= 0 or None, got -1"),
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdaptiveMicroBatch(torch.nn.Linear(2, 2), **kwargs)


def test_bad_batches_are_named():
    model, batch = make_problem()
    amb = AdaptiveMicroBatch(model)
    with pytest.raises(ValueError, match=r"batch\['y'\]: expected leading dimension 12 "
                                         r"\(as 'x'\), got 5"):
        amb.run({"x": batch["x"], "y": batch["y"][:5]}, Step(model, N))
    with pytest.raises(ValueError, match="batch: expected a non-empty mapping"):
        amb.run({}, Step(model, N))
    with pytest.raises(ValueError, match="'attention_mask' entry"):
        AdaptiveMicroBatch(model, max_tokens=8).run(batch, Step(model, N))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_cuda_out_of_memory_is_caught():
    model, batch = make_problem()
    model = model.cuda()
    batch = {k: v.cuda() for k, v in batch.items()}
    want = full_batch_grads(model, batch)
    free, _ = torch.cuda.mem_get_info()

    def step(micro):
        if len(micro["x"]) > 3:
            torch.empty(2 * free, dtype=torch.uint8, device="cuda")  # more than the device
        return torch.nn.functional.mse_loss(model(micro["x"]), micro["y"])

    stats = AdaptiveMicroBatch(model, max_micro_batch=N).run(batch, step)
    assert stats.micro_batch == 3
    assert_grads_equal(model, want)
