"""ZarrStorage's ragged and string entries (issue 46): TorchRL's nested tensors stored in the
buffer's ragged fields and read back as jagged nested tensors, and non-tensor strings
(``NonTensorData`` / ``NonTensorStack``) stored as UTF-8 and read back as TorchRL's own
``LazyTensorStorage`` returns them; across ring overwrites, samplers and a reopen."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.heavy import require

require("torchrl", "tensordict", "torch")

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

from rlbuffers.integrations.torchrl import ZarrStorage


def texts(n: int, start: int) -> list[str]:
    return [("é" + str(start + i)) * ((start + i) % 3) for i in range(n)]  # '' included


def batch(n: int, start: int = 0, ragged: bool = True) -> TensorDict:
    """``n`` rows: a dense leaf, a nested string leaf, and (``ragged``) two nested tensors,
    one of them 2-d per row; lengths 0-3."""
    i = torch.arange(start, start + n)
    td = TensorDict({"step": i, "info": {"text": texts(n, start)}}, batch_size=[n])
    if ragged:
        td["tokens"] = torch.nested.nested_tensor(
            [torch.arange(k % 4, dtype=torch.int32) + k for k in range(start, start + n)],
            layout=torch.jagged)
        td["boxes"] = torch.nested.nested_tensor(
            [torch.full((k % 3, 2), float(k)) for k in range(start, start + n)],
            layout=torch.jagged)
    return td


def strings(td: TensorDict) -> list[str]:
    return td.get(("info", "text")).tolist()


def test_strings_come_back_as_lazy_tensor_storage_gives_them(tmp_path):
    rbs = {"tensor": TensorDictReplayBuffer(storage=LazyTensorStorage(10), batch_size=6),
           "zarr": TensorDictReplayBuffer(storage=ZarrStorage(tmp_path / "z", 10), batch_size=6)}
    out = {}
    for name, rb in rbs.items():
        torch.manual_seed(0)
        rb.extend(batch(7, 0, ragged=False))
        rb.extend(batch(6, 7, ragged=False))  # wraps: slots 7-9, then 0-2
        s = rb.storage
        sampled = rb.sample()
        one = s.get(4)
        out[name] = (strings(s.get(torch.tensor([0, 2, 9, -1]))), strings(s.get(slice(None))),
                     type(s.get(torch.tensor([1, 3])).get(("info", "text"))),
                     type(one.get(("info", "text"))), one["info", "text"],
                     strings(sampled), sampled["step"].tolist())
    assert out["zarr"] == out["tensor"]
    assert out["zarr"][2] is NonTensorStack and out["zarr"][3] is NonTensorData
    assert out["zarr"][1] == texts(3, 10) + texts(7, 3)


def test_nested_tensors_round_trip_as_jagged(tmp_path):
    z = ZarrStorage(tmp_path / "z", 8)
    rb = TensorDictReplayBuffer(storage=z)
    rb.extend(batch(5, 0))
    rb.extend(batch(5, 5))  # wraps: rows 2..9 held
    got = z.get(torch.tensor([0, 1, 7]))  # slots 0, 1 hold rows 8, 9; slot 7 row 7
    assert got["tokens"].is_nested and got["tokens"].layout == torch.jagged
    for slot, row in zip((0, 1, 7), (8, 9, 7), strict=True):
        want = batch(1, row)
        j = (0, 1, 7).index(slot)
        assert torch.equal(got["tokens"].unbind(0)[j], want["tokens"].unbind(0)[0])
        assert torch.equal(got["boxes"].unbind(0)[j], want["boxes"].unbind(0)[0])
        assert got["tokens"].unbind(0)[j].dtype == torch.int32
    one = z.get(3)  # one row: the ragged leaf as a dense tensor, like TensorDict's own td[i]
    assert torch.equal(one["boxes"], torch.full((3 % 3, 2), 3.0))
    assert z.buffer.fields["tokens"].shape == (None,)
    assert z.buffer.fields["boxes"].shape == (None, 2)


def test_reopen_reads_the_committed_ragged_rows(tmp_path):
    z = ZarrStorage(tmp_path / "z", 6)
    TensorDictReplayBuffer(storage=z).extend(batch(4, 0))
    z.commit()
    before = z.get(slice(None))
    TensorDictReplayBuffer(storage=z).extend(batch(3, 4))  # not committed: dropped on reopen
    z.close()
    again = ZarrStorage(tmp_path / "z", 6)
    after = again.get(slice(None))
    assert len(again) == 4 and strings(after) == strings(before) == texts(4, 0)
    for k in ("tokens", "boxes"):
        for x, y in zip(after[k].unbind(0), before[k].unbind(0), strict=True):
            assert torch.equal(x, y)
    TensorDictReplayBuffer(storage=again).extend(batch(2, 4))  # same layout after the reopen
    assert strings(again.get(slice(None))) == texts(6, 0)


@settings(max_examples=8, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.tuples(st.text(max_size=5), st.integers(0, 5)), min_size=1,
                     max_size=25),
       cut=st.integers(1, 9), max_size=st.integers(1, 9))
def test_ring_of_strings_and_lengths_equals_a_list(tmp_path_factory, rows, cut, max_size):
    """Against a naive reference: the last ``max_size`` rows written, in slot order."""
    z = ZarrStorage(tmp_path_factory.mktemp("h") / "z", max_size)
    rb = TensorDictReplayBuffer(storage=z)
    for a in range(0, len(rows), min(cut, max_size)):
        part = rows[a:a + min(cut, max_size)]
        rb.extend(TensorDict({
            "s": [t for t, _ in part],
            "x": torch.nested.nested_tensor([torch.arange(k, dtype=torch.float64) for _, k in part],
                                            layout=torch.jagged)}, batch_size=[len(part)]))
    n = len(rows)
    held = [rows[i] for i in range(n - min(n, max_size), n)]
    slots = [i % max_size for i in range(n - len(held), n)]
    want = sorted(zip(slots, held, strict=True))
    got = z.get(slice(None))
    assert got.get("s").tolist() == [t for _, (t, _) in want]
    assert [len(x) for x in got["x"].unbind(0)] == [k for _, (_, k) in want]
    z.close()


def test_errors_name_the_key(tmp_path):
    rb = TensorDictReplayBuffer(storage=ZarrStorage(tmp_path / "a", 4))
    with pytest.raises(TypeError, match=r"data\[\('obj',\)\]: non-tensor data must be str"):
        rb.extend(TensorDict({"obj": [{"a": 1}, {"b": 2}], "x": torch.zeros(2)}, [2]))
    rb = TensorDictReplayBuffer(storage=ZarrStorage(tmp_path / "b", 4))
    rb.extend(batch(2, 0))
    bad = batch(2, 2)
    bad["tokens"] = torch.nested.nested_tensor([torch.zeros(1), torch.zeros(2)],
                                               layout=torch.jagged)  # float, not int32
    with pytest.raises(ValueError, match=r"data\[\('tokens',\)\]: expected rows of torch.int32"):
        rb.extend(bad)
    bad = batch(2, 2)
    bad["info", "text"] = torch.zeros(2)
    with pytest.raises(TypeError, match=r"data\[\('info', 'text'\)\]: expected non-tensor "):
        rb.extend(bad)
    grid = TensorDict({"s": [["a", "b"], ["c", "d"]]}, batch_size=[2, 2])
    with pytest.raises(TypeError, match=r"rows of batch \[\]"):
        TensorDictReplayBuffer(storage=ZarrStorage(tmp_path / "c", 4)).extend(grid)
    with pytest.raises(ValueError, match="read by an int or a 1-d index"):
        rb.storage.get(torch.tensor([[0, 1]]))


def test_a_tensorclass_str_field_is_each_rows_string(tmp_path):
    from tensordict import tensorclass

    @tensorclass
    class Step:
        obs: torch.Tensor
        text: str

    z = ZarrStorage(tmp_path / "z", 5)
    z.set(range(3), Step(obs=torch.arange(3), text="same for all", batch_size=[3]))
    got = z.get(slice(None))
    assert torch.equal(got["obs"], torch.arange(3))
    assert got.get("text").tolist() == ["same for all"] * 3
