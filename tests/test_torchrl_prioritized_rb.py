"""ZarrTensorDictPrioritizedReplayBuffer (issue 46): TorchRL's TensorDictPrioritizedReplayBuffer
with ZarrPrioritizedSampler. TorchRL's own class cannot be built on this machine (its sum tree
is in the compiled extension, which does not load beside torch 2.13.0), so the reference is the
naive one: rlbuffers' ReplayBuffer with its PrioritizedSampler, fed the reduced priorities by
hand, draws the same rows with the same weights."""

from __future__ import annotations

import numpy as np
import pytest

from tests.heavy import require

require("torchrl", "tensordict", "torch")

import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage

from rlbuffers import FieldSpec, PrioritizedSampler, ReplayBuffer
from rlbuffers.integrations.torchrl import ZarrStorage, ZarrTensorDictPrioritizedReplayBuffer

ALPHA, BETA, EPS, SIZE, B = 0.6, 0.4, 1e-6, 16, 8


def rows(n: int, start: int, td_error: torch.Tensor | None = None) -> TensorDict:
    i = torch.arange(start, start + n)
    td = TensorDict({"x": i, "obs": {"pixels": i.to(torch.uint8).unsqueeze(-1).expand(n, 4)}},
                    [n])
    if td_error is not None:
        td["td_error"] = td_error
    return td


def make(path, reduction: str = "max") -> ZarrTensorDictPrioritizedReplayBuffer:
    return ZarrTensorDictPrioritizedReplayBuffer(
        alpha=ALPHA, beta=BETA, eps=EPS, reduction=reduction, batch_size=B,
        storage=ZarrStorage(path, SIZE, seed=5))


@pytest.mark.parametrize("reduction", ["max", "mean"])
def test_extend_sample_update_equal_the_naive_buffer(tmp_path, reduction):
    rb = make(tmp_path / "z", reduction)
    ref = ReplayBuffer.create(tmp_path / "ref", capacity=SIZE,
                              fields={"x": FieldSpec((), "int64")},
                              sampler=PrioritizedSampler(ALPHA, BETA, EPS), seed=5)
    reduce = {"max": lambda t: t.amax(-1), "mean": lambda t: t.mean(-1)}[reduction]
    g = torch.Generator().manual_seed(0)
    added = 0
    for _ in range(6):  # 6 x 5 rows through 16 slots: the ring wraps
        err = torch.rand(5, generator=g) * 4  # [n]: TorchRL's extend does not reduce them
        rb.extend(rows(5, added, err))
        ref.extend({"x": np.arange(added, added + 5)})
        ref.update_priorities(np.arange(added, added + 5), err.numpy())
        added += 5
        batch = rb.sample()
        want = ref.sample(B)
        assert batch["x"].tolist() == want["x"].tolist()
        assert batch["index"].tolist() == (want["indices"] % SIZE).tolist()
        assert np.array_equal(batch["priority_weight"].numpy(), want["weights"])
        assert batch["obs", "pixels"].tolist() == \
            [[v % 256] * 4 for v in want["x"].tolist()]
        batch["td_error"] = torch.rand(B, 3, generator=g) * 4  # per row [B, 3]: reduced
        rb.update_tensordict_priority(batch)
        ref.update_priorities(want["indices"], reduce(batch["td_error"]).numpy())


def test_weights_are_schaul_et_al(tmp_path):
    rb = make(tmp_path / "z")
    p = torch.tensor([0.5, 1.0, 2.0, 4.0, 8.0, 0.0, 3.0, 1.5])
    rb.extend(rows(8, 0, p))
    q = (p.double().numpy() + EPS) ** ALPHA
    for _ in range(20):
        batch = rb.sample()
        w = (q[batch["index"].numpy()] / q.min()) ** -BETA  # Sec. 3.4, over max_j w_j
        np.testing.assert_allclose(batch["priority_weight"].numpy(), w, rtol=1e-6)


def test_reopened_storage_samples_the_uninterrupted_stream(tmp_path):
    rb = make(tmp_path / "z")
    g = torch.Generator().manual_seed(1)
    for k in range(3):
        rb.extend(rows(7, 7 * k, torch.rand(7, generator=g)))
        batch = rb.sample()
        batch["td_error"] = torch.rand(B, generator=g)
        rb.update_tensordict_priority(batch)
    rb.storage.commit({"step": 3})
    after = [rb.sample() for _ in range(4)]
    rb.extend(rows(3, 100, torch.ones(3)))  # never committed
    rb.storage.close()

    rb2 = make(tmp_path / "z")
    assert rb2.storage.buffer.metadata["step"] == 3 and len(rb2) == SIZE
    for want in after:
        got = rb2.sample()
        assert torch.equal(got["index"], want["index"])
        assert torch.equal(got["priority_weight"], want["priority_weight"])
        assert torch.equal(got["x"], want["x"])


def test_errors_name_the_argument(tmp_path):
    with pytest.raises(TypeError, match="storage: expected a ZarrStorage, got LazyTensorStorage"):
        ZarrTensorDictPrioritizedReplayBuffer(alpha=0.5, beta=0.5, storage=LazyTensorStorage(4))
    z = ZarrStorage(tmp_path / "z", 4)
    with pytest.raises(ValueError, match="sync: expected True, got False"):
        ZarrTensorDictPrioritizedReplayBuffer(alpha=0.5, beta=0.5, storage=z, sync=False)
    with pytest.raises(ValueError, match=r"sampler_device: expected None or 'cpu' \(the sum "
                       r"tree is numpy\), got 'cuda'"):
        ZarrTensorDictPrioritizedReplayBuffer(alpha=0.5, beta=0.5, storage=z,
                                              sampler_device="cuda")
    with pytest.raises(ValueError, match="alpha: expected >= 0, got -1.0"):
        ZarrTensorDictPrioritizedReplayBuffer(alpha=-1, beta=0.5, storage=z)
    with pytest.raises(ValueError, match="reduction: expected one of"):
        ZarrTensorDictPrioritizedReplayBuffer(alpha=0.5, beta=0.5, storage=z, reduction="avg")
