"""ReplayBuffer: a FIFO ring of transitions on disk, sampled from an uncompressed working tier
and committed to a compressed Zarr v3 group with incremental, atomic saves.

See ``docs/format.md`` for the on-disk layout and the commit protocol.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rlbuffers.codecs import DEFAULT_CODEC, check_codec
from rlbuffers.errors import (
    BufferClosedError,
    BufferExistsError,
    FieldError,
    NotPrioritizedError,
    ReadOnlyError,
)
from rlbuffers.samplers import (
    PrioritizedSampler,
    SampleContext,
    Sampler,
    UniformSampler,
    sampler_from_state,
)
from rlbuffers.save_job import SAVE_RUN_BYTES, SaveJob, rows_nbytes
from rlbuffers.spec import FieldSpec, check_batch, check_names, check_row
from rlbuffers.storage.location import Location
from rlbuffers.storage.manifest import (
    FORMAT_VERSION,
    MANIFEST,
    field_chunk_rows,
    read_manifest,
    write_manifest,
)
from rlbuffers.storage.persistent import PersistentTier, chunk_rows, stored_of
from rlbuffers.storage.reader import ChunkReader
from rlbuffers.storage.working import FixedColumn, WorkingTier

log = logging.getLogger(__name__)

EPISODE_ID = "_episode_id"
PRIORITY = "_priority"
#: Boolean fields whose True value ends an episode.
EPISODE_END_FIELDS = ("terminated", "truncated", "done")
#: Keys that ``sample`` adds next to the fields.
SAMPLE_KEYS = ("indices", "weights")
#: Target raw bytes of one chunk of the largest field when ``chunk_transitions`` is None.
AUTO_CHUNK_BYTES = 4 * 2**20


@dataclass(frozen=True)
class SaveReport:
    """What one :meth:`ReplayBuffer.save` did.

    Attributes:
        generation: the commit number now on disk.
        chunks_written: chunks encoded and written (all fields).
        bytes_written: compressed bytes written, checksums included.
        raw_bytes: uncompressed bytes those chunks hold.
        seconds: wall time of the save.
    """

    generation: int
    chunks_written: int
    bytes_written: int
    raw_bytes: int
    seconds: float


def _auto_chunk(fields: Mapping[str, FieldSpec], capacity: int) -> int:
    row = max(spec.estimate_bytes() for spec in fields.values())
    return int(max(1, min(capacity, AUTO_CHUNK_BYTES // max(row, 1))))


def _check_create_args(capacity: int, fields: Mapping[str, FieldSpec]) -> None:
    if not isinstance(capacity, (int, np.integer)) or capacity < 1:
        raise ValueError(f"capacity: expected a positive integer, got {capacity!r}")
    if not fields:
        raise FieldError("fields: expected at least one field, got none")
    for name, spec in fields.items():
        if not isinstance(spec, FieldSpec):
            raise FieldError(f"field {name!r}: expected a FieldSpec, got {type(spec).__name__}")
        if not name or name.startswith(("_", ".")) or "/" in name or name in SAMPLE_KEYS:
            raise FieldError(
                f"field name {name!r}: must be non-empty, must not start with '_' or '.', "
                f"contain '/', or be one of {SAMPLE_KEYS}"
            )
        if name in EPISODE_END_FIELDS and (spec.shape != () or spec.dtype != np.bool_):
            raise FieldError(
                f"field {name!r}: episode-end flags must be FieldSpec((), 'bool'), "
                f"got {spec.describe()}"
            )


class ReplayBuffer:
    """A fixed-capacity FIFO ring of transitions stored on disk.

    Create with :meth:`create`, reopen with :meth:`open`. Transitions are indexed in insertion
    order (``buf[0]`` is the oldest); once ``capacity`` transitions are stored, each new one
    overwrites the oldest. ``add``/``extend`` write to the working tier; ``save`` commits every
    change since the last commit to the persistent tier. Not thread-safe.
    """

    def __init__(
        self,
        loc: Location,
        manifest: dict[str, Any],
        *,
        mode: str,
        working_dir: Path | None,
        fresh: bool = False,
    ) -> None:
        self._loc = loc
        #: the buffer's directory (a ``Path``) or URL (a ``str``)
        self.path: Path | str = loc.root if loc.local else loc.url
        self._buffer_id: str = manifest.get("buffer_id", "")
        self.mode = mode
        self._fields = {n: FieldSpec.from_dict(d) for n, d in manifest["fields"].items()}
        self._codecs = {n: d["codec"] for n, d in manifest["fields"].items()}
        self._internal = {n: FieldSpec.from_dict(d) for n, d in manifest["internal"].items()}
        self.capacity: int = manifest["capacity"]
        self.chunk_transitions: int = manifest["chunk_transitions"]
        self._load_state(manifest)
        self._specs = {**self._fields, **self._internal}
        #: field -> transitions per stored chunk (a multiple of ``chunk_transitions``)
        self._chunk_rows = field_chunk_rows(manifest)
        self._persistent = PersistentTier(loc, self._specs, self._chunk_rows, self.capacity)
        self._persistent.generation = self.generation
        self._dirty: dict[str, set[int]] = {n: set() for n in self._specs}
        self._lock = threading.Lock()  # guards working-tier writes against a background save
        self._job: SaveJob | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._pending_save: Future[SaveReport] | None = None
        self._working: WorkingTier | None = None
        self._reader: ChunkReader | None = None
        self._closed = False
        if mode == "r":
            self._reader = ChunkReader(self._persistent)
        else:
            self._working_dir = working_dir or default_working_dir(loc)
            if fresh:
                shutil.rmtree(self._working_dir, ignore_errors=True)
            self._attach_working()

    def _load_state(self, m: dict[str, Any]) -> None:
        self.generation: int = m["generation"]
        self._cursor: int = m["cursor"]
        self._size: int = m["size"]
        self.total_added: int = m["total_added"]
        self.episodes: int = m["episodes"]
        self._episode_id: int = m["episode_id"]
        self.metadata: dict[str, Any] = m["metadata"]
        self._committed_at: float = m["committed_at"]
        self.sampler: Sampler = sampler_from_state(m["sampler"])
        self._rng = np.random.Generator(getattr(np.random, m["rng"]["bit_generator"])())
        self._rng.bit_generator.state = m["rng"]

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        path: str | os.PathLike[str],
        *,
        capacity: int,
        fields: Mapping[str, FieldSpec],
        chunk_transitions: int | None = None,
        codec: str | Mapping[str, str] = DEFAULT_CODEC,
        sampler: Sampler | None = None,
        seed: int | None = None,
        working_dir: str | os.PathLike[str] | None = None,
        overwrite: bool = False,
        storage_options: Mapping[str, Any] | None = None,
    ) -> ReplayBuffer:
        """Create an empty buffer at ``path`` (a directory; committed as generation 0).

        Args:
            capacity: most transitions held; the oldest are overwritten beyond it.
            fields: name -> :class:`FieldSpec`. Fields named ``terminated``, ``truncated`` or
                ``done`` (``FieldSpec((), "bool")``) end an episode when True.
            chunk_transitions: transitions per stored chunk of the largest field and of ragged
                fields (the unit of incremental saves); None picks ~4 MiB raw per chunk of the
                largest field. Smaller fixed fields store whole multiples of it, about as many
                bytes per chunk (see :func:`rlbuffers.storage.persistent.chunk_rows`).
            codec: ``"blosc-zstd"`` (default), ``"blosc-lz4"``, ``"zstd"`` or ``"none"``, or a
                field -> codec mapping (missing fields get the default).
            sampler: :class:`UniformSampler` (default), :class:`PrioritizedSampler` or
                :class:`SequenceSampler`.
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
        _check_create_args(capacity, fields)
        loc = Location(path, dict(storage_options or {}))
        if loc.exists() and loc.listdir():
            if not overwrite:
                raise BufferExistsError(
                    f"{loc}: already exists and is not empty (pass overwrite=True)"
                )
            loc.remove_tree("")
        chunk = (
            _auto_chunk(fields, int(capacity)) if chunk_transitions is None else chunk_transitions
        )
        if not isinstance(chunk, (int, np.integer)) or chunk < 1:
            raise ValueError(f"chunk_transitions: expected a positive integer, got {chunk!r}")
        codecs = {
            n: check_codec(codec if isinstance(codec, str) else codec.get(n, DEFAULT_CODEC), n)
            for n in fields
        }
        sampler = sampler or UniformSampler()
        internal = {EPISODE_ID: FieldSpec((), "int64")}
        if sampler.uses_priorities:
            internal[PRIORITY] = FieldSpec((), "float64")
        codecs.update({n: DEFAULT_CODEC for n in internal})
        rows = chunk_rows({**fields, **internal}, int(chunk), int(capacity))
        PersistentTier.create(
            loc,
            {**fields, **internal},
            codecs,
            capacity=int(capacity),
            chunks=rows,
            attrs={"rlbuffers": {"format_version": FORMAT_VERSION, "manifest": MANIFEST}},
        )
        manifest = {
            "format": "rlbuffers",
            "format_version": FORMAT_VERSION,
            "buffer_id": uuid.uuid4().hex,
            "capacity": int(capacity),
            "chunk_transitions": int(chunk),
            "field_chunk_transitions": rows,
            "fields": {n: {**s.to_dict(), "codec": codecs[n]} for n, s in fields.items()},
            "internal": {n: s.to_dict() for n, s in internal.items()},
            "generation": 0,
            "cursor": 0,
            "size": 0,
            "total_added": 0,
            "episodes": 0,
            "episode_id": 0,
            "metadata": {},
            "committed_at": time.time(),
            "sampler": sampler.state_dict(),
            "rng": np.random.Generator(np.random.PCG64(seed)).bit_generator.state,
        }
        write_manifest(loc, manifest)
        buf = cls(loc, manifest, mode="r+", working_dir=_opt_path(working_dir), fresh=True)
        buf.sampler = sampler
        return buf

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        mode: str = "r+",
        working_dir: str | os.PathLike[str] | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> ReplayBuffer:
        """Open the last commit of the buffer at ``path``.

        Reads only the manifest; the working tier is reused when it mirrors the commit, and only
        the chunks changed since the commit (or all of them, if the working tier is missing) are
        rebuilt from the persistent tier. Data added after the last ``save`` is discarded.

        Args:
            mode: ``"r+"`` (read/write) or ``"r"`` (read-only; reads decode stored chunks and
                never touch the working tier, so it is safe while a writer runs).
            working_dir, storage_options: as for :meth:`create`.

        Raises:
            NotABufferError: ``path`` holds no buffer. FormatVersionError: written by a newer
            format. ValueError: an unknown mode. CorruptChunkError: a chunk that had to be
            rebuilt failed its checksum.
        """
        if mode not in ("r", "r+"):
            raise ValueError(f"mode: expected 'r' or 'r+', got {mode!r}")
        loc = Location(path, dict(storage_options or {}))
        return cls(loc, read_manifest(loc), mode=mode, working_dir=_opt_path(working_dir))

    def _attach_working(self) -> None:
        """Open (or create) the working tier and bring it in line with the last commit."""
        tier, gen, wdir = self._persistent, self.generation, self._working_dir
        tier.apply(gen)  # finishes an interrupted commit; drops uncommitted staging
        all_chunks = set(range(-(-self.capacity // self.chunk_transitions)))
        try:
            self._working = WorkingTier(
                wdir, self._specs, self.capacity, self.chunk_transitions, create=False,
                buffer_id=self._buffer_id,
            )
            state = self._working.state
            rebuild = (
                set(state.get("dirty_chunks", []))
                if self._working.trusted(self._buffer_id)
                and state.get("generation") in (gen, gen - 1)
                else all_chunks
            )
        except (OSError, ValueError):
            self._working = WorkingTier(
                wdir, self._specs, self.capacity, self.chunk_transitions, create=True,
                buffer_id=self._buffer_id,
            )
            rebuild = all_chunks
        if rebuild:
            self._rebuild(sorted(rebuild))
        self._working.write_state(gen, [])

    def _stored(self, name: str, chunks: set[int] | list[int]) -> list[int]:
        """The stored chunks of ``name`` that hold the base chunks ``chunks``."""
        return sorted(stored_of(chunks, self._chunk_rows[name], self.chunk_transitions))

    def _rebuild(self, chunks: list[int]) -> None:
        """Rewrite base chunks ``chunks`` of the working tier from the last commit (fields
        with larger stored chunks rewrite the whole stored chunk: the rest of it is
        unchanged since the commit, so rewriting it is harmless)."""
        assert self._working is not None
        filled = min(self.total_added, self.capacity)
        log.info("rebuilding %d chunk(s) of the working tier from %s", len(chunks), self.path)
        for name, col in self._working.columns.items():
            k = self._chunk_rows[name]
            for c in chunks:
                col.reset_chunk(c)
            for c in self._stored(name, chunks):
                if c * k < filled:
                    col.write(c * k, self._persistent.read_chunk(name, c))

    # -- adding -----------------------------------------------------------------------------
    def add(self, **transition: Any) -> None:
        """Append one transition (one keyword per field, shapes as in the field specs).

        Raises:
            FieldError: an unknown or missing field, or a wrong shape or dtype; the buffer is
            left unchanged. ReadOnlyError: the buffer was opened with ``mode="r"``.
        """
        self._writable()
        check_names(list(self._fields), list(transition))
        rows = {}
        for n, spec in self._fields.items():
            row = check_row(n, spec, transition[n])
            rows[n] = [row] if spec.ragged else row[None]
        self._write(rows, 1)

    def extend(self, batch: Mapping[str, Any]) -> None:
        """Append ``B`` transitions: ``batch[field]`` is ``[B, *shape]`` (ragged: a sequence of
        ``B`` arrays). If ``B`` exceeds the capacity only the last ``capacity`` stay.

        Raises:
            FieldError: an unknown or missing field, a wrong shape or dtype, or unequal batch
            sizes; the buffer is left unchanged. ReadOnlyError: opened with ``mode="r"``.
        """
        self._writable()
        check_names(list(self._fields), list(batch))
        first = next(iter(self._fields))
        size = len(batch[first])
        rows = {n: check_batch(n, spec, batch[n], size) for n, spec in self._fields.items()}
        self._write(rows, size)

    def _write(self, rows: dict[str, Any], n: int) -> None:
        assert self._working is not None
        if n == 0:
            return
        done = np.zeros(n, dtype=bool)
        for name in EPISODE_END_FIELDS:
            if name in rows:
                done |= np.asarray(rows[name], dtype=bool).reshape(n)
        ends = np.cumsum(done)
        rows[EPISODE_ID] = self._episode_id + np.concatenate([[0], ends[:-1]]).astype(np.int64)
        keep = min(n, self.capacity)
        first_slot = (self._cursor + n - keep) % self.capacity
        slots = (first_slot + np.arange(keep)) % self.capacity
        ctx = self._context()
        prio = self.sampler.on_write(slots, ctx)
        if prio is not None:
            rows[PRIORITY] = prio if keep == n else np.concatenate([np.zeros(n - keep), prio])
        chunks = set(np.unique(slots // self.chunk_transitions).tolist())
        run1 = min(keep, self.capacity - first_slot)
        with self._lock:
            self._touch(list(rows), chunks)
            for name, col in self._working.columns.items():
                data = rows[name][n - keep :]
                col.write(first_slot, data[:run1])
                if run1 < keep:
                    col.write(0, data[run1:])
        self._cursor = (self._cursor + n) % self.capacity
        self._size = min(self._size + n, self.capacity)
        self.total_added += n
        self.episodes += int(ends[-1])
        self._episode_id += int(ends[-1])

    # -- reading ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._size

    @property
    def fields(self) -> dict[str, FieldSpec]:
        """Field name -> spec (user fields only)."""
        return dict(self._fields)

    def _context(self) -> SampleContext:
        return SampleContext(
            size=self._size,
            capacity=self.capacity,
            start_slot=(self._cursor - self._size) % self.capacity,
            episode_ids=lambda slots: self._gather(EPISODE_ID, slots),
            priorities=self._all_priorities,
        )

    def _all_priorities(self) -> np.ndarray:
        out = np.zeros(self.capacity, dtype=np.float64)
        filled = min(self.total_added, self.capacity)
        k = self.chunk_transitions
        for a in range(0, filled, k):
            b = min(a + k, filled)
            out[a:b] = self._gather(PRIORITY, np.arange(a, b))
        return out

    def _gather(self, name: str, slots: np.ndarray) -> Any:
        self._open_check()
        flat = np.asarray(slots, dtype=np.int64).ravel()
        if self._reader is not None:
            return self._reader.gather(name, flat)
        assert self._working is not None
        return self._working.columns[name].gather(flat)

    def _rows(self, slots: np.ndarray) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, spec in self._fields.items():
            data = self._gather(name, slots)
            if spec.ragged:
                out[name] = (
                    data
                    if slots.ndim == 1
                    else [data[i : i + slots.shape[1]] for i in range(0, len(data), slots.shape[1])]
                )
            else:
                out[name] = data.reshape(*slots.shape, *spec.row_shape)
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
        if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size: expected a positive integer, got {batch_size!r}")
        draw = self.sampler.sample(int(batch_size), self._context(), rng or self._rng)
        out = self._rows(draw.slots)
        out["indices"] = self._ids(draw.slots)
        out["weights"] = draw.weights
        return out

    def _ids(self, slots: np.ndarray) -> np.ndarray:
        logical = (slots - (self._cursor - self._size)) % self.capacity
        return (logical + (self.total_added - self._size)).astype(np.int64)

    def __getitem__(self, key: int | slice | np.ndarray | list[int]) -> dict[str, Any]:
        """Transitions by position in insertion order (0 = oldest, -1 = newest).

        An int gives one transition (``{field: [*shape]}``); a slice or an int array gives
        ``{field: [N, *shape]}`` (ragged: a list).

        Raises:
            IndexError: a position outside ``[-len, len)``.
        """
        if isinstance(key, slice):
            logical = np.arange(self._size)[key]
        else:
            logical = np.asarray(key, dtype=np.int64)
            if logical.ndim > 1:
                raise IndexError(
                    f"index: expected an int, slice or 1-d int array, got {logical.shape}"
                )
            bad = (logical < -self._size) | (logical >= self._size)
            if bad.any():
                raise IndexError(
                    f"index {logical[bad].tolist()[:5]} out of range for "
                    f"buffer of {self._size} transitions"
                )
            logical = logical % max(self._size, 1)
        slots = (self._cursor - self._size + np.atleast_1d(logical)) % self.capacity
        rows = self._rows(slots)
        if np.ndim(logical) == 0:
            return {n: v[0] for n, v in rows.items()}
        return rows

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
            RLBuffersError: the buffer's sampler is not prioritized. FieldError: unequal lengths,
            negative or non-finite priorities, or ids never added.
        """
        self._writable()
        if not isinstance(self.sampler, PrioritizedSampler):
            raise NotPrioritizedError(
                "update_priorities needs a PrioritizedSampler, buffer has "
                f"{type(self.sampler).__name__}"
            )
        ids = np.asarray(indices, dtype=np.int64).ravel()
        pr = np.asarray(priorities, dtype=np.float64).ravel()
        if ids.shape != pr.shape:
            raise FieldError(f"priorities: expected shape {ids.shape} like indices, got {pr.shape}")
        if not np.all(np.isfinite(pr)) or (pr < 0).any():
            raise FieldError(
                "priorities: expected finite values >= 0, got "
                f"min {np.nanmin(pr) if len(pr) else 0}, non-finite {int((~np.isfinite(pr)).sum())}"
            )
        if ((ids < 0) | (ids >= self.total_added)).any():
            raise FieldError(
                f"indices: expected transition ids in [0, {self.total_added}), got "
                f"min {ids.min()} max {ids.max()}"
            )
        live = ids >= self.total_added - self._size
        ids, pr = ids[live], pr[live]
        if len(ids) == 0:
            return 0
        n = len(ids)
        slots, last = np.unique((ids % self.capacity)[::-1], return_index=True)
        pr = pr[::-1][last]  # a slot given twice keeps its last priority
        raw = self.sampler.update(slots, pr, self._context())
        assert self._working is not None
        chunks = set(np.unique(slots // self.chunk_transitions).tolist())
        col = self._working.columns[PRIORITY]
        assert isinstance(col, FixedColumn)
        with self._lock:
            self._touch([PRIORITY], chunks)
            col.scatter(slots, raw)
        return n

    def _touch(self, names: list[str], chunks: set[int]) -> None:
        """Before writing ``chunks`` of ``names`` (lock held): copy aside what a running save
        still needs, record the chunks as changed in ``state.json`` and the dirty sets."""
        assert self._working is not None
        if self._job is not None:
            self._job.protect(names, chunks, self._read_chunks)
        self._working.mark_dirty(self.generation, chunks)
        for name in names:
            self._dirty[name] |= chunks

    # -- saving -----------------------------------------------------------------------------
    def save(
        self,
        *,
        metadata: Mapping[str, Any] | None = None,
        full: bool = False,
        background: bool = False,
    ) -> SaveReport | Future[SaveReport]:
        """Commit every change since the last commit.

        Writes only the chunks changed since the last commit (``full=True`` rewrites every
        filled chunk), in runs of consecutive chunks of at most ~32 MiB raw
        (``save_job.SAVE_RUN_BYTES``), so extra memory is bounded whatever the buffer size;
        then commits by renaming the manifest into place. The commit holds the buffer as
        it was when ``save`` was called. On any error before the commit the previous commit
        stays intact and the changes stay pending for the next save.

        Args:
            metadata: JSON-serialisable dict stored with the commit (e.g. the trainer's
                generation); None keeps the previous one. Read it back as ``buf.metadata``.
            full: rewrite all filled chunks (a full save, e.g. after changing storage).
            background: encode and write in a worker thread and return at once; ``add``,
                ``extend``, ``sample`` and ``update_priorities`` may go on meanwhile (chunks
                they overwrite before the save reads them are copied aside first). A later
                ``save`` or ``close`` waits for it.

        Returns:
            a :class:`SaveReport`, or with ``background=True`` a ``concurrent.futures.Future``
            of one (its ``result()`` raises the save's error, if any).

        Raises:
            TypeError: metadata is not JSON-serialisable. OSError: the write failed (e.g. disk
            full); nothing committed. ReadOnlyError: opened with ``mode="r"``.
        """
        self._writable()
        self.wait_for_save()
        meta = self.metadata if metadata is None else json.loads(json.dumps(dict(metadata)))
        with self._lock:
            job = self._start_job(meta, full)
        if not background:
            return self._run_job(job)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="rlbuffers-save")
        self._pending_save = self._executor.submit(self._run_job, job)
        return self._pending_save

    def wait_for_save(self) -> None:
        """Block until a background save finishes (its error, if any, is logged; the changes
        it could not commit are pending again for the next save)."""
        fut, self._pending_save = self._pending_save, None
        if fut is not None:
            try:
                fut.result()
            except Exception:
                log.exception("background save of %s failed; its changes stay pending", self.path)

    def _start_job(self, meta: dict[str, Any], full: bool) -> SaveJob:
        filled = set(range(-(-min(self.total_added, self.capacity) // self.chunk_transitions)))
        todo = {n: self._stored(n, filled if full else self._dirty[n]) for n in self._specs}
        self._dirty = {n: set() for n in self._specs}
        state = dict(
            generation=self.generation + 1,
            cursor=self._cursor,
            size=self._size,
            total_added=self.total_added,
            episodes=self.episodes,
            episode_id=self._episode_id,
            metadata=meta,
            sampler=self.sampler.state_dict(),
            rng=self._rng.bit_generator.state,
        )
        self._job = SaveJob(self.generation + 1, todo, state, self._lock, self._chunk_rows,
                            self.chunk_transitions)
        return self._job

    def _read_chunks(self, name: str, first: int, count: int) -> Any:
        """Rows of stored chunks ``[first, first + count)`` of ``name`` from the working tier."""
        assert self._working is not None
        a = first * self._chunk_rows[name]
        b = min(a + count * self._chunk_rows[name], self.capacity)
        return self._working.columns[name].read_range(a, b)

    def _run_job(self, job: SaveJob) -> SaveReport:
        assert self._working is not None
        t0 = time.perf_counter()
        tier, gen = self._persistent, job.generation
        chunks = nbytes = raw = 0
        try:
            tier.drop_staging()
            for name in job.todo:
                chunk_bytes = self._chunk_rows[name] * self._specs[name].estimate_bytes()
                for first, count in job.runs(name, max(1, SAVE_RUN_BYTES // chunk_bytes)):
                    data = job.take(name, first, count, self._read_chunks)
                    nbytes += tier.stage_chunks(gen, name, first, data)
                    raw += rows_nbytes(data)
                    chunks += count
            tier.seal(gen)
            manifest = {**read_manifest(self._loc), **job.state, "committed_at": time.time()}
            write_manifest(self._loc, manifest)
        except BaseException:
            tier.drop_staging()
            job.abandon()
            with self._lock:
                for name, cs in job.todo.items():
                    self._dirty[name] |= job.base_chunks(name, cs)
                self._job = None
            raise
        with self._lock:
            self.generation, self.metadata = gen, manifest["metadata"]
            self._committed_at = manifest["committed_at"]
            tier.generation = gen
            self._job = None
        tier.apply(gen)
        self._working.flush()
        with self._lock:
            self._working.write_state(gen, set().union(*self._dirty.values()))
        report = SaveReport(gen, chunks, nbytes, raw, time.perf_counter() - t0)
        log.info("saved %s: %s", self.path, report)
        return report

    @property
    def committed_at(self) -> float:
        """Unix time (seconds) of the last commit."""
        return self._committed_at

    @property
    def rng(self) -> np.random.Generator:
        """The buffer's generator (its state is saved by ``save`` and restored by ``open``)."""
        return self._rng

    # -- lifecycle --------------------------------------------------------------------------
    def _open_check(self) -> None:
        if self._closed:
            raise BufferClosedError(f"{self.path}: buffer is closed")

    def _writable(self) -> None:
        self._open_check()
        if self.mode == "r":
            raise ReadOnlyError(f"{self.path}: opened read-only (mode='r')")

    def close(self) -> None:
        """Wait for a background save, then release files. Does not save: changes since the
        last ``save`` are discarded."""
        if self._closed:
            return
        self.wait_for_save()
        if self._executor is not None:
            self._executor.shutdown()
        if self._working is not None:
            self._working.close()
        self._closed = True

    def __enter__(self) -> ReplayBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"ReplayBuffer({str(self.path)!r}, size={self._size}, capacity={self.capacity}, "
            f"generation={self.generation}, fields={list(self._fields)})"
        )


def _opt_path(p: str | os.PathLike[str] | None) -> Path | None:
    return None if p is None else Path(p)


def default_working_dir(loc: Location) -> Path:
    """``<path>/.working`` for a local buffer; ``~/.cache/rlbuffers/working/<hash>`` for a URL
    (``$RLBUFFERS_CACHE`` replaces ``~/.cache/rlbuffers``)."""
    if loc.local:
        return loc.root / ".working"
    cache = Path(os.environ.get("RLBUFFERS_CACHE", Path.home() / ".cache" / "rlbuffers"))
    return cache / "working" / hashlib.sha1(loc.url.encode()).hexdigest()[:16]
