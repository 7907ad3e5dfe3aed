import json

import numpy as np
import pytest

from rlbuffers.cache import ENTRY_OVERHEAD_BYTES, ByteLRUCache


def arr(n: int) -> np.ndarray:
    return np.zeros(n, dtype=np.int32)  # n * 4 bytes


def test_capacity_in_bytes_evicts_least_recently_used():
    entry = 100 * 4 + ENTRY_OVERHEAD_BYTES
    cache = ByteLRUCache(3 * entry)
    for k in "abc":
        cache.put(k, arr(100))
    assert cache.current_bytes == 3 * entry
    assert cache.get("a") is not None  # a is now most recent; b is least recent
    cache.put("d", arr(100))
    assert cache.get("b") is None
    assert cache.get("a") is not None and cache.get("c") is not None
    assert cache.stats() == {"hits": 3, "misses": 1, "evictions": 1, "rejected": 0,
                             "entries": 3, "current_bytes": 3 * entry, "max_bytes": 3 * entry}


def test_large_value_evicts_several_and_oversized_value_is_rejected():
    entry = 10 * 4 + ENTRY_OVERHEAD_BYTES
    cache = ByteLRUCache(4 * entry)
    for k in range(4):
        cache.put(k, arr(10))
    cache.put("big", arr(10 + 2 * entry // 4))  # needs the room of three small entries
    assert cache.evictions == 3 and len(cache) == 2
    cache.put("huge", arr(4 * entry))
    assert cache.rejected == 1 and cache.get("huge") is None


def test_zero_capacity_never_stores():
    cache = ByteLRUCache(0)
    cache.put("a", arr(1))
    assert cache.get("a") is None and len(cache) == 0
    assert cache.stats()["misses"] == 1 and cache.stats()["rejected"] == 1


def test_state_round_trips_through_json_and_checks_capacity():
    cache = ByteLRUCache(10_000)
    cache.put("a", arr(10))
    cache.get("a")
    cache.get("b")
    state = json.loads(json.dumps(cache.state_dict()))
    other = ByteLRUCache(10_000)
    other.load_state_dict(state)
    assert other.state_dict() == {"max_bytes": 10_000, "hits": 1, "misses": 1, "evictions": 0,
                                  "rejected": 0}
    with pytest.raises(ValueError, match="max_bytes"):
        ByteLRUCache(5).load_state_dict(state)
    with pytest.raises(ValueError, match="max_bytes"):
        ByteLRUCache(-1)
