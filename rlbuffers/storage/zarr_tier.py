"""The persistent tier on Zarr v3 (a :class:`~rlbuffers.storage.persistent.PersistentTier`):
one array per field, chunked along the slot axis, compressed per field and protected by a
crc32c checksum per chunk. It lives in a local directory or behind any fsspec URL (see
:class:`~rlbuffers.storage.location.Location`).

Saves never overwrite a committed chunk in place. Changed chunks are first written into a
staging copy of each array (``.staging/g<generation>/<field>``, same Zarr metadata) and made
durable; the manifest that names the new generation is then replaced (the commit point); only
then are the staged chunk files moved over the old ones. A crash before the commit leaves only
an invisible staging directory; a crash after it is finished by the next writer's ``open``
(:meth:`ZarrTier.apply`, idempotent), and readers prefer staged chunks of the committed
generation meanwhile.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
import zarr

from rlbuffers.compression import DEFAULT_CODEC, zarr_compressors
from rlbuffers.errors import CorruptChunkError
from rlbuffers.intmath import ceil_div
from rlbuffers.storage.location import Location
from rlbuffers.storage.manifest import MANIFEST, Manifest, read_manifest, write_manifest

if TYPE_CHECKING:
    from zarr.core.array_spec import ArrayConfigParams

log = logging.getLogger(__name__)

STAGING = ".staging"
#: What zarr and its codecs raise for a chunk that does not decode: a checksum mismatch
#: (crc32c: ValueError), a bad Blosc or zstd frame (RuntimeError / ValueError), a vlen-bytes
#: frame of the wrong length (IndexError / ValueError). I/O errors (OSError) are not among them.
DECODE_ERRORS = (ValueError, RuntimeError, IndexError, TypeError)
#: A chunk of zeros must still replace an older chunk.
_CONFIG: ArrayConfigParams = {"write_empty_chunks": True}


@contextmanager
def _quiet() -> Iterator[None]:
    """Silence zarr's note that vlen-bytes (our ragged encoding) is not in the v3 spec yet."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"The data type \(VariableLengthBytes")
        yield


class ZarrTier:
    """The Zarr group at ``loc`` holding the commit ``manifest``.

    Stored-chunk indices passed to and returned by this class count in each field's stored
    chunks (see :mod:`rlbuffers.storage.layout`).
    """

    def __init__(self, loc: Location, manifest: Manifest) -> None:
        self.loc = loc
        #: the commit this tier reads: its staged chunks win over older ones while a writer
        #: is still moving them into place (see :meth:`apply`).
        self.manifest = manifest
        self.specs = manifest.specs
        self.layout = manifest.layout
        self._arrays: dict[str, zarr.Array] = {}
        self._meta: dict[str, tuple[int, Any]] = {}  # name -> (ndim, array metadata); never changes
        self._staged: dict[str, zarr.Array] = {}  # staging arrays of the save in progress

    @classmethod
    def open(cls, loc: Location) -> ZarrTier:
        """The tier at ``loc`` as of its last commit (reads the manifest only).

        Raises:
            NotABufferError, FormatVersionError: as :func:`read_manifest`.
        """
        return cls(loc, read_manifest(loc))

    @classmethod
    def create(cls, loc: Location, manifest: Manifest) -> ZarrTier:
        """Create the group, one empty array per column (shape ``[capacity, *shape]``; ragged
        fields: ``[capacity]`` of variable-length bytes) chunked by its stored-chunk rows, and
        commit ``manifest`` (generation 0)."""
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
        write_manifest(loc, manifest)
        return cls(loc, manifest)

    def _open(self, rel: str, mode: str = "r") -> zarr.Array:
        with _quiet():
            arr = zarr.open_array(**self.loc.zarr_args(rel), mode=mode)
        return arr.with_config(_CONFIG) if mode != "r" else arr

    def array(self, name: str) -> zarr.Array:
        """The committed Zarr array of field ``name``."""
        arr = self._arrays.get(name)
        if arr is None:
            arr = self._arrays[name] = self._open(name)
        return arr

    def chunk_key(self, name: str, c: int) -> str:
        """Path of chunk ``c`` of field ``name`` relative to its array directory."""
        if name not in self._meta:
            arr = self.array(name)
            self._meta[name] = (arr.ndim, arr.metadata)
        ndim, meta = self._meta[name]
        return meta.encode_chunk_key((c,) + (0,) * (ndim - 1))

    # -- saving ---------------------------------------------------------------------------
    def staging_dir(self, generation: int) -> str:
        return f"{STAGING}/g{generation}"

    def stage_chunks(self, generation: int, name: str, c: int, data: Any) -> int:
        """Encode a run of consecutive chunks of ``name``, starting at chunk ``c``, into the
        staging area of ``generation``. Zarr encodes the chunks of one run concurrently (the
        Blosc and crc32c codecs release the GIL), so callers bound a run's size, not its count.

        Args:
            data: the rows of chunks ``c, c+1, ...``, ``[n, *shape]`` (fixed) or a list of n
                arrays (ragged); every chunk but the last of the run must be whole.

        Returns:
            bytes written (compressed, including the checksums).
        """
        dst = f"{self.staging_dir(generation)}/{name}"
        stage = self._staged.get(dst)
        if stage is None:
            if not self.loc.exists(f"{dst}/zarr.json"):
                self.loc.copy(f"{name}/zarr.json", f"{dst}/zarr.json")
            stage = self._staged[dst] = self._open(dst, mode="r+")
        a = c * self.layout.stored_chunk_rows[name]
        if self.specs[name].ragged:
            blob = np.empty(len(data), dtype=object)
            blob[:] = [np.ascontiguousarray(v).tobytes() for v in data]
            data = blob
        stage[a : a + len(data)] = data
        last = c + ceil_div(len(data), self.layout.stored_chunk_rows[name])
        return sum(self.loc.size(f"{dst}/{self.chunk_key(name, i)}") for i in range(c, last))

    def commit(self, manifest: Manifest) -> None:
        """Make everything staged for ``manifest.generation`` durable, then replace the manifest
        (atomic, fsynced): the commit point. Call :meth:`apply` next. On error nothing is
        committed (call :meth:`abort`)."""
        self.loc.sync_tree(self.staging_dir(manifest.generation))
        write_manifest(self.loc, manifest)
        self.manifest = manifest

    def apply(self, generation: int) -> int:
        """Move the staged chunks of committed ``generation`` over the old ones; idempotent.
        Also removes staging left by uncommitted saves.

        Returns:
            the number of chunk files moved.
        """
        staging = self.staging_dir(generation)
        moved = 0
        touched: set[str] = set()  # directories whose entries the renames changed
        for name in self.specs:
            for rel in self.loc.files(f"{staging}/{name}"):
                if rel != "zarr.json":
                    self.loc.move(f"{staging}/{name}/{rel}", f"{name}/{rel}")
                    moved += 1
                    parts = f"{name}/{rel}".split("/")[:-1]  # parent dirs (new ones too)
                    touched.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
        # The renames must be durable before the staging copies go: the reader falls back to
        # staging only while it exists.
        self.loc.sync_dirs(sorted(touched))
        self.abort()
        self._arrays.clear()
        return moved

    def abort(self) -> None:
        """Remove every staging directory (uncommitted or already applied saves)."""
        self._staged.clear()
        for d in self.loc.listdir(STAGING):
            log.info("removing staging directory %s/%s/%s", self.loc, STAGING, d)
            self.loc.remove_tree(f"{STAGING}/{d}")

    # -- reading --------------------------------------------------------------------------
    def read_chunk(self, name: str, c: int) -> Any:
        """Decode stored chunk ``c`` of ``name``: ``[n, *shape]`` or, for ragged fields, a list
        of arrays ``[len_i, *row]``.

        Raises:
            CorruptChunkError: the checksum does not match or the chunk cannot be decoded.
            OSError: the chunk could not be read (permission, network, ...): not corruption.
        """
        a, b = self.layout.stored_slots(name, c)
        try:
            src, staged = self._source(name, c)
            data = src[a:b]
            if staged is not None and not self.loc.exists(staged):  # moved into place mid-read
                data = self.array(name)[a:b]
        except OSError:
            raise
        except DECODE_ERRORS as e:
            raise CorruptChunkError(name, c, f"{type(e).__name__}: {e}") from e
        spec = self.specs[name]
        if spec.ragged:
            return [np.frombuffer(v, dtype=spec.dtype).reshape(-1, *spec.row_shape)
                    for v in np.asarray(data, dtype=object)]
        return data

    def _source(self, name: str, c: int) -> tuple[zarr.Array, str | None]:
        """The array holding the committed chunk ``c`` (and the staged chunk file, if any): the
        staging copy while a committed save is still being applied, else the main array."""
        if self.manifest.generation > 0:
            staged = f"{self.staging_dir(self.manifest.generation)}/{name}"
            key = f"{staged}/{self.chunk_key(name, c)}"
            if self.loc.exists(key):
                return self._open(staged), key
        return self.array(name), None

    def stored_chunks(self, name: str) -> dict[int, int]:
        """Chunk index -> stored bytes, for every committed chunk of ``name``."""
        prefix = self.chunk_key(name, 0).rsplit("/", 1 + (self.array(name).ndim - 1))[0]
        out = {}
        for rel, size in self.loc.files(name).items():
            if rel.startswith(prefix + "/"):
                out[int(rel[len(prefix) + 1 :].split("/", 1)[0])] = size
        return out

    def verify(self) -> list[tuple[str, int, str]]:
        """Decode every stored chunk; return ``(field, chunk, reason)`` for each corrupt one."""
        bad = []
        for name in self.specs:
            for c in sorted(self.stored_chunks(name)):
                try:
                    self.read_chunk(name, c)
                except CorruptChunkError as e:
                    bad.append((name, c, e.reason))
        return bad
