"""ReplayBuffer: a FIFO ring of transitions on disk, sampled from an uncompressed working tier
and committed to a compressed Zarr v3 group with incremental, atomic saves. Where each part
lives: ``docs/internals.md``; the on-disk layout: ``docs/format.md``."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from rlbuffers import framestack, framestack_columns, samplers, spec
from rlbuffers.compression import DEFAULT_CODEC
from rlbuffers.deprecation import UNSET, renamed_attribute, renamed_keyword
from rlbuffers.errors import BufferClosedError, ManifestError, ReadOnlyError
from rlbuffers.packed import check_ragged_format
from rlbuffers.ring import RingState
from rlbuffers.samplers import EPISODE_ID, PRIORITY, SampleContext, Sampler
from rlbuffers.spec import FieldSpec
from rlbuffers.storage.create import create_tier, positive_int
from rlbuffers.storage.engine import open_tier
from rlbuffers.storage.location import make_location
from rlbuffers.storage.lock import WriterLock, probe
from rlbuffers.storage.manifest import KEEP_COMMITS, Manifest
from rlbuffers.storage.persistent import PersistentTier
from rlbuffers.storage.saver import SaveFuture, SaveReport, exit_watch
from rlbuffers.storage.store import (
    ReadOnlyStorage,
    WritableStorage,
    working_dir_of,
    writer_lock_path,
)

__all__ = ["ReplayBuffer", "SaveReport"]

#: Keys that ``sample`` adds next to the fields.
SAMPLE_KEYS = ("indices", "weights")


class ReplayBuffer:
    """A fixed-capacity FIFO ring of transitions stored on disk.

    Create with :meth:`create`, reopen with :meth:`open`. ``buf[0]`` is the oldest transition;
    beyond ``capacity`` each new one overwrites the oldest. ``add``/``extend`` write the working
    tier; ``save`` commits the changes to the persistent tier. Not thread-safe.
    """

    def __init__(self, tier: PersistentTier, *, mode: str,
                 working_dir: str | os.PathLike[str] | None = None,
                 fresh: bool = False, sampler: Sampler | None = None,
                 lock: WriterLock | None = None, pinned: bool = False) -> None:
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
            ReadOnlyStorage(tier, pinned=pinned) if mode == "r" else
            WritableStorage(tier, working_dir_of(loc, working_dir), fresh=fresh))
        self._closed = False
        if self._storage.manifest is not m:  # a reader whose commit moved on while leasing
            self._load_state(self._storage.manifest)
        if mode != "r":
            exit_watch.add(self._storage.saver)

    def _load_state(self, m: Manifest, sampler: Sampler | None = None) -> None:
        self._ring: RingState = m.ring
        try:
            self.sampler: Sampler = sampler or samplers.sampler_from_state(m.sampler)
        except Exception as e:
            raise ManifestError(str(self.path), "sampler", "the state_dict() of a registered "
                                f"sampler ({type(e).__name__}: {e})", repr(m.sampler)[:120]) \
                from None
        try:
            self._rng = samplers.generator_from_state(m.rng)
        except Exception as e:
            raise ManifestError(str(self.path), "rng", "a bit_generator.state "
                                f"({type(e).__name__}: {e})", repr(m.rng)[:120]) from None

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
            sampler: a registered :class:`~rlbuffers.samplers.Sampler` (default uniform).
            working_dir: local directory of the working tier (default ``path/.working``; for
                a URL, under ``~/.cache/rlbuffers``). overwrite: replace a buffer at ``path``.
            storage_options: fsspec options for a URL path (``endpoint_url``, ``key``...).
            keep_commits: how many of the newest commits stay readable (>= 1; None: 2).
            next_of: derived field name -> stacked field, e.g. ``{"next_obs": "obs"}``: the
                derived field is added and sampled like the others (same spec) but stored
                only as the next transition's frame (plus each episode's last next frame);
                see :mod:`rlbuffers.framestack`, which also covers ``stack_axis`` fields.
            keep_generations: deprecated spelling of ``keep_commits``.

        Raises:
            FieldError: an invalid field name or spec. ValueError: a bad capacity, chunk size or
            codec. FileExistsError: ``path`` is not empty and ``overwrite`` is False.
        """
        keep_commits = renamed_keyword("keep_generations", keep_generations,
                                       "keep_commits", keep_commits)
        spec.check_field_specs(fields, SAMPLE_KEYS)
        next_of = framestack_columns.check_next_of(fields, next_of, SAMPLE_KEYS)
        sampler = sampler or samplers.UniformSampler()
        loc = make_location(path, dict(storage_options or {}))
        wdir = working_dir_of(loc, working_dir)
        if overwrite and isinstance(loc.root, Path):
            probe(writer_lock_path(loc, wdir))  # never overwrite a buffer a writer has open
        tier = create_tier(
            loc, capacity=capacity, fields=fields,
            internal={EPISODE_ID: FieldSpec((), "int64"), **sampler.extra_columns,
                      **framestack_columns.side_columns(fields, next_of)}, next_of=next_of,
            chunk_transitions=chunk_transitions, codec=codec,
            sampler_state=sampler.state_dict(), seed=seed, overwrite=overwrite,
            keep_commits=KEEP_COMMITS if keep_commits is None else keep_commits)
        return cls._locked(tier.loc, wdir, lambda lock: cls(
            tier, mode="r+", working_dir=working_dir, fresh=True, sampler=sampler, lock=lock))

    @classmethod
    def _locked(cls, loc: Any, wdir: Path,
                build: Callable[[WriterLock], ReplayBuffer]) -> ReplayBuffer:
        """``build(lock)`` with the writer lock of ``loc`` taken first, released if ``build``
        fails."""
        path = writer_lock_path(loc, wdir)
        if not isinstance(loc.root, Path):
            path.parent.mkdir(parents=True, exist_ok=True)
        lock = WriterLock.acquire(path)
        try:
            return build(lock)
        except BaseException:
            lock.release()
            raise

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, mode: str = "r+",
             working_dir: str | os.PathLike[str] | None = None,
             storage_options: Mapping[str, Any] | None = None,
             commit: int | None = None, generation: int | None = UNSET) -> ReplayBuffer:
        """Open the last commit at ``path`` (a working tier that mirrors it is reused, else
        rebuilt chunk by chunk); data added after the last ``save`` is discarded.

        Args:
            mode: ``"r+"`` (read/write) or ``"r"`` (read-only: a snapshot of one commit, read
                from committed chunks; the writer's later saves do not change it).
            commit: (``mode="r"``) the number of a kept older commit to read instead of the
                last. generation: deprecated spelling of ``commit``.
            working_dir, storage_options: as ``create``.

        Raises:
            NotABufferError: no buffer there. FormatVersionError: a newer format. ValueError: an
            unknown mode. CorruptChunkError: a chunk to rebuild fails its checksum.
            SnapshotReclaimedError: commit ``commit`` is not kept.
        """
        commit = renamed_keyword("generation", generation, "commit", commit)
        if mode not in ("r", "r+") or (commit is not None and mode != "r"):
            raise ValueError(f"mode: expected 'r' or 'r+' ('r' with commit), got {mode!r}")
        loc = make_location(path, dict(storage_options or {}))
        tier = open_tier(loc, commit)  # no buffer, or an invalid one: raised before any lock
        if mode == "r":
            return cls(tier, mode=mode, working_dir=working_dir, pinned=commit is not None)
        # a writer: the lock, then the manifest again (no other writer commits after that)
        return cls._locked(loc, working_dir_of(loc, working_dir), lambda lock: cls(
            open_tier(loc), mode=mode, working_dir=working_dir, lock=lock))

    def add(self, **transition: Any) -> None:
        """Append one transition (one keyword per field, shapes as in the field specs).

        Raises:
            FieldError: an unknown or missing field, or a wrong shape or dtype (the buffer is
            unchanged). ReadOnlyError: opened with ``mode="r"``.
        """
        storage = self._writer()
        spec.check_names(list(self._fields), list(transition))
        rows = {}
        for n, s in self._fields.items():
            row = spec.check_row(n, s, transition[n])
            rows[n] = [row] if s.ragged else row[None]
        self._write(storage, rows, 1)

    def extend(self, batch: Mapping[str, Any]) -> None:
        """Append ``B`` transitions: ``batch[field]`` is ``[B, *shape]`` (ragged: a sequence of
        ``B`` arrays). If ``B`` exceeds the capacity only the last ``capacity`` stay.

        Raises:
            FieldError: as :meth:`add`, or unequal batch sizes. ReadOnlyError: as :meth:`add`.
        """
        storage = self._writer()
        spec.check_names(list(self._fields), list(batch))
        size = len(batch[next(iter(self._fields))])
        rows = {n: spec.check_batch(n, s, batch[n], size) for n, s in self._fields.items()}
        self._write(storage, rows, size)

    def _write(self, storage: WritableStorage, rows: dict[str, Any], n: int) -> None:
        if n == 0:
            return
        done = spec.episode_ends(rows, n)
        episode, ended = self._ring.episode_ids(done)
        side: list[tuple[int, dict[str, Any]]] = []
        if self._stacks:
            rows, side = self._stacks.encode(rows, n, done, self._ring, self._gather)
        first, slots = self._ring.append_slots(n)
        kept = {name: data[n - len(slots):] for name, data in rows.items()}
        kept[EPISODE_ID] = episode[n - len(slots):]
        extra = self.sampler.on_write(slots, self._context())
        for name in self.sampler.extra_columns:
            kept[name] = extra
        storage.write(first, kept)
        for slot, columns in side:
            storage.write(slot, columns)
        self._ring = self._ring.appended(n, ended)

    def end_episode(self) -> bool:
        """End the newest transition's episode without changing its fields: the next one added
        starts an episode (a stacked field then stores its earlier frames as given, and no
        longer requires it to continue the newest stack). For environments reset outside an
        episode end (no ``terminated``/``truncated``/``done`` flag set). Kept by the next
        ``save``. Returns False (nothing changes) when the buffer is empty or the newest
        transition ended its episode already.

        Raises:
            ReadOnlyError: opened with ``mode="r"``.
        """
        self._writer()
        total = self._ring.total_added
        if total == 0 or int(self._gather(EPISODE_ID, np.array([(total - 1) % self.capacity]))[0]
                             ) < self._ring.episodes:
            return False
        self._ring = self._ring.appended(0, 1)
        return True

    def __len__(self) -> int:
        return self._ring.size

    fields = property(lambda self: dict(self._fields), doc="Field name -> spec (user fields).")
    total_added = property(lambda self: self._ring.total_added, doc="Transitions ever added.")
    episodes = property(lambda self: self._ring.episodes, doc="Episodes ended so far.")
    commit = property(lambda self: self._storage.manifest.commit,
                      doc="The number of the commit on disk (0 at create, +1 per save).")
    generation = renamed_attribute("generation", "commit")
    metadata = property(lambda self: self._storage.manifest.metadata,
                        doc="The metadata dict of the last commit.")
    committed_at = property(lambda self: self._storage.manifest.committed_at,
                            doc="Unix time (seconds) of the last commit.")

    def _context(self) -> SampleContext:
        return SampleContext.over(self._ring, self._gather, self.chunk_transitions)

    def _gather(self, name: str, slots: np.ndarray) -> Any:
        self._open_check()
        return self._storage.gather(name, np.asarray(slots, dtype=np.int64).ravel())

    def _rows(self, slots: np.ndarray, ragged: str = "list") -> dict[str, Any]:
        """``{field: [*slots.shape, *shape]}`` of stored ``slots`` (stacks rebuilt; ragged
        fields as ``ragged`` says: see :meth:`sample`)."""
        if self._stacks:
            plain = self._stacks.reader(self._ring, self._gather, slots)
        else:  # what _gather does, once for all fields
            self._open_check()
            flat, gather = np.asarray(slots, dtype=np.int64).ravel(), self._storage.gather
            plain = lambda n: gather(n, flat)  # noqa: E731
        if ragged == "list":  # the default path stays as it was: no wrapper per field
            return spec.batch_rows(self._fields, slots.shape, plain)
        flat = np.asarray(slots, dtype=np.int64).ravel()
        joined = (self._storage.gather_packed if ragged == "packed"
                  else self._storage.gather_padded)

        def get(name: str) -> Any:
            if self._fields[name].ragged:
                self._open_check()
                return joined(name, flat)
            return plain(name)

        return spec.batch_rows(self._fields, slots.shape, get)

    def sample(self, batch_size: int, *, rng: np.random.Generator | None = None,
               ragged: str = "list") -> dict[str, Any]:
        """Draw ``batch_size`` (B) transitions with the sampler, from ``rng`` (default: the
        buffer's own generator, saved by ``save``).

        Args:
            ragged: how ragged fields (``FieldSpec((None, *row), ...)``) come back:
                ``"list"`` (default): a list of B arrays ``[len_i, *row]`` (sequence samplers:
                B lists of L arrays); ``"packed"``: one :class:`~rlbuffers.packed.Packed`
                (FlashAttention's varlen layout) with ``values [sum_len, *row]`` in the
                field's dtype and ``cu_seqlens`` int64[B + 1] (row i is
                ``values[cu_seqlens[i]:cu_seqlens[i + 1]]``); with a sequence sampler the
                B * L rows are packed in ``[B, L]`` row-major order and ``cu_seqlens`` is
                int64[B * L + 1] (row ``(b, l)`` is number ``b * L + l``); ``"padded"``: one
                :class:`~rlbuffers.padded.Padded` with ``values [B, T, *row]`` in the
                field's dtype, ``T`` the longest of the B rows, each row followed by zeros
                (the pad value is always 0, ``False`` for bool), and ``lengths`` int64[B]
                (row i is ``values[i, :lengths[i]]``; ``mask`` bool[B, T]); with a sequence
                sampler ``values [B * L, T, *row]`` and ``lengths`` int64[B * L], rows in
                ``[B, L]`` row-major order as packed. All formats draw the same transitions
                from the same generator state; packed and padded return no Python object
                per row.

        Returns:
            ``{field: [B, *shape]}`` (sequences: ``[B, L, *shape]``; ragged fields: as
            ``ragged`` says), ``indices``: int64[B] (``[B, L]``) transition ids,
            ``weights``: float32[B] importance weights (ones unless prioritized).

        Raises:
            BufferEmptyError: too few transitions.
            ValueError: batch_size < 1, or ``ragged`` not ``"list"``, ``"packed"`` or
                ``"padded"`` (nothing is drawn: the generator does not move).
        """
        batch_size = positive_int("batch_size", batch_size)
        ragged = check_ragged_format(ragged)
        draw = self.sampler.sample(batch_size, self._context(), rng or self._rng)
        rows = self._rows(draw.slots, ragged)
        return {**rows, "indices": self._ring.ids(draw.slots), "weights": draw.weights}

    def __getitem__(self, key: int | slice | np.ndarray | list[int]) -> dict[str, Any]:
        """Transitions by position (0 = oldest, -1 = newest): an int gives ``{field:
        [*shape]}``, a slice or int array ``{field: [N, *shape]}`` (ragged: a list).

        Raises:
            IndexError: a position outside ``[-len, len)``.
        """
        positions = self._ring.positions(key)
        slots = self._ring.slots(np.atleast_1d(positions))
        rows = self._rows(slots)
        return {n: v[0] for n, v in rows.items()} if positions.ndim == 0 else rows

    def update_priorities(self, indices: Any, priorities: Any) -> int:
        """Set new priorities (e.g. ``|TD error|``, float[N], finite, >= 0) of sampled
        transitions ``indices`` (int64[N] ids from ``sample``); returns how many were updated
        (ids overwritten since they were sampled are skipped).

        Raises:
            NotPrioritizedError: the buffer's sampler keeps no priorities.
            FieldError: unequal lengths, negative or non-finite priorities, or ids never
                added.
        """
        storage = self._writer()
        slots, raw, n = samplers.priority_update(self.sampler, self._context(), self._ring,
                                                 indices, priorities)
        if n:
            storage.scatter(PRIORITY, slots, raw)
        return n

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

    def _open_check(self) -> None:
        if self._closed:
            raise BufferClosedError(f"{self.path}: buffer is closed")

    def _writer(self) -> WritableStorage:
        self._open_check()
        if not isinstance(self._storage, WritableStorage):
            raise ReadOnlyError(f"{self.path}: opened read-only (mode='r')")
        return self._storage

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
