"""Packed ragged rows: the values of N variable-length rows end to end plus their offsets, the
layout of FlashAttention's varlen API (``cu_seqlens``; Dao, "FlashAttention-2", 2023, and
``flash_attn_varlen_func``) and of sequence packing in LLM trainers.

``ReplayBuffer.sample(B, ragged="packed")`` returns a ragged field as a :class:`Packed`
instead of a list of B arrays: two arrays, no Python object per row. Its ``cu_seqlens`` is
int32, as in the streaming pipeline's batches (:mod:`rlbuffers.stream`), FlashAttention's
varlen kernels and HF transformers' flattening collator; the gathers compute offsets in int64
and convert when the :class:`Packed` is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from rlbuffers import ranges

#: The values ``ragged=`` takes: a list of arrays (one per row), one :class:`Packed`, or one
#: :class:`~rlbuffers.padded.Padded`.
RAGGED_FORMATS = ("list", "packed", "padded")
#: The most values (rows along the ragged axis) one :class:`Packed` holds: int32's maximum.
MAX_PACKED_VALUES = int(np.iinfo(np.int32).max)


@dataclass(frozen=True, eq=False)
class Packed:
    """N ragged rows packed end to end.

    Attributes:
        values: ``[sum_len, *row_shape]`` in the field's dtype: row ``i`` is
            ``values[cu_seqlens[i]:cu_seqlens[i + 1]]`` (e.g. int32[sum_len] token ids for a
            ``FieldSpec((None,), "int32")`` field, float32[sum_len, 3] for ``(None, 3)``).
        cu_seqlens: int32[N + 1], ``cu_seqlens[0] == 0``, non-decreasing,
            ``cu_seqlens[-1] == len(values)``: what ``flash_attn_varlen_func`` takes as it is.
            Integer offsets of another dtype are converted to int32 when the object is built.

    Raises:
        TypeError: ``cu_seqlens`` not integers.
        ValueError: an entry of ``cu_seqlens`` outside int32's range (more than
            :data:`MAX_PACKED_VALUES` values), naming it.
    """

    values: np.ndarray
    cu_seqlens: np.ndarray

    def __post_init__(self) -> None:
        object.__setattr__(self, "cu_seqlens", int32_offsets(self.cu_seqlens))

    def __len__(self) -> int:
        """N, the number of rows."""
        return len(self.cu_seqlens) - 1

    @property
    def seqlens(self) -> np.ndarray:
        """int32[N]: the length of each row."""
        return np.diff(self.cu_seqlens)

    def __getitem__(self, i: int) -> np.ndarray:
        """Row ``i`` (``-N <= i < N``): a view ``[len_i, *row_shape]`` of :attr:`values`.

        Raises:
            IndexError: ``i`` outside ``[-N, N)``.
        """
        i = row_index(i, len(self))
        return self.values[int(self.cu_seqlens[i]):int(self.cu_seqlens[i + 1])]

    def to_list(self) -> list[np.ndarray]:
        """The N rows (the ``ragged="list"`` format): ``values[cu_seqlens[i]:cu_seqlens[i +
        1]]`` for each ``i``, views of :attr:`values` of its type (see :func:`row_list`).

        Raises:
            ValueError: ``values`` a 0-d array; ``cu_seqlens`` empty, or an entry below 0,
                below the one before it or above ``len(values)`` (naming the first such entry,
                the expected range and its value).
        """
        return row_list(self.values, self.cu_seqlens)


def row_list(values: Any, cu: np.ndarray) -> list[Any]:
    """``[values[cu[i]:cu[i + 1]] for i in range(N)]`` (``cu`` N + 1 integer offsets, any
    integer dtype): made in C (:data:`rlbuffers.ranges.row_views`, on int64 offsets) where the
    extension is built and ``values`` is a plain ``np.ndarray``, by slicing otherwise (any
    other ``values`` that slices, e.g. a list or an ndarray subclass): the same rows, and the
    same errors, either way.

    Raises:
        ValueError: ``values`` a 0-d array; ``cu`` empty, or an entry below 0, below the one
            before it or above ``len(values)`` (naming the first such entry, the expected
            range and its value).
    """
    cu = np.asarray(cu)
    if ranges.row_views is not None and type(values) is np.ndarray:
        return ranges.row_views(values, np.ascontiguousarray(cu, dtype=np.int64))
    if isinstance(values, np.ndarray) and values.ndim == 0:
        raise ValueError("values: expected an array of at least 1 dimension, got 0")
    check_offsets(cu, len(values))
    b = cu.tolist()
    return [values[x:y] for x, y in zip(b[:-1], b[1:], strict=True)]


def int32_offsets(cu: Any) -> np.ndarray:
    """``cu`` (integer offsets) as an int32 array (``cu`` itself when it is one already); an
    empty sequence gives an empty int32 array (what :meth:`Packed.to_list` then refuses).

    Raises:
        TypeError: ``cu`` holds no integers (e.g. floats or bools).
        ValueError: an entry outside int32's range (the first such entry named).
    """
    arr = np.asarray(cu)
    if arr.size == 0:
        return np.zeros(arr.shape, dtype=np.int32)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"cu_seqlens: expected integer offsets (int32), got dtype {arr.dtype}")
    if arr.dtype == np.int32:
        return arr
    low, high = np.iinfo(np.int32).min, MAX_PACKED_VALUES
    bad = np.flatnonzero((arr.ravel() > high) | (arr.ravel() < low))
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"cu_seqlens[{i}]: expected an int32 offset (at most "
                         f"{MAX_PACKED_VALUES:,} values in one Packed), got "
                         f"{arr.ravel()[i].item():,}")
    return arr.astype(np.int32)


def check_offsets(cu: np.ndarray, rows: int) -> None:
    """Check ``cu`` (N + 1 row offsets into ``rows`` rows, integers) as
    :data:`rlbuffers.ranges.row_views` does: at least one value, each in ``[the one before (0
    for the first), rows]``.

    Raises:
        ValueError: naming the first entry that is not, the expected range and its value.
    """
    if len(cu) == 0:
        raise ValueError("cu_seqlens: expected at least 1 value, got 0")
    bad = np.flatnonzero((cu[1:] < cu[:-1]) | (cu[1:] > rows))
    i = 0 if not 0 <= cu[0] <= rows else (int(bad[0]) + 1 if len(bad) else None)
    if i is not None:
        before = cu[i - 1].item() if i else 0
        raise ValueError(f"cu_seqlens[{i}]: expected a value in [{before}, {rows}] "
                         f"(non-decreasing, at most len(values)), got {cu[i].item()}")


def row_index(i: int, n: int) -> int:
    """Row ``i`` of ``n`` as an index in ``[0, n)`` (negative ``i`` counts from the end).

    Raises:
        IndexError: ``i`` outside ``[-n, n)``.
    """
    if not -n <= i < n:
        raise IndexError(f"row: expected an index in [{-n}, {n}), got {i}")
    return i % n


def row_offsets(lengths: np.ndarray) -> np.ndarray:
    """int64[N + 1]: 0, then the running sum of ``lengths`` (int[N])."""
    cu = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    return cu


def packed_offsets(lengths: np.ndarray, field: str) -> np.ndarray:
    """:func:`row_offsets` (int64) of the rows of a :class:`Packed` of ragged field ``field``,
    checked before any value is gathered to fit its int32 ``cu_seqlens``.

    Raises:
        ValueError: the rows hold more than :data:`MAX_PACKED_VALUES` values (the field, the
            rows and the values named).
    """
    cu = row_offsets(lengths)
    if cu[-1] > MAX_PACKED_VALUES:
        raise ValueError(
            f"field {field!r}: the {len(lengths):,} rows hold {int(cu[-1]):,} values, more than "
            f"ragged='packed' addresses with int32 cu_seqlens ({MAX_PACKED_VALUES:,}); sample "
            "fewer rows, or use ragged='list' or 'padded'")
    return cu


def concat_rows(rows: list[np.ndarray], dtype: np.dtype, row_shape: tuple[int, ...]
                ) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` (N arrays ``[len_i, *row_shape]``) end to end in one new array, and their
    offsets (int64[N + 1], :func:`row_offsets`): a decoded chunk, whatever its size."""
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    values = (np.concatenate(rows) if rows else np.empty((0, *row_shape), dtype=dtype))
    return (np.ascontiguousarray(values, dtype=dtype).reshape(-1, *row_shape),
            row_offsets(lengths))


def check_ragged_format(ragged: object) -> str:
    """``ragged`` if it is one of :data:`RAGGED_FORMATS`.

    Raises:
        ValueError: any other value (naming ``ragged``, the expected and the actual value).
    """
    if not isinstance(ragged, str) or ragged not in RAGGED_FORMATS:
        raise ValueError(f"ragged: expected one of {RAGGED_FORMATS}, got {ragged!r}")
    return ragged
