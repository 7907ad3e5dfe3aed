"""Reads for buffers opened with ``mode="r"``: rows are gathered from the persistent tier
through an LRU cache of decoded chunks whose capacity is in bytes
(:class:`~rlbuffers.cache.ByteLRUCache`), so a reader never touches the writer's working tier
and its memory stays bounded."""

from __future__ import annotations

from typing import Any

import numpy as np

from rlbuffers.cache import ENTRY_OVERHEAD_BYTES, ByteLRUCache
from rlbuffers.packed import Packed, pack_rows, packed_from_bytes
from rlbuffers.storage.persistent import PersistentTier


def _nbytes(chunk: Any) -> int:
    """Bytes of a decoded chunk: an array, or a :class:`Packed` (ragged)."""
    if isinstance(chunk, np.ndarray):
        return int(chunk.nbytes) + ENTRY_OVERHEAD_BYTES
    return int(chunk.values.nbytes + chunk.cu_seqlens.nbytes) + ENTRY_OVERHEAD_BYTES


class ChunkReader:
    """Row gathers over a :class:`PersistentTier` with a decoded-chunk cache of ``cache_max_bytes``
    bytes (default 256 MiB)."""

    def __init__(self, tier: PersistentTier, cache_max_bytes: int = 256 * 2**20) -> None:
        self.tier = tier
        self.cache = ByteLRUCache(cache_max_bytes, getsizeof=_nbytes)

    def _chunk(self, name: str, c: int) -> Any:
        """Decoded chunk ``c`` of ``name``: ``[n, *shape]``, or a :class:`Packed` (ragged)."""
        chunk = self.cache.get((name, c))
        if chunk is None:
            chunk = self.tier.read_chunk(name, c)
            spec = self.tier.specs[name]
            if spec.ragged:
                chunk = pack_rows(chunk, spec.dtype, spec.row_shape)
            self.cache.put((name, c), chunk)
        return chunk

    def gather(self, name: str, slots: np.ndarray) -> Any:
        """Rows at ``slots`` (int64[N]): an array ``[N, *shape]`` or, for ragged fields, a list
        of N arrays ``[len_i, *row]`` (views of one new array: :meth:`gather_packed`)."""
        spec = self.tier.specs[name]
        if spec.ragged:
            return self.gather_packed(name, slots).to_list()
        k = self.tier.layout.stored_chunk_rows[name]
        slots = np.asarray(slots, dtype=np.int64).ravel()
        out = np.empty((len(slots), *spec.row_shape), dtype=spec.dtype)
        for c in np.unique(slots // k):
            sel = slots // k == c
            out[sel] = self._chunk(name, int(c))[slots[sel] % k]
        return out

    def gather_packed(self, name: str, slots: np.ndarray) -> Packed:
        """Rows of ragged field ``name`` at ``slots`` (int64[N]) packed into new arrays
        (``values [sum_len, *row]``, ``cu_seqlens`` int64[N + 1]): the rows' byte ranges in
        the cached decoded chunks joined by one ``bytearray.join``, no numpy call per row."""
        k = self.tier.layout.stored_chunk_rows[name]
        spec = self.tier.specs[name]
        slots = np.asarray(slots, dtype=np.int64).ravel()
        chunk, local = np.divmod(slots, k)
        starts = np.empty(len(slots), dtype=np.int64)
        ends = np.empty(len(slots), dtype=np.int64)
        sources: dict[int, memoryview] = {}
        for c in np.unique(chunk).tolist():
            packed = self._chunk(name, c)
            sel = chunk == c
            starts[sel] = packed.cu_seqlens[local[sel]]
            ends[sel] = packed.cu_seqlens[local[sel] + 1]
            sources[c] = memoryview(packed.values.reshape(-1).view(np.uint8))
        lengths = ends - starts
        row_bytes = spec.item_bytes
        blob = bytearray().join([sources[c][a:b] for c, a, b in zip(
            chunk.tolist(), (starts * row_bytes).tolist(), (ends * row_bytes).tolist(),
            strict=True)])
        return packed_from_bytes(blob, lengths, spec.dtype, spec.row_shape)
