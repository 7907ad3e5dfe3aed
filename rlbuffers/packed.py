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
        """The N rows as a list of views of :attr:`values` (the ``ragged="list"`` format), made
        in C (:data:`rlbuffers.ranges.row_views`) where the extension is built."""
        cu = self.cu_seqlens
        if ranges.row_views is not None and cu.dtype == np.int64 and cu.flags.c_contiguous:
            return ranges.row_views(self.values, cu)
        b = self.cu_seqlens.tolist()
        return [self.values[x:y] for x, y in zip(b[:-1], b[1:], strict=True)]


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
