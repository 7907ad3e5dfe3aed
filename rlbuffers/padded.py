"""Padded ragged rows: N variable-length rows in one ``[N, L, *row_shape]`` array, each row
followed by zeros up to ``L``, the longest row of the batch, plus the length of each row: the
layout of a padded token batch (``input_ids`` with an attention mask) and of what cpprb,
Stable-Baselines3 and TorchRL store for ragged data.

``ReplayBuffer.sample(B, ragged="padded")`` returns a ragged field as a :class:`Padded`. The
pad value is always 0 (``False`` for bool fields): ``sample`` has no pad argument; use
:attr:`Padded.mask` or :attr:`Padded.lengths` to tell padding from values that are 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from rlbuffers.packed import row_index


@dataclass(frozen=True, eq=False)
class Padded:
    """N ragged rows, each padded with zeros to the longest.

    Attributes:
        values: ``[N, L, *row_shape]`` in the field's dtype, ``L = max(lengths)`` (0 when
            every row is empty): row ``i`` is ``values[i, :lengths[i]]``, the rest of
            ``values[i]`` is 0 (e.g. int32[N, L] token ids for a ``FieldSpec((None,),
            "int32")`` field, float32[N, L, 3] for ``(None, 3)``).
        lengths: int64[N], the length of each row along the ragged axis.
    """

    values: np.ndarray
    lengths: np.ndarray

    def __len__(self) -> int:
        """N, the number of rows."""
        return len(self.lengths)

    @property
    def mask(self) -> np.ndarray:
        """bool[N, L]: True at the row's values, False at the padding (a new array)."""
        return np.arange(self.values.shape[1]) < self.lengths[:, None]

    def __getitem__(self, i: int) -> np.ndarray:
        """Row ``i`` (``-N <= i < N``): a view ``[len_i, *row_shape]`` of :attr:`values`.

        Raises:
            IndexError: ``i`` outside ``[-N, N)``.
        """
        i = row_index(i, len(self))
        return self.values[i, :int(self.lengths[i])]

    def to_list(self) -> list[np.ndarray]:
        """The N rows as a list of views of :attr:`values` (the ``ragged="list"`` format)."""
        return [self.values[i, :k] for i, k in enumerate(self.lengths.tolist())]


def padded_from_pieces(pieces: list, lengths: np.ndarray, dtype: np.dtype,
                       row_shape: tuple[int, ...]) -> Padded:
    """The rows whose bytes are ``pieces`` (N buffers, row ``i`` holding ``lengths[i]`` rows of
    ``row_shape`` in ``dtype``), padded with zero bytes to the longest: one ``bytearray.join``
    of the rows and their pads (one new buffer, written once; ``values`` views it)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    longest = int(lengths.max()) if len(lengths) else 0
    row_bytes = np.dtype(dtype).itemsize * math.prod(row_shape)
    zeros = memoryview(bytes(longest * row_bytes))
    parts: list = [None] * (2 * len(pieces))
    parts[0::2] = pieces
    parts[1::2] = [zeros[:k] for k in ((longest - lengths) * row_bytes).tolist()]
    values = np.frombuffer(bytearray().join(parts), dtype=dtype)
    return Padded(values.reshape(len(lengths), longest, *row_shape), lengths)
