"""Packed ragged rows: the values of N variable-length rows end to end plus their offsets, the
layout of FlashAttention's varlen API (``cu_seqlens``; Dao, "FlashAttention-2", 2023, and
``flash_attn_varlen_func``) and of sequence packing in LLM trainers.

``ReplayBuffer.sample(B, ragged="packed")`` returns a ragged field as a :class:`Packed`
instead of a list of B arrays: two arrays, no Python object per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rlbuffers import ranges

#: The values ``ragged=`` takes: a list of arrays (one per row), one :class:`Packed`, or one
#: :class:`~rlbuffers.padded.Padded`.
RAGGED_FORMATS = ("list", "packed", "padded")


@dataclass(frozen=True, eq=False)
class Packed:
    """N ragged rows packed end to end.

    Attributes:
        values: ``[sum_len, *row_shape]`` in the field's dtype: row ``i`` is
            ``values[cu_seqlens[i]:cu_seqlens[i + 1]]`` (e.g. int32[sum_len] token ids for a
            ``FieldSpec((None,), "int32")`` field, float32[sum_len, 3] for ``(None, 3)``).
        cu_seqlens: int64[N + 1], ``cu_seqlens[0] == 0``, non-decreasing,
            ``cu_seqlens[-1] == len(values)`` (cast to int32 for ``flash_attn_varlen_func``).
    """

    values: np.ndarray
    cu_seqlens: np.ndarray

    def __len__(self) -> int:
        """N, the number of rows."""
        return len(self.cu_seqlens) - 1

    @property
    def seqlens(self) -> np.ndarray:
        """int64[N]: the length of each row."""
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
        1]]`` for each ``i``, views of :attr:`values` of its type. Made in C
        (:data:`rlbuffers.ranges.row_views`) where the extension is built and ``values`` is a
        plain ``np.ndarray`` (``cu_seqlens`` int64), by slicing otherwise (any other
        ``values`` that slices, e.g. a list or an ndarray subclass): the same rows, and the
        same errors, either way.

        Raises:
            ValueError: ``values`` a 0-d array; ``cu_seqlens`` empty, or an entry below 0,
                below the one before it or above ``len(values)`` (naming the first such entry,
                the expected range and its value).
        """
        values, cu = self.values, np.asarray(self.cu_seqlens)
        if (ranges.row_views is not None and type(values) is np.ndarray
                and cu.dtype == np.int64 and cu.flags.c_contiguous):
            return ranges.row_views(values, cu)
        if isinstance(values, np.ndarray) and values.ndim == 0:
            raise ValueError("values: expected an array of at least 1 dimension, got 0")
        check_offsets(cu, len(values))
        b = cu.tolist()
        return [values[x:y] for x, y in zip(b[:-1], b[1:], strict=True)]


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


def packed_from_bytes(blob: bytes | bytearray, lengths: np.ndarray, dtype: np.dtype,
                      row_shape: tuple[int, ...]) -> Packed:
    """The rows whose values are ``blob`` end to end (no copy: ``values`` views ``blob``) and
    whose lengths are ``lengths`` (int64[N], rows along the ragged axis)."""
    return Packed(np.frombuffer(blob, dtype=dtype).reshape(-1, *row_shape), cu_seqlens(lengths))


def cu_seqlens(lengths: np.ndarray) -> np.ndarray:
    """int64[N + 1]: 0, then the running sum of ``lengths`` (int[N])."""
    cu = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    return cu


def pack_rows(rows: list[np.ndarray], dtype: np.dtype, row_shape: tuple[int, ...]) -> Packed:
    """``rows`` (N arrays ``[len_i, *row_shape]``) packed into one new :class:`Packed`."""
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    values = (np.concatenate(rows) if rows else np.empty((0, *row_shape), dtype=dtype))
    return Packed(np.ascontiguousarray(values, dtype=dtype).reshape(-1, *row_shape),
                  cu_seqlens(lengths))


def check_ragged_format(ragged: object) -> str:
    """``ragged`` if it is one of :data:`RAGGED_FORMATS`.

    Raises:
        ValueError: any other value (naming ``ragged``, the expected and the actual value).
    """
    if not isinstance(ragged, str) or ragged not in RAGGED_FORMATS:
        raise ValueError(f"ragged: expected one of {RAGGED_FORMATS}, got {ragged!r}")
    return ragged
