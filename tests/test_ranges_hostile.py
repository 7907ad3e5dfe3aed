"""The C helpers (``rlbuffers/_ranges.c``) against hostile callers (issue 44): index vectors
changed by another thread while ``copy_ranges`` runs, ``out`` overlapping a source, sum trees
whose nodes are not the sums of finite leaves >= 0, and packed values that are not plain numpy
arrays. Memory stays in bounds, every leaf is in ``[0, n)``, and the C and Python paths accept
and refuse the same inputs."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.heavy import require

require("rlbuffers._ranges")

from rlbuffers import ranges  # noqa: E402
from rlbuffers.packed import Packed  # noqa: E402
from rlbuffers.sampling import segment_tree  # noqa: E402
from rlbuffers.sampling.segment_tree import SegmentTree  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

#: Run in a child process (a write out of bounds may crash it): one thread calls copy_ranges
#: over and over on 4,096 rows while another keeps overwriting each index vector in place with
#: values that are each out of range, then restoring it. Every call must either refuse
#: (ValueError) or copy exactly the good rows; the guard bytes around ``out`` must keep FILL.
RACE = textwrap.dedent("""
    import sys, threading
    import numpy as np
    from rlbuffers import ranges

    sys.setswitchinterval(1e-6)
    N, K, GUARD, FILL, CALLS = 4096, 256, 1 << 16, 0xAB, 2000
    M = N * K
    block = np.full(GUARD + M + GUARD, FILL, dtype=np.uint8)
    out = block[GUARD:GUARD + M]
    src = np.random.default_rng(0).integers(0, 256, M, dtype=np.uint8)
    at = np.arange(N, dtype=np.int64) * K
    vectors = dict(source=np.zeros(N, np.int64), starts=at.copy(), ends=at + K, dst=at.copy(),
                   stops=at + K)
    good = {name: v.copy() for name, v in vectors.items()}
    bad = dict(source=np.full(N, 1 << 40, np.int64),     # no such source
               starts=at - (1 << 40),                   # before the source
               ends=at + K + GUARD // 2,                # past the source, K + GUARD / 2 bytes
               dst=M + at % (GUARD // 2),               # in the guard bytes after out
               stops=at + K + GUARD // 2)               # zeros into the guard bytes
    done = threading.Event()
    changes = [0]

    def mutate():
        while not done.is_set():
            for name, v in vectors.items():
                v[:] = bad[name]
                v[:] = good[name]
                changes[0] += 1

    thread = threading.Thread(target=mutate)
    thread.start()
    refused = copied = 0
    try:
        for _ in range(CALLS):
            out.fill(FILL)
            try:
                ranges.copy_ranges(out, [src], *vectors.values())
            except ValueError:
                refused += 1
                assert (out == FILL).all(), "a refused call wrote to out"
            else:
                copied += 1
                assert (out == src).all(), "a call copied something else than the good rows"
    finally:
        done.set()
        thread.join()
    assert (block[:GUARD] == FILL).all() and (block[GUARD + M:] == FILL).all(), "guard written"
    print(f"ok copied={copied} refused={refused} changes={changes[0]}")
""")


def test_copy_ranges_reads_index_vectors_once_while_another_thread_changes_them() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT),
                                                         os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", RACE], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, f"rc {run.returncode}: {run.stdout}\n{run.stderr[-3000:]}"
    counts = dict(x.split("=") for x in run.stdout.split()[1:])
    assert int(counts["copied"]) > 0 and int(counts["changes"]) > 0, run.stdout


def i64(values: list[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def test_copy_ranges_refuses_out_that_overlaps_a_source() -> None:
    block = np.arange(32, dtype=np.uint8)
    out = block[8:24]
    one = (i64([0]), i64([0]), i64([4]), i64([0]), i64([4]))
    for source in (block[0:9], block[23:32], block[10:12], block):  # each shares a byte with out
        with pytest.raises(ValueError, match=r"^out: expected a buffer that shares no memory "
                                             r"with sources\[0\]"):
            ranges.copy_ranges(out, [source], *one)
        np.testing.assert_array_equal(block, np.arange(32))  # nothing written
    lone = bytearray(b"0123456789")
    with pytest.raises(ValueError, match=r"^out: .*sources\[1\]"):
        ranges.copy_ranges(lone, [b"abcd", memoryview(lone)[2:6]], i64([0, 1]), i64([0, 0]),
                           i64([2, 2]), i64([0, 2]), i64([2, 4]))
    assert lone == b"0123456789"
    ranges.copy_ranges(out, [block[0:8], block[24:32]], i64([0, 1]), i64([0, 0]), i64([8, 8]),
                       i64([0, 8]), i64([8, 16]))  # next to out, not in it: copied
    np.testing.assert_array_equal(block, np.r_[np.arange(8), np.arange(8), np.arange(24, 32),
                                               np.arange(24, 32)])
    # a source out does not read is not looked at (as before), overlapping or not
    ranges.copy_ranges(out, [block[0:8], out], i64([0]), i64([0]), i64([1]), i64([0]), i64([1]))
    assert "overlap" in ranges.copy_ranges.__doc__


HOSTILE = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
    [0.0, -0.0, -1.0, 1.0, np.inf, -np.inf, np.nan, 1e308])


def level_total(nodes: np.ndarray) -> float:
    """The running sum of ``nodes`` as the search computes it (a sum at a time), quietly."""
    with np.errstate(invalid="ignore", over="ignore"):
        return float(np.cumsum(nodes)[-1])


@settings(max_examples=400, deadline=None)
@given(data=st.data(), log_n=st.integers(0, 4))
def test_prefix_search_on_hostile_trees_refuses_or_returns_leaves_in_range(
        data: st.DataObject, log_n: int) -> None:
    n = 1 << log_n
    tree = np.array(data.draw(st.lists(HOSTILE, min_size=2 * n, max_size=2 * n)))
    tree[1] = data.draw(st.floats(1e-300, 1e300))  # a root prefix_search takes
    first = 1 << data.draw(st.integers(0, log_n))
    mass = np.array(data.draw(st.lists(st.floats(0, allow_infinity=True), min_size=1,
                                       max_size=8)))
    out = np.full(len(mass), -7, dtype=np.int64)
    try:
        ranges.prefix_search(tree, first, mass, out)
    except ValueError as e:
        assert str(e).startswith(f"tree: expected the nodes [{first}, {2 * first}) "), e
        assert (out == -7).all()  # refused before writing
        total = level_total(tree[first:2 * first])
        assert not total > 0, (total, e)  # refused only for a level that does not sum > 0
    else:
        assert ((out >= 0) & (out < n)).all(), (out, n)


@pytest.mark.parametrize("level", [[0.0, 0.0], [np.nan, 1.0], [1.0, -1.0], [-2.0, 1.0],
                                   [np.inf, -np.inf]])
def test_prefix_search_refuses_a_level_that_does_not_sum_above_zero(level: list) -> None:
    tree = np.array([0.0, 1.0, *level])  # root 1, leaves `level`: not their sum
    out = np.full(3, -7, dtype=np.int64)
    total = level_total(np.array(level))
    with pytest.raises(ValueError) as e:
        ranges.prefix_search(tree, 2, np.array([0.0, 0.5, 9.0]), out)
    assert str(e.value) == (f"tree: expected the nodes [2, 4) to sum to a value > 0 (the nodes "
                            f"of a sum tree of finite leaves >= 0), got {total!r}")
    assert (out == -7).all()
    ranges.prefix_search(tree, 1, np.array([0.0, 0.5, 9.0]), out)  # from the root: in range
    assert ((out >= 0) & (out < 2)).all()


@settings(max_examples=300, deadline=None)
@given(data=st.data(), log_n=st.integers(0, 4), top_depth=st.integers(0, 4))
def test_find_prefix_on_hostile_trees_returns_leaves_in_range_on_both_paths(
        data: st.DataObject, log_n: int, top_depth: int) -> None:
    """A tree whose nodes are not sums of finite leaves >= 0 (set directly, as a hostile
    caller can): both paths return leaves in [0, n); where the level of the running-sum step
    does not sum > 0, both search from the root instead, so they agree."""
    tree = SegmentTree(1 << log_n, np.add, 0.0)
    n = tree.n
    tree.tree[:] = data.draw(st.lists(HOSTILE, min_size=2 * n, max_size=2 * n))
    if data.draw(st.booleans()):
        tree.tree[1] = data.draw(st.floats(1e-300, 1e300))  # the fast paths' root
    mass = np.array(data.draw(st.lists(st.floats(0, allow_infinity=True), max_size=8)))
    with mock.patch.object(segment_tree, "TOP_DEPTH", top_depth):
        first = tree._top_first()
        got = tree.find_prefix(mass)
        with mock.patch.object(ranges, "prefix_search", None):
            numpy = tree.find_prefix(mass)
    for leaves in (got, numpy):
        assert leaves.dtype == np.int64 and leaves.shape == mass.shape
        assert ((leaves >= 0) & (leaves < n)).all(), (leaves, n)
    if not level_total(tree.tree[first:2 * first]) > 0:
        np.testing.assert_array_equal(got, numpy)


def test_find_prefix_searches_from_the_root_where_the_level_does_not_sum_above_zero() -> None:
    tree = SegmentTree(4, np.add, 0.0)
    tree.tree[:] = [0.0, 3.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0]  # root 3 = 1 + 2, leaves all 0
    for compiled in (True, False):  # the running-sum step's level is the leaves (sum 0)
        with mock.patch.object(ranges, "prefix_search",
                               ranges.prefix_search if compiled else None):
            # from the root with the full rule: 0 < 1 goes left, then left leaf 0 <= 0 goes
            # right (leaf 1); 2.5 >= 1 goes right (1.5 left), then leaf 2 is 0: right (leaf 3)
            assert tree.find_prefix(np.array([0.0, 2.5])).tolist() == [1, 3]


class Wrapped(np.ndarray):
    """An ndarray subclass: slicing keeps the type, as row views must on both paths."""


def rows_of(packed: Packed) -> list:
    """``packed.to_list()`` on the C path (as built) and on the Python path."""
    got = packed.to_list()
    with mock.patch.object(ranges, "row_views", None):
        python = packed.to_list()
    return [got, python]


@pytest.mark.parametrize("values", [
    [1, 2, 3, 4, 5],
    (1, 2, 3, 4, 5),
    memoryview(np.arange(5, dtype=np.int32)),
    np.ma.masked_array(np.arange(5), mask=[0, 1, 0, 0, 1]),
    np.arange(5).view(Wrapped),
], ids=["list", "tuple", "memoryview", "masked", "subclass"])
def test_packed_to_list_takes_the_same_values_on_both_paths(values) -> None:
    packed = Packed(values, i64([0, 2, 2, 5]))
    got, python = rows_of(packed)
    assert len(got) == len(python) == 3
    for a, b, (x, y) in zip(got, python, [(0, 2), (2, 2), (2, 5)], strict=True):
        assert type(a) is type(b) is type(values[x:y])
        assert list(a) == list(b) == list(values[x:y])
    if isinstance(values, np.ma.MaskedArray):
        assert got[2].mask.tolist() == [False, False, True]


@pytest.mark.parametrize(("cu", "message"), [
    ([0, 3, 2], "cu_seqlens[2]: expected a value in [3, 5]"),
    ([0, 6], "cu_seqlens[1]: expected a value in [0, 5]"),
    ([-1, 2], "cu_seqlens[0]: expected a value in [0, 5]"),
    ([], "cu_seqlens: expected at least 1 value, got 0"),
])
@pytest.mark.parametrize("dtype", ["int64", "int32"])
def test_packed_to_list_refuses_the_same_offsets_on_both_paths(cu: list, message: str,
                                                               dtype: str) -> None:
    packed = Packed(np.arange(5), np.asarray(cu, dtype=dtype))
    for compiled in (True, False):
        with mock.patch.object(ranges, "row_views", ranges.row_views if compiled else None):
            with pytest.raises(ValueError) as e:
                packed.to_list()
            assert message in str(e.value), (compiled, e.value)


def test_packed_to_list_refuses_0d_values_on_both_paths() -> None:
    packed = Packed(np.array(3), i64([0]))
    for compiled in (True, False):
        with mock.patch.object(ranges, "row_views", ranges.row_views if compiled else None):
            with pytest.raises(ValueError, match="values: expected an array of at least 1 "
                                                 "dimension, got 0"):
                packed.to_list()
