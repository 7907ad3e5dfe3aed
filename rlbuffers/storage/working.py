"""Working tier: uncompressed, fixed-capacity files on local disk that ``add`` writes into and
``sample`` reads from.

Writes go through ``os.pwrite`` and bulk reads for saves through ``os.preadv``, so neither
grows the process RSS; sampling gathers rows through a read-only memory map, so hot pages live
in the OS page cache rather than the Python heap.

Layout of the working directory:

- ``<field>.npy``: a ``.npy`` file of shape ``[capacity, *shape]`` (fixed fields);
- ``<field>.ragged/{start,length}.npy`` (int64[capacity]: byte offset and row count of each
  slot) plus ``c<chunk>.bin`` (the values of the slots of one chunk, appended) for ragged
  fields;
- ``state.json``: the commit generation this tier mirrors and the chunks changed since.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from rlbuffers.spec import FieldSpec
from rlbuffers.storage.manifest import write_json_atomic

STATE = "state.json"


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _pread_into(fd: int, out: np.ndarray, offset: int) -> None:
    view = memoryview(out).cast("B")
    while len(view):
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise OSError(f"short read at offset {offset}")
        view, offset = view[n:], offset + n


class FixedColumn:
    """One fixed-shape field: a ``.npy`` file ``[capacity, *shape]``."""

    def __init__(self, path: Path, spec: FieldSpec, capacity: int, *, create: bool) -> None:
        self.path, self.spec, self.capacity = path, spec, capacity
        shape = (capacity, *spec.shape)
        if create:
            np.lib.format.open_memmap(path, mode="w+", dtype=spec.dtype, shape=shape).flush()
        view = np.lib.format.open_memmap(path, mode="r")
        if view.shape != shape or view.dtype != spec.dtype:
            raise OSError(f"{path}: expected {shape} {spec.dtype}, found {view.shape} {view.dtype}")
        self.view = view
        self.offset = int(view.offset)
        self.fd = os.open(path, os.O_RDWR)

    def write(self, slot: int, rows: np.ndarray) -> None:
        """Write ``rows[n, *shape]`` into slots ``[slot, slot + n)`` (no wrap)."""
        data = np.ascontiguousarray(rows, dtype=self.spec.dtype)
        _pwrite_all(self.fd, memoryview(data).cast("B"), self.offset + slot * self.spec.item_bytes)

    def gather(self, slots: np.ndarray) -> np.ndarray:
        """Rows at ``slots`` (int64[N]) as a new array ``[N, *shape]``."""
        return self.view[slots]

    def read_range(self, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` read with ``preadv`` (bounded RSS: no mapping is touched)."""
        out = np.empty((stop - start, *self.spec.shape), dtype=self.spec.dtype)
        _pread_into(self.fd, out, self.offset + start * self.spec.item_bytes)
        return out

    def reset_chunk(self, chunk: int) -> None:
        """Nothing to do for fixed fields (rows are overwritten in place)."""

    def flush(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        os.close(self.fd)
        self.view = None  # type: ignore[assignment]


class RaggedColumn:
    """One ragged field: per-slot (byte offset, row count) and one append-only values file per
    chunk, compacted whenever a chunk has been completely rewritten."""

    def __init__(
        self, path: Path, spec: FieldSpec, capacity: int, chunk: int, *, create: bool
    ) -> None:
        self.path, self.spec, self.capacity, self.chunk = path, spec, capacity, chunk
        if create:
            path.mkdir(parents=True, exist_ok=True)
            for name in ("start", "length"):
                np.lib.format.open_memmap(
                    path / f"{name}.npy", mode="w+", dtype=np.int64, shape=(capacity,)
                ).flush()
        self.start = np.lib.format.open_memmap(path / "start.npy", mode="r+")
        self.length = np.lib.format.open_memmap(path / "length.npy", mode="r+")
        self._fds: dict[int, int] = {}

    def _fd(self, c: int) -> int:
        fd = self._fds.get(c)
        if fd is None:
            fd = os.open(self.path / f"c{c}.bin", os.O_RDWR | os.O_CREAT, 0o644)
            self._fds[c] = fd
        return fd

    def write(self, slot: int, rows: list[np.ndarray]) -> None:
        """Append ``rows`` (n arrays ``[len_i, *row]``) as slots ``[slot, slot + n)``."""
        i = 0
        while i < len(rows):
            c = (slot + i) // self.chunk
            n = min(len(rows) - i, (c + 1) * self.chunk - (slot + i))
            part = rows[i : i + n]
            fd = self._fd(c)
            end = os.fstat(fd).st_size
            lengths = np.array([len(r) for r in part], dtype=np.int64)
            starts = end + np.concatenate([[0], np.cumsum(lengths[:-1] * self.spec.item_bytes)])
            blob = b"".join(np.ascontiguousarray(r).tobytes() for r in part)
            _pwrite_all(fd, memoryview(blob), end)
            s = slot + i
            self.start[s : s + n] = starts
            self.length[s : s + n] = lengths
            if (s + n) % self.chunk == 0 or s + n == self.capacity:
                self._maybe_compact(c)
            i += n

    def _live_range(self, c: int) -> tuple[int, int]:
        return c * self.chunk, min((c + 1) * self.chunk, self.capacity)

    def _maybe_compact(self, c: int) -> None:
        a, b = self._live_range(c)
        live = int(self.length[a:b].sum()) * self.spec.item_bytes
        if os.fstat(self._fd(c)).st_size > 2 * live + 4096:
            self._rewrite(c, self.read_range(a, b))

    def _rewrite(self, c: int, rows: list[np.ndarray]) -> None:
        a, _ = self._live_range(c)
        self.reset_chunk(c)
        self.write(a, rows)

    def gather(self, slots: np.ndarray) -> list[np.ndarray]:
        """Values of ``slots`` (int64[N]) as a list of N arrays ``[len_i, *row]``."""
        out = []
        for s in np.asarray(slots).ravel():
            n = int(self.length[s])
            arr = np.empty((n, *self.spec.row_shape), dtype=self.spec.dtype)
            if n:
                _pread_into(self._fd(int(s) // self.chunk), arr, int(self.start[s]))
            out.append(arr)
        return out

    def read_range(self, start: int, stop: int) -> list[np.ndarray]:
        """Values of slots ``[start, stop)``."""
        return self.gather(np.arange(start, stop))

    def reset_chunk(self, chunk: int) -> None:
        """Empty the values file of ``chunk`` (before it is rebuilt)."""
        os.ftruncate(self._fd(chunk), 0)
        a, b = self._live_range(chunk)
        self.start[a:b] = 0
        self.length[a:b] = 0

    def flush(self) -> None:
        self.start.flush()
        self.length.flush()
        for fd in self._fds.values():
            os.fsync(fd)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self.start = self.length = None  # type: ignore[assignment]


Column = FixedColumn | RaggedColumn


class WorkingTier:
    """All columns of one buffer plus ``state.json``, which records the commit generation the
    tier mirrors and the chunks changed since (rebuilt from the persistent tier on open)."""

    def __init__(
        self,
        path: Path,
        specs: dict[str, FieldSpec],
        capacity: int,
        chunk: int,
        *,
        create: bool,
        buffer_id: str = "",
    ) -> None:
        self.path = path
        self.buffer_id = buffer_id
        if create:
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
        self.columns: dict[str, Column] = {}
        for name, spec in specs.items():
            if spec.ragged:
                col: Column = RaggedColumn(
                    path / f"{name}.ragged", spec, capacity, chunk, create=create
                )
            else:
                col = FixedColumn(path / f"{name}.npy", spec, capacity, create=create)
            self.columns[name] = col
        self.state: dict[str, Any] = self.read_state() if not create else {}

    def read_state(self) -> dict[str, Any]:
        """``{"buffer_id", "generation", "dirty_chunks"}``, or ``{}`` if missing or unreadable."""
        try:
            with open(self.path / STATE) as f:
                state = json.load(f)
            return state if isinstance(state, dict) else {}
        except (OSError, json.JSONDecodeError):
            return {}

    def write_state(self, generation: int, dirty_chunks: Iterable[int]) -> None:
        """Record (durably, before any data write) which chunks may differ from ``generation``."""
        self.state = {
            "buffer_id": self.buffer_id,
            "generation": generation,
            "dirty_chunks": sorted(set(dirty_chunks)),
        }
        write_json_atomic(self.path / STATE, self.state)

    def mark_dirty(self, generation: int, chunks: Iterable[int]) -> None:
        """Add ``chunks`` to the dirty set in ``state.json`` if they are not there yet."""
        known = set(self.state.get("dirty_chunks", []))
        new = set(chunks) - known
        if new or self.state.get("generation") != generation:
            self.write_state(generation, known | new)

    def flush(self) -> None:
        for col in self.columns.values():
            col.flush()

    def close(self) -> None:
        for col in self.columns.values():
            col.close()
