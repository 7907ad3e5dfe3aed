"""GroupSampler: whole groups only (never split, never a group cut by the ring), newest-k
windows, recency weighting, state round trip through save/open."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbuffers import FieldSpec, ReplayBuffer
from rlbuffers.errors import BufferEmptyError
from rlbuffers.sampling.samplers import GroupSampler

FIELDS = {"group": FieldSpec((), "int64"), "member": FieldSpec((), "int64"),
          "done": FieldSpec((), "bool")}


def add_groups(buf, first, count, g):
    for grp in range(first, first + count):
        buf.extend({"group": np.full(g, grp), "member": np.arange(g),
                    "done": np.arange(g) == g - 1})


@settings(max_examples=30, deadline=None)
@given(g=st.integers(1, 5), capacity=st.integers(5, 40), groups=st.integers(1, 25),
       seed=st.integers(0, 2**16))
def test_batches_hold_whole_groups_only(tmp_path_factory, g, capacity, groups, seed):
    path = tmp_path_factory.mktemp("b") / "buf"
    buf = ReplayBuffer.create(path, capacity=capacity, fields=FIELDS,
                              sampler=GroupSampler(g, replace=True), seed=seed)
    add_groups(buf, 0, groups, g)
    # Naive reference: the groups whose g members are all still stored.
    stored = buf[np.arange(len(buf))]
    whole = {grp for grp in range(groups) if (stored["group"] == grp).sum() == g}
    if not whole:
        with pytest.raises(BufferEmptyError, match="whole groups"):
            buf.sample(2)
        return
    batch = buf.sample(7)
    assert batch["group"].shape == (7, g)
    for row, members in zip(batch["group"], batch["member"], strict=True):
        assert len(set(row.tolist())) == 1 and row[0] in whole
        assert members.tolist() == list(range(g))
    buf.close()


def test_without_replacement_newest_window_and_recency(tmp_path):
    buf = ReplayBuffer.create(tmp_path / "b", capacity=64, fields=FIELDS,
                              sampler=GroupSampler(4, newest=3), seed=0)
    add_groups(buf, 0, 10, 4)
    for _ in range(20):
        rows = buf.sample(3)["group"][:, 0]
        assert sorted(rows.tolist()) == [7, 8, 9]  # distinct, and only the newest 3
    with pytest.raises(BufferEmptyError, match="among the newest 3"):
        buf.sample(4)
    buf.sampler = GroupSampler(4, half_life=1.0, replace=True)
    counts = np.bincount(buf.sample(20_000)["group"][:, 0], minlength=10)
    want = 0.5 ** np.arange(9, -1, -1.0)
    np.testing.assert_allclose(counts / counts.sum(), want / want.sum(), atol=0.01)
    buf.close()


def test_state_round_trips_through_save_and_open(tmp_path):
    buf = ReplayBuffer.create(tmp_path / "b", capacity=32, fields=FIELDS,
                              sampler=GroupSampler(2, newest=5, half_life=2.5), seed=3)
    add_groups(buf, 0, 8, 2)
    buf.save()
    want = buf.sample(4)
    buf.close()
    again = ReplayBuffer.open(tmp_path / "b")
    assert again.sampler == GroupSampler(2, newest=5, half_life=2.5)
    np.testing.assert_array_equal(again.sample(4)["group"], want["group"])
    again.close()


@pytest.mark.parametrize("kwargs, match", [({"group_size": 0}, "group_size"),
                                           ({"group_size": 2, "newest": 0}, "newest"),
                                           ({"group_size": 2, "half_life": 0.0}, "half_life")])
def test_bad_settings_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GroupSampler(**kwargs)
