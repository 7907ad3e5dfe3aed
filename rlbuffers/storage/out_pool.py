"""Recycled output arrays for large gathers.

A ``sample(256)`` of 256 KB observations returns a new 64 MB array. glibc serves an
allocation that large with a fresh ``mmap`` (its threshold is at most 32 MB) and returns it
with ``munmap`` when the array is freed, so every call the kernel faults in and zeroes 64 MB
before the gather copies 64 MB into it: about half of the call (issue 33, workload (b)).

:class:`OutputPool` keeps the last few arrays it handed out and hands one out again once
nothing but the pool refers to it (its reference count says so: the caller dropped the batch,
and with it every view, tensor or memoryview of it, since each of those refers to the array).
That is what freeing and allocating again would do, minus the zeroing: no array that anyone
can still reach is ever reused (a weak reference does not count: it sees the array reused,
where without the pool it would see it freed). Two arrays cover the usual loop ``batch =
buf.sample(B)``, where the previous batch is still bound while the next is drawn; they stay
allocated while the caller holds no batch, until :meth:`OutputPool.clear` (the column's
``close``).
"""

from __future__ import annotations

import math
import sys
import threading

import numpy as np

#: Outputs smaller than this come from ``np.empty`` (malloc reuses small blocks itself).
MIN_BYTES = 1 << 20
#: Arrays kept per pool: the batch the caller holds plus the one being filled.
KEPT = 2


def _refcounts_exact() -> bool:
    """Whether ``sys.getrefcount`` counts every reference (CPython with the GIL)."""
    gil = getattr(sys, "_is_gil_enabled", lambda: True)()
    return hasattr(sys, "getrefcount") and gil and sys.implementation.name == "cpython"


def _count(arrays: list[np.ndarray], i: int) -> int:
    """The reference count of ``arrays[i]`` as seen from here (calibrated once per pool on an
    array only a list refers to, so interpreter versions that count stack references
    differently agree with themselves)."""
    return sys.getrefcount(arrays[i])


class OutputPool:
    """Arrays for gathers of at least :data:`MIN_BYTES`, reused once no one else holds them.

    Thread-safe: the check that an array is free and taking it happen under one lock.
    """

    def __init__(self, kept: int = KEPT, min_bytes: int = MIN_BYTES) -> None:
        self.kept, self.min_bytes = kept, min_bytes
        self._arrays: list[np.ndarray] = []
        self._lock = threading.Lock()
        self._enabled = _refcounts_exact()
        #: what :func:`_count` gives for an array only the list refers to
        self._free_count = _count([np.empty(0)], 0)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An uninitialised C-contiguous array ``shape`` of ``dtype``: a kept one that no one
        else refers to any more, or a new one (then kept, the oldest kept one dropped)."""
        dtype = np.dtype(dtype)
        if not self._enabled or math.prod(shape) * dtype.itemsize < self.min_bytes:
            return np.empty(shape, dtype)
        with self._lock:
            arrays = self._arrays
            for i in range(len(arrays)):
                if (_count(arrays, i) == self._free_count and arrays[i].shape == shape
                        and arrays[i].dtype == dtype):
                    out = arrays.pop(i)
                    arrays.append(out)  # most recently handed out last
                    return out
            out = np.empty(shape, dtype)
            arrays.append(out)
            if len(arrays) > self.kept:
                del arrays[0]
            return out

    def clear(self) -> None:
        """Drop the kept arrays (their memory is freed once callers drop theirs)."""
        with self._lock:
            self._arrays.clear()
