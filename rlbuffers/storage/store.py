"""The storage facade the buffer talks to: columns addressed by slot, and commits.

- :class:`WritableStorage` (``mode="r+"``): writes and reads go to the working tier, commits go
  through the :class:`~rlbuffers.storage.saver.Saver` into the persistent tier.
- :class:`ReadOnlyStorage` (``mode="r"``): reads decode committed chunks through a byte-bounded
  cache; it never touches the writer's working tier.

Both expose ``manifest`` (the last commit), ``gather(name, slots)``, ``gather_packed(name,
slots)`` (ragged columns) and ``close()``.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from rlbuffers.errors import FieldError, SnapshotReclaimedError, UnsafePathError
from rlbuffers.packed import Packed
from rlbuffers.padded import Padded
from rlbuffers.storage.lease import ReaderLease
from rlbuffers.storage.location import LocalLocation, Location
from rlbuffers.storage.lock import LOCK_FILE
from rlbuffers.storage.manifest import Manifest, read_manifest
from rlbuffers.storage.persistent import PersistentTier
from rlbuffers.storage.ragged_column import RaggedColumn
from rlbuffers.storage.reader import ChunkReader
from rlbuffers.storage.saver import SaveFuture, Saver, SaveReport
from rlbuffers.storage.working import FixedColumn, WorkingTier, clear_working_dir

log = logging.getLogger(__name__)

#: Tries to lease a commit still in the kept window while a writer commits meanwhile.
LEASE_ATTEMPTS = 20


def default_working_dir(loc: Location) -> Path:
    """``<path>/.working`` for a local buffer; ``~/.cache/rlbuffers/working/<hash>`` for a URL
    (``$RLBUFFERS_CACHE`` replaces ``~/.cache/rlbuffers``)."""
    if isinstance(loc, LocalLocation):
        return loc.root / ".working"
    cache = Path(os.environ.get("RLBUFFERS_CACHE", Path.home() / ".cache" / "rlbuffers"))
    return cache / "working" / hashlib.sha1(loc.url.encode()).hexdigest()[:16]


def writer_lock_path(loc: Location, working_dir: Path) -> Path:
    """The writer lock's file: ``<path>/writer.lock`` for a local buffer; beside the working
    tier (``<working dir>.lock``, so one writer per machine) for a URL."""
    if isinstance(loc, LocalLocation):
        return loc.root / LOCK_FILE
    return working_dir.parent / f"{working_dir.name}.lock"


def working_dir_of(loc: Location, working_dir: str | os.PathLike[str] | None) -> Path:
    """The working tier's directory: ``working_dir`` as given, else the default, which must
    not be a symlink (``docs/format.md``, "Symlinks").

    Raises:
        UnsafePathError: the default ``<path>/.working`` is a symlink.
    """
    if working_dir is not None:
        return Path(working_dir)
    wdir = default_working_dir(loc)
    if isinstance(loc, LocalLocation) and wdir.is_symlink():
        raise UnsafePathError(f"{wdir}: is a symlink (to {os.readlink(wdir)}); rlbuffers does "
                              "not follow symlinks inside a buffer's directory for writes: "
                              "remove it, or pass working_dir= to put the working tier "
                              "elsewhere")
    return wdir


class ReadOnlyStorage:
    """Reads of one commit (a snapshot: it does not change while the writer saves), from the
    persistent tier, with a decoded-chunk cache of ``cache_max_bytes`` bytes."""

    def __init__(self, tier: PersistentTier, cache_max_bytes: int = 256 * 2**20, *,
                 pinned: bool = False) -> None:
        self._cache_max_bytes = cache_max_bytes
        self._lease: ReaderLease | None = None
        self.tier, self._lease = self._leased(tier, pinned)
        self._reader = ChunkReader(self.tier, cache_max_bytes)

    @staticmethod
    def _leased(tier: PersistentTier, pinned: bool) -> tuple[PersistentTier, ReaderLease | None]:
        """``tier`` (or, unless ``pinned``, the latest commit if ``tier``'s left the kept
        window before its lease was visible) with a lease on its commit (``lease.py``).

        Raises:
            SnapshotReclaimedError: ``pinned`` and the commit may be reclaimed already.
        """
        for _ in range(LEASE_ATTEMPTS):
            lease = ReaderLease.take(tier.loc, tier.manifest.commit)
            if lease is None:
                return tier, None
            head = read_manifest(tier.loc)
            if tier.manifest.commit > head.commit - head.keep_commits:
                return tier, lease
            lease.release()
            if pinned:
                raise SnapshotReclaimedError(
                    f"{tier.loc}: commit {tier.manifest.commit} is not kept; kept: "
                    f"{head.commit - head.keep_commits + 1}..{head.commit}")
            tier = tier.reopen()
        return tier, None  # a writer faster than we can lease: read as without leases

    def refresh(self) -> None:
        """Move to the latest commit (its lease is taken before the old one is released)."""
        old = self._lease
        self.tier, self._lease = self._leased(self.tier.reopen(), False)
        self._reader = ChunkReader(self.tier, self._cache_max_bytes)
        if old is not None:
            old.release()

    @property
    def manifest(self) -> Manifest:
        return self.tier.manifest

    def gather(self, name: str, slots: np.ndarray) -> Any:
        """Rows of column ``name`` at ``slots`` (int64[N]): ``[N, *shape]``, or a list (ragged)."""
        return self._reader.gather(name, slots)

    def gather_packed(self, name: str, slots: np.ndarray) -> Packed:
        """Rows of ragged column ``name`` at ``slots`` (int64[N]) as one :class:`Packed`."""
        return self._reader.gather_packed(name, slots)

    def gather_padded(self, name: str, slots: np.ndarray) -> Padded:
        """Rows of ragged column ``name`` at ``slots`` (int64[N]) as one :class:`Padded`."""
        return self._reader.gather_padded(name, slots)

    def close(self) -> None:
        """Release the lease (the cache goes with the object)."""
        if self._lease is not None:
            self._lease.release()


class WritableStorage:
    """The working tier of one buffer, kept in line with its persistent tier.

    Opening finishes an interrupted commit, then reuses the working tier at ``working_dir`` if
    it mirrors the last commit (rebuilding only the base chunks changed since), else rebuilds
    it from the persistent tier chunk by chunk.
    """

    def __init__(self, tier: PersistentTier, working_dir: Path, *, fresh: bool = False) -> None:
        self.tier = tier
        self.layout = tier.manifest.layout
        #: the library's own directory (the default): anything in it may be deleted; an
        #: explicit working_dir= loses only a working tier's own files (clear_working_dir)
        self._own = Path(working_dir) == default_working_dir(tier.loc)
        if fresh:
            clear_working_dir(working_dir, tier.manifest.specs, own=self._own)
        self.working = self._attach(working_dir, fresh)
        self.saver = Saver(tier, self.working)

    @property
    def manifest(self) -> Manifest:
        """The last commit."""
        return self.tier.manifest

    def _attach(self, wdir: Path, fresh: bool = False) -> WorkingTier:
        m, tier = self.tier.manifest, self.tier
        tier.apply(m.commit)  # drops uncommitted chunks and commits no longer kept
        args = (wdir, m.specs, m.capacity, self.layout.base_chunk_rows)
        everything = set(range(self.layout.n_base_chunks))
        if fresh:  # a new buffer (commit 0, nothing stored): a new, empty tier, nothing to read
            working = WorkingTier(*args, create=True, buffer_id=m.buffer_id, own=self._own)
            for col in working.columns.values():  # every chunk file made now (empty), so the
                for c in sorted(everything):     # state's files digest covers all of them
                    col.reset_chunk(c)
            working.write_state(m.commit, [])
            return working
        try:
            working = WorkingTier(*args, create=False, buffer_id=m.buffer_id)
            state = working.state
            same = working.trusted(m.buffer_id) and state.get("commit") in (
                m.commit, m.commit - 1)
            rebuild = set(state.get("dirty_chunks", [])) if same else everything
        except (OSError, ValueError) as e:  # missing, foreign, or a planted entry in it
            if wdir.exists():
                log.warning("%s: unusable working tier (%s: %s); rebuilding it from commit %d",
                            wdir, type(e).__name__, str(e)[:300], m.commit)
            working = WorkingTier(*args, create=True, buffer_id=m.buffer_id, own=self._own)
            rebuild = everything
        if rebuild:
            self._rebuild(working, sorted(rebuild))
        working.write_state(m.commit, [])
        return working

    def _rebuild(self, working: WorkingTier, base_chunks: list[int]) -> None:
        """Rewrite ``base_chunks`` of the working tier from the last commit (fields with larger
        stored chunks rewrite the whole stored chunk: the rest of it is unchanged since the
        commit, so rewriting it is harmless)."""
        size = self.tier.manifest.ring.size
        log.info("%s: restoring %d chunk(s) of the working tier from commit %d",
                 self.tier.loc, len(base_chunks), self.tier.manifest.commit)
        for name, col in working.columns.items():
            for c in base_chunks:
                col.reset_chunk(c)
            for c in self.layout.stored_of(name, base_chunks):
                a, _ = self.layout.stored_slots(name, c)
                if a < size:
                    col.write(a, self.tier.read_chunk(name, c))

    def write(self, first_slot: int, rows: dict[str, Any]) -> None:
        """Write ``k`` rows of every column into slots ``first_slot, first_slot + 1, ...``
        (wrapping at the capacity); ``rows[name]`` is ``[k, *shape]`` or a list of ``k``
        arrays, ``k <= capacity``."""
        k = len(next(iter(rows.values())))
        capacity = self.layout.capacity
        slots = (first_slot + np.arange(k)) % capacity
        head = min(k, capacity - first_slot)
        with self.saver.lock:
            self.saver.touch(rows, self.layout.base_chunks_of_slots(slots))
            for name, data in rows.items():
                col = self.working.columns[name]
                col.write(first_slot, data[:head])
                if head < k:
                    col.write(0, data[head:])

    def scatter(self, name: str, slots: np.ndarray, values: np.ndarray) -> None:
        """Set ``values[i]`` at ``slots[i]`` (distinct slots) of the fixed column ``name``.

        Raises:
            FieldError: ``name`` is a ragged column.
        """
        col = self.working.columns[name]
        if not isinstance(col, FixedColumn):
            raise FieldError(f"column {name!r}: expected a fixed-shape column, got a ragged one")
        with self.saver.lock:
            self.saver.touch([name], self.layout.base_chunks_of_slots(slots))
            col.scatter(slots, values)

    def gather(self, name: str, slots: np.ndarray) -> Any:
        """Rows of column ``name`` at ``slots`` (int64[N]): ``[N, *shape]``, or a list (ragged)."""
        return self.working.columns[name].gather(slots)

    def _ragged_column(self, name: str, method: str) -> RaggedColumn:
        col = self.working.columns[name]
        if not isinstance(col, RaggedColumn):
            raise TypeError(f"field {name!r}: not ragged ({method} is for ragged fields)")
        return col

    def gather_packed(self, name: str, slots: np.ndarray) -> Packed:
        """Rows of ragged column ``name`` at ``slots`` (int64[N]) as one :class:`Packed`."""
        return self._ragged_column(name, "gather_packed").gather_packed(slots)

    def gather_padded(self, name: str, slots: np.ndarray) -> Padded:
        """Rows of ragged column ``name`` at ``slots`` (int64[N]) as one :class:`Padded`."""
        return self._ragged_column(name, "gather_padded").gather_padded(slots)

    def commit(self, manifest: Manifest, *, full: bool = False,
               background: bool = False) -> SaveReport | SaveFuture:
        """Save every change since the last commit as ``manifest`` (see :meth:`Saver.save`)."""
        return self.saver.save(manifest, full=full, background=background)

    def close(self) -> None:
        """Release the working tier's files, then raise a background save's unseen error."""
        try:
            self.saver.close()
        finally:
            self.working.close()
