"""Reads for buffers opened with ``mode="r"``: rows are gathered from the persistent tier
through an LRU cache of decoded chunks whose capacity is in bytes
(:class:`~rlbuffers.cache.ByteLRUCache`), so a reader never touches the writer's working tier
and its memory stays bounded."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from rlbuffers.cache import ENTRY_OVERHEAD_BYTES, ByteLRUCache
from rlbuffers.packed import Packed, concat_rows, packed_offsets
from rlbuffers.padded import Padded, padded_from_pieces
from rlbuffers.storage.persistent import PersistentTier


class RaggedChunk(NamedTuple):
    """A decoded chunk of a ragged field: its rows end to end and their int64 offsets (row
    ``i`` is ``values[offsets[i]:offsets[i + 1]]``; int64, so a chunk of any size)."""

    values: np.ndarray
    offsets: np.ndarray


def _nbytes(chunk: Any) -> int:
    """Bytes of a decoded chunk: an array, or a :class:`RaggedChunk`."""
    if isinstance(chunk, np.ndarray):
        return int(chunk.nbytes) + ENTRY_OVERHEAD_BYTES
    return int(chunk.values.nbytes + chunk.offsets.nbytes) + ENTRY_OVERHEAD_BYTES


class ChunkReader:
    """Row gathers over a :class:`PersistentTier` with a decoded-chunk cache of ``cache_max_bytes``
    bytes (default 256 MiB)."""

    def __init__(self, tier: PersistentTier, cache_max_bytes: int = 256 * 2**20) -> None:
        self.tier = tier
        self.cache = ByteLRUCache(cache_max_bytes, getsizeof=_nbytes)

    def _chunk(self, name: str, c: int) -> Any:
        """Decoded chunk ``c`` of ``name``: ``[n, *shape]``, or a read-only
        :class:`RaggedChunk` (ragged; rows handed out are views of it, so nobody may write
        into it)."""
        chunk = self.cache.get((name, c))
        if chunk is None:
            chunk = self.tier.read_chunk(name, c)
            spec = self.tier.specs[name]
            if spec.ragged:
                chunk = RaggedChunk(*concat_rows(chunk, spec.dtype, spec.row_shape))
                chunk.values.flags.writeable = False
            self.cache.put((name, c), chunk)
        return chunk

    def gather(self, name: str, slots: np.ndarray) -> Any:
        """Rows at ``slots`` (int64[N]): an array ``[N, *shape]`` or, for ragged fields, a list
        of N read-only arrays ``[len_i, *row]`` (views of the cached decoded chunks: no copy)."""
        spec = self.tier.specs[name]
        if spec.ragged:
            chunk, starts, ends, packed = self._ragged_ranges(name, slots)
            return [packed[c].values[a:b] for c, a, b in zip(
                chunk.tolist(), starts.tolist(), ends.tolist(), strict=True)]
        k = self.tier.layout.stored_chunk_rows[name]
        slots = np.asarray(slots, dtype=np.int64).ravel()
        out = np.empty((len(slots), *spec.row_shape), dtype=spec.dtype)
        for c in np.unique(slots // k):
            sel = slots // k == c
            out[sel] = self._chunk(name, int(c))[slots[sel] % k]
        return out

    def _ragged_ranges(self, name: str, slots: np.ndarray) -> tuple[
            np.ndarray, np.ndarray, np.ndarray, dict[int, RaggedChunk]]:
        """Where the rows of ragged field ``name`` at ``slots`` (int64[N]) lie: their stored
        chunk, first and end row in that chunk's values (int64[N] each), and chunk -> cached
        :class:`RaggedChunk`; computed a chunk at a time, not a row at a time."""
        k = self.tier.layout.stored_chunk_rows[name]
        chunk, local = np.divmod(np.asarray(slots, dtype=np.int64).ravel(), k)
        starts = np.empty(len(chunk), dtype=np.int64)
        ends = np.empty(len(chunk), dtype=np.int64)
        packed: dict[int, RaggedChunk] = {}
        for c in np.unique(chunk).tolist():
            p = packed[c] = self._chunk(name, c)
            sel = chunk == c
            starts[sel] = p.offsets[local[sel]]
            ends[sel] = p.offsets[local[sel] + 1]
        return chunk, starts, ends, packed

    def _pieces(self, name: str, slots: np.ndarray) -> tuple[list[memoryview], np.ndarray]:
        """The bytes of the rows of ragged field ``name`` at ``slots`` (int64[N]): N
        memoryviews of the cached decoded chunks (no copy, no numpy call per row) and their
        lengths (int64[N], rows along the ragged axis)."""
        row_bytes = self.tier.specs[name].item_bytes
        chunk, starts, ends, packed = self._ragged_ranges(name, slots)
        sources = {c: memoryview(p.values.reshape(-1).view(np.uint8)) for c, p in packed.items()}
        return [sources[c][a:b] for c, a, b in zip(
            chunk.tolist(), (starts * row_bytes).tolist(), (ends * row_bytes).tolist(),
            strict=True)], ends - starts

    def gather_packed(self, name: str, slots: np.ndarray) -> Packed:
        """Rows of ragged field ``name`` at ``slots`` (int64[N]) packed into new arrays
        (``values [sum_len, *row]``, ``cu_seqlens`` int32[N + 1]): the rows' byte ranges in
        the cached decoded chunks joined by one ``bytearray.join``, no numpy call per row.

        Raises:
            ValueError: the rows hold more values than int32 ``cu_seqlens`` address (the field
                named; see :func:`~rlbuffers.packed.packed_offsets`).
        """
        spec = self.tier.specs[name]
        pieces, lengths = self._pieces(name, slots)
        cu = packed_offsets(lengths, name)  # checked before the join
        values = np.frombuffer(bytearray().join(pieces), dtype=spec.dtype)
        return Packed(values.reshape(-1, *spec.row_shape), cu)

    def gather_padded(self, name: str, slots: np.ndarray) -> Padded:
        """Rows of ragged field ``name`` at ``slots`` (int64[N]) padded into a new array
        (``values [N, L, *row]``, zeros after each row, ``L`` the longest; ``lengths``
        int64[N]): the rows' byte ranges and their pads joined by one ``bytearray.join``."""
        spec = self.tier.specs[name]
        pieces, lengths = self._pieces(name, slots)
        return padded_from_pieces(pieces, lengths, spec.dtype, spec.row_shape)
