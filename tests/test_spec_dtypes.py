"""Lossless dtypes: a value is stored in a field of another dtype only if it comes back equal;
otherwise FieldError names the field, the dtype and the value, and the buffer is unchanged.
``FieldSpec(..., finite=True)`` refuses NaN and inf and survives save / open."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbuffers import FieldError, FieldSpec, ReplayBuffer
from rlbuffers.spec import check_batch, check_row

INTS = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
FLOATS = ["float16", "float32", "float64"]


def fits(v, target: np.dtype) -> bool:
    """Naive reference, one Python value at a time."""
    if target.kind == "b":
        return v in (0, 1)
    if target.kind in "iu":
        if isinstance(v, float) and (math.isnan(v) or math.isinf(v) or v != int(v)):
            return False
        info = np.iinfo(target)
        return info.min <= int(v) <= info.max
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return True  # non-finite stays non-finite
    with np.errstate(over="ignore"):  # finite must stay finite (rounding to max is fine)
        return bool(np.isfinite(np.float64(v).astype(target)))


int_values = st.integers(-(2**64), 2**64 - 1)
float_values = st.one_of(st.integers(-(2**70), 2**70).map(float),
                         st.sampled_from([0.5, -2.25, 1e300, -1e300, 7e4, math.inf, -math.inf,
                                          math.nan, 1e38, 3e38]))


@settings(max_examples=300, deadline=None)
@given(source=st.sampled_from(INTS + ["bool"]), target=st.sampled_from(INTS + FLOATS + ["bool"]),
       data=st.data())
def test_integer_sources(source, target, data):
    src = np.dtype(source)
    if src.kind == "b":
        values = data.draw(st.lists(st.booleans(), min_size=1, max_size=5))
    else:
        info = np.iinfo(src)
        values = data.draw(st.lists(st.integers(int(info.min), int(info.max)), min_size=1,
                                    max_size=5))
    arr = np.array(values, dtype=src)
    check(arr, np.dtype(target), [v if isinstance(v, bool) else int(v) for v in values])


@settings(max_examples=300, deadline=None)
@given(target=st.sampled_from(INTS + FLOATS + ["bool"]),
       values=st.lists(float_values, min_size=1, max_size=5))
def test_float_sources(target, values):
    check(np.array(values, dtype=np.float64), np.dtype(target), values)


def check(arr, target, py_values):
    spec = FieldSpec((len(arr),), target)
    ok = all(fits(v, target) for v in py_values)
    if not ok:
        with pytest.raises(FieldError, match=f"field 'x': value .* does not fit dtype {target}"):
            check_row("x", spec, arr)
        return
    got = check_row("x", spec, arr)
    assert got.dtype == target
    if target.kind in "biu":
        assert [int(v) for v in got] == [int(v) for v in py_values]  # exact
    else:
        want = np.array(py_values, dtype=np.float64).astype(target)
        np.testing.assert_array_equal(got, want)  # float rounding only, NaN where NaN


@pytest.fixture(scope="module")
def buffers(tmp_path_factory):
    """One buffer per target dtype, each with a scalar field ``x`` and a ragged field ``t``,
    filled by the examples of the test below (closed at the end)."""
    root = tmp_path_factory.mktemp("dtypes")
    bufs = {t: ReplayBuffer.create(root / t, capacity=100_000, fields={
        "x": FieldSpec((), t), "t": FieldSpec((None,), t)}) for t in INTS + ["bool"]}
    yield bufs
    for b in bufs.values():
        b.close()


@settings(max_examples=200, deadline=None)
@given(source=st.sampled_from(INTS + ["bool"]), target=st.sampled_from(INTS + ["bool"]),
       data=st.data())
def test_extend_stores_iff_representable_and_reads_back_equal(buffers, source, target, data):
    """Through the buffer: ``extend`` succeeds iff every value fits, a refused batch leaves the
    buffer unchanged, and what was stored reads back equal, for the fixed and the ragged
    field."""
    src = np.dtype(source)
    if src.kind == "b":
        values = data.draw(st.lists(st.booleans(), min_size=1, max_size=6))
    else:
        info = np.iinfo(src)
        values = data.draw(st.lists(st.integers(int(info.min), int(info.max)), min_size=1,
                                    max_size=6))
    buf, n = buffers[target], len(values)
    arr = np.array(values, dtype=src)
    before = buf.total_added
    if not all(fits(int(v), np.dtype(target)) for v in values):
        with pytest.raises(FieldError, match=f"does not fit dtype {target}"):
            buf.extend({"x": arr, "t": [arr] * n})
        assert buf.total_added == before
        return
    buf.extend({"x": arr, "t": [arr[:i] for i in range(n)]})
    back = buf[np.arange(len(buf) - n, len(buf))]
    assert back["x"].dtype == np.dtype(target)
    assert [int(v) for v in back["x"]] == [int(v) for v in values]
    assert [[int(v) for v in row] for row in back["t"]] == [
        [int(v) for v in values[:i]] for i in range(n)]


def test_cases_from_the_issue():
    with pytest.raises(FieldError, match="value 300 \\(uint16\\) does not fit dtype uint8"):
        check_row("obs", FieldSpec((1,), "uint8"), np.array([300], np.uint16))
    with pytest.raises(FieldError, match=f"value {2**40 + 5} \\(int64\\) does not fit dtype int32"):
        check_row("a", FieldSpec((1,), "int32"), np.array([2**40 + 5]))
    assert check_row("a", FieldSpec((2,), "uint8"), np.array([3, 5])).tolist() == [3, 5]
    assert check_batch("r", FieldSpec((), "int16"), [2.0, -3.0], 2).tolist() == [2, -3]
    with pytest.raises(FieldError, match="value 2.5"):
        check_batch("t", FieldSpec((None,), "int32"), [np.array([1.0]), np.array([2.5])], 2)


def test_a_refused_add_leaves_the_buffer_unchanged(tmp_path):
    buf = ReplayBuffer.create(tmp_path / "b", capacity=8,
                              fields={"a": FieldSpec((), "uint8"), "r": FieldSpec((), "float32")})
    buf.extend({"a": np.array([1, 2]), "r": np.array([0.5, 1.5])})
    with pytest.raises(FieldError, match="field 'a': value 256"):
        buf.extend({"a": np.array([3, 256]), "r": np.array([0.0, 0.0])})
    with pytest.raises(FieldError, match="field 'a': value -1"):
        buf.add(a=-1, r=0.0)
    assert len(buf) == 2 and buf[np.arange(2)]["a"].tolist() == [1, 2]
    buf.close()


def test_finite_refuses_nan_and_inf_and_survives_save_and_open(tmp_path):
    fields = {"r": FieldSpec((), "float32", finite=True), "x": FieldSpec((), "float32")}
    buf = ReplayBuffer.create(tmp_path / "b", capacity=8, fields=fields)
    buf.add(r=1.0, x=math.nan)  # x keeps non-finite values
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(FieldError, match="field 'r': expected finite values"):
            buf.add(r=bad, x=0.0)
    buf.save()
    buf.close()
    again = ReplayBuffer.open(tmp_path / "b")
    assert again.fields["r"] == FieldSpec((), "float32", finite=True)
    with pytest.raises(FieldError, match="expected finite"):
        again.add(r=math.nan, x=0.0)
    assert len(again) == 1
    again.close()


def test_finite_needs_a_float_dtype():
    with pytest.raises(FieldError, match="finite=True: expected a float dtype, got int32"):
        FieldSpec((), "int32", finite=True)
