"""ZarrStorage (issue 46) against TorchRL's own LazyTensorStorage / LazyMemmapStorage: the same
rows back, exactly, through TorchRL's replay buffers, writers and samplers given the same torch
RNG; resume by reopening the path; TorchRL's dumps/loads; one clear error per misuse."""

from __future__ import annotations

import pickle
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.heavy import require

require("torchrl", "tensordict", "torch")

import torch
from tensordict import TensorDict
from torchrl.data import (
    LazyMemmapStorage,
    LazyTensorStorage,
    ReplayBuffer,
    TensorDictReplayBuffer,
)
from torchrl.data.replay_buffers.samplers import (
    RandomSampler,
    SamplerWithoutReplacement,
    SliceSampler,
    SliceSamplerWithoutReplacement,
)

from rlbuffers import FieldSpec
from rlbuffers import ReplayBuffer as Buffer
from rlbuffers.integrations.torchrl import ZarrStorage
from rlbuffers.integrations.torchrl.storage import POINTER_FILE


def transitions(n: int, start: int = 0, seed: int = 0) -> TensorDict:
    """``n`` transitions of a TorchRL collector's shape: nested ``next``, every stored dtype."""
    g = torch.Generator().manual_seed(seed + start)
    i = torch.arange(start, start + n)
    return TensorDict({
        "observation": torch.randn(n, 4, generator=g),
        "pixels": torch.randint(0, 256, (n, 3, 8, 8), generator=g, dtype=torch.uint8),
        "action": torch.randint(0, 2, (n, 2), generator=g),
        "step": i.to(torch.int32),
        "half": torch.randn(n, 3, generator=g).half(),
        "brain": torch.randn(n, 3, generator=g).bfloat16(),
        "q": torch.randn(n, generator=g, dtype=torch.float64),
        "next": {"observation": torch.randn(n, 4, generator=g),
                 "reward": torch.randn(n, 1, generator=g),
                 "done": (i % 7 == 6).unsqueeze(-1),
                 "terminated": (i % 7 == 6).unsqueeze(-1)},
    }, batch_size=[n])


def assert_td_equal(a: TensorDict, b: TensorDict) -> None:
    ka = sorted(a.keys(include_nested=True, leaves_only=True), key=str)
    kb = sorted(b.keys(include_nested=True, leaves_only=True), key=str)
    assert ka == kb
    assert a.batch_size == b.batch_size
    for k in ka:
        x, y = a.get(k), b.get(k)
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert torch.equal(x, y), k


def peers(tmp_path, max_size):
    return {"tensor": LazyTensorStorage(max_size),
            "memmap": LazyMemmapStorage(max_size, scratch_dir=tmp_path / "memmap"),
            "zarr": ZarrStorage(tmp_path / "zarr", max_size)}


@pytest.mark.parametrize("sampler", [RandomSampler, SamplerWithoutReplacement])
def test_same_rows_and_samples_as_torchrl_storages(tmp_path, sampler):
    out = {}
    for name, storage in peers(tmp_path, 20).items():
        rb = TensorDictReplayBuffer(storage=storage, sampler=sampler(), batch_size=8)
        torch.manual_seed(0)
        batches = []
        for k in range(6):  # 6 x 7 = 42 rows through a ring of 20: wraps twice
            rb.extend(transitions(7, 7 * k))
            batches.append(rb.sample())
        out[name] = (rb[:], batches, len(rb))
    for name in ("memmap", "zarr"):
        assert out[name][2] == out["tensor"][2] == 20
        assert_td_equal(out[name][0], out["tensor"][0])
        for got, want in zip(out[name][1], out["tensor"][1], strict=True):
            assert_td_equal(got, want)


def test_plain_tensors_add_and_extend(tmp_path):
    rbs = [ReplayBuffer(storage=LazyTensorStorage(5)),
           ReplayBuffer(storage=ZarrStorage(tmp_path / "z", 5))]
    for rb in rbs:
        rb.add(torch.tensor([1.0, 2.0]))
        rb.extend(torch.arange(12, dtype=torch.float32).reshape(6, 2))
        rb.add(torch.tensor([7.0, 8.0]))
    assert torch.equal(rbs[0][:], rbs[1][:])
    assert rbs[1][:].dtype == torch.float32 and len(rbs[1]) == 5
    assert torch.equal(rbs[1][2], rbs[0][2])


def test_single_row_index_and_row_batch_dims(tmp_path):
    td = TensorDict({"obs": torch.arange(24.0).reshape(4, 3, 2)}, batch_size=[4, 3])
    z = ZarrStorage(tmp_path / "z", 10)
    rb = TensorDictReplayBuffer(storage=z)
    rb.extend(td)
    row = z.get(1)
    assert row.batch_size == torch.Size([3]) and torch.equal(row["obs"], td[1]["obs"])
    grid = z.get(torch.tensor([[0, 1], [3, -1]]))
    assert grid.batch_size == torch.Size([2, 2, 3])
    assert torch.equal(grid["obs"][1, 1], td[3]["obs"])


@settings(max_examples=8, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(1, 13), min_size=1, max_size=6),
       max_size=st.integers(1, 12))
def test_ring_overwrite_equals_lazy_tensor_storage(tmp_path_factory, sizes, max_size):
    tmp = tmp_path_factory.mktemp("h")
    want = TensorDictReplayBuffer(storage=LazyTensorStorage(max_size))
    z = ZarrStorage(tmp / "z", max_size)
    got = TensorDictReplayBuffer(storage=z)
    start = 0
    for n in sizes:
        data = transitions(n, start)
        if n > max_size:  # TorchRL warns and keeps the last max_size; extend them alone
            data = data[-max_size:]
        want.extend(data)
        got.extend(data)
        start += n
    assert_td_equal(got[:], want[:])
    z.close()


def test_reopen_resumes_at_the_last_commit_and_cursor(tmp_path):
    path = tmp_path / "z"
    z = ZarrStorage(path, 10)
    rb = TensorDictReplayBuffer(storage=z)
    rb.extend(transitions(13))
    report = z.commit({"step": 13})
    rb.extend(transitions(4, 13))  # not committed: discarded by the reopening
    z.close()
    assert report.commit == 2 and Buffer.open(path, mode="r").metadata["step"] == 13

    z2 = ZarrStorage(path, 10)
    rb2 = TensorDictReplayBuffer(storage=z2)
    want = TensorDictReplayBuffer(storage=LazyTensorStorage(10))
    want.extend(transitions(13))
    assert_td_equal(rb2[:], want[:])
    for rb_ in (rb2, want):  # the fresh writer follows the reopened ring's cursor
        idx = rb_.extend(transitions(5, 13))
    assert_td_equal(rb2[:], want[:])
    assert rb2._writer.state_dict()["_cursor"] == want._writer.state_dict()["_cursor"] == 8
    assert idx.tolist() == [3, 4, 5, 6, 7]


def test_torchrl_dumps_loads_points_at_a_commit(tmp_path):
    z = ZarrStorage(tmp_path / "z", 16)
    rb = TensorDictReplayBuffer(storage=z, sampler=RandomSampler(), batch_size=4)
    rb.extend(transitions(10))
    rb.dumps(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "storage" / POINTER_FILE).exists()
    saved = rb[:]
    rb.extend(transitions(3, 10))
    rb.loads(tmp_path / "ckpt")  # the uncommitted rows are dropped, the writer restored
    assert len(rb) == 10
    assert_td_equal(rb[:], saved)
    rb.extend(transitions(3, 10))
    assert torch.equal(rb[:]["step"], torch.arange(13, dtype=torch.int32))

    z.close()  # a new process: a new storage object loads the same pointer
    rb2 = TensorDictReplayBuffer(storage=ZarrStorage(tmp_path / "other", 16))
    rb2.loads(tmp_path / "ckpt")
    assert_td_equal(rb2[:], saved)


def test_loads_refuses_a_pointer_whose_commit_moved_on(tmp_path):
    z = ZarrStorage(tmp_path / "z", 8)
    rb = TensorDictReplayBuffer(storage=z)
    rb.extend(transitions(3))
    rb.dumps(tmp_path / "a")
    rb.extend(transitions(3, 3))
    rb.dumps(tmp_path / "b")
    with pytest.raises(ValueError, match="expected commit 2 .* found 3"):
        rb.loads(tmp_path / "a")


def test_state_dict_is_plain_data_and_reopens(tmp_path):
    z = ZarrStorage(tmp_path / "z", 8)
    rb = TensorDictReplayBuffer(storage=z)
    rb.extend(transitions(5))
    z.commit()
    sd = z.state_dict()
    assert sd == {"path": str(tmp_path / "z"), "commit": 2, "len": 5}
    rb.extend(transitions(2, 5))
    z.load_state_dict(sd)
    assert len(z) == 5


def test_empty_starts_over(tmp_path):
    z = ZarrStorage(tmp_path / "z", 8)
    rb = TensorDictReplayBuffer(storage=z)
    rb.extend(transitions(5))
    rb.empty()
    assert len(rb) == 0 and len(ZarrStorage(tmp_path / "z2", 8)) == 0
    rb.extend(transitions(2, 100))
    assert rb[:]["step"].tolist() == [100, 101]


def test_errors_name_the_argument(tmp_path):
    with pytest.raises(ValueError, match="max_size: expected an int >= 1, got 0"):
        ZarrStorage(tmp_path / "a", 0)
    z = ZarrStorage(tmp_path / "z", 8)
    with pytest.raises(RuntimeError, match="non-initialized"):
        z.get(0)
    rb = TensorDictReplayBuffer(storage=z)
    rb.extend(transitions(3))
    z.commit()
    with pytest.raises(IndexError, match=r"index: expected indices in \[-3, 3\), got \[5\]"):
        z.get(5)
    with pytest.raises(ValueError, match=r"cursor: expected the ring's next slots \[3, 4\], "
                                         r"got \[0, 2\]"):
        z.set(torch.tensor([0, 2]), transitions(2))
    with pytest.raises(NotImplementedError, match="set_cursor=False"):
        z[0] = transitions(1)[0]
    bad = transitions(2).exclude("q")
    with pytest.raises(ValueError, match="missing: \\[\\('q',\\)\\]"):
        rb.extend(bad)
    wrong = transitions(2)
    wrong["q"] = wrong["q"].float()
    with pytest.raises(ValueError, match=r"data\[\('q',\)\]: expected torch.float64"):
        rb.extend(wrong)
    rb.extend(transitions(2, 3))  # the writer's cursor moved past the failed writes: realigned
    assert z.get(slice(None))["step"].tolist() == [0, 1, 2, 3, 4]
    assert z.get(slice(None))["index"].tolist() == [0, 1, 2, 3, 4]
    z.close()
    with pytest.raises(ValueError, match=r"max_size: expected the capacity .* \(8\), got 9"):
        ZarrStorage(tmp_path / "z", 9)
    Buffer.create(tmp_path / "plain", capacity=4, fields={"x": FieldSpec((), "int64")}).close()
    with pytest.raises(ValueError, match="not written by a ZarrStorage"):
        ZarrStorage(tmp_path / "plain", 4)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(ZarrStorage(tmp_path / "p", 2))


def test_fields_are_named_by_their_keys(tmp_path):
    z = ZarrStorage(tmp_path / "z", 4)
    data = transitions(2)
    data["done"] = torch.zeros(2, 1, dtype=torch.bool)  # a state's flag: not an episode end
    data["_private"] = torch.zeros(2)
    TensorDictReplayBuffer(storage=z).extend(data)
    assert set(z.buffer.fields) >= {"observation", "next.observation", "next.reward", "pixels",
                                    "next.done", "root.done", "key0"}
    assert torch.equal(z.get(slice(None))["_private"], torch.zeros(2))
    assert z.buffer.fields["brain"].dtype == np.uint16  # bfloat16's bits


def test_importing_the_package_imports_no_torchrl():
    code = ("import sys, rlbuffers, rlbuffers.integrations.torchrl as t; "
            "assert 'torchrl' not in sys.modules; t.ZarrStorage; "
            "assert 'torchrl' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("sampler", [SliceSampler, SliceSamplerWithoutReplacement])
def test_torchrl_slice_samplers_run_over_it_unchanged(tmp_path, sampler):
    n = 60
    done = torch.zeros(n, 1, dtype=torch.bool)
    done[[11, 19, 38, 59]] = True  # episodes of 12, 8, 19 and 21 steps
    episode = torch.bucketize(torch.arange(n), torch.tensor([11, 19, 38]))
    data = TensorDict({"obs": torch.arange(n).float(), "episode": episode,
                       ("next", "done"): done}, [n])
    out = []
    for storage in (LazyTensorStorage(100), ZarrStorage(tmp_path / "z", 100)):
        rb = TensorDictReplayBuffer(storage=storage, sampler=sampler(slice_len=4),
                                    batch_size=12)
        rb.extend(data.clone())
        torch.manual_seed(0)
        out.append([rb.sample() for _ in range(3)])
    for got, want in zip(out[1], out[0], strict=True):
        assert_td_equal(got, want)
