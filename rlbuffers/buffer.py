"""ReplayBuffer: a FIFO ring of transitions on disk, sampled from an uncompressed working tier
and committed to a compressed Zarr v3 group with incremental, atomic saves. Where each part
lives: ``docs/internals.md``; the on-disk layout: ``docs/format.md``."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlbuffers import spec
from rlbuffers.core import framestack, opening, rows
from rlbuffers.core.reading import BufferReads
from rlbuffers.deprecation import UNSET, renamed_attribute, renamed_keyword
from rlbuffers.ring import RingState
from rlbuffers.sampling import samplers
from rlbuffers.sampling.samplers import Sampler
from rlbuffers.spec import FieldSpec
from rlbuffers.storage import framestack_columns
from rlbuffers.storage.compression import DEFAULT_CODEC
from rlbuffers.storage.engine import open_tier
from rlbuffers.storage.location import make_location
from rlbuffers.storage.lock import WriterLock
from rlbuffers.storage.manifest import Manifest
from rlbuffers.storage.persistent import PersistentTier
from rlbuffers.storage.saver import SaveFuture, SaveReport, exit_watch
from rlbuffers.storage.store import ReadOnlyStorage, WritableStorage, working_dir_of

__all__ = ["ReplayBuffer", "SaveReport"]


class ReplayBuffer(BufferReads):
    """A fixed-capacity FIFO ring of transitions stored on disk.

    Create with :meth:`create`, reopen with :meth:`open`. ``buf[0]`` is the oldest transition;
    beyond ``capacity`` each new one overwrites the oldest. ``add``/``extend`` write the working
    tier; ``save`` commits the changes to the persistent tier. Not thread-safe. The reading
    half (``sample``, ``buf[i]``, ``update_priorities``) is :class:`~rlbuffers.core.reading.
    BufferReads`.
    """

    def __init__(self, tier: PersistentTier, *, mode: str,
                 working_dir: str | os.PathLike[str] | None = None,
                 fresh: bool = False, sampler: Sampler | None = None,
                 lock: WriterLock | None = None, pinned: bool = False,
                 cache_bytes: int | None = None) -> None:
        m, loc = tier.manifest, tier.loc
        #: the buffer's directory (a ``Path``) or URL (a ``str``)
        self.path: Path | str = loc.path
        self.mode = mode
        self.capacity: int = m.capacity
        self.chunk_transitions: int = m.layout.base_chunk_rows
        self._fields = framestack_columns.user_fields(m.fields, m.next_of)
        self._stacks = framestack.FrameStacks(m.fields, m.next_of)
        self._lock = lock
        self._closed = True
        self._load_state(m, sampler)
        self._storage: ReadOnlyStorage | WritableStorage = (
            ReadOnlyStorage(tier, opening.READ_CACHE_BYTES if cache_bytes is None else
                            int(cache_bytes), pinned=pinned) if mode == "r" else
            WritableStorage(tier, working_dir_of(loc, working_dir), fresh=fresh))
        self._closed = False
        if self._storage.manifest is not m:  # a reader whose commit moved on while leasing
            self._load_state(self._storage.manifest)
        if mode != "r":
            exit_watch.add(self._storage.saver)

    def _load_state(self, m: Manifest, sampler: Sampler | None = None) -> None:
        self._ring: RingState = m.ring
        self.sampler, self._rng = opening.sampler_and_rng(m, self.path, sampler)

    @classmethod
    def create(cls, path: str | os.PathLike[str], *, capacity: int,
               fields: Mapping[str, FieldSpec], chunk_transitions: int | None = None,
               codec: str | Mapping[str, str] = DEFAULT_CODEC, sampler: Sampler | None = None,
               seed: int | None = None, working_dir: str | os.PathLike[str] | None = None,
               overwrite: bool = False, storage_options: Mapping[str, Any] | None = None,
               keep_commits: int | None = None, next_of: Mapping[str, str] | None = None,
               keep_generations: int = UNSET) -> ReplayBuffer:
        """Create an empty buffer at ``path`` (a directory or fsspec URL): commit 0.

        Args:
            capacity: most transitions held; the oldest are overwritten beyond it.
            fields: name -> :class:`FieldSpec`; ``terminated``/``truncated``/``done``
                (``FieldSpec((), "bool")``) end an episode when True.
            chunk_transitions: transitions per base chunk, the unit of incremental saves (see
                :mod:`rlbuffers.storage.layout`); None: ~4 MiB raw of the largest field.
            codec: ``"blosc-zstd"`` (default), ``"blosc-lz4"``, ``"zstd"``, ``"none"``, or a
                field -> codec mapping. seed: seed of the buffer's PCG64 generator.
            sampler: a registered :class:`~rlbuffers.Sampler` (default uniform).
            working_dir: local directory of the working tier (default ``path/.working``; for
                a URL, under ``~/.cache/rlbuffers``). overwrite: replace a buffer at ``path``.
            storage_options: fsspec options for a URL path (``endpoint_url``, ``key``...).
            keep_commits: how many of the newest commits stay readable (>= 1; None: 2).
            next_of: derived field -> stacked field (``{"next_obs": "obs"}``): sampled like
                the others, stored only as the next transition's frame (and each episode's
                last): :mod:`rlbuffers.core.framestack`. keep_generations: old ``keep_commits``.

        Raises:
            FieldError: an invalid field name or spec. ValueError: a bad capacity, chunk size or
            codec. FileExistsError: ``path`` is not empty and ``overwrite`` is False.
        """
        keep_commits = renamed_keyword("keep_generations", keep_generations,
                                       "keep_commits", keep_commits)
        sampler = sampler or samplers.UniformSampler()
        tier, wdir = opening.new_tier(
            path, capacity=capacity, fields=fields, chunk_transitions=chunk_transitions,
            codec=codec, sampler=sampler, seed=seed, working_dir=working_dir,
            overwrite=overwrite, storage_options=storage_options, keep_commits=keep_commits,
            next_of=next_of)
        return opening.with_writer_lock(tier.loc, wdir, lambda lock: cls(
            tier, mode="r+", working_dir=working_dir, fresh=True, sampler=sampler, lock=lock))

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, mode: str = "r+",
             working_dir: str | os.PathLike[str] | None = None,
             storage_options: Mapping[str, Any] | None = None,
             commit: int | None = None, generation: int | None = UNSET,
             cache_bytes: int | None = None) -> ReplayBuffer:
        """Open the last commit at ``path`` (a working tier that mirrors it is reused, else
        rebuilt chunk by chunk); data added after the last ``save`` is discarded.

        Args:
            mode: ``"r+"`` (read/write) or ``"r"`` (read-only: a snapshot of one commit, read
                from committed chunks; the writer's later saves do not change it).
            commit: (``mode="r"``) the number of a kept older commit to read instead of the
                last. generation: deprecated spelling of ``commit``.
            cache_bytes: (``mode="r"``) most bytes of decoded chunks a reader keeps (default
                256 MiB; 0: none, each read decodes its chunks again).
            working_dir, storage_options: as ``create``.

        Raises:
            NotABufferError: no buffer there. FormatVersionError: a newer format.
            ValueError: an unknown mode, ``commit`` or ``cache_bytes`` with ``mode="r+"``, or
                a ``cache_bytes`` that is not an int >= 0.
            CorruptChunkError: a chunk to rebuild fails its checksum.
            SnapshotReclaimedError: commit ``commit`` is not kept.
        """
        commit = renamed_keyword("generation", generation, "commit", commit)
        opening.check_open_mode(mode, commit, cache_bytes)
        loc = make_location(path, dict(storage_options or {}))
        tier = opening.open_checked(loc, commit)  # no buffer or a bad one: raised before a lock
        if mode == "r":
            return cls(tier, mode=mode, working_dir=working_dir, pinned=commit is not None,
                       cache_bytes=cache_bytes)
        # a writer: the lock, then the manifest again (no other writer commits after that)
        return opening.with_writer_lock(loc, working_dir_of(loc, working_dir), lambda lock: cls(
            open_tier(loc), mode=mode, working_dir=working_dir, lock=lock))

    def add(self, **transition: Any) -> None:
        """Append one transition (one keyword per field, shapes as in the field specs).

        Raises:
            FieldError: an unknown or missing field, or a wrong shape or dtype (the buffer is
            unchanged). ReadOnlyError: opened with ``mode="r"``.
        """
        self._write(self._writer(), spec.transition_rows(self._fields, transition), 1)

    def extend(self, batch: Mapping[str, Any]) -> None:
        """Append ``B`` transitions: ``batch[field]`` is ``[B, *shape]`` (ragged: a sequence of
        ``B`` arrays). If ``B`` exceeds the capacity only the last ``capacity`` stay.

        Raises:
            FieldError: as :meth:`add`, or unequal batch sizes. ReadOnlyError: as :meth:`add`.
        """
        self._write(self._writer(), *spec.batch_of_rows(self._fields, batch))

    def _write(self, storage: WritableStorage, batch: dict[str, Any], n: int) -> None:
        self._ring = rows.write_rows(storage, self._ring, self.sampler, self._stacks,
                                     self._gather, self.chunk_transitions, batch, n)

    def end_episode(self) -> bool:
        """End the newest transition's episode without changing its fields (an environment reset
        with no ``terminated``/``truncated``/``done`` flag): the next transition starts one,
        stacked fields included; ``episode_ids`` and the offline exports see the boundary.
        Kept by the next ``save``. Returns False (no change) if the buffer is empty or that
        episode has ended already. Raises ReadOnlyError (``mode="r"``).
        """
        self._writer()
        ring = rows.end_episode(self._ring, self._gather)
        self._ring = ring or self._ring
        return ring is not None

    def __len__(self) -> int:
        return self._ring.size

    fields = property(lambda self: dict(self._fields), doc="Field name -> spec (user fields).")
    total_added = property(lambda self: self._ring.total_added, doc="Transitions ever added.")
    episodes = property(lambda self: self._ring.episodes, doc="Episodes ended so far: also "
                        "the episode number of the next transition (see ``episode_ids``).")
    commit = property(lambda self: self._storage.manifest.commit,
                      doc="The number of the commit on disk (0 at create, +1 per save).")
    generation = renamed_attribute("generation", "commit")
    metadata = property(lambda self: self._storage.manifest.metadata,
                        doc="The metadata dict of the last commit.")
    committed_at = property(lambda self: self._storage.manifest.committed_at,
                            doc="Unix time (seconds) of the last commit.")

    def save(self, *, metadata: Mapping[str, Any] | None = None, full: bool = False,
             background: bool = False) -> SaveReport | SaveFuture:
        """Commit the buffer as it is at this call: write the chunks changed since the last
        commit (runs of <= ~32 MiB raw: bounded memory), then commit atomically (a new
        snapshot; commits older than ``keep_commits`` are reclaimed). On an error before
        the commit the previous one stays intact and the changes stay pending.

        Args:
            metadata: JSON dict stored with the commit (``buf.metadata``); None keeps the last.
            full: rewrite all filled chunks.
            background: write in a thread and return a ``Future`` of the report at once;
                ``add``, ``extend``, ``sample``, ``update_priorities`` may go on meanwhile.

        Returns:
            a :class:`SaveReport` (or its ``Future``, whose ``result()`` raises its error).

        Raises:
            TypeError: metadata is not JSON. OSError: the write failed (e.g. disk full).
            ReadOnlyError: ``mode="r"``. Also an unseen earlier background save's error.
        """
        storage = self._writer()
        storage.saver.wait()
        meta = self.metadata if metadata is None else json.loads(json.dumps(dict(metadata)))
        manifest = storage.manifest.replace(ring=self._ring, sampler=self.sampler.state_dict(),
                                            rng=self._rng.bit_generator.state, metadata=meta)
        return storage.commit(manifest, full=full, background=background)

    def refresh(self) -> None:
        """Move this reader (``mode="r"``; else ValueError) to the latest commit."""
        self._open_check()
        if not isinstance(self._storage, ReadOnlyStorage):
            raise ValueError(f"{self.path}: refresh() is for readers (mode='r')")
        self._storage.refresh()
        self._load_state(self._storage.manifest)

    def wait_for_save(self) -> None:
        """Block until a background save finishes; raise its error unless its future already
        reported it (the changes it could not commit stay pending for the next save)."""
        if isinstance(self._storage, WritableStorage):
            self._storage.saver.wait()

    rng = property(lambda self: self._rng, doc="The buffer's generator (saved by ``save``).")

    def close(self) -> None:
        """Wait for a background save, release files, then raise the save's error if nobody
        has seen it. Does not save: changes since the last ``save`` are discarded."""
        if not self._closed:
            self._closed = True
            try:
                self._storage.close()
            finally:
                if self._lock is not None:
                    self._lock.release()

    def __enter__(self) -> ReplayBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ReplayBuffer({str(self.path)!r}, size={len(self)}, commit={self.commit})"
