"""Buffer fields as Arrow columns and back: a field of shape ``(a, b)`` is a fixed-size list
of ``a`` fixed-size lists of ``b`` values (what ``datasets`` reads as nested sequences and
returns as ``[n, a, b]`` arrays with ``with_format("numpy")``); a ragged field ``(None, b)``
is a variable-size list of fixed-size lists; a scalar is a plain column. Every dtype a buffer
stores except complex maps to its Arrow type (bool, int8..uint64, float16..float64)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

__all__ = ["arrow_type", "to_arrow", "to_numpy"]


def arrow_type(name: str, shape: tuple[int | None, ...], dtype: Any) -> pa.DataType:
    """The Arrow type of a field.

    Raises:
        ValueError: a complex dtype (Parquet has none), naming the field.
    """
    dt = np.dtype(dtype)
    if dt.kind == "c":
        raise ValueError(f"field {name!r}: {dt} has no Parquet type (expected a bool, integer "
                         "or float dtype)")
    t = pa.from_numpy_dtype(dt)
    for dim in reversed(shape):
        t = pa.list_(t) if dim is None else pa.list_(t, dim)
    return t


def _dims(shape: tuple[int | None, ...]) -> tuple[int, ...]:
    return tuple(int(d) for d in shape if d is not None)


def _fixed(values: np.ndarray, dims: tuple[int, ...]) -> pa.Array:
    arr = pa.array(values.reshape(-1))
    for dim in reversed(dims):
        arr = pa.FixedSizeListArray.from_arrays(arr, dim)
    return arr


def to_arrow(name: str, shape: tuple[int | None, ...], dtype: Any, rows: Any) -> pa.Array:
    """``rows`` (``[n, *shape]``; ragged: a list of ``n`` arrays) as an Arrow array of
    :func:`arrow_type`."""
    arrow_type(name, shape, dtype)  # the dtype check
    if shape and shape[0] is None:
        inner = _dims(shape[1:])
        lengths = np.array([len(r) for r in rows], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32 if lengths.sum()
                                                                   < 2**31 else np.int64)
        flat = (np.concatenate([np.asarray(r, dtype).reshape(-1, *inner) for r in rows])
                if len(rows) else np.empty((0, *inner), dtype))
        values = _fixed(flat, inner)
        cls = pa.ListArray if offsets.dtype == np.int32 else pa.LargeListArray
        return cls.from_arrays(pa.array(offsets), values)
    data = np.ascontiguousarray(np.asarray(rows, dtype=dtype))
    return _fixed(data, _dims(shape))


def _leaf(arr: Any, depth: int) -> np.ndarray:
    for _ in range(depth):
        arr = arr.flatten()
    return arr.to_numpy(zero_copy_only=False)


def to_numpy(shape: tuple[int | None, ...], dtype: Any, column: Any) -> Any:
    """An Arrow array or chunked array of :func:`arrow_type` as ``[n, *shape]`` (ragged: a list
    of ``n`` arrays ``[len_i, *shape[1:]]``)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    n = len(column)
    if shape and shape[0] is None:
        inner = _dims(shape[1:])
        offsets = column.offsets.to_numpy() - column.offsets[0].as_py()
        flat = _leaf(column.flatten(), len(inner)).astype(dtype, copy=False)
        flat = flat.reshape(-1, *inner)
        return [flat[offsets[i]:offsets[i + 1]] for i in range(n)]
    values = _leaf(column, len(shape)).astype(dtype, copy=False)
    return values.reshape(n, *_dims(shape))
