"""The vectorised sampling paths against naive references: the sum-tree descent (all draws
one level at a time, after a running-sum search of one level) against a search a node at a
time per draw, prioritized draws against the
formulas of Schaul et al. (2016) computed draw by draw from the same generator state, and the
ragged gather (one join of byte ranges) against reading each row's bytes from its values file."""

import contextlib
import itertools
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbuffers import FieldSpec, PrioritizedSampler, ReplayBuffer, ranges
from rlbuffers.sampling import segment_tree
from rlbuffers.sampling.segment_tree import SegmentTree

#: Each search test runs twice: with the C search (``rlbuffers.ranges.prefix_search``, where
#: the extension is built; tests/test_ranges.py requires it under CI) and with the numpy path.
PATHS = pytest.mark.parametrize("compiled", [True, False], ids=["c", "numpy"])


def path(compiled: bool):
    """Run with the C search (as installed) or with the numpy path."""
    return (contextlib.nullcontext() if compiled
            else mock.patch.object(ranges, "prefix_search", None))


def depth(d: int):
    """``find_prefix`` with its running-sum step at depth ``d`` (0: the plain descent)."""
    return mock.patch.object(segment_tree, "TOP_DEPTH", d)


def descend(tree: SegmentTree, mass: float, i: int = 1) -> int:
    """One prefix-sum search, a node at a time from node ``i``, with the comparisons of the
    original loop."""
    while i < tree.n:
        left, right = tree.tree[2 * i], tree.tree[2 * i + 1]
        go_right = bool((mass >= left and right > 0) or left <= 0)
        if go_right:
            mass = mass - left
        i = 2 * i + go_right
    return i - tree.n


def search(tree: SegmentTree, mass: float) -> int:
    """One prefix-sum search by the two steps of ``find_prefix`` (mass >= 0, root > 0), a
    node at a time: the first node at depth ``min(TOP_DEPTH, log2(n))`` whose running sum
    exceeds ``mass`` (clamped below the level's total), then the descent below it."""
    first = 1 << min(segment_tree.TOP_DEPTH, tree.n.bit_length() - 1)
    sums = list(itertools.accumulate(float(v) for v in tree.tree[first : 2 * first]))
    mass = min(mass, float(np.nextafter(sums[-1], 0.0)))
    b = next(j for j, c in enumerate(sums) if mass < c)
    return descend(tree, mass - sums[b - 1] if b else mass, first + b)


leaves = st.lists(st.one_of(st.just(0.0), st.floats(1e-9, 1e6, allow_nan=False)),
                  min_size=1, max_size=70)


@PATHS
@settings(max_examples=150, deadline=None)
@given(values=leaves, fracs=st.lists(st.floats(0, 1, exclude_max=True), min_size=1, max_size=40),
       spare=st.integers(0, 9))
def test_find_prefix_equals_the_scalar_search(values, fracs, spare, compiled):
    """At every depth of the running-sum step (0: the plain descent; 2: both steps; the
    default: the leaves of these small trees), the same leaves as a search a node at a
    time, and positive ones."""
    with path(compiled):
        tree = SegmentTree(len(values) + spare, np.add, 0.0)  # spare: empty leaves at the end
        tree.rebuild(np.array(values))
        mass = np.array(fracs) * tree.root
        for d in (0, 2, segment_tree.TOP_DEPTH):
            with depth(d):
                got = tree.find_prefix(mass)
                assert got.dtype == np.int64 and got.shape == mass.shape
                if tree.root > 0:
                    assert got.tolist() == [search(tree, float(m)) for m in mass]
                    assert (np.array(values + [0.0] * spare)[got] > 0).all()
                else:
                    assert got.tolist() == [descend(tree, float(m)) for m in mass]
            if d == 0 and tree.root > 0:  # the running-sum step at depth 0 is the plain descent
                assert got.tolist() == [descend(tree, float(m)) for m in mass]


@PATHS
@settings(max_examples=50, deadline=None)
@given(capacity=st.integers(1, 30), d=st.integers(0, 5),
       steps=st.lists(st.tuples(st.lists(st.tuples(st.integers(0, 29), st.floats(0, 1e3)),
                                         max_size=5),
                                st.lists(st.floats(0, 1, exclude_max=True), min_size=1,
                                         max_size=8)), min_size=1, max_size=8))
def test_searches_follow_every_change_of_the_leaves(capacity, d, steps, compiled):
    """Updates between searches: each search sees the leaves as they are then."""
    with path(compiled):
        tree = SegmentTree(capacity, np.add, 0.0)
        tree.rebuild(np.ones(capacity))
        with depth(d):
            for updates, fracs in steps:
                for i, v in updates:
                    tree.set(np.array([i % capacity]), np.array([v]))
                if tree.root > 0:
                    mass = np.array(fracs) * tree.root
                    assert tree.find_prefix(mass).tolist() == [search(tree, float(m)) for m in mass]


@PATHS
@settings(max_examples=50, deadline=None)
@given(values=leaves, mass=st.lists(st.floats(-5, 1e7, allow_nan=False), min_size=1,
                                    max_size=20))
def test_find_prefix_outside_its_domain_still_follows_the_full_rule(values, mass, compiled):
    """Masses < 0 (or a zero root) take the unshortened test at every node from the root;
    masses at or past the root are searched as the largest float below the level's total."""
    with path(compiled):
        tree = SegmentTree(len(values), np.add, 0.0)
        tree.rebuild(np.array(values))
        got = tree.find_prefix(np.array(mass))
        if tree.root > 0 and min(mass) >= 0:
            assert got.tolist() == [search(tree, m) for m in mass]
        else:
            assert got.tolist() == [descend(tree, m) for m in mass]


@PATHS
def test_find_prefix_where_rounding_would_enter_a_zero_subtree(compiled):
    """0 + 5.37 + 8.29 rounds so that the largest mass minus 5.37 is >= 8.29: a search testing
    only ``mass >= left`` would go right into the zero leaf 3; the full rule keeps leaf 2."""
    with path(compiled):
        tree = SegmentTree(3, np.add, 0.0)
        tree.rebuild(np.array([0.0, 5.37, 8.29]))
        mass = np.array([np.nextafter(tree.root, 0), 0.0, 5.37])
        with depth(0):
            assert tree.find_prefix(mass).tolist() == [descend(tree, float(m)) for m in mass] \
                == [2, 1, 2]
        assert tree.find_prefix(mass).tolist() == [search(tree, float(m)) for m in mass] \
            == [2, 1, 2]


@PATHS
def test_find_prefix_of_no_draws_and_of_one_leaf(compiled):
    with path(compiled):
        tree = SegmentTree(1, np.add, 0.0)
        tree.rebuild(np.array([2.0]))
        for d in (0, segment_tree.TOP_DEPTH):
            with depth(d):
                assert tree.find_prefix(np.array([0.0, 1.9])).tolist() == [0, 0]
                assert tree.find_prefix(np.zeros(0)).shape == (0,)


def reference_draw(sampler: PrioritizedSampler, raw: np.ndarray, size: int, batch: int,
                   rng: np.random.Generator) -> tuple[list[int], list[float]]:
    """Slots and weights of one stratified prioritized draw, computed draw by draw."""
    tsum = SegmentTree(len(raw), np.add, 0.0)
    tsum.rebuild(raw**sampler.alpha)
    low = float(np.min(raw[:size] ** sampler.alpha))
    total = tsum.root
    u = rng.random(batch)
    slots, weights = [], []
    for j in range(batch):
        mass = min((j + u[j]) * (total / batch), np.nextafter(total, 0))
        s = search(tsum, mass)
        slots.append(s)
        weights.append(float(np.float32((tsum.tree[tsum.n + s] / low) ** -sampler.beta)))
    return slots, weights


@PATHS
@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), seed=st.integers(0, 2**32 - 1), batch=st.integers(1, 33),
       prios=st.lists(st.floats(0, 50, allow_nan=False), min_size=40, max_size=40))
def test_prioritized_draws_equal_the_reference_for_the_same_rng_state(tmp_path_factory, n,
                                                                       seed, batch, prios,
                                                                       compiled):
    with path(compiled):
        check_prioritized_draw(tmp_path_factory, n, seed, batch, prios)


def check_prioritized_draw(tmp_path_factory, n, seed, batch, prios):
    sampler = PrioritizedSampler(alpha=0.7, beta=0.5)
    buf = ReplayBuffer.create(tmp_path_factory.mktemp("b") / "b", capacity=40, sampler=sampler,
                              fields={"x": FieldSpec((), "int64")}, seed=seed)
    buf.extend({"x": np.arange(n)})
    buf.update_priorities(np.arange(n), np.array(prios[:n]))
    raw = np.zeros(40)
    raw[:n] = np.abs(np.array(prios[:n])) + sampler.eps
    want_slots, want_weights = reference_draw(
        sampler, raw, n, batch, np.random.Generator(np.random.PCG64(seed)))
    out = buf.sample(batch)
    assert out["indices"].tolist() == want_slots  # ids = slots before the ring wraps
    assert out["x"].tolist() == want_slots
    assert out["weights"].dtype == np.float32
    assert out["weights"].tolist() == want_weights
    buf.close()


def naive_rows(col, slots: np.ndarray) -> list[np.ndarray]:
    """Each row read on its own from its chunk's values file."""
    out = []
    for s in slots.tolist():
        path = Path(col.path) / f"c{s // col.base_chunk_rows}.bin"
        data = path.read_bytes() if path.exists() else b""
        a, k = int(col.start[s]), int(col.length[s])
        raw = data[a : a + k * col.spec.item_bytes]
        out.append(np.frombuffer(raw, dtype=col.spec.dtype).reshape(k, *col.spec.row_shape))
    return out


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(0, 9), min_size=1, max_size=60),
       picks=st.lists(st.integers(0, 10**6), min_size=0, max_size=80),
       chunk=st.integers(1, 8))
def test_ragged_gather_equals_rows_read_one_by_one(tmp_path_factory, lengths, picks, chunk):
    fields = {"tok": FieldSpec((None, 2), "int16")}
    buf = ReplayBuffer.create(tmp_path_factory.mktemp("r") / "b", capacity=24, fields=fields,
                              chunk_transitions=chunk)
    rows = [np.arange(2 * k, dtype=np.int16).reshape(k, 2) + 3 * i for i, k in enumerate(lengths)]
    buf.extend({"tok": rows})  # more than the capacity: chunks rewritten and compacted
    col = buf._storage.working.columns["tok"]
    slots = np.array([p % min(len(lengths), 24) for p in picks], dtype=np.int64)
    got = col.gather(slots)
    want = naive_rows(col, slots)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == np.int16 and g.shape == w.shape and g.flags.writeable
        np.testing.assert_array_equal(g, w)
    kept = rows[-24:]
    assert all(np.array_equal(buf[i]["tok"], kept[i]) for i in range(len(kept)))
    buf.close()


@settings(max_examples=25, deadline=None)
@given(batches=st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=12), min_size=1,
                        max_size=8),
       picks=st.lists(st.integers(0, 10**6), min_size=1, max_size=40),
       chunk=st.integers(1, 8))
def test_ragged_gather_between_writes_equals_rows_read_one_by_one(tmp_path_factory, batches,
                                                                   picks, chunk):
    """The values files' maps stay open between gathers: after appends (files grow past their
    maps) and rewrites (chunks truncated and compacted) a gather still reads the rows as
    stored."""
    fields = {"tok": FieldSpec((None,), "int32")}
    buf = ReplayBuffer.create(tmp_path_factory.mktemp("r") / "b", capacity=16, fields=fields,
                              chunk_transitions=chunk)
    col = buf._storage.working.columns["tok"]
    added = 0
    for lengths in batches:
        buf.extend({"tok": [np.arange(k, dtype=np.int32) + 100 * (added + i)
                            for i, k in enumerate(lengths)]})
        added += len(lengths)
        slots = np.array([p % min(added, 16) for p in picks], dtype=np.int64)
        got = col.gather_packed(slots)
        want = naive_rows(col, slots)
        assert got.to_list() and len(got) == len(want)
        for g, w in zip(got.to_list(), want, strict=True):
            np.testing.assert_array_equal(g, w)
    buf.close()
