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
- ``state.json``: the commit this tier mirrors, the chunks changed since, its layout
  (capacity, base chunk rows) and the boot it was written in (a tier from an earlier boot is
  rebuilt, so saves need not fsync it).

Every file here is opened through :mod:`rlbuffers.storage.safe_files` (no symlink followed, no
FIFO waited on, no hard-linked file written in place); a tier with anything else where a file
should be, or a ``state.json`` that does not check (:func:`check_state`), is rebuilt whole
from the persistent tier.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from rlbuffers.errors import UnsafePathError
from rlbuffers.intmath import ceil_div
from rlbuffers.memory.limits import memory_limit_bytes
from rlbuffers.spec import FieldSpec
from rlbuffers.storage.copy_threads import take_rows
from rlbuffers.storage.fileio import pread_into, pwrite_all
from rlbuffers.storage.location import check_inside
from rlbuffers.storage.out_pool import OutputPool
from rlbuffers.storage.ragged_column import RaggedColumn
from rlbuffers.storage.safe_files import (
    create_npy_inside,
    open_file_inside,
    open_inside,
    open_npy_inside,
    remove_inside,
    write_atomic_inside,
)
from rlbuffers.storage.working_state import check_state

log = logging.getLogger(__name__)

STATE = "state.json"


def current_boot_id() -> str:
    """The kernel's id of this boot (Linux), or ``""`` where there is none."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


#: The working tier is a cache of the persistent tier. Within one boot, data written with
#: ``pwrite`` sits in the page cache and survives a killed process, so ``state.json`` may vouch
#: for it without an fsync; a tier last written in another boot (after a power loss or an OS
#: crash the page cache is gone) is not trusted and is rebuilt from the persistent tier.
BOOT_ID = current_boot_id()


#: Rows smaller than this keep the memory map even in ``random_reads`` mode: a syscall per
#: row costs more than the page they share, and small columns stay in page cache anyway.
PREAD_MIN_ROW_BYTES = 4096
#: Threads that read rows in ``random_reads`` mode (``pread`` releases the GIL).
READ_THREADS = 8
_POOL: tuple[int, ThreadPoolExecutor] | None = None


def _read_pool() -> ThreadPoolExecutor:
    """The reader threads of this process (a forked child, e.g. a DataLoader worker, gets its
    own: the parent's threads do not exist there)."""
    global _POOL
    if _POOL is None or _POOL[0] != os.getpid():
        _POOL = (os.getpid(), ThreadPoolExecutor(READ_THREADS, thread_name_prefix="rlbuffers-read"))
    return _POOL[1]


class FixedColumn:
    """One fixed-shape field: a ``.npy`` file ``[capacity, *shape]`` at ``root/rel``.

    Raises (on construction):
        UnsafePathError: the file is a symlink, FIFO, directory or hard link (safe_files).
        OSError, ValueError: it is not a ``.npy`` of the expected shape and dtype.
    """

    def __init__(self, root: Path, rel: str, spec: FieldSpec, capacity: int, *,
                 create: bool) -> None:
        self.root, self.rel = root, rel
        self.path, self.spec, self.capacity = root / rel, spec, capacity
        path = self.path
        shape = (capacity, *spec.row_shape)
        if create:
            create_npy_inside(root, rel, spec.dtype, shape)
        view = open_npy_inside(root, rel, "r")
        if view.shape != shape or view.dtype != spec.dtype:
            raise OSError(f"{path}: expected {shape} {spec.dtype}, found {view.shape} {view.dtype}")
        self.view = view
        self._rows = view.view(np.ndarray)  # the same map, indexed without memmap's overhead
        self.offset = int(view.offset)
        self.fd = open_inside(root, rel, os.O_RDWR)
        self._random_reads = False
        self._writable: np.memmap | None = None  # opened by the first scatter
        self._out = OutputPool()  # large gathers reuse outputs the caller has dropped
        # computed once: gather needs them on every call
        self._row_shape, self._row_bytes = spec.row_shape, spec.item_bytes

    def write(self, slot: int, rows: np.ndarray) -> None:
        """Write ``rows[n, *shape]`` into slots ``[slot, slot + n)`` (no wrap)."""
        data = np.ascontiguousarray(rows, dtype=self.spec.dtype)
        pwrite_all(self.fd, memoryview(data).cast("B"), self.offset + slot * self.spec.item_bytes)

    def gather(self, slots: np.ndarray) -> np.ndarray:
        """Rows at ``slots`` (int64[N], each in ``[-capacity, capacity)``) as an array
        ``[N, *shape]`` that no one else holds: numpy indexing of the memory map, or, with
        :attr:`random_reads`, one ``pread`` per row. A gather of at least
        :data:`~rlbuffers.storage.out_pool.MIN_BYTES` writes into an array of
        :class:`~rlbuffers.storage.out_pool.OutputPool` (one the caller has dropped, so the
        kernel need not zero fresh pages for it) with ``np.take``, in parallel parts when it
        is large (:func:`take_rows`).

        Raises:
            IndexError: a slot outside ``[-capacity, capacity)``.
        """
        if self.random_reads:
            return self._gather_pread(np.asarray(slots, dtype=np.int64))
        if (not isinstance(slots, np.ndarray) or slots.ndim != 1 or slots.dtype.kind != "i"
                or len(slots) * self._row_bytes < self._out.min_bytes):
            return self._rows[slots]  # (np.take would also cast float slots to int)
        lo, hi = int(slots.min()), int(slots.max())
        if lo < -self.capacity or hi >= self.capacity:
            bad = lo if lo < -self.capacity else hi
            raise IndexError(f"{self.path.name}: slot {bad} is outside [-{self.capacity}, "
                             f"{self.capacity})")
        out = self._out.empty((len(slots), *self._row_shape), self.spec.dtype)
        return take_rows(self._rows, slots, out)

    @property
    def random_reads(self) -> bool:
        """Gather with ``pread`` (set when the working tier does not fit in memory): page
        faults on a map read ahead far more than a row, and under memory pressure that
        readahead evicts the rows just read; ``pread`` reads exactly the row, and the reads
        run in parallel threads so the disk sees several requests at once."""
        return self._random_reads

    @random_reads.setter
    def random_reads(self, on: bool) -> None:
        self._random_reads = bool(on) and self.spec.item_bytes >= PREAD_MIN_ROW_BYTES

    def _gather_pread(self, slots: np.ndarray) -> np.ndarray:
        out = self._out.empty((len(slots), *self.spec.row_shape), self.spec.dtype)
        rows = out.reshape(len(slots), -1).view(np.uint8)
        order = np.argsort(slots, kind="stable")  # ascending offsets: friendlier to the disk
        offsets = (self.offset + slots[order] * self.spec.item_bytes).tolist()
        jobs = list(zip(order.tolist(), offsets, strict=True))

        def read(part: list[tuple[int, int]]) -> None:
            for j, off in part:
                pread_into(self.fd, rows[j], off)

        step = ceil_div(len(jobs), READ_THREADS)
        for _ in _read_pool().map(read, [jobs[i : i + step] for i in range(0, len(jobs), step)]):
            pass
        return out

    def scatter(self, slots: np.ndarray, rows: np.ndarray) -> None:
        """Write ``rows[N, *shape]`` into ``slots`` (int64[N], no duplicates) through a
        writable map: one numpy assignment instead of a syscall per row (priority updates)."""
        if self._writable is None:
            self._writable = open_npy_inside(self.root, self.rel, "r+")
        self._writable[slots] = rows

    def read_range(self, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` read with ``preadv`` (bounded RSS: no mapping is touched)."""
        out = np.empty((stop - start, *self.spec.row_shape), dtype=self.spec.dtype)
        pread_into(self.fd, out, self.offset + start * self.spec.item_bytes)
        return out

    def inodes(self) -> list[tuple[str, int | None, int, int]]:
        """``[(path relative to the tier, None, inode, ctime ns)]`` of the column's file."""
        if self.fd < 0:
            return []
        st = os.fstat(self.fd)
        return [(self.rel, None, st.st_ino, st.st_ctime_ns)]

    def reset_chunk(self, c: int) -> None:
        """Nothing to do for fixed fields (rows are overwritten in place)."""

    def flush(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        os.close(self.fd)
        self.fd = -1
        self._out.clear()
        self.view = self._rows = self._writable = None  # type: ignore[assignment]


Column = FixedColumn | RaggedColumn


#: A working tier larger than this share of the memory the process may use (RAM or cgroup
#: limit) does not fit in page cache: its large rows are then gathered with ``pread``.
RANDOM_READS_FRACTION = 0.5


class WorkingTier:
    """All columns of one buffer plus ``state.json``, which records the commit the
    tier mirrors and the chunks changed since (rebuilt from the persistent tier on open)."""

    def __init__(
        self,
        path: Path,
        specs: dict[str, FieldSpec],
        capacity: int,
        base_chunk_rows: int,
        *,
        create: bool,
        buffer_id: str = "",
        own: bool = True,
    ) -> None:
        self.path = path
        self.buffer_id = buffer_id
        #: the layout the files are cut by: a tier of another layout is not this one's
        self.layout = [capacity, base_chunk_rows]
        if create:
            clear_working_dir(path, specs, own=own)
        self.columns: dict[str, Column] = {}
        try:
            for name, spec in specs.items():
                check_inside(path, path / f"{name}.x")  # names are checked; the backstop
                if spec.ragged:
                    col: Column = RaggedColumn(path, f"{name}.ragged", spec, capacity,
                                               base_chunk_rows, create=create)
                else:
                    col = FixedColumn(path, f"{name}.npy", spec, capacity, create=create)
                self.columns[name] = col
        except BaseException:
            self.close()
            raise
        self.state: dict[str, Any] = self.read_state() if not create else {}
        self.nbytes = sum(spec.item_bytes for spec in specs.values()
                          if not spec.ragged) * capacity
        limit = memory_limit_bytes()
        if self.nbytes > RANDOM_READS_FRACTION * limit:
            log.info("working tier %s: %.2f GB > %.0f%% of the %.2f GB this process may use; "
                     "sampling reads large rows with pread", path, self.nbytes / 1e9,
                     100 * RANDOM_READS_FRACTION, limit / 1e9)
            for col in self.columns.values():
                if isinstance(col, FixedColumn):
                    col.random_reads = True

    def read_state(self) -> dict[str, Any]:
        """``{"buffer_id", "boot_id", "layout", "commit", "dirty_chunks"}``, or ``{}`` if
        missing, unreadable (a symlink, a FIFO: never followed or waited on) or invalid
        (:func:`check_state`: wrong types or ranges; logged at WARNING with the reason, and
        the tier is then rebuilt whole)."""
        try:
            with open_file_inside(self.path, STATE, "rb") as f:
                state = json.loads(f.read(1 << 20))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, RecursionError) as e:
            log.warning("%s: unreadable (%s: %s); the working tier is rebuilt from the last "
                        "commit", self.path / STATE, type(e).__name__, str(e)[:200])
            return {}
        if isinstance(state, dict) and "generation" in state and "commit" not in state:
            state["commit"] = state.pop("generation")  # written before the rename
        why = check_state(state, ceil_div(self.layout[0], self.layout[1]))
        if why:
            log.warning("%s: invalid (%s); the working tier is rebuilt from the last commit",
                        self.path / STATE, why)
            return {}
        return state  # type: ignore[no-any-return]

    def write_state(self, commit: int, dirty_chunks: Iterable[int]) -> None:
        """Record (durably, before any data write) which chunks may differ from ``commit``."""
        self.state = {
            "buffer_id": self.buffer_id,
            "boot_id": BOOT_ID,
            "layout": self.layout,
            "commit": commit,
            "dirty_chunks": sorted(set(dirty_chunks)),
        }
        self.state["files"] = self.fingerprint(set(self.state["dirty_chunks"]))
        data = json.dumps(self.state, indent=1).encode()
        try:
            write_atomic_inside(self.path, STATE, data)
        except UnsafePathError:  # a directory planted there: this tier's cache, replace it
            remove_inside(self.path, STATE)
            write_atomic_inside(self.path, STATE, data)

    def mark_dirty(self, commit: int, chunks: Iterable[int]) -> None:
        """Add ``chunks`` to the dirty set in ``state.json`` if they are not there yet."""
        known = set(self.state.get("dirty_chunks", []))
        new = set(chunks) - known
        if new or self.state.get("commit") != commit:
            self.write_state(commit, known | new)

    def flush(self) -> None:
        """Make the data as durable as ``state.json`` claims: a no-op where the boot id is
        known (see :data:`BOOT_ID`), else an fsync of every column."""
        if BOOT_ID:
            return
        for col in self.columns.values():
            col.flush()

    def fingerprint(self, dirty: set[int]) -> str:
        """A digest of the files holding this tier's data: the inode of every file, and the
        change time (ctime) of the values files of clean base chunks (nothing writes those
        before the next ``state.json``), leaving out the values files of the ``dirty``
        chunks. A file replaced since ``state.json`` was written (a regular file planted at
        its name) changes it, and so does a clean chunk's values file written by someone
        else; bytes changed in place in a shared ``.npy`` file do not (no checksums: the tier
        is a cache, trusted within one boot)."""
        entries = sorted(f"{rel}:{ino}" + ("" if chunk is None else f":{ctime}")
                         for col in self.columns.values()
                         for rel, chunk, ino, ctime in col.inodes() if chunk not in dirty)
        return hashlib.sha256("\n".join(entries).encode()).hexdigest()

    def trusted(self, buffer_id: str) -> bool:
        """Whether ``state.json`` speaks for this tier: same buffer, written in this boot, cut
        by the same capacity and base chunk, and the same files as when it was written (its
        ``files`` digest; a state without one is not trusted). A tier whose files were
        replaced is logged (WARNING)."""
        if not (self.state.get("buffer_id") == buffer_id
                and self.state.get("boot_id", "") == BOOT_ID
                and self.state.get("layout") == self.layout):
            return False
        files = self.state.get("files")
        dirty = set(self.state.get("dirty_chunks", []))
        if files is None:  # older rlbuffers, or a state.json someone wrote: not vouched for
            log.info("%s: %s records no digest of the tier's files; the working tier is "
                     "rebuilt from the last commit", self.path, STATE)
            return False
        if files != self.fingerprint(dirty):
            log.warning("%s: files of the working tier were replaced since %s was written; "
                        "the working tier is rebuilt from the last commit", self.path, STATE)
            return False
        return True

    def close(self) -> None:
        for col in self.columns.values():
            col.close()


def _is_working_entry(name: str, fields: Iterable[str]) -> bool:
    """Whether ``name`` is one a working tier of columns ``fields`` makes: ``state.json``,
    ``<field>.npy``, ``<field>.ragged`` and the temporary files of their atomic writes
    (``.<name>.<pid>-<id>.tmp``)."""
    own = {STATE, *(f"{f}.npy" for f in fields), *(f"{f}.ragged" for f in fields)}
    if name.startswith(".") and name.endswith(".tmp"):
        return any(name.startswith(f".{n}.") for n in own)
    return name in own


def clear_working_dir(path: Path, fields: Iterable[str], *, own: bool) -> None:
    """Make ``path`` an empty directory for a new working tier. ``own`` (the default
    ``<buffer>/.working``, the library's own directory): whatever is there is removed (a
    symlink itself, never its target). Otherwise (a ``working_dir=`` given explicitly) only a
    working tier's own entries are removed, and a directory holding anything else is refused,
    so a mistyped ``working_dir`` (the buffer itself, its parent, a directory of other files)
    never loses data. ``fields``: the column names (their ``.npy`` / ``.ragged`` entries).

    Raises:
        UnsafePathError: ``path`` (explicit) holds entries that are not a working tier's.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        path.mkdir(parents=True)
        return
    if not own:
        stray = sorted(n for n in os.listdir(path) if not _is_working_entry(n, fields)) \
            if os.path.isdir(path) else [path.name]
        if stray:
            raise UnsafePathError(
                f"{path}: working_dir holds {stray[0]!r}"
                + (f" and {len(stray) - 1} more entries" if len(stray) > 1 else "")
                + " that are not a working tier's files; rlbuffers deletes only its own files "
                "there: pass an empty or new directory")
    if not (os.path.isdir(path) and not stat.S_ISLNK(st.st_mode)) and own:
        os.unlink(path)  # a file, a FIFO or a symlink at .working: removed itself
        path.mkdir()
        return
    for name in os.listdir(path):  # never into a symlink: rmtree does not follow them
        child = path / name
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            os.unlink(child)
