"""ZarrPrioritizedSampler (issue 46): TorchRL's prioritized-sampler contract on rlbuffers' sum
tree. Its draws are the buffer's own PrioritizedSampler stream, its probabilities and weights
those of Schaul et al. (2016), its priorities survive a commit and a reopening, and TorchRL's
TensorDictReplayBuffer drives it (priority_key, update_tensordict_priority, dumps/loads)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.heavy import require

require("torchrl", "tensordict", "torch")

import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

from rlbuffers import FieldError, FieldSpec, PrioritizedSampler, ReplayBuffer
from rlbuffers.integrations.torchrl import ZarrPrioritizedSampler, ZarrStorage

ALPHA, BETA, EPS = 0.7, 0.5, 1e-6


def rows(n: int, start: int = 0) -> TensorDict:
    i = torch.arange(start, start + n)
    return TensorDict({"x": i, "obs": i.float().unsqueeze(-1).expand(n, 3).clone()}, [n])


def prioritized(tmp_path, max_size: int = 16, seed: int = 3, name: str = "z"):
    storage = ZarrStorage(tmp_path / name, max_size, seed=seed)
    sampler = ZarrPrioritizedSampler(max_size, ALPHA, BETA, EPS)
    rb = TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=8,
                                priority_key="td_error")
    return rb, storage, sampler


def test_draws_are_the_buffers_prioritized_stream(tmp_path):
    rb, storage, sampler = prioritized(tmp_path)
    ref = ReplayBuffer.create(tmp_path / "ref", capacity=16, fields={"x": FieldSpec((), "int64")},
                              sampler=PrioritizedSampler(ALPHA, BETA, EPS), seed=3)
    rng = np.random.default_rng(0)
    for k in range(5):  # 5 x 6 rows through 16 slots: wraps
        rb.extend(rows(6, 6 * k))
        ref.extend({"x": np.arange(6 * k, 6 * k + 6)})
        idx, info = sampler.sample(storage, 8)
        want = ref.sample(8)
        assert idx.tolist() == (want["indices"] % 16).tolist()
        assert np.array_equal(info["priority_weight"].numpy(), want["weights"])
        assert storage.get(idx)["x"].tolist() == want["x"].tolist()
        p = rng.uniform(0, 5, 8)
        sampler.update_priority(idx, torch.as_tensor(p), storage=storage)
        ref.update_priorities(want["indices"], p)


def test_probabilities_and_weights_are_schaul_et_al(tmp_path):
    rb, storage, sampler = prioritized(tmp_path, max_size=8)
    rb.extend(rows(8))
    p = np.array([0.1, 1.0, 2.0, 4.0, 0.5, 3.0, 0.0, 8.0])
    sampler.update_priority(torch.arange(8), torch.as_tensor(p))
    q = (p + EPS) ** ALPHA
    expected = q / q.sum()  # Eq. 1
    counts = np.zeros(8)
    for _ in range(250):
        idx, info = sampler.sample(storage, 64)
        counts += np.bincount(idx.numpy(), minlength=8)
        w = (q[idx.numpy()] / q.min()) ** -BETA  # Sec. 3.4, normalised by max_j w_j
        np.testing.assert_allclose(info["priority_weight"].numpy(), w, rtol=1e-6)
    freq = counts / counts.sum()
    sd = np.sqrt(expected * (1 - expected) / counts.sum())
    assert np.all(np.abs(freq - expected) < 5 * sd + 1e-4), (freq, expected)


def test_priority_key_on_extend_and_update_tensordict_priority(tmp_path):
    rb, storage, sampler = prioritized(tmp_path, max_size=8)
    data = rows(4)
    data["td_error"] = torch.tensor([0.0, 0.0, 0.0, 50.0])
    rb.extend(data)  # TorchRL sets the priorities given with the data
    s = rb.sample()
    assert (s["x"] == 3).float().mean() > 0.5 and "priority_weight" in s.keys()
    s["td_error"] = torch.zeros(8)
    rb.update_tensordict_priority(s)
    assert storage.buffer.sampler.max_priority == pytest.approx(50.0 + EPS)
    assert sampler.default_priority == pytest.approx(50.0 + EPS)


def test_update_priority_skips_negative_indices_and_takes_a_scalar(tmp_path):
    rb, storage, sampler = prioritized(tmp_path, max_size=4)
    rb.extend(rows(4))
    sampler.update_priority(torch.tensor([-1, 2]), torch.tensor([9.0, 0.0]), storage=storage)
    sampler.update_priority(torch.tensor([0, 1, 3]), 5.0)
    for _ in range(5):
        assert sampler.sample(storage, 8)[0].tolist().count(2) == 0
    with pytest.raises(FieldError):
        sampler.update_priority(torch.tensor([0]), torch.tensor([-1.0]))


def test_priorities_and_stream_survive_commit_and_reopen(tmp_path):
    rb, storage, sampler = prioritized(tmp_path)
    for k in range(3):
        rb.extend(rows(7, 7 * k))
        idx, _ = sampler.sample(storage, 8)
        sampler.update_priority(idx, torch.rand(8, generator=torch.Generator().manual_seed(k)))
    storage.commit({"step": 3})
    after = []
    for _ in range(4):  # the uninterrupted run after the commit
        idx, info = sampler.sample(storage, 8)
        after.append((idx, info["priority_weight"]))
    rb.extend(rows(3, 100))  # never committed
    storage.close()

    rb2, storage2, sampler2 = prioritized(tmp_path)
    assert storage2.buffer.metadata["step"] == 3
    for idx, w in after:
        idx2, info2 = sampler2.sample(storage2, 8)
        assert torch.equal(idx2, idx) and torch.equal(info2["priority_weight"], w)


def test_torchrl_dumps_loads_with_the_sampler(tmp_path):
    rb, storage, sampler = prioritized(tmp_path)
    rb.extend(rows(10))
    sampler.update_priority(torch.arange(10), torch.arange(10.0))
    rb.dumps(tmp_path / "ckpt")
    want = [sampler.sample(storage, 8)[0] for _ in range(3)]
    sampler.beta = 1.0
    rb.loads(tmp_path / "ckpt")
    assert sampler.beta == BETA
    assert all(torch.equal(sampler.sample(storage, 8)[0], w) for w in want)


def test_beta_annealing_changes_the_weights_only(tmp_path):
    rb, storage, sampler = prioritized(tmp_path, max_size=4)
    rb.extend(rows(4))
    sampler.update_priority(torch.arange(4), torch.tensor([1.0, 2.0, 3.0, 4.0]))
    sampler.beta = 1.0
    idx, info = sampler.sample(storage, 4)
    q = (np.array([1.0, 2.0, 3.0, 4.0]) + EPS) ** ALPHA
    np.testing.assert_allclose(info["priority_weight"].numpy(), (q[idx.numpy()] / q[0]) ** -1.0,
                               rtol=1e-6)


def test_errors_name_the_argument(tmp_path):
    with pytest.raises(ValueError, match="alpha: expected >= 0, got -1.0"):
        ZarrPrioritizedSampler(4, -1, 0.5)
    with pytest.raises(ValueError, match=r"beta: expected in \[0, 1\], got 2.0"):
        ZarrPrioritizedSampler(4, 0.5, 2)
    with pytest.raises(ValueError, match="eps: expected > 0, got 0.0"):
        ZarrPrioritizedSampler(4, 0.5, 0.5, eps=0)
    with pytest.raises(ValueError, match="max_capacity: expected an int >= 1, got 0"):
        ZarrPrioritizedSampler(0, 0.5, 0.5)
    with pytest.raises(ValueError, match="reduction: expected one of"):
        ZarrPrioritizedSampler(4, 0.5, 0.5, reduction="avg")
    s = ZarrPrioritizedSampler(4, 0.5, 0.5)
    with pytest.raises(ValueError, match=r"beta: expected in \[0, 1\], got -0.5"):
        s.beta = -0.5
    with pytest.raises(TypeError, match="expected a ZarrStorage, got LazyTensorStorage"):
        s.sample(LazyTensorStorage(4), 2)
    with pytest.raises(RuntimeError, match="pass storage="):
        s.update_priority(torch.tensor([0]), 1.0)
    uniform = ZarrStorage(tmp_path / "u", 4)
    TensorDictReplayBuffer(storage=uniform).extend(rows(2))
    with pytest.raises(ValueError, match="created with the 'uniform' sampler"):
        s.sample(uniform, 2)
    with pytest.raises(ValueError, match="max_capacity: expected the storage's max_size 4, got 5"):
        ZarrPrioritizedSampler(5, 0.5, 0.5).sample(uniform, 2)
    rb, storage, _ = prioritized(tmp_path, max_size=4, name="p")
    with pytest.raises(RuntimeError, match="empty storage"):
        s.sample(storage, 2)
    rb.extend(rows(2))
    with pytest.raises(ValueError, match=r"alpha, eps: expected the buffer's 0.7, 1e-06"):
        s.sample(storage, 2)
