"""ReplayBuffer: a FIFO ring of transitions on disk, sampled from an uncompressed working tier
and committed to a compressed Zarr v3 group with incremental, atomic saves.

The parts: :mod:`rlbuffers.ring` (ring state as a value), :mod:`rlbuffers.samplers` (index
policies), :mod:`rlbuffers.storage.store` (working tier + saver, or read-only reads),
:mod:`rlbuffers.storage.manifest` (the commit record). ``docs/format.md`` has the layout.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from rlbuffers.compression import DEFAULT_CODEC
from rlbuffers.errors import BufferClosedError, FieldError, NotPrioritizedError, ReadOnlyError
from rlbuffers.ring import RingState
from rlbuffers.samplers import (
    PRIORITY,
    SampleContext,
    Sampler,
    UniformSampler,
    check_priorities,
    sampler_from_state,
)
from rlbuffers.spec import (
    EPISODE_END_FIELDS,
    FieldSpec,
    check_batch,
    check_field_specs,
    check_names,
    check_row,
)
from rlbuffers.storage.create import create_tier, positive_int
from rlbuffers.storage.location import Location
from rlbuffers.storage.saver import SaveFuture, SaveReport
from rlbuffers.storage.store import ReadOnlyStorage, WritableStorage, default_working_dir
from rlbuffers.storage.zarr_tier import ZarrTier

__all__ = ["ReplayBuffer", "SaveReport"]

EPISODE_ID = "_episode_id"
#: Keys that ``sample`` adds next to the fields.
SAMPLE_KEYS = ("indices", "weights")


class ReplayBuffer:
    """A fixed-capacity FIFO ring of transitions stored on disk.

    Create with :meth:`create`, reopen with :meth:`open`. Transitions are indexed in insertion
    order (``buf[0]`` is the oldest); once ``capacity`` transitions are stored, each new one
    overwrites the oldest. ``add``/``extend`` write to the working tier; ``save`` commits every
    change since the last commit to the persistent tier. Not thread-safe.
    """

    def __init__(self, tier: ZarrTier, *, mode: str, working_dir: Path | None = None,
                 fresh: bool = False, sampler: Sampler | None = None) -> None:
        m, loc = tier.manifest, tier.loc
        #: the buffer's directory (a ``Path``) or URL (a ``str``)
        self.path: Path | str = loc.root if loc.local else loc.url
        self.mode = mode
        self.capacity: int = m.capacity
        self.chunk_transitions: int = m.layout.base_chunk_rows
        self._fields = dict(m.fields)
        self._ring: RingState = m.ring
        self.sampler: Sampler = sampler or sampler_from_state(m.sampler)
        self._rng = np.random.Generator(getattr(np.random, m.rng["bit_generator"])())
        self._rng.bit_generator.state = m.rng
        self._storage: ReadOnlyStorage | WritableStorage = (
            ReadOnlyStorage(tier) if mode == "r" else
            WritableStorage(tier, working_dir or default_working_dir(loc), fresh=fresh))
        self._closed = False

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def create(cls, path: str | os.PathLike[str], *, capacity: int,
               fields: Mapping[str, FieldSpec], chunk_transitions: int | None = None,
               codec: str | Mapping[str, str] = DEFAULT_CODEC, sampler: Sampler | None = None,
               seed: int | None = None, working_dir: str | os.PathLike[str] | None = None,
               overwrite: bool = False,
               storage_options: Mapping[str, Any] | None = None) -> ReplayBuffer:
        """Create an empty buffer at ``path`` (a directory; committed as generation 0).

        Args:
            capacity: most transitions held; the oldest are overwritten beyond it.
            fields: name -> :class:`FieldSpec`. Fields named ``terminated``, ``truncated`` or
                ``done`` (``FieldSpec((), "bool")``) end an episode when True.
            chunk_transitions: transitions per base chunk: the chunk of the largest field and
                of ragged fields, and the unit of incremental saves; None picks ~4 MiB raw per
                chunk of the largest field. Smaller fixed fields store whole multiples of it,
                about as many bytes per chunk (see :mod:`rlbuffers.storage.layout`).
            codec: ``"blosc-zstd"`` (default), ``"blosc-lz4"``, ``"zstd"`` or ``"none"``, or a
                field -> codec mapping (missing fields get the default).
            sampler: a registered :class:`~rlbuffers.samplers.Sampler`: ``UniformSampler``
                (default), ``PrioritizedSampler``, ``SequenceSampler``, or your own.
            seed: seed of the buffer's ``np.random.Generator`` (PCG64).
            working_dir: local directory of the uncompressed working tier (default
                ``path/.working``, or for a URL a directory under ``~/.cache/rlbuffers``).
            overwrite: replace an existing buffer at ``path``.
            storage_options: fsspec options when ``path`` is a URL (``s3://bucket/buf``...),
                e.g. ``{"endpoint_url": ..., "key": ..., "secret": ...}``.

        Raises:
            FieldError: an invalid field name or spec. ValueError: a bad capacity, chunk size or
            codec. FileExistsError: ``path`` is not empty and ``overwrite`` is False.
        """
        check_field_specs(fields, SAMPLE_KEYS)
        sampler = sampler or UniformSampler()
        tier = create_tier(
            Location(path, dict(storage_options or {})), capacity=capacity, fields=fields,
            internal={EPISODE_ID: FieldSpec((), "int64"), **sampler.extra_columns},
            chunk_transitions=chunk_transitions, codec=codec,
            sampler_state=sampler.state_dict(), seed=seed, overwrite=overwrite)
        return cls(tier, mode="r+", working_dir=_opt_path(working_dir), fresh=True,
                   sampler=sampler)

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, mode: str = "r+",
             working_dir: str | os.PathLike[str] | None = None,
             storage_options: Mapping[str, Any] | None = None) -> ReplayBuffer:
        """Open the last commit of the buffer at ``path``.

        Reads only the manifest; the working tier is reused when it mirrors the commit, and only
        the chunks changed since the commit (or all of them, if the working tier is missing) are
        rebuilt from the persistent tier. Data added after the last ``save`` is discarded.

        Args:
            mode: ``"r+"`` (read/write) or ``"r"`` (read-only; reads decode stored chunks and
                never touch the working tier).
            working_dir, storage_options: as for :meth:`create`.

        Raises:
            NotABufferError: ``path`` holds no buffer. FormatVersionError: written by a newer
            format. ValueError: an unknown mode. CorruptChunkError: a chunk that had to be
            rebuilt failed its checksum.
        """
        if mode not in ("r", "r+"):
            raise ValueError(f"mode: expected 'r' or 'r+', got {mode!r}")
        tier = ZarrTier.open(Location(path, dict(storage_options or {})))
        return cls(tier, mode=mode, working_dir=_opt_path(working_dir))

    # -- adding -----------------------------------------------------------------------------
    def add(self, **transition: Any) -> None:
        """Append one transition (one keyword per field, shapes as in the field specs).

        Raises:
            FieldError: an unknown or missing field, or a wrong shape or dtype; the buffer is
            left unchanged. ReadOnlyError: the buffer was opened with ``mode="r"``.
        """
        storage = self._writer()
        check_names(list(self._fields), list(transition))
        rows = {}
        for n, spec in self._fields.items():
            row = check_row(n, spec, transition[n])
            rows[n] = [row] if spec.ragged else row[None]
        self._write(storage, rows, 1)

    def extend(self, batch: Mapping[str, Any]) -> None:
        """Append ``B`` transitions: ``batch[field]`` is ``[B, *shape]`` (ragged: a sequence of
        ``B`` arrays). If ``B`` exceeds the capacity only the last ``capacity`` stay.

        Raises:
            FieldError: an unknown or missing field, a wrong shape or dtype, or unequal batch
            sizes; the buffer is left unchanged. ReadOnlyError: opened with ``mode="r"``.
        """
        storage = self._writer()
        check_names(list(self._fields), list(batch))
        size = len(batch[next(iter(self._fields))])
        rows = {n: check_batch(n, spec, batch[n], size) for n, spec in self._fields.items()}
        self._write(storage, rows, size)

    def _write(self, storage: WritableStorage, rows: dict[str, Any], n: int) -> None:
        if n == 0:
            return
        done = np.zeros(n, dtype=bool)
        for name in EPISODE_END_FIELDS:
            if name in rows:
                done |= np.asarray(rows[name], dtype=bool).reshape(n)
        ends = np.cumsum(done)
        episode = self._ring.episodes + np.concatenate([[0], ends[:-1]]).astype(np.int64)
        first, slots = self._ring.append_slots(n)
        kept = {name: data[n - len(slots):] for name, data in rows.items()}
        kept[EPISODE_ID] = episode[n - len(slots):]
        extra = self.sampler.on_write(slots, self._context())
        for name in self.sampler.extra_columns:
            kept[name] = extra
        storage.write(first, kept)
        self._ring = self._ring.appended(n, int(ends[-1]))

    # -- reading ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._ring.size

    @property
    def fields(self) -> dict[str, FieldSpec]:
        """Field name -> spec (user fields only)."""
        return dict(self._fields)

    @property
    def total_added(self) -> int:
        """Transitions ever added."""
        return self._ring.total_added

    @property
    def episodes(self) -> int:
        """Episodes ended so far."""
        return self._ring.episodes

    def _context(self) -> SampleContext:
        ring = self._ring
        return SampleContext(size=ring.size, capacity=ring.capacity, start_slot=ring.start_slot,
                             episode_ids=lambda slots: self._gather(EPISODE_ID, slots),
                             priorities=self._all_priorities)

    def _all_priorities(self) -> np.ndarray:
        out = np.zeros(self.capacity, dtype=np.float64)
        size, k = self._ring.size, self.chunk_transitions
        for a in range(0, size, k):
            out[a:min(a + k, size)] = self._gather(PRIORITY, np.arange(a, min(a + k, size)))
        return out

    def _gather(self, name: str, slots: np.ndarray) -> Any:
        self._open_check()
        return self._storage.gather(name, np.asarray(slots, dtype=np.int64).ravel())

    def _rows(self, slots: np.ndarray) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, spec in self._fields.items():
            data = self._gather(name, slots)
            if not spec.ragged:
                out[name] = data.reshape(*slots.shape, *spec.row_shape)
            elif slots.ndim == 1:
                out[name] = data
            else:
                w = slots.shape[1]
                out[name] = [data[i:i + w] for i in range(0, len(data), w)]
        return out

    def sample(self, batch_size: int, *, rng: np.random.Generator | None = None) -> dict[str, Any]:
        """Draw a batch with the buffer's sampler.

        Args:
            batch_size: B, the number of transitions (or sequences) drawn.
            rng: the generator to draw from; default the buffer's own (saved by ``save``).

        Returns:
            ``{field: [B, *shape]}`` (a :class:`SequenceSampler` gives ``[B, L, *shape]``;
            ragged fields give a list of ``B`` arrays ``[len_i, *row]``, or for sequences a list
            of ``B`` lists of ``L`` arrays), plus ``indices``: int64[B] (``[B, L]``) transition
            ids for :meth:`update_priorities`, and ``weights``: float32[B] importance weights
            (ones unless prioritized).

        Raises:
            BufferEmptyError: too few transitions. ValueError: batch_size < 1.
        """
        batch_size = positive_int("batch_size", batch_size)
        draw = self.sampler.sample(batch_size, self._context(), rng or self._rng)
        return {**self._rows(draw.slots), "indices": self._ring.ids(draw.slots),
                "weights": draw.weights}

    def __getitem__(self, key: int | slice | np.ndarray | list[int]) -> dict[str, Any]:
        """Transitions by position in insertion order (0 = oldest, -1 = newest).

        An int gives one transition (``{field: [*shape]}``); a slice or an int array gives
        ``{field: [N, *shape]}`` (ragged: a list).

        Raises:
            IndexError: a position outside ``[-len, len)``.
        """
        positions = self._ring.positions(key)
        rows = self._rows(self._ring.slots(np.atleast_1d(positions)))
        return {n: v[0] for n, v in rows.items()} if positions.ndim == 0 else rows

    # -- priorities -------------------------------------------------------------------------
    def update_priorities(self, indices: Any, priorities: Any) -> int:
        """Set new priorities (e.g. ``|TD error|``) of sampled transitions.

        Args:
            indices: int64[N] transition ids from ``sample(...)["indices"]``.
            priorities: float[N], finite and >= 0.

        Returns:
            how many were updated; ids of transitions overwritten since they were sampled are
            skipped.

        Raises:
            NotPrioritizedError: the buffer's sampler keeps no priorities. FieldError: unequal
            lengths, negative or non-finite priorities, or ids never added.
        """
        storage = self._writer()
        update = getattr(self.sampler, "update", None)
        if PRIORITY not in self.sampler.extra_columns or update is None:
            raise NotPrioritizedError("update_priorities needs a PrioritizedSampler, buffer "
                                      f"has {type(self.sampler).__name__}")
        ids = np.asarray(indices, dtype=np.int64).ravel()
        pr = check_priorities(priorities, len(ids))
        if ((ids < 0) | (ids >= self.total_added)).any():
            raise FieldError(f"indices: expected transition ids in [0, {self.total_added}), "
                             f"got min {ids.min()} max {ids.max()}")
        live = ids >= self._ring.first_live_id
        if not live.any():
            return 0
        slots, last = np.unique((ids[live] % self.capacity)[::-1], return_index=True)
        raw = update(slots, pr[live][::-1][last], self._context())  # a repeated id: last wins
        storage.scatter(PRIORITY, slots, raw)
        return int(live.sum())

    # -- saving -----------------------------------------------------------------------------
    def save(self, *, metadata: Mapping[str, Any] | None = None, full: bool = False,
             background: bool = False) -> SaveReport | SaveFuture:
        """Commit every change since the last commit.

        Writes only the chunks changed since the last commit (``full=True`` rewrites every
        filled chunk), in runs of consecutive chunks of at most ~32 MiB raw
        (``save_job.SAVE_RUN_BYTES``), so extra memory is bounded whatever the buffer size;
        then commits by renaming the manifest into place. The commit holds the buffer as it was
        when ``save`` was called. On any error before the commit the previous commit stays
        intact and the changes stay pending for the next save.

        Args:
            metadata: JSON-serialisable dict stored with the commit (e.g. the trainer's
                generation); None keeps the previous one. Read it back as ``buf.metadata``.
            full: rewrite all filled chunks (a full save, e.g. after changing storage).
            background: encode and write in a worker thread and return at once; ``add``,
                ``extend``, ``sample`` and ``update_priorities`` may go on meanwhile (chunks
                they overwrite before the save reads them are copied aside first). A later
                ``save``, ``wait_for_save`` or ``close`` waits for it.

        Returns:
            a :class:`SaveReport`, or with ``background=True`` a ``concurrent.futures.Future``
            of one (its ``result()`` raises the save's error, if any).

        Raises:
            TypeError: metadata is not JSON-serialisable. OSError: the write failed (e.g. disk
            full); nothing committed. ReadOnlyError: opened with ``mode="r"``. Also the error
            of an earlier background save whose future nobody asked.
        """
        storage = self._writer()
        storage.saver.wait()
        meta = self.metadata if metadata is None else json.loads(json.dumps(dict(metadata)))
        commit = storage.manifest.replace(ring=self._ring, sampler=self.sampler.state_dict(),
                                          rng=self._rng.bit_generator.state, metadata=meta)
        return storage.commit(commit, full=full, background=background)

    def wait_for_save(self) -> None:
        """Block until a background save finishes.

        Raises:
            Exception: the background save's error, unless its future already reported it (the
            changes it could not commit stay pending for the next save).
        """
        if isinstance(self._storage, WritableStorage):
            self._storage.saver.wait()

    @property
    def generation(self) -> int:
        """The commit number on disk (0 at create, +1 per save)."""
        return self._storage.manifest.generation

    @property
    def metadata(self) -> dict[str, Any]:
        """The metadata of the last commit."""
        return self._storage.manifest.metadata

    @property
    def committed_at(self) -> float:
        """Unix time (seconds) of the last commit."""
        return self._storage.manifest.committed_at

    @property
    def rng(self) -> np.random.Generator:
        """The buffer's generator (its state is saved by ``save`` and restored by ``open``)."""
        return self._rng

    # -- lifecycle --------------------------------------------------------------------------
    def _open_check(self) -> None:
        if self._closed:
            raise BufferClosedError(f"{self.path}: buffer is closed")

    def _writer(self) -> WritableStorage:
        self._open_check()
        if not isinstance(self._storage, WritableStorage):
            raise ReadOnlyError(f"{self.path}: opened read-only (mode='r')")
        return self._storage

    def close(self) -> None:
        """Wait for a background save, then release files. Does not save: changes since the
        last ``save`` are discarded.

        Raises:
            Exception: a background save's error nobody has seen (after the files are released).
        """
        if not self._closed:
            self._closed = True
            self._storage.close()

    def __enter__(self) -> ReplayBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"ReplayBuffer({str(self.path)!r}, size={len(self)}, capacity={self.capacity}, "
                f"generation={self.generation}, fields={list(self._fields)})")


def _opt_path(p: str | os.PathLike[str] | None) -> Path | None:
    return None if p is None else Path(p)
