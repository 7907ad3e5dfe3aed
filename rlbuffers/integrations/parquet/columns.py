"""Buffer fields as Arrow columns and back, in one of two encodings:

- ``"list"``: a field of shape ``(a, b)`` is a fixed-size list of ``a`` fixed-size lists of
  ``b`` values (what ``datasets`` reads as nested sequences and returns as ``[n, a, b]`` arrays
  with ``with_format("numpy")``); a ragged field ``(None, b)`` a variable-size list of
  fixed-size lists; a scalar a plain column;
- ``"binary"``: each row's raw bytes (C order, the field's dtype) as one fixed-size binary
  value; ``datasets`` returns ``bytes``, read back with ``np.frombuffer(value, dtype)
  .reshape(shape)`` (dtype and shape are in ``meta/info.json``). Parquet writes lists with a
  repetition and definition level per value, ~8 MB/s for uint8 images on this machine, and
  binary values ~100x faster, so large rows (images) use it: :func:`encoding`.

Every dtype a buffer stores except complex maps to its Arrow type (bool, int8..uint64,
float16..float64)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

__all__ = ["BINARY_BYTES", "arrow_type", "encoding", "to_arrow", "to_numpy"]

#: rows of at least this many bytes are written ``"binary"`` by default
BINARY_BYTES = 4096


def encoding(shape: tuple[int | None, ...], dtype: Any, binary_bytes: int | None) -> str:
    """``"binary"`` for a fixed-shape field whose rows have >= ``binary_bytes`` bytes (None:
    never), else ``"list"``."""
    if binary_bytes is None or (shape and shape[0] is None) or not shape:
        return "list"
    row = int(np.prod(_dims(shape), dtype=np.int64)) * np.dtype(dtype).itemsize
    return "binary" if row >= binary_bytes else "list"


def arrow_type(name: str, shape: tuple[int | None, ...], dtype: Any,
               enc: str = "list") -> pa.DataType:
    """The Arrow type of a field in encoding ``enc``.

    Raises:
        ValueError: a complex dtype (Parquet has none), naming the field.
    """
    dt = np.dtype(dtype)
    if dt.kind == "c":
        raise ValueError(f"field {name!r}: {dt} has no Parquet type (expected a bool, integer "
                         "or float dtype)")
    if enc == "binary":
        return pa.binary(int(np.prod(_dims(shape), dtype=np.int64)) * dt.itemsize)
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


def to_arrow(name: str, shape: tuple[int | None, ...], dtype: Any, rows: Any,
             enc: str = "list") -> pa.Array:
    """``rows`` (``[n, *shape]``; ragged: a list of ``n`` arrays) as an Arrow array of
    :func:`arrow_type`."""
    t = arrow_type(name, shape, dtype, enc)  # the dtype check
    if enc == "binary":
        data = np.ascontiguousarray(np.asarray(rows, dtype=dtype))
        return pa.FixedSizeBinaryArray.from_buffers(t, len(data), [None, pa.py_buffer(data)])
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


def to_numpy(shape: tuple[int | None, ...], dtype: Any, column: Any,
             enc: str = "list") -> Any:
    """An Arrow array or chunked array of :func:`arrow_type` as ``[n, *shape]`` (ragged: a list
    of ``n`` arrays ``[len_i, *shape[1:]]``)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    n = len(column)
    if enc == "binary":
        width = column.type.byte_width
        raw = np.frombuffer(column.buffers()[1], dtype=np.uint8)
        raw = raw[column.offset * width:(column.offset + n) * width]
        return raw.view(dtype).reshape(n, *_dims(shape)).copy()
    if shape and shape[0] is None:
        inner = _dims(shape[1:])
        offsets = column.offsets.to_numpy() - column.offsets[0].as_py()
        flat = _leaf(column.flatten(), len(inner)).astype(dtype, copy=False)
        flat = flat.reshape(-1, *inner)
        return [flat[offsets[i]:offsets[i + 1]] for i in range(n)]
    values = _leaf(column, len(shape)).astype(dtype, copy=False)
    return values.reshape(n, *_dims(shape))
