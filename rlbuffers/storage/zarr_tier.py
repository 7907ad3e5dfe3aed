"""The persistent tier on Zarr v3 (a :class:`~rlbuffers.storage.persistent.PersistentTier`),
with copy-on-write chunk versions: every commit is a snapshot that stays readable, unchanged,
for as long as it is kept.

Layout (``docs/format.md``): ``<field>/zarr.json`` is the array of each field (its metadata:
shape, chunks, codecs with a crc32c checksum per chunk). A save writes the chunks it changes
into ``versions/g<N>/<field>/``, a Zarr array with the same metadata that holds only those
chunks, makes them durable, writes ``history/g<N>.json`` and then replaces ``manifest.json``
(the commit point). The manifest lists every committed chunk: which commit's array holds
it and its size in bytes. A chunk file is never modified after its save, so a reader that holds
a manifest reads exactly that commit whatever the writer does; a chunk listed but missing or of
another size is corrupt, not zeros.

The newest ``keep_commits`` commits stay readable (``ReplayBuffer.open(path, mode="r",
commit=N)``); after each commit the writer deletes the chunk versions only older commits
use, then their manifests. A crash at any point leaves the last commit intact; leftovers of an
uncommitted save are removed by the next save.

Buffers of format 1 and 2 kept their chunks in ``<field>/`` itself: they read as commit 0
of the chunk table, and the first save writes a format-3 manifest.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import zarr

from rlbuffers.errors import (
    CorruptChunkError,
    ManifestError,
    NotABufferError,
    SnapshotReclaimedError,
)
from rlbuffers.intmath import ceil_div
from rlbuffers.storage.compression import DEFAULT_CODEC, zarr_compressors
from rlbuffers.storage.lease import leased_commits
from rlbuffers.storage.location import Location
from rlbuffers.storage.manifest import (
    COMMIT_KEY,
    FORMAT_VERSION,
    HISTORY,
    MANIFEST,
    ChunkEntry,
    Manifest,
    history_file,
    read_manifest,
    write_manifest,
)
from rlbuffers.storage.zarr_arrays import (
    VERSIONS,
    array_path,
    check_against_arrays,
    check_kept,
    chunk_encoder,
    decode_chunk,
    ragged_blob,
    write_chunks,
)
from rlbuffers.storage.zarr_helpers import DECODE_ERRORS, check_array_meta
from rlbuffers.storage.zarr_helpers import naming as _naming
from rlbuffers.storage.zarr_helpers import numbers as _numbers
from rlbuffers.storage.zarr_helpers import quiet as _quiet

if TYPE_CHECKING:
    from zarr.core.array_spec import ArrayConfigParams

log = logging.getLogger(__name__)

#: Staging of format-2 saves (moved into ``<field>/`` after their commit); finished on open.
LEGACY_STAGING = ".staging"
#: A chunk of zeros must still be written (the manifest lists it).
_CONFIG: ArrayConfigParams = {"write_empty_chunks": True}
#: Reads of the manifest while a writer keeps committing, before giving up on consistency.
READ_ATTEMPTS = 20


class ZarrTier:
    """The Zarr group at ``loc``, read as of the commit ``manifest``: the
    :class:`~rlbuffers.storage.persistent.PersistentTier` of this library.

    Stored-chunk indices passed to and returned by this class count in each field's stored
    chunks (see :mod:`rlbuffers.storage.layout`).
    """

    def __init__(self, loc: Location, manifest: Manifest) -> None:
        self.loc = loc
        self.specs = manifest.specs
        self.layout = manifest.layout
        self._arrays: dict[str, zarr.Array] = {}
        self._meta: dict[str, tuple[int, Any]] = {}  # name -> (ndim, array metadata); never changes
        self._staged: dict[str, dict[int, int]] = {}  # name -> {chunk: bytes} of the open save
        self._history: dict[int, Manifest] = {}  # kept commits' manifests read so far
        self._stage_arrays: dict[str, zarr.Array | None] = {}  # arrays the open save writes
        self._encoders: dict[str, Any] = {}  # name -> zarr_arrays.chunk_encoder's, or None
        #: a format 1-2 buffer: its chunks are the files in <field>/ (commit 0)
        self._legacy = manifest.chunks is None
        #: the commit this tier reads.
        self.manifest = self._with_listed_chunks(manifest) if self._legacy else manifest

    @classmethod
    def open(cls, loc: Location, commit: int | None = None) -> ZarrTier:
        """The tier at ``loc`` as of its last commit, or of a kept ``commit``.

        Raises:
            NotABufferError, FormatVersionError: as :func:`read_manifest`; NotABufferError
                also for a path that is a file, not a directory.
            SnapshotReclaimedError: ``commit`` is not kept any more (or never existed).
        """
        head = cls._consistent_head(loc)
        if commit is None or commit == head.commit:
            return cls(loc, head)
        try:
            kept = read_manifest(loc, history_file(commit))
            check_against_arrays(loc, kept, history_file(commit))
            return cls(loc, kept)
        except ManifestError:
            raise
        except NotABufferError:
            first = head.commit - head.keep_commits + 1
            raise SnapshotReclaimedError(
                f"{loc}: commit {commit} is not kept; kept: {max(first, 0)}.."
                f"{head.commit} (keep_commits={head.keep_commits})") from None

    @classmethod
    def _consistent_head(cls, loc: Location) -> Manifest:
        """The last commit's manifest, checked against the commits on disk: ``versions/`` and
        ``history/`` may hold the commit after it (a save that crashed before its commit
        point), never a later one; a manifest older than that (restored from a backup, or
        tampered with) would make a writer delete every newer chunk version as uncommitted.
        A writer committing meanwhile moves the head: read again (bounded).

        Raises:
            ManifestError: the manifest's commit is older than what is on disk.
        """
        for _ in range(READ_ATTEMPTS):
            try:
                head = read_manifest(loc)
            except NotADirectoryError:
                raise NotABufferError(
                    f"{loc}: not an rlbuffers buffer (a file, not a directory)") from None
            on_disk = _numbers(loc.listdir(VERSIONS), "") + _numbers(loc.listdir(HISTORY),
                                                                     ".json")
            newest = max(on_disk, default=0)
            if newest <= head.commit + 1:
                check_against_arrays(loc, head, MANIFEST)
                return head
            if read_manifest(loc).commit == head.commit:  # not a writer moving on
                raise ManifestError(
                    f"{loc}/{MANIFEST}", COMMIT_KEY,
                    f"at least {newest - 1}: {VERSIONS}/ or {HISTORY}/ hold commit {newest} "
                    f"(restore {history_file(newest)} as {MANIFEST} if that commit is whole)",
                    str(head.commit))
        return head

    def reopen(self, commit: int | None = None) -> ZarrTier:
        """The same store as of its last commit now (or of the kept ``commit``)."""
        return type(self).open(self.loc, commit)

    @classmethod
    def create(cls, loc: Location, manifest: Manifest) -> ZarrTier:
        """Create the group, one empty array per column (shape ``[capacity, *shape]``; ragged
        fields: ``[capacity]`` of variable-length bytes) chunked by its stored-chunk rows, and
        commit ``manifest`` (commit 0, no chunks)."""
        attrs: dict[str, Any] = {
            "rlbuffers": {"format_version": manifest.format_version, "manifest": MANIFEST}}
        group = zarr.open_group(**loc.zarr_args(), mode="w", zarr_format=3, attributes=attrs)
        codecs = {**manifest.codecs, **{n: DEFAULT_CODEC for n in manifest.internal}}
        for name, spec in manifest.specs.items():
            chunk = manifest.layout.stored_chunk_rows[name]
            capacity = manifest.capacity
            with _quiet():
                group.create_array(
                    name,
                    shape=(capacity,) if spec.ragged else (capacity, *spec.row_shape),
                    chunks=(chunk,) if spec.ragged else (chunk, *spec.row_shape),
                    dtype=zarr.dtype.VariableLengthBytes() if spec.ragged else spec.dtype,
                    compressors=zarr_compressors(codecs[name], spec.dtype.itemsize),
                    fill_value=b"" if spec.ragged else 0,
                    attributes={"rlbuffers_field": spec.to_dict(), "codec": codecs[name]},
                    config=_CONFIG,
                )
        manifest = manifest.replace(chunks={n: {} for n in manifest.specs})
        write_manifest(loc, manifest, history_file(0))
        write_manifest(loc, manifest)
        return cls(loc, manifest)

    def _open(self, rel: str, mode: str = "r") -> zarr.Array:
        check_array_meta(self.loc, rel)  # never a FIFO for zarr's blocking open
        with _quiet():
            arr = zarr.open_array(**self.loc.zarr_args(rel), mode=mode)
        return arr.with_config(_CONFIG) if mode != "r" else arr

    def _array(self, rel: str) -> zarr.Array:
        arr = self._arrays.get(rel)
        if arr is None:
            arr = self._arrays[rel] = self._open(rel)
        return arr

    def chunk_key(self, name: str, c: int) -> str:
        """Path of chunk ``c`` of field ``name`` relative to an array directory."""
        if name not in self._meta:
            arr = self._array(name)
            self._meta[name] = (arr.ndim, arr.metadata)
        ndim, meta = self._meta[name]
        return meta.encode_chunk_key((c,) + (0,) * (ndim - 1))

    def chunk_path(self, name: str, c: int) -> str:
        """The file (relative to the buffer) of committed chunk ``c`` of ``name``.

        Raises:
            KeyError: the commit has no such chunk.
        """
        commit, _ = self._entry(name, c)
        return f"{array_path(name, commit)}/{self.chunk_key(name, c)}"

    def _entry(self, name: str, c: int) -> ChunkEntry:
        return (self.manifest.chunks or {})[name][c]

    # -- saving ---------------------------------------------------------------------------
    def stage_chunks(self, commit: int, name: str, c: int, data: Any) -> int:
        """Encode a run of consecutive chunks of ``name``, starting at chunk ``c``, into the
        array of ``commit`` (invisible to readers until :meth:`commit`), several chunks at once
        (fixed fields on local disk: ``write_chunks``, else Zarr): bound a run's size.

        Args:
            data: the rows of chunks ``c, c+1, ...``, ``[n, *shape]`` (fixed) or a list of n
                arrays (ragged); every chunk but the last of the run must be whole.

        Returns:
            bytes written (compressed, including the checksums).
        """
        dst = array_path(name, commit)
        if dst not in self._stage_arrays:
            self.loc.check_inside(dst)  # then a copy that never follows a symlink:
            self.loc.copy(f"{name}/zarr.json", f"{dst}/zarr.json")
            self._stage_arrays[dst] = None  # opened only if zarr writes (below)
        k = self.layout.stored_chunk_rows[name]
        last = c + ceil_div(len(data), k)
        if name not in self._encoders:  # the staged zarr.json is a copy of this array's
            self._encoders[name] = None if self.specs[name].ragged or not self.loc.local \
                else chunk_encoder(self._array(name))
        with _naming(self.loc.full(dst)):
            if self._encoders[name] is not None:  # whole chunks, encoded as zarr would
                keys = [self.chunk_key(name, i) for i in range(c, last)]
                written = write_chunks(self.loc, dst, keys, data, k, self._encoders[name])
            else:
                stage = self._stage_arrays[dst] or self._open(dst, mode="r+")
                self._stage_arrays[dst] = stage
                stage[c * k : c * k + len(data)] = ragged_blob(data) \
                    if self.specs[name].ragged else data
                written = [self.loc.size(f"{dst}/{self.chunk_key(name, i)}")
                           for i in range(c, last)]
        self._staged.setdefault(name, {}).update(zip(range(c, last), written, strict=True))
        return sum(written)

    def commit(self, manifest: Manifest) -> None:
        """Commit ``manifest`` with the chunks staged for ``manifest.commit``: make them
        durable, keep the manifest in ``history/``, then replace ``manifest.json`` (atomic,
        fsynced): the commit point. Call :meth:`apply` next. On error nothing is committed
        (call :meth:`abort`)."""
        gen = manifest.commit
        chunks = {n: dict(t) for n, t in (self.manifest.chunks or {}).items()}
        for name, sizes in self._staged.items():
            chunks[name].update({c: (gen, size) for c, size in sizes.items()})
        manifest = manifest.replace(chunks=chunks, format_version=max(
            FORMAT_VERSION, manifest.format_version))
        with _naming(self.loc.full(f"{VERSIONS}/g{gen}")):
            self.loc.sync_tree(f"{VERSIONS}/g{gen}")
        with _naming(self.loc.full(history_file(gen))):
            write_manifest(self.loc, manifest, history_file(gen))
        with _naming(self.loc.full(MANIFEST)):
            write_manifest(self.loc, manifest)
        self.manifest = self._history[gen] = manifest
        self._staged, self._stage_arrays = {}, {}

    def apply(self, commit: int) -> int:
        """After the commit of ``commit`` (or on opening for writing): drop what no kept
        commit needs: chunk versions only older commits use, then their manifests, and anything
        staged by uncommitted saves. Idempotent; a crash part-way is finished next time.

        Returns:
            bytes reclaimed.
        """
        if self._legacy:
            self._finish_legacy_staging()
        self.abort()
        head = self.manifest
        first_kept = head.commit - head.keep_commits + 1
        leased = leased_commits(self.loc)  # commits that open readers hold (lease.py)
        history = [g for g in self._history_commits() if g != head.commit]
        kept = [head] + [self._kept_manifest(g) for g in history
                         if g >= first_kept or g in leased]
        dropped = [g for g in history if g < first_kept and g not in leased]
        used = {(n, c, e[0]) for m in kept for n, t in (m.chunks or {}).items()
                for c, e in t.items()}
        reclaimed = self._drop_versions(dropped, used)
        for g in dropped:  # last: a crash before this redoes the deletions next time
            self.loc.remove_file(history_file(g))
            self._history.pop(g, None)
        if reclaimed:
            log.info("%s: reclaimed %d bytes of commits older than commit %d", self.loc,
                     reclaimed, first_kept)
        return reclaimed

    def _kept_manifest(self, commit: int) -> Manifest:
        """A kept commit's manifest (read once; commits never change)."""
        m = self._history.get(commit)
        if m is None:
            m = self._history[commit] = read_manifest(self.loc, history_file(commit))
        return m

    def _drop_versions(self, dropped: list[int], used: set[tuple[str, int, int]]) -> int:
        """Delete the chunk files that the ``dropped`` commits list and no kept commit uses
        (``used``: (field, chunk, commit)), and every array of a commit nothing uses.
        Returns the bytes deleted."""
        used_gens = {g for _, _, g in used}
        reclaimed = 0
        gone: set[tuple[str, int, int]] = set()
        for g in sorted(dropped):
            for name, table in (self._kept_manifest(g).chunks or {}).items():
                for c, (cg, size) in table.items():
                    key = (name, c, cg)
                    if key in used or key in gone or (cg != 0 and cg not in used_gens):
                        continue  # still needed, done, or its whole array goes below
                    gone.add(key)
                    self.loc.remove_file(f"{array_path(name, cg)}/{self.chunk_key(name, c)}")
                    reclaimed += size
        for g in self._version_commits():
            if g not in used_gens and g <= self.manifest.commit:
                reclaimed += sum(self.loc.files(f"{VERSIONS}/g{g}").values())
                self.loc.remove_tree(f"{VERSIONS}/g{g}")
        return reclaimed

    def committed(self, commit: int) -> bool:
        """Whether ``manifest.json`` on storage already names ``commit`` (after an error
        part-way through :meth:`commit`: the rename may have happened); if so, this tier
        adopts that commit."""
        head = read_manifest(self.loc)
        if head.commit == commit and head.commit > self.manifest.commit:
            self.manifest, self._staged, self._stage_arrays = head, {}, {}
            self._history[commit] = head
        return head.commit == commit

    def abort(self) -> None:
        """Drop everything staged and not committed (arrays of commits after the head).
        After a failed commit, call :meth:`committed` first: it adopts a commit whose rename
        happened, so this never deletes a committed chunk."""
        self._staged, self._stage_arrays = {}, {}
        head = self.manifest.commit
        for g in self._version_commits():
            if g > head:
                log.info("removing uncommitted %s/%s/g%d", self.loc, VERSIONS, g)
                self.loc.remove_tree(f"{VERSIONS}/g{g}")

    def _version_commits(self) -> list[int]:
        return sorted(int(d[1:]) for d in self.loc.listdir(VERSIONS) if d[1:].isdigit())

    def _history_commits(self) -> list[int]:
        names = self.loc.listdir(HISTORY)
        return sorted(int(d[1:-5]) for d in names if d.startswith("g") and d.endswith(".json")
                      and d[1:-5].isdigit())

    def _finish_legacy_staging(self) -> None:
        """Format 2 moved staged chunks into ``<field>/`` after its commit; a writer killed
        part-way left some in ``.staging/g<N>``: finish the moves of the committed commit,
        drop the rest, and list the chunks again (once: format 3 never stages there)."""
        staging = f"{LEGACY_STAGING}/g{self.manifest.commit}"
        for name in self.specs:
            for rel in self.loc.files(f"{staging}/{name}"):
                if rel != "zarr.json":
                    self.loc.move(f"{staging}/{name}/{rel}", f"{name}/{rel}")
        self.loc.remove_tree(LEGACY_STAGING)
        self.manifest = self._with_listed_chunks(self.manifest)
        self._legacy = False

    def _with_listed_chunks(self, manifest: Manifest) -> Manifest:
        return manifest.replace(chunks={
            n: {c: (0, size) for c, size in self._listed_chunks(n).items()} for n in self.specs})

    # -- reading --------------------------------------------------------------------------
    def read_chunk(self, name: str, c: int) -> Any:
        """Decode stored chunk ``c`` of ``name`` as of :attr:`manifest`: ``[n, *shape]`` or,
        for ragged fields, a list of arrays ``[len_i, *row]``; a chunk the commit does not list
        was never written and reads as the fill value (zeros, empty rows).

        Raises:
            CorruptChunkError: the chunk is listed but missing, of another size, fails its
                checksum or does not decode.
            SnapshotReclaimedError: the chunk is gone because the writer no longer keeps this
                commit (call ``refresh()``).
            OSError: the chunk could not be read (permission, network, ...): not corruption.
        """
        a, b = self.layout.stored_slots(name, c)
        table = (self.manifest.chunks or {}).get(name, {})
        if c not in table:
            return decode_chunk(self.specs[name], self._array(name)[a:b])
        commit, size = table[c]
        path = f"{array_path(name, commit)}/{self.chunk_key(name, c)}"
        self._check_present(name, c, path, size)
        try:
            data = self._array(array_path(name, commit))[a:b]
        except FileNotFoundError as e:  # zarr's ArrayNotFoundError too: removed after the check
            check_kept(self.loc, self.manifest)
            raise CorruptChunkError(name, c, f"missing: {path} ({type(e).__name__})") from e
        except OSError:
            raise
        except DECODE_ERRORS as e:
            raise CorruptChunkError(name, c, f"{type(e).__name__}: {e}") from e
        # Chunk files are immutable: present after the read means the read saw it (zarr reads
        # a missing chunk as the fill value, so this rules out a deletion during the read).
        self._check_present(name, c, path, size)
        return decode_chunk(self.specs[name], data)

    def _check_present(self, name: str, c: int, path: str, size: int) -> None:
        try:
            actual = self.loc.size(path)
        except FileNotFoundError:
            check_kept(self.loc, self.manifest)
            raise CorruptChunkError(name, c, f"missing: {path} ({size} bytes committed)") from None
        if actual != size:
            raise CorruptChunkError(name, c, f"truncated or rewritten: {path} has {actual} "
                                             f"bytes, {size} committed")

    def _listed_chunks(self, name: str) -> dict[int, int]:
        """Chunk index -> bytes of the chunk files in ``<name>/`` (format 1-2 buffers)."""
        prefix = self.chunk_key(name, 0).rsplit("/", 1 + (self._array(name).ndim - 1))[0]
        out = {}
        for rel, size in self.loc.files(name).items():
            if rel.startswith(prefix + "/"):
                out[int(rel[len(prefix) + 1 :].split("/", 1)[0])] = size
        return out

    def stored_chunks(self, name: str) -> dict[int, int]:
        """Chunk index -> stored bytes, for every committed chunk of ``name``."""
        return {c: size for c, (_, size) in (self.manifest.chunks or {})[name].items()}

    def verify(self) -> list[tuple[str, int, str]]:
        """Read every committed chunk; ``(field, chunk, reason)`` for each corrupt one (failed
        checksum, undecodable, missing or truncated)."""
        bad = []
        for name in self.specs:
            for c in sorted(self.stored_chunks(name)):
                try:
                    self.read_chunk(name, c)
                except CorruptChunkError as e:
                    bad.append((name, c, e.reason))
        return bad
