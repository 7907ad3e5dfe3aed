"""C3: every dtype x shape is either refused by ``FieldSpec`` (FieldError saying what is
supported, nothing left on disk) or round-trips exactly through add / save / open / sample.
Zero-length ragged rows round-trip; zero-size axes are refused."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlbuffers import FieldError, FieldSpec, ReplayBuffer
from rlbuffers.spec import SUPPORTED_DTYPES

DTYPES = [np.dtype(t) for t in (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
    "float32", "float64", "complex64", "complex128", "longdouble", "clongdouble",
    "datetime64[s]", "timedelta64[ns]", ">i4", ">f8", "U3", "S2", "V4", "i4,i4", "(2,)f4")]
SHAPES = st.one_of(
    st.lists(st.integers(0, 3), max_size=3).map(tuple),
    st.lists(st.integers(0, 3), max_size=2).map(lambda s: (None, *s)))


def _values(dtype: np.dtype, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    raw = rng.integers(0, 256, size=int(np.prod(shape, dtype=np.int64)) * dtype.itemsize,
                       dtype=np.uint8)
    out = raw.view(dtype).reshape(shape)
    if dtype.kind in "fc":
        out = np.nan_to_num(out)  # compare with ==, not NaN payloads
    if dtype.kind == "b":
        out = out.view(np.uint8) % 2 == 1
    return out


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=st.sampled_from(DTYPES), shape=SHAPES, data=st.data())
def test_refused_at_create_or_exact_round_trip(tmp_path_factory, dtype, shape, data):
    root = tmp_path_factory.mktemp("spec")
    try:
        spec = FieldSpec(shape, dtype)
    except FieldError as e:
        assert dtype not in SUPPORTED_DTYPES or not dtype.isnative or 0 in shape, (dtype, shape)
        assert "expected" in str(e)
        with pytest.raises(FieldError):
            ReplayBuffer.create(root / "b", capacity=4, fields={"v": FieldSpec(shape, dtype)})
        assert list(root.iterdir()) == []  # nothing left behind
        return
    assert dtype in SUPPORTED_DTYPES and dtype.isnative and 0 not in shape
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    rows = []
    for _ in range(5):
        n = data.draw(st.integers(0, 3)) if spec.ragged else None
        rows.append(_values(dtype, ((n, *spec.row_shape) if spec.ragged else spec.shape), rng))
    with ReplayBuffer.create(root / "b", capacity=4, fields={"v": spec},
                             chunk_transitions=2) as buf:
        for r in rows:
            buf.add(v=r)
        buf.save()
    expected = rows[-4:]
    for mode in ("r", "r+"):
        with ReplayBuffer.open(root / "b", mode=mode) as buf:
            got = buf[:]["v"]
            for want, have in zip(expected, got, strict=True):
                assert have.dtype == dtype and have.shape == want.shape
                np.testing.assert_array_equal(have, want)
            s = buf.sample(8)
            for i, have in zip(s["indices"].tolist(), s["v"], strict=True):
                np.testing.assert_array_equal(have, rows[i])


def test_zero_length_ragged_rows_round_trip(tmp_path):
    with ReplayBuffer.create(tmp_path / "b", capacity=3, chunk_transitions=2,
                             fields={"tok": FieldSpec((None, 2), "int32")}) as buf:
        buf.extend({"tok": [np.zeros((0, 2), np.int32), np.ones((2, 2), np.int32),
                            np.zeros((0, 2), np.int32)]})
        buf.save()
    with ReplayBuffer.open(tmp_path / "b", mode="r") as ro:
        assert [a.shape for a in ro[:]["tok"]] == [(0, 2), (2, 2), (0, 2)]


@pytest.mark.parametrize(("shape", "dtype", "match"), [
    ((3, 0), "float32", "expected sizes that are integers >= 1"),
    ((None, 0), "int8", "expected sizes that are integers >= 1"),
    ((), "longdouble", "not stored; expected one of bool, int8"),
    ((), "clongdouble", "not stored"),
    ((2,), "datetime64[s]", "not stored"),
    ((2,), "timedelta64", "not stored"),
    ((2,), ">i4", "native byte order"),
    ((2**20, 2**20), "float64", "expected at most 2147483648"),
])
def test_unsupported_specs_are_refused_with_what_is_supported(tmp_path, shape, dtype, match):
    with pytest.raises(FieldError, match=match):
        ReplayBuffer.create(tmp_path / "b", capacity=4, fields={"v": FieldSpec(shape, dtype)})
    assert list(tmp_path.iterdir()) == []
