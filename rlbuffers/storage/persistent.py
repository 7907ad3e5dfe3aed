"""Persistent tier: a Zarr v3 group holding one array per field, chunked along the slot axis,
compressed per field and protected by a crc32c checksum per chunk. It lives in a local
directory or behind any fsspec URL (see :class:`~rlbuffers.storage.location.Location`).

Saves never overwrite a committed chunk in place. Changed chunks are first written into a
staging copy of each array (``.staging/g<generation>/<field>``, same Zarr metadata) and made
durable; the manifest that names the new generation is then replaced (the commit point); only
then are the staged chunk files moved over the old ones. A crash before the commit leaves only
an invisible staging directory; a crash after it is finished by the next writer's ``open``
(:meth:`PersistentTier.apply`, idempotent), and readers prefer staged chunks of the committed
generation meanwhile.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
import zarr

from rlbuffers.codecs import zarr_compressors
from rlbuffers.errors import CorruptChunkError
from rlbuffers.spec import FieldSpec
from rlbuffers.storage.location import Location

if TYPE_CHECKING:
    from zarr.core.array_spec import ArrayConfigParams

log = logging.getLogger(__name__)

STAGING = ".staging"
#: A chunk of zeros must still replace an older chunk.
_CONFIG: ArrayConfigParams = {"write_empty_chunks": True}


@contextmanager
def _quiet() -> Iterator[None]:
    """Silence zarr's note that vlen-bytes (our ragged encoding) is not in the v3 spec yet."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"The data type \(VariableLengthBytes")
        yield


def chunk_rows(
    specs: dict[str, FieldSpec], base: int, capacity: int
) -> dict[str, int]:
    """Transitions per stored chunk of each field.

    Every field's chunk is a whole number of ``base`` chunks (the unit ``add`` marks dirty), so
    base chunk ``c`` lies in stored chunk ``c // (rows // base)``. The largest field (by
    :meth:`FieldSpec.estimate_bytes`) and ragged fields keep ``base``; a smaller fixed field
    (rewards, actions, flags, priorities) takes as many base chunks as make about the raw bytes
    of one chunk of the largest field, at most the whole capacity. An incremental save then
    writes one or two files for it instead of one per changed base chunk.

    Args:
        specs: field name -> spec (internal fields included).
        base: transitions per base chunk (``chunk_transitions``).
        capacity: transitions held.

    Returns:
        field name -> transitions per stored chunk (a multiple of ``base``).
    """
    n_base = -(-capacity // base)
    target = base * max(spec.estimate_bytes() for spec in specs.values())
    out = {}
    for name, spec in specs.items():
        m = 1 if spec.ragged else target // (base * max(spec.item_bytes, 1))
        out[name] = base * int(max(1, min(m, n_base)))
    return out


def stored_of(base_chunks: Iterable[int], rows: int, base: int) -> set[int]:
    """The stored chunks (of ``rows`` transitions) holding the base chunks ``base_chunks`` (of
    ``base`` transitions; ``rows`` is a multiple of ``base``)."""
    m = rows // base
    return {c // m for c in base_chunks}


def base_of(stored: Iterable[int], rows: int, base: int) -> set[int]:
    """The base chunks that the stored chunks ``stored`` hold (inverse of :func:`stored_of`)."""
    m = rows // base
    return {b for c in stored for b in range(c * m, (c + 1) * m)}


class PersistentTier:
    """The Zarr group at ``loc``: create, stage and apply chunk writes, read and verify chunks.

    ``chunks``: field name -> transitions per stored chunk (see :func:`chunk_rows`); chunk
    indices passed to and returned by this class count in those units, per field.
    """

    def __init__(
        self, loc: Location, specs: dict[str, FieldSpec], chunks: dict[str, int], capacity: int
    ) -> None:
        self.loc, self.specs, self.chunks, self.capacity = loc, specs, chunks, capacity
        self._arrays: dict[str, zarr.Array] = {}
        self._meta: dict[str, tuple[int, Any]] = {}  # name -> (ndim, array metadata); never changes
        self._staged: dict[str, zarr.Array] = {}  # staging arrays of the save in progress
        #: generation of the manifest the reader trusts: its staged chunks win over older ones
        #: while a writer is still moving them into place (see :meth:`apply`).
        self.generation: int | None = None

    @classmethod
    def create(
        cls,
        loc: Location,
        specs: dict[str, FieldSpec],
        codecs: dict[str, str],
        *,
        capacity: int,
        chunks: dict[str, int],
        attrs: dict[str, Any],
    ) -> PersistentTier:
        """Create the group and one empty array per field (shape ``[capacity, *shape]``;
        ragged fields: ``[capacity]`` of variable-length bytes), chunked by ``chunks[field]``
        transitions."""
        group = zarr.open_group(**loc.zarr_args(), mode="w", zarr_format=3, attributes=attrs)
        for name, spec in specs.items():
            chunk = chunks[name]
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
        return cls(loc, specs, chunks, capacity)

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
        k = self.chunks[name]
        a = c * k
        if self.specs[name].ragged:
            blob = np.empty(len(data), dtype=object)
            blob[:] = [np.ascontiguousarray(v).tobytes() for v in data]
            data = blob
        stage[a : a + len(data)] = data
        last = c + -(-len(data) // k)
        return sum(self.loc.size(f"{dst}/{self.chunk_key(name, i)}") for i in range(c, last))

    def seal(self, generation: int) -> None:
        """Make everything staged for ``generation`` durable (called before the commit)."""
        self.loc.sync_tree(self.staging_dir(generation))

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
        self.drop_staging()
        self._arrays.clear()
        return moved

    def drop_staging(self) -> None:
        """Remove every staging directory (uncommitted or already applied saves)."""
        self._staged.clear()
        for d in self.loc.listdir(STAGING):
            log.info("removing staging directory %s/%s/%s", self.loc, STAGING, d)
            self.loc.remove_tree(f"{STAGING}/{d}")

    # -- reading --------------------------------------------------------------------------
    def read_chunk(self, name: str, c: int) -> Any:
        """Decode chunk ``c`` of ``name``: ``[n, *shape]`` or, for ragged fields, a list of
        arrays ``[len_i, *row]``.

        Raises:
            CorruptChunkError: the checksum does not match or the chunk cannot be decoded.
        """
        k = self.chunks[name]
        a, b = c * k, min((c + 1) * k, self.capacity)
        try:
            src, staged = self._source(name, c)
            data = src[a:b]
            if staged is not None and not self.loc.exists(staged):  # moved into place mid-read
                data = self.array(name)[a:b]
        except Exception as e:  # zarr raises ValueError / RuntimeError depending on the codec
            raise CorruptChunkError(name, c, f"{type(e).__name__}: {e}") from e
        spec = self.specs[name]
        if spec.ragged:
            return [np.frombuffer(v, dtype=spec.dtype).reshape(-1, *spec.row_shape)
                    for v in np.asarray(data, dtype=object)]
        return data

    def _source(self, name: str, c: int) -> tuple[zarr.Array, str | None]:
        """The array holding the committed chunk ``c`` (and the staged chunk file, if any): the
        staging copy while a committed save is still being applied, else the main array."""
        if self.generation is not None:
            staged = f"{self.staging_dir(self.generation)}/{name}"
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

    def stored_bytes(self, name: str) -> int:
        """Bytes stored for the committed chunks of ``name``."""
        return sum(self.stored_chunks(name).values())

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
