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

#: Raw bytes of consecutive chunks handed to Zarr in one write during a save: Zarr encodes
#: them concurrently, and this bounds the extra memory of a save (a run, its concatenation
#: and its encoded chunks).
SAVE_RUN_BYTES = 32 * 2**20

#: Reads the rows of chunk ``c`` of column ``name`` from the working tier.
ChunkReader = Callable[[str, int], Any]


@dataclass
class SaveJob:
    """What one save writes. ``todo``: column -> chunk indices; ``state``: manifest fields."""

    generation: int
    todo: dict[str, list[int]]
    state: dict[str, Any]
    lock: threading.Lock
    pending: set[tuple[str, int]] = field(default_factory=set)
    snapshots: dict[tuple[str, int], Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.pending = {(n, c) for n, cs in self.todo.items() for c in cs}

    def protect(self, names: Iterable[str], chunks: Iterable[int], read: ChunkReader) -> None:
        """Copy aside the chunks about to be overwritten that the save has not read yet.
        Call with ``lock`` held, before writing."""
        for name in names:
            for c in chunks:
                key = (name, c)
                if key in self.pending and key not in self.snapshots:
                    self.snapshots[key] = read(name, c)

    def take(self, name: str, c: int, read: ChunkReader) -> Any:
        """The rows of chunk ``c`` as of the snapshot (takes ``lock``)."""
        with self.lock:
            self.pending.discard((name, c))
            snap = self.snapshots.pop((name, c), None)
            return read(name, c) if snap is None else snap

    def runs(self, name: str, read: ChunkReader) -> Iterator[tuple[int, list[Any]]]:
        """Take the chunks of column ``name`` one by one (as :meth:`take`) and yield
        ``(first chunk, [rows of each chunk])`` for runs of consecutive chunks of at most
        ~``SAVE_RUN_BYTES`` raw bytes."""
        run: list[Any] = []
        first = size = 0
        for c in self.todo[name]:
            if run and (c != first + len(run) or size >= SAVE_RUN_BYTES):
                yield first, run
                run, size = [], 0
            if not run:
                first = c
            run.append(self.take(name, c, read))
            size += rows_nbytes(run[-1])
        if run:
            yield first, run

    def abandon(self) -> None:
        """Forget pending reads and snapshots (after a failure)."""
        with self.lock:
            self.pending.clear()
            self.snapshots.clear()


def rows_nbytes(rows: Any) -> int:
    """Raw bytes of a chunk's rows: ``[n, *shape]`` array or list of arrays (ragged)."""
    return int(rows.nbytes) if isinstance(rows, np.ndarray) else sum(int(r.nbytes) for r in rows)


def concat_rows(run: list[Any]) -> Any:
    """Rows of a run of chunks as one ``[n, *shape]`` array (or one list, ragged)."""
    if len(run) == 1:
        return run[0]
    if isinstance(run[0], list):
        return [row for rows in run for row in rows]
    return np.concatenate(run)
