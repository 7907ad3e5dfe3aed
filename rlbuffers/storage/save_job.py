"""One save in flight: the chunks it must write and the copy-on-write snapshots that keep it
consistent while ``add``/``extend``/``update_priorities`` go on (background saves).

The job is frozen at the moment ``save`` is called: the manifest fields (cursor, size, RNG
state, ...) are captured then, and every chunk it has not yet read is protected: before the
caller overwrites such a chunk, :meth:`SaveJob.protect` copies its current contents aside, and
the save encodes that copy instead of the live chunk. Extra memory is the chunks overwritten
while the save runs (usually the one or two at the ring cursor), never the buffer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlbuffers.storage.layout import ChunkLayout

#: Raw bytes of consecutive chunks read and handed to Zarr in one write during a save: Zarr
#: encodes them concurrently, and this bounds the extra memory of a save (a run and its
#: encoded chunks).
SAVE_RUN_BYTES = 32 * 2**20

#: Reads the rows of stored chunks ``[first, first + count)`` of column ``name`` from the
#: working tier: ``[n, *shape]`` (fixed) or a list of n arrays (ragged).
ReadStored = Callable[[str, int, int], Any]


@dataclass
class SaveJob:
    """What one save writes.

    Attributes:
        commit: the commit number it writes.
        todo: column -> sorted stored-chunk indices to write.
        manifest: what it commits (a manifest, less ``committed_at``), frozen at the call.
        lock: the lock writers hold while they write the working tier.
        layout: base and stored chunk sizes.
    """

    commit: int
    todo: dict[str, list[int]]
    manifest: Any
    lock: threading.Lock
    layout: ChunkLayout
    pending: set[tuple[str, int]] = field(default_factory=set)
    snapshots: dict[tuple[str, int], Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.pending = {(n, c) for n, cs in self.todo.items() for c in cs}

    def base_chunks(self, name: str, stored: Iterable[int]) -> set[int]:
        """The base chunks that stored chunks ``stored`` of ``name`` hold."""
        return self.layout.base_of(name, stored)

    def protect(self, names: Iterable[str], chunks: Iterable[int], read: ReadStored) -> None:
        """Copy aside the stored chunks holding base chunks ``chunks``, about to be
        overwritten, that the save has not read yet. Call with ``lock`` held, before writing."""
        chunks = list(chunks)
        for name in names:
            for c in self.layout.stored_of(name, chunks):
                key = (name, c)
                if key in self.pending and key not in self.snapshots:
                    self.snapshots[key] = read(name, c, 1)

    def runs(self, name: str, max_chunks: int) -> Iterator[tuple[int, int]]:
        """``(first chunk, count)`` for the runs of consecutive chunks of column ``name`` that
        this save writes, in order, each of at most ``max_chunks`` chunks."""
        todo = self.todo[name]
        i = 0
        while i < len(todo):
            n = 1
            while n < max_chunks and i + n < len(todo) and todo[i + n] == todo[i] + n:
                n += 1
            yield todo[i], n
            i += n

    def take(self, name: str, first: int, count: int, read: ReadStored) -> Any:
        """The rows of chunks ``[first, first + count)`` as of the snapshot (takes ``lock``):
        one read of the whole range, with the chunks copied aside by :meth:`protect` laid
        over it."""
        with self.lock:
            rows = read(name, first, count)
            for c in range(first, first + count):
                self.pending.discard((name, c))
                snap = self.snapshots.pop((name, c), None)
                if snap is not None:
                    a = (c - first) * self.layout.stored_chunk_rows[name]
                    rows[a : a + len(snap)] = snap
            return rows

    def abandon(self) -> None:
        """Forget pending reads and snapshots (after a failure)."""
        with self.lock:
            self.pending.clear()
            self.snapshots.clear()


def rows_nbytes(rows: Any) -> int:
    """Raw bytes of a chunk's rows: ``[n, *shape]`` array or list of arrays (ragged)."""
    return int(rows.nbytes) if isinstance(rows, np.ndarray) else sum(int(r.nbytes) for r in rows)
