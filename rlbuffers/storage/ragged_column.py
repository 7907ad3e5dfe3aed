"""A ragged field of the working tier: per-slot (byte offset, row count) in two ``.npy``
files and one append-only values file per chunk (``<field>.ragged/``; layout in
``rlbuffers.storage.working``), gathered as a list of rows, :class:`~rlbuffers.packed.Packed`
or :class:`~rlbuffers.padded.Padded`."""

from __future__ import annotations

import functools
import mmap
import os
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from rlbuffers import ranges
from rlbuffers.errors import UnsafePathError
from rlbuffers.intmath import ceil_div
from rlbuffers.packed import Packed, packed_offsets, row_list, row_offsets
from rlbuffers.padded import Padded, padded_from_pieces
from rlbuffers.spec import FieldSpec
from rlbuffers.storage.copy_threads import copy_parts, copy_pool
from rlbuffers.storage.fileio import pwrite_all
from rlbuffers.storage.safe_files import (
    check_regular,
    create_npy_inside,
    open_inside,
    open_npy_inside,
    remove_inside,
    stat_inside,
)


def copy_rows(out: np.ndarray, views: list[memoryview], chunk: np.ndarray, starts: np.ndarray,
              ends: np.ndarray, bounds: np.ndarray) -> None:
    """Row ``i`` (bytes ``[starts[i], ends[i])`` of ``views[chunk[i]]``; int64[N] each) into
    bytes ``[bounds[i], bounds[i + 1])`` of ``out`` (``bounds`` int64[N + 1], non-decreasing),
    zeros after its bytes: :data:`ranges.copy_ranges`, by
    :func:`~rlbuffers.storage.copy_threads.copy_parts` threads at once (the calling thread and
    copy threads, each a run of rows of about the same bytes; the C copy releases the GIL; a
    part whose thread has not started when the calling thread is done is copied by the
    calling thread, never waited for).

    Raises:
        RuntimeError: the C extension is not built (callers check :data:`ranges.copy_ranges`).
        ValueError: a range outside its source or ``out`` (nothing written).
    """
    copy_ranges = ranges.copy_ranges
    if copy_ranges is None:
        raise RuntimeError("copy_rows: needs the C extension rlbuffers._ranges, not built here")
    total = int(bounds[-1])
    threads = min(copy_parts(total), len(starts))
    if threads <= 1:
        copy_ranges(out, views, chunk, starts, ends, bounds[:-1], bounds[1:])
        return
    cuts = np.searchsorted(bounds[1:], np.arange(1, threads) * (total // threads)).tolist()
    cuts = [0, *cuts, len(starts)]

    def copy(j: int) -> None:
        a, b = cuts[j], cuts[j + 1]
        copy_ranges(out, views, chunk[a:b], starts[a:b], ends[a:b], bounds[a:b],
                    bounds[a + 1:b + 1])

    helpers = [copy_pool().submit(copy, j) for j in range(1, threads)]
    copy(0)
    for j, job in enumerate(helpers, 1):
        if job.cancel():  # not started: the calling thread copies its part, never waits for it
            copy(j)
        else:
            job.result()


class RaggedColumn:
    """One ragged field in the directory ``root/rel``: per-slot (byte offset, row count) and
    one append-only values file per chunk, compacted whenever a chunk has been completely
    rewritten. Every file is opened through :mod:`rlbuffers.storage.safe_files` (never a
    symlink, a FIFO or a hard-linked file).

    Raises (on construction):
        UnsafePathError: a file or the directory is a symlink, FIFO or other non-regular entry.
        OSError, ValueError: the index files are not ``.npy`` files of ``int64[capacity]``.
    """

    def __init__(self, root: Path, rel: str, spec: FieldSpec, capacity: int,
                 base_chunk_rows: int, *, create: bool) -> None:
        self.root, self.rel = root, rel
        self.path, self.spec, self.capacity = root / rel, spec, capacity
        self.name = Path(rel).name.removesuffix(".ragged")
        """The field's name (for error messages)."""
        self.base_chunk_rows = base_chunk_rows
        self._row_bytes = spec.item_bytes  # computed once: gather needs it on every call
        self._fds: dict[int, int] = {}
        if create:
            try:
                os.mkdir(self.path)
            except FileExistsError:  # a symlink there is refused by the walk below
                pass
            for name in ("start", "length"):
                create_npy_inside(root, f"{rel}/{name}.npy", np.int64, (capacity,))
        #: chunk -> (inode, ctime ns) of its values file as found on open (files opened
        #: since: _fds)
        self._known: dict[int, tuple[int, int]] = {} if create else self._check_entries()
        self.start = open_npy_inside(root, f"{rel}/start.npy", "r+")
        self.length = open_npy_inside(root, f"{rel}/length.npy", "r+")
        for name, index in (("start", self.start), ("length", self.length)):
            if index.shape != (capacity,) or index.dtype != np.int64:
                raise OSError(f"{self.path / name}.npy: expected ({capacity},) int64, found "
                              f"{index.shape} {index.dtype}")
        # the same maps as plain arrays: indexed without memmap's per-call overhead
        self._start_rows = self.start.view(np.ndarray)
        self._length_rows = self.length.view(np.ndarray)
        self._maps: dict[int, mmap.mmap] = {}  # read-only maps of the values files (gather)
        n_chunks = ceil_div(capacity, base_chunk_rows)
        #: ``_views[c]``: a memoryview of ``_maps[c]``, or an empty one where chunk ``c`` is
        #: not mapped (its rows so far have 0 bytes: slicing it gives them)
        self._views: list[memoryview] = [memoryview(b"")] * n_chunks
        #: ``_mapped[c]``: bytes of chunk ``c`` that ``_views[c]`` covers (0: not mapped)
        self._mapped = np.zeros(n_chunks, dtype=np.int64)
        #: held while a map is replaced: a background save's reads and a sample may remap the
        #: same chunk at once, and ``_views[c]`` must never be shorter than ``_mapped[c]``
        self._map_lock = threading.Lock()

    def _check_entries(self) -> dict[int, tuple[int, int]]:
        """Refuse a directory holding anything but regular files of one link (a symlink or
        FIFO planted at a values file would otherwise be met only when its chunk is written).

        Returns:
            chunk -> (inode number, ctime in ns) of each values file ``c<chunk>.bin``.

        Raises:
            UnsafePathError: as :func:`~rlbuffers.storage.safe_files.check_regular`, also
                for a file with more than one hard link.
        """
        found = {}
        for name in os.listdir(self.path):
            st = check_regular(self.path / name)
            if st.st_nlink > 1:
                raise UnsafePathError(f"{self.path / name}: has more than one hard link; "
                                      "the working tier writes its files in place")
            if name.startswith("c") and name.endswith(".bin") and name[1:-4].isdigit():
                found[int(name[1:-4])] = (st.st_ino, st.st_ctime_ns)
        return found

    def inodes(self) -> list[tuple[str, int | None, int, int]]:
        """``(path relative to the tier, base chunk or None, inode, ctime ns)`` of every file
        of this column: the index files (no chunk) and each chunk's values file."""
        known = dict(self._known)
        for c, fd in self._fds.items():
            st = os.fstat(fd)
            known[c] = (st.st_ino, st.st_ctime_ns)
        index = [(f"{self.rel}/{n}.npy", stat_inside(self.root, f"{self.rel}/{n}.npy"))
                 for n in ("start", "length")]
        return [(rel, None, st.st_ino, st.st_ctime_ns) for rel, st in index] + [
            (f"{self.rel}/c{c}.bin", c, ino, ctime) for c, (ino, ctime) in known.items()]

    def _fd(self, c: int) -> int:
        """The values file of chunk ``c``, opened (created if missing) as
        :func:`~rlbuffers.storage.safe_files.open_inside`: a symlink, FIFO or hard link
        planted there raises UnsafePathError, never written through."""
        fd = self._fds.get(c)
        if fd is None:
            fd = open_inside(self.root, f"{self.rel}/c{c}.bin", os.O_RDWR | os.O_CREAT)
            self._fds[c] = fd
        return fd

    def write(self, slot: int, rows: list[np.ndarray]) -> None:
        """Append ``rows`` (n arrays ``[len_i, *row]``) as slots ``[slot, slot + n)``."""
        i = 0
        while i < len(rows):
            c = (slot + i) // self.base_chunk_rows
            n = min(len(rows) - i, (c + 1) * self.base_chunk_rows - (slot + i))
            part = rows[i : i + n]
            fd = self._fd(c)
            end = os.fstat(fd).st_size
            lengths = np.array([len(r) for r in part], dtype=np.int64)
            starts = end + np.concatenate([[0], np.cumsum(lengths[:-1] * self.spec.item_bytes)])
            blob = b"".join(np.ascontiguousarray(r).tobytes() for r in part)
            pwrite_all(fd, memoryview(blob), end)
            s = slot + i
            self.start[s : s + n] = starts
            self.length[s : s + n] = lengths
            if (s + n) % self.base_chunk_rows == 0 or s + n == self.capacity:
                self._maybe_compact(c)
            i += n

    def _live_range(self, c: int) -> tuple[int, int]:
        return c * self.base_chunk_rows, min((c + 1) * self.base_chunk_rows, self.capacity)

    def _maybe_compact(self, c: int) -> None:
        a, b = self._live_range(c)
        live = int(self.length[a:b].sum()) * self.spec.item_bytes
        if os.fstat(self._fd(c)).st_size > 2 * live + 4096:
            self._rewrite(c, self.read_range(a, b))

    def _rewrite(self, c: int, rows: list[np.ndarray]) -> None:
        a, _ = self._live_range(c)
        self.reset_chunk(c)
        self.write(a, rows)

    def _values(self, c: int, end: int) -> mmap.mmap:
        """A read-only map of chunk ``c``'s values file covering bytes ``[0, end)``; remapped
        when the file has grown past the cached map."""
        with self._map_lock:
            m = self._maps.get(c)
            if m is None or len(m) < end:
                m = self._maps[c] = mmap.mmap(self._fd(c), 0, prot=mmap.PROT_READ)
                self._views[c] = memoryview(m)  # the view first: readers check _mapped first
                self._mapped[c] = len(m)
            return m

    def _unmap(self, c: int) -> None:
        """Forget chunk ``c``'s map (before its file is truncated: reading a map past the end
        of its file raises SIGBUS)."""
        with self._map_lock:
            self._maps.pop(c, None)
            self._mapped[c] = 0
            self._views[c] = memoryview(b"")

    def gather(self, slots: np.ndarray) -> list[np.ndarray]:
        """Values of ``slots`` (int64[N]) as a list of N arrays ``[len_i, *row]``: views into
        one new flat array gathered as :meth:`gather_packed` does (with int64 offsets: no
        int32 limit on the list format)."""
        return row_list(*self._gather_flat(slots, row_offsets))

    def _ranges(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                   np.ndarray]:
        """Where the values of ``slots`` (int64[N]) are: their chunks, first and end bytes in
        the chunk's values file, and lengths (all int64[N]; lengths in rows along the ragged
        axis). The maps stay open between calls; a chunk is (re)mapped only when a row ends
        past its map, so ``self._views[chunk[i]]`` covers ``[starts[i], ends[i])``."""
        slots = np.asarray(slots, dtype=np.int64).ravel()
        lengths = self._length_rows[slots]
        starts = self._start_rows[slots]
        ends = starts + lengths * self._row_bytes
        chunk = slots // self.base_chunk_rows
        if (ends > self._mapped[chunk]).any():
            last = np.zeros(len(self._mapped), dtype=np.int64)
            np.maximum.at(last, chunk, ends)  # the furthest byte read in each chunk
            for c in np.flatnonzero(last).tolist():
                self._values(c, int(last[c]))
        return chunk, starts, ends, lengths

    def _pieces(self, slots: np.ndarray) -> tuple[list[memoryview], np.ndarray]:
        """The bytes of the values of ``slots`` (int64[N]): N memoryviews of the memory-mapped
        values files (no copy, no numpy call per row) and their lengths (int64[N], rows along
        the ragged axis)."""
        chunk, starts, ends, lengths = self._ranges(slots)
        views = self._views  # a row of 0 bytes slices to b"" whether its chunk is mapped or not
        return [views[c][a:b] for c, a, b in
                zip(chunk.tolist(), starts.tolist(), ends.tolist(), strict=True)], lengths

    def _gather_flat(self, slots: np.ndarray, offsets: Callable[[np.ndarray], np.ndarray]
                     ) -> tuple[np.ndarray, np.ndarray]:
        """Values of ``slots`` (int64[N]) end to end, ``[sum_len, *row]`` (a new array), and
        their offsets ``offsets(lengths)`` (int64[N + 1], computed, and checked by
        ``offsets``, before anything is copied); copied out of the memory-mapped values files
        in one C call (:data:`ranges.copy_ranges`), or, without the C extension, one
        ``bytearray.join`` of the rows' byte ranges (no numpy call per row)."""
        if ranges.copy_ranges is not None:
            chunk, starts, ends, lengths = self._ranges(slots)
            cu = offsets(lengths)
            values = np.empty((int(cu[-1]), *self.spec.row_shape), dtype=self.spec.dtype)
            copy_rows(values, self._views, chunk, starts, ends, cu * self._row_bytes)
            return values, cu
        pieces, lengths = self._pieces(slots)
        cu = offsets(lengths)
        flat = np.frombuffer(bytearray().join(pieces), dtype=self.spec.dtype)
        return flat.reshape(-1, *self.spec.row_shape), cu

    def gather_packed(self, slots: np.ndarray) -> Packed:
        """Values of ``slots`` (int64[N]) packed: ``values [sum_len, *row]`` (a new array),
        ``cu_seqlens`` int32[N + 1] (see :meth:`_gather_flat`).

        Raises:
            ValueError: the rows hold more values than int32 ``cu_seqlens`` address (the field
                named; see :func:`~rlbuffers.packed.packed_offsets`).
        """
        return Packed(*self._gather_flat(slots, functools.partial(packed_offsets,
                                                                  field=self.name)))

    def gather_padded(self, slots: np.ndarray) -> Padded:
        """Values of ``slots`` (int64[N]) padded: ``values [N, L, *row]`` (a new array, zeros
        after each row, ``L`` the longest), ``lengths`` int64[N]; copied out of the
        memory-mapped values files in one C call (:data:`ranges.copy_ranges`), or, without
        the C extension, one ``bytearray.join`` of the rows and their pads."""
        if ranges.copy_ranges is not None:
            chunk, starts, ends, lengths = self._ranges(slots)
            longest = int(lengths.max(initial=0))
            values = np.empty((len(lengths), longest, *self.spec.row_shape),
                              dtype=self.spec.dtype)
            bounds = np.arange(len(lengths) + 1, dtype=np.int64) * (longest * self._row_bytes)
            copy_rows(values, self._views, chunk, starts, ends, bounds)
            return Padded(values, lengths)
        pieces, lengths = self._pieces(slots)
        return padded_from_pieces(pieces, lengths, self.spec.dtype, self.spec.row_shape)

    def read_range(self, start: int, stop: int) -> list[np.ndarray]:
        """Values of slots ``[start, stop)``."""
        return self.gather(np.arange(start, stop))

    def reset_chunk(self, c: int) -> None:
        """Empty the values file of base chunk ``c`` (before it is rebuilt). A file this
        column has not opened yet is replaced by a new empty one (whatever was planted at
        its name, a symlink or a FIFO, is removed, never followed)."""
        self._unmap(c)
        fd = self._fds.get(c)
        if fd is None:
            rel = f"{self.rel}/c{c}.bin"
            remove_inside(self.root, rel)
            fd = self._fds[c] = open_inside(self.root, rel,
                                            os.O_RDWR | os.O_CREAT | os.O_EXCL)
        os.ftruncate(fd, 0)
        a, b = self._live_range(c)
        self.start[a:b] = 0
        self.length[a:b] = 0

    def flush(self) -> None:
        self.start.flush()
        self.length.flush()
        for fd in self._fds.values():
            os.fsync(fd)

    def close(self) -> None:
        for c in list(self._maps):
            self._unmap(c)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self.start = self.length = None  # type: ignore[assignment]
        self._start_rows = self._length_rows = None  # type: ignore[assignment]
