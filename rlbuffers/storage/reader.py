"""Reads for buffers opened with ``mode="r"``: rows are gathered from the persistent tier
through an LRU cache of decoded chunks whose capacity is in bytes, so a reader never touches
the writer's working tier and its memory stays bounded."""

from __future__ import annotations

from typing import Any

import numpy as np
from cachetools import LRUCache

from rlbuffers.storage.persistent import PersistentTier


def _nbytes(chunk: Any) -> int:
    if isinstance(chunk, np.ndarray):
        return int(chunk.nbytes)
    return sum(int(a.nbytes) for a in chunk) + 64 * len(chunk)


class ChunkReader:
    """Row gathers over a :class:`PersistentTier` with a decoded-chunk cache of
    ``cache_max_bytes`` bytes (default 256 MiB)."""

    def __init__(self, tier: PersistentTier, cache_max_bytes: int = 256 * 2**20) -> None:
        self.tier = tier
        self.cache: LRUCache[tuple[str, int], Any] = LRUCache(cache_max_bytes, getsizeof=_nbytes)

    def _chunk(self, name: str, c: int) -> Any:
        key = (name, c)
        chunk = self.cache.get(key)
        if chunk is None:
            chunk = self.tier.read_chunk(name, c)
            if _nbytes(chunk) <= self.cache.maxsize:
                self.cache[key] = chunk
        return chunk

    def gather(self, name: str, slots: np.ndarray) -> Any:
        """Rows at ``slots`` (int64[N]): an array ``[N, *shape]`` or, for ragged fields, a list."""
        k = self.tier.chunks[name]
        spec = self.tier.specs[name]
        slots = np.asarray(slots, dtype=np.int64).ravel()
        if spec.ragged:
            return [self._chunk(name, int(s) // k)[int(s) % k] for s in slots]
        out = np.empty((len(slots), *spec.row_shape), dtype=spec.dtype)
        for c in np.unique(slots // k):
            sel = slots // k == c
            out[sel] = self._chunk(name, int(c))[slots[sel] % k]
        return out
