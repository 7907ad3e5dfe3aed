"""Reads for buffers opened with ``mode="r"``: rows are gathered from the persistent tier
through an LRU cache of decoded chunks whose capacity is in bytes
(:class:`~rlbuffers.cache.ByteLRUCache`), so a reader never touches the writer's working tier
and its memory stays bounded."""

from __future__ import annotations

from typing import Any

import numpy as np

from rlbuffers.cache import ENTRY_OVERHEAD_BYTES, ByteLRUCache
from rlbuffers.storage.persistent import PersistentTier


def _nbytes(chunk: Any) -> int:
    """Bytes of a decoded chunk: an array, or a list of arrays (ragged)."""
    if isinstance(chunk, np.ndarray):
        return int(chunk.nbytes) + ENTRY_OVERHEAD_BYTES
    return sum(int(a.nbytes) + 64 for a in chunk) + ENTRY_OVERHEAD_BYTES


class ChunkReader:
    """Row gathers over a :class:`PersistentTier` with a decoded-chunk cache of ``cache_max_bytes``
    bytes (default 256 MiB)."""

    def __init__(self, tier: PersistentTier, cache_max_bytes: int = 256 * 2**20) -> None:
        self.tier = tier
        self.cache = ByteLRUCache(cache_max_bytes, getsizeof=_nbytes)

    def _chunk(self, name: str, c: int) -> Any:
        chunk = self.cache.get((name, c))
        if chunk is None:
            chunk = self.tier.read_chunk(name, c)
            self.cache.put((name, c), chunk)
        return chunk

    def gather(self, name: str, slots: np.ndarray) -> Any:
        """Rows at ``slots`` (int64[N]): an array ``[N, *shape]`` or, for ragged fields, a list."""
        k = self.tier.layout.stored_chunk_rows[name]
        spec = self.tier.specs[name]
        slots = np.asarray(slots, dtype=np.int64).ravel()
        if spec.ragged:
            return [self._chunk(name, int(s) // k)[int(s) % k] for s in slots]
        out = np.empty((len(slots), *spec.row_shape), dtype=spec.dtype)
        for c in np.unique(slots // k):
            sel = slots // k == c
            out[sel] = self._chunk(name, int(c))[slots[sel] % k]
        return out
