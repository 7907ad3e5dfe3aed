"""The C helpers of ragged fields (``rlbuffers/_ranges.c``, built by ``pip install``): the
range copy's bytes equal a copy a range at a time, the row views equal numpy slices, bad
arguments are refused before a byte is written or a view made, and the gathers that use them
(packed, padded, list; one thread or several) return exactly the rows that were added, as the
Python path (``bytearray.join``, slicing) does."""

import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.heavy import require

require("rlbuffers._ranges")

from rlbuffers import FieldSpec, ReplayBuffer, ranges  # noqa: E402
from rlbuffers.storage import ragged_column  # noqa: E402

FILL = 0xAB  # what out holds before the copy: bytes no range or pad covers keep it


def i64(values: list[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


@st.composite
def copies(draw: st.DrawFn) -> tuple:
    """Sources, N ranges of them, and where each goes in out (gaps and pads included)."""
    sources = [bytes(draw(st.binary(max_size=64))) for _ in range(draw(st.integers(1, 3)))]
    n = draw(st.integers(0, 12))
    source, starts, ends, dst, stops = [], [], [], [], []
    at = 0
    for _ in range(n):
        s = draw(st.integers(0, len(sources) - 1))
        a = draw(st.integers(0, len(sources[s])))
        b = draw(st.integers(a, len(sources[s])))
        at += draw(st.integers(0, 3))  # a gap left untouched
        source.append(s), starts.append(a), ends.append(b), dst.append(at)
        at += b - a + draw(st.integers(0, 5))  # then zeros up to the stop
        stops.append(at)
    return sources, source, starts, ends, dst, stops, at + draw(st.integers(0, 4))


@settings(max_examples=300, deadline=None)
@given(case=copies())
def test_copy_ranges_equals_a_copy_a_range_at_a_time(case: tuple) -> None:
    sources, source, starts, ends, dst, stops, size = case
    want = bytearray([FILL]) * size
    for s, a, b, d, e in zip(source, starts, ends, dst, stops, strict=True):
        want[d:d + b - a] = sources[s][a:b]
        want[d + b - a:e] = bytes(e - d - (b - a))
    out = np.full(size, FILL, dtype=np.uint8)
    ranges.copy_ranges(out, [memoryview(x) for x in sources], i64(source), i64(starts),
                       i64(ends), i64(dst), i64(stops))
    assert out.tobytes() == bytes(want)


GOOD = dict(source=[0, 1], starts=[0, 2], ends=[3, 4], dst=[0, 3], stops=[3, 8])
BAD = [
    ("source", dict(source=[0, 2]), ValueError, "source[1]: expected a value in [0, 2), got 2"),
    ("source", dict(source=[-1, 0]), ValueError, "source[0]"),
    ("starts", dict(starts=[4, 2]), ValueError, "got 4, 3"),
    ("ends", dict(ends=[3, 5]), ValueError, "<= 4 (the bytes of sources[1]), got 2, 5"),
    ("starts", dict(starts=[-1, 2]), ValueError, "starts[0], ends[0]"),
    ("dst", dict(dst=[0, 7]), ValueError, "dst[1], stops[1]"),
    ("stops", dict(stops=[3, 9]), ValueError, "<= 8 (the bytes of out), got 3, 9"),
    ("stops", dict(stops=[2, 8]), ValueError, "dst[0], stops[0]"),
    ("starts", dict(starts=[0]), ValueError, "starts: expected 2 values (as source), got 1"),
    ("ends", dict(ends=np.array([3, 4], dtype=np.int32)), TypeError, "ends: expected a 1-D"),
    ("dst", dict(dst=np.zeros((2, 1), dtype=np.int64)), TypeError, "dst: expected a 1-D"),
]


@pytest.mark.parametrize(("name", "change", "error", "message"), BAD,
                         ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_copy_ranges_refuses_bad_arguments_before_writing(name: str, change: dict, error: type,
                                                          message: str) -> None:
    args = {k: i64(v) for k, v in GOOD.items()}
    args.update({k: (v if isinstance(v, np.ndarray) else i64(v)) for k, v in change.items()})
    out = np.full(8, FILL, dtype=np.uint8)
    with pytest.raises(error) as e:
        ranges.copy_ranges(out, [b"abc", b"defg"], *args.values())
    assert name in str(e.value).split(":")[0] and message in str(e.value)
    assert (out == FILL).all()  # nothing written, not even the rows before the bad one


def test_copy_ranges_refuses_read_only_out_and_non_buffers() -> None:
    args = [i64(v) for v in GOOD.values()]
    with pytest.raises(BufferError):
        ranges.copy_ranges(bytes(8), [b"abc", b"defg"], *args)
    with pytest.raises(TypeError):
        ranges.copy_ranges(bytearray(8), [b"abc", 5], *args)
    with pytest.raises(TypeError, match="sources: expected a sequence"):
        ranges.copy_ranges(bytearray(8), 5, *args)
    ranges.copy_ranges(bytearray(8), (b"abc", b"defg"), *args)  # a tuple is a sequence too


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(0, 5), max_size=12), row=st.sampled_from([(), (3,), (2, 2)]),
       dtype=st.sampled_from(["int32", "float64", "bool", "uint8"]), writeable=st.booleans(),
       spare=st.integers(0, 3))
def test_row_views_equal_numpy_slices(lengths: list[int], row: tuple, dtype: str,
                                      writeable: bool, spare: int) -> None:
    cu = np.cumsum([0, *lengths]).astype(np.int64)
    values = np.arange((int(cu[-1]) + spare) * int(np.prod(row))).reshape(-1, *row).astype(dtype)
    values.flags.writeable = writeable
    got = ranges.row_views(values, cu)
    assert len(got) == len(lengths)
    for i, view in enumerate(got):
        want = values[cu[i]:cu[i + 1]]
        np.testing.assert_array_equal(view, want)
        assert view.dtype == want.dtype and view.shape == want.shape
        assert view.strides == want.strides and view.base is values
        assert view.flags.writeable == writeable and view.flags.c_contiguous
        assert np.shares_memory(view, values) or view.size == 0


def test_row_views_keep_values_alive_and_release_it() -> None:
    values = np.arange(10, dtype=np.int32)
    before = sys.getrefcount(values)
    views = ranges.row_views(values, i64([0, 4, 10]))
    assert sys.getrefcount(values) == before + 2  # one per view (its base)
    views[1][0] = 99  # a view, not a copy
    assert values[4] == 99
    del views
    assert sys.getrefcount(values) == before


@pytest.mark.parametrize(("cu", "error", "message"), [
    ([0, 3, 2], ValueError, "cu_seqlens[2]: expected a value in [3, 10]"),
    ([0, 11], ValueError, "cu_seqlens[1]: expected a value in [0, 10]"),
    ([-1, 2], ValueError, "cu_seqlens[0]: expected a value in [0, 10]"),
    ([], ValueError, "cu_seqlens: expected at least 1 value, got 0"),
    (np.array([0, 2], dtype=np.int32), TypeError, "cu_seqlens: expected a 1-D contiguous int64"),
])
def test_row_views_refuse_bad_offsets(cu, error: type, message: str) -> None:
    cu = cu if isinstance(cu, np.ndarray) else i64(cu)
    with pytest.raises(error) as e:
        ranges.row_views(np.zeros(10, dtype=np.int32), cu)
    assert message in str(e.value)
    with pytest.raises(ValueError, match="values: expected an array of at least 1 dimension"):
        ranges.row_views(np.zeros((), dtype=np.int32), i64([0]))
    with pytest.raises(TypeError):
        ranges.row_views([1, 2, 3], i64([0, 1]))


def sum_tree(leaves: list[float]) -> np.ndarray:
    """float64[2n]: a sum tree over ``leaves`` (n a power of two, leaves at [n, 2n))."""
    n = 1 << max(0, (len(leaves) - 1).bit_length())
    tree = np.zeros(2 * n)
    tree[n:n + len(leaves)] = leaves
    for k in range(n - 1, 0, -1):
        tree[k] = tree[2 * k] + tree[2 * k + 1]
    return tree


@pytest.mark.parametrize(("args", "error", "message"), [
    (dict(tree=np.zeros(6)), ValueError, "tree: expected 2 n values, n a power of two, got 6"),
    (dict(tree=sum_tree([0.0, 0.0])), ValueError, "tree: expected a root in (0, inf), got 0.0"),
    (dict(tree=sum_tree([1.0, np.inf])), ValueError, "tree: expected a root in (0, inf), got inf"),
    (dict(first=3), ValueError, "first: expected a power of two in [1, 4], got 3"),
    (dict(first=8), ValueError, "first: expected a power of two in [1, 4], got 8"),
    (dict(mass=np.array([0.5, -1.0])), ValueError, "mass[1]: expected a value >= 0, got -1.0"),
    (dict(mass=np.array([0.5, np.nan])), ValueError, "mass[1]: expected a value >= 0, got nan"),
    (dict(out=np.full(3, -7, dtype=np.int64)), ValueError, "out: expected 2 writable values"),
    (dict(mass=np.array([1, 2])), TypeError, "mass: expected a 1-D contiguous float64"),
    (dict(tree=sum_tree([1.0, 2.0]).astype(np.float32)), TypeError, "tree: expected a 1-D"),
])
def test_prefix_search_refuses_bad_arguments_before_writing(args: dict, error: type,
                                                            message: str) -> None:
    call = dict(tree=sum_tree([1.0, 2.0, 0.0, 3.0]), first=2, mass=np.array([0.5, 5.5]),
                out=np.full(2, -7, dtype=np.int64))
    call.update(args)
    with pytest.raises(error) as e:
        ranges.prefix_search(call["tree"], call["first"], call["mass"], call["out"])
    assert message in str(e.value)
    assert (call["out"] == -7).all()
    out = np.full(2, -7, dtype=np.int64)
    ranges.prefix_search(sum_tree([1.0, 2.0, 0.0, 3.0]), 2, np.array([0.5, 5.5]), out)
    assert out.tolist() == [0, 3]  # 0.5 in leaf 0; 5.5 past 1 + 2 + 0, in leaf 3
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out: expected 2 writable values .*, got 2 read-only"):
        ranges.prefix_search(sum_tree([1.0, 2.0, 0.0, 3.0]), 2, np.array([0.5, 5.5]), out)


SHAPES = {"tok": ((None,), "int32"), "pts": ((None, 3), "float64"), "flag": ((None,), "bool")}


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(0, 40), min_size=1, max_size=30),
       batch=st.integers(1, 40), threads=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_ragged_gathers_return_the_added_rows(tmp_path_factory: pytest.TempPathFactory,
                                              lengths: list[int], batch: int, threads: int,
                                              seed: int) -> None:
    """Packed, padded and list gathers of random slots (repeats included), by the C copy in
    ``threads`` parts (and the C row views) and by the Python paths, equal the rows as they
    were added; rows span several chunks of the values files."""
    rng = np.random.default_rng(seed)
    rows = {name: [rng.integers(-99, 99, (k, *shape[1:])).astype(dtype) for k in lengths]
            for name, (shape, dtype) in SHAPES.items()}
    path = Path(tmp_path_factory.mktemp("ranges")) / "buf"
    fields = {name: FieldSpec(*spec) for name, spec in SHAPES.items()}
    buf = ReplayBuffer.create(path, capacity=64, fields=fields, chunk_transitions=8)
    try:
        buf.extend(rows)
        slots = rng.integers(0, len(lengths), batch)
        for name, (shape, dtype) in SHAPES.items():
            col = buf._storage.working.columns[name]
            want = [rows[name][i] for i in slots.tolist()]
            with mock.patch.object(ragged_column, "copy_parts", lambda nbytes: threads):
                got = (col.gather_packed(slots), col.gather_padded(slots), col.gather(slots))
            with mock.patch.object(ranges, "copy_ranges", None), \
                    mock.patch.object(ranges, "row_views", None):
                python = (col.gather_packed(slots), col.gather_padded(slots), col.gather(slots))
            for packed, padded, listed in (got, python):
                np.testing.assert_array_equal(
                    packed.cu_seqlens, np.cumsum([0, *(len(r) for r in want)]))
                assert packed.values.dtype == np.dtype(dtype)
                np.testing.assert_array_equal(
                    packed.values, np.concatenate(want).reshape(-1, *shape[1:]))
                longest = max(len(r) for r in want)
                assert padded.values.shape == (batch, longest, *shape[1:])
                for i, r in enumerate(want):
                    np.testing.assert_array_equal(padded.values[i, :len(r)], r)
                    assert not padded.values[i, len(r):].any()  # zeros after each row
                    np.testing.assert_array_equal(listed[i], r)
                np.testing.assert_array_equal(padded.lengths, [len(r) for r in want])
    finally:
        buf.close()
