"""An LRU cache whose capacity is a number of bytes, with hit / miss / eviction counters.

Built on :class:`cachetools.LRUCache` with a ``getsizeof`` function, so the bound is on the
summed size of the cached values (plus a fixed per-entry overhead), not on the entry count.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable
from typing import Any

import cachetools
import numpy as np

#: Bytes charged per entry on top of the value: key object, dict and order-list slots.
ENTRY_OVERHEAD_BYTES = 160


def nbytes_of(value: Any) -> int:
    """Bytes held by ``value``: ``.nbytes`` for numpy arrays, ``sys.getsizeof`` otherwise."""
    if isinstance(value, np.ndarray):
        return int(value.nbytes) + ENTRY_OVERHEAD_BYTES
    return sys.getsizeof(value) + ENTRY_OVERHEAD_BYTES


class _CountingLRU(cachetools.LRUCache):
    """cachetools LRU that counts evictions (every ``popitem`` called by ``__setitem__``)."""

    def __init__(self, maxsize: int, getsizeof: Callable[[Any], int]) -> None:
        super().__init__(maxsize=maxsize, getsizeof=getsizeof)
        self.evictions = 0

    def popitem(self) -> tuple[Any, Any]:
        self.evictions += 1
        return super().popitem()


class ByteLRUCache:
    """Least-recently-used cache bounded by ``max_bytes`` (value bytes + per-entry overhead).

    Args:
        max_bytes: capacity in bytes; ``0`` disables caching (every lookup is a miss).
        getsizeof: size of one value in bytes; default :func:`nbytes_of`.

    Raises:
        ValueError: ``max_bytes`` is negative.

    Values larger than ``max_bytes`` are not stored (counted in ``rejected``).
    """

    def __init__(self, max_bytes: int, *, getsizeof: Callable[[Any], int] = nbytes_of) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes: expected >= 0, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self._cache = _CountingLRU(max(self.max_bytes, 1), getsizeof)
        self._getsizeof = getsizeof
        self.hits = 0
        self.misses = 0
        self.rejected = 0

    def get(self, key: Hashable) -> Any | None:
        """The cached value for ``key`` (and mark it recently used), or ``None``."""
        value = self._cache.get(key) if self.max_bytes else None
        if value is None:
            self.misses += 1
        else:
            self.hits += 1
        return value

    def put(self, key: Hashable, value: Any) -> None:
        """Store ``value``, evicting least recently used entries to stay within ``max_bytes``."""
        if not self.max_bytes or self._getsizeof(value) > self.max_bytes:
            self.rejected += 1
            return
        self._cache[key] = value

    @property
    def evictions(self) -> int:
        """Entries removed to make room, since creation."""
        return self._cache.evictions

    @property
    def current_bytes(self) -> int:
        """Bytes currently charged against ``max_bytes``."""
        return int(self._cache.currsize) if self.max_bytes else 0

    def __len__(self) -> int:
        return len(self._cache) if self.max_bytes else 0

    def stats(self) -> dict[str, int]:
        """Counters: ``hits``, ``misses``, ``evictions``, ``rejected``, ``entries``,
        ``current_bytes``, ``max_bytes``."""
        return {
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "rejected": self.rejected,
            "entries": len(self),
            "current_bytes": self.current_bytes,
            "max_bytes": self.max_bytes,
        }

    def clear(self) -> None:
        """Drop every entry (counters are kept)."""
        self._cache.clear()

    def state_dict(self) -> dict[str, int]:
        """Plain-data state: capacity and counters. Entries are not saved (a cache only
        changes speed, never results), so a restored cache starts empty."""
        return {
            "max_bytes": self.max_bytes,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "rejected": self.rejected,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore counters from :meth:`state_dict`.

        Raises:
            ValueError: ``state['max_bytes']`` differs from this cache's capacity.
        """
        if int(state["max_bytes"]) != self.max_bytes:
            raise ValueError(
                f"cache state 'max_bytes': expected {self.max_bytes}, got {state['max_bytes']}"
            )
        self.clear()
        self.hits = int(state["hits"])
        self.misses = int(state["misses"])
        self._cache.evictions = int(state["evictions"])
        self.rejected = int(state["rejected"])
