"""Hypothesis: for any sequence of extends, saves and reopens, the buffer holds exactly the
newest ``capacity`` transitions, in order, and reopen shows exactly the last commit."""

import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlbuffers import FieldSpec, ReplayBuffer

FIELDS = {"x": FieldSpec((2,), "int64"), "seq": FieldSpec((None,), "int16")}
ops = st.lists(
    st.one_of(
        st.tuples(st.just("extend"), st.integers(0, 23)),
        st.tuples(st.just("save"), st.just(0)),
        st.tuples(st.just("reopen"), st.just(0)),
    ),
    min_size=1,
    max_size=12,
)


def _batch(first, n):
    ids = np.arange(first, first + n)
    return {"x": np.stack([ids, ids * 3], 1), "seq": [np.full(i % 4, i, np.int16) for i in ids]}


def _check(buf, total):
    want = np.arange(max(0, total - buf.capacity), total)
    assert (len(buf), buf.total_added) == (len(want), total)
    if len(want):
        rows = buf[:]
        np.testing.assert_array_equal(rows["x"][:, 0], want)
        assert [int(s[0]) if len(s) else None for s in rows["seq"]] == [
            int(i) if i % 4 else None for i in want
        ]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(capacity=st.integers(1, 17), chunk=st.integers(1, 7), ops=ops)
def test_ring_matches_reference(capacity, chunk, ops):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "b"
        buf = ReplayBuffer.create(path, capacity=capacity, fields=FIELDS, chunk_transitions=chunk)
        total = committed = 0
        for op, n in ops:
            if op == "extend":
                buf.extend(_batch(total, n))
                total += n
            elif op == "save":
                buf.save()
                committed = total
            else:
                buf.close()
                buf = ReplayBuffer.open(path)
                total = committed
            _check(buf, total)
        buf.close()


@settings(max_examples=30, deadline=None)
@given(capacity=st.integers(1, 30), sizes=st.lists(st.integers(0, 40), max_size=6))
def test_persistent_tier_alone_matches(capacity, sizes):
    """Rebuilding from the Zarr group (fresh working dir) gives the same contents."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "b"
        buf = ReplayBuffer.create(path, capacity=capacity, fields=FIELDS, chunk_transitions=4)
        total = 0
        for n in sizes:
            buf.extend(_batch(total, n))
            total += n
            buf.save()
        buf.close()
        with ReplayBuffer.open(path, working_dir=Path(d) / "fresh") as b:
            _check(b, total)
