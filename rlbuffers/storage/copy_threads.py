"""Copies that several threads make at once: a gather of many bytes is cut into parts, and
the calling thread and copy threads copy them together (``np.take`` and the C range copy of
``rlbuffers/ranges.py`` release the GIL; one core's copy does not use the memory
bandwidth of the machine)."""

from __future__ import annotations

import os
import queue
from concurrent.futures import ThreadPoolExecutor

import numpy as np

#: A gather copies in parallel once it has at least this many bytes per thread (``np.take``
#: releases the GIL): below it, waking a thread costs more than the copy it saves.
COPY_PART_BYTES = 2 << 20
#: At most this many threads copy one gather (the calling thread is one): one copy does not
#: use the memory bandwidth of a core, a few do.
COPY_THREADS = 4
#: The rows of a parallel gather are cut into pieces of about this many bytes, which the
#: threads take off a shared queue until none is left: a thread that starts late copies fewer
#: pieces, and no thread waits long for another.
COPY_PIECE_BYTES = 1 << 19
_POOL: tuple[int, ThreadPoolExecutor] | None = None


def copy_parts(nbytes: int) -> int:
    """Threads that copy a gather of ``nbytes``: one per :data:`COPY_PART_BYTES`, at most
    :data:`COPY_THREADS` and at most the CPUs this process may run on."""
    cpus = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count() or 1)
    return max(1, min(nbytes // COPY_PART_BYTES, COPY_THREADS, cpus))


def copy_pool() -> ThreadPoolExecutor:
    """The copy threads of this process (its own pool, not the readers': a copy never waits
    on a reader, so neither pool can fill up with tasks waiting on the other)."""
    global _POOL
    if _POOL is None or _POOL[0] != os.getpid():
        _POOL = (os.getpid(), ThreadPoolExecutor(COPY_THREADS - 1,
                                                      thread_name_prefix="rlbuffers-copy"))
    return _POOL[1]


def take_rows(rows: np.ndarray, slots: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out[:] = rows[slots]`` (``slots`` int64[N], each in ``[-len(rows), len(rows))``,
    checked by the caller), by :func:`copy_parts` threads at once (the calling thread and
    copy threads), each taking pieces of :data:`COPY_PIECE_BYTES` off a shared queue. A copy
    thread that has not started when the calling thread finds the queue empty is cancelled,
    not waited for. Returns ``out``."""
    threads = copy_parts(out.nbytes)
    if threads == 1:
        # mode="wrap": in-range slots index as numpy indexing does, and the rows go straight
        # into ``out`` (mode="raise" would copy them through a buffer)
        return np.take(rows, slots, axis=0, out=out, mode="wrap")
    pieces = max(threads, min(len(slots), out.nbytes // COPY_PIECE_BYTES))
    cuts = [len(slots) * i // pieces for i in range(pieces + 1)]
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for j in range(pieces):
        todo.put(j)

    def copy() -> None:
        while True:
            try:
                j = todo.get_nowait()
            except queue.Empty:
                return
            a, b = cuts[j], cuts[j + 1]
            np.take(rows, slots[a:b], axis=0, out=out[a:b], mode="wrap")

    helpers = [copy_pool().submit(copy) for _ in range(threads - 1)]
    copy()
    for job in helpers:
        if not job.cancel():  # started: it may still be copying its last piece
            job.result()
    return out
