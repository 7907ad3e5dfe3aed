"""Persistent tier: a Zarr v3 group holding one array per field, chunked along the slot axis,
compressed per field and protected by a crc32c checksum per chunk.

Saves never overwrite a committed chunk in place. Changed chunks are first written into a
staging copy of each array (``.staging/g<generation>/<field>``, same Zarr metadata) and
fsynced; the manifest that names the new generation is then renamed into place (the commit
point); only then are the staged chunk files renamed over the old ones. A crash before the
commit leaves only an invisible staging directory; a crash after it is finished by the next
``open`` (:meth:`PersistentTier.apply`), which is idempotent.
"""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from rlbuffers.codecs import zarr_compressors
from rlbuffers.errors import CorruptChunkError
from rlbuffers.spec import FieldSpec
from rlbuffers.storage.manifest import fsync_dir

log = logging.getLogger(__name__)

STAGING = ".staging"
_CONFIG = {"write_empty_chunks": True}  # a chunk of zeros must still replace an older chunk


@contextmanager
def _quiet() -> Iterator[None]:
    """Silence zarr's note that vlen-bytes (our ragged encoding) is not in the v3 spec yet."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"The data type \(VariableLengthBytes")
        yield


def _fsync_tree(path: Path) -> None:
    for dirpath, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


class PersistentTier:
    """The Zarr group at ``root``: create, stage and apply chunk writes, read and verify chunks."""

    def __init__(self, root: Path, specs: dict[str, FieldSpec], chunk: int, capacity: int) -> None:
        self.root, self.specs, self.chunk, self.capacity = root, specs, chunk, capacity
        self._arrays: dict[str, zarr.Array] = {}
        #: generation of the manifest the reader trusts: its staged chunks win over older ones
        #: while a writer is still moving them into place (see :meth:`apply`).
        self.generation: int | None = None

    @property
    def n_chunks(self) -> int:
        return -(-self.capacity // self.chunk)

    @classmethod
    def create(
        cls,
        root: Path,
        specs: dict[str, FieldSpec],
        codecs: dict[str, str],
        *,
        capacity: int,
        chunk: int,
        attrs: dict[str, Any],
    ) -> PersistentTier:
        """Create the group and one empty array per field (shape ``[capacity, *shape]``;
        ragged fields: ``[capacity]`` of variable-length bytes)."""
        group = zarr.open_group(root, mode="w", zarr_format=3, attributes=attrs)
        for name, spec in specs.items():
            with _quiet():
                group.create_array(
                    name,
                    shape=(capacity,) if spec.ragged else (capacity, *spec.shape),
                    chunks=(chunk,) if spec.ragged else (chunk, *spec.shape),
                    dtype=zarr.dtype.VariableLengthBytes() if spec.ragged else spec.dtype,
                    compressors=zarr_compressors(codecs[name], spec.dtype.itemsize),
                    fill_value=b"" if spec.ragged else 0,
                    attributes={"rlbuffers_field": spec.to_dict(), "codec": codecs[name]},
                    config=_CONFIG,
                )
        return cls(root, specs, chunk, capacity)

    def array(self, name: str) -> zarr.Array:
        """The committed Zarr array of field ``name``."""
        arr = self._arrays.get(name)
        if arr is None:
            with _quiet():
                arr = zarr.open_array(self.root / name, mode="r")
            self._arrays[name] = arr
        return arr

    def chunk_key(self, name: str, c: int) -> str:
        """Relative path of chunk ``c`` of field ``name`` inside its array directory."""
        arr = self.array(name)
        return arr.metadata.encode_chunk_key((c,) + (0,) * (arr.ndim - 1))

    # -- saving ---------------------------------------------------------------------------
    def staging_dir(self, generation: int) -> Path:
        return self.root / STAGING / f"g{generation}"

    def stage_chunk(self, generation: int, name: str, c: int, data: Any) -> int:
        """Encode chunk ``c`` of ``name`` into the staging area of ``generation``.

        Args:
            data: the chunk's rows, ``[n, *shape]`` (fixed) or a list of n arrays (ragged).

        Returns:
            bytes written (compressed, including the checksum).
        """
        dst = self.staging_dir(generation) / name
        if not (dst / "zarr.json").exists():
            dst.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.root / name / "zarr.json", dst / "zarr.json")
        with _quiet():
            stage = zarr.open_array(dst, mode="r+").with_config(_CONFIG)
        a = c * self.chunk
        if self.specs[name].ragged:
            blob = np.empty(len(data), dtype=object)
            blob[:] = [np.ascontiguousarray(v).tobytes() for v in data]
            data = blob
        stage[a : a + len(data)] = data
        return (dst / self.chunk_key(name, c)).stat().st_size

    def seal(self, generation: int) -> None:
        """fsync everything staged for ``generation`` (called before the commit)."""
        staging = self.staging_dir(generation)
        if staging.exists():
            _fsync_tree(staging)

    def apply(self, generation: int) -> int:
        """Move the staged chunks of committed ``generation`` over the old ones; idempotent.

        Returns:
            the number of chunk files moved.
        """
        staging = self.staging_dir(generation)
        moved = 0
        if staging.exists():
            for name in self.specs:
                src_root = staging / name
                for dirpath, _, files in os.walk(src_root):
                    for f in files:
                        if f == "zarr.json":
                            continue
                        src = Path(dirpath) / f
                        dst = self.root / name / src.relative_to(src_root)
                        dst.parent.mkdir(parents=True, exist_ok=True)
                        os.replace(src, dst)
                        moved += 1
                fsync_dir(self.root / name)
            shutil.rmtree(staging)
        self.drop_staging(keep=None)
        self._arrays.clear()
        return moved

    def drop_staging(self, keep: int | None) -> None:
        """Remove staging directories other than generation ``keep`` (uncommitted leftovers)."""
        base = self.root / STAGING
        if not base.exists():
            return
        for d in base.iterdir():
            if keep is None or d.name != f"g{keep}":
                log.info("removing uncommitted staging directory %s", d)
                shutil.rmtree(d, ignore_errors=True)

    # -- reading --------------------------------------------------------------------------
    def read_chunk(self, name: str, c: int) -> Any:
        """Decode chunk ``c`` of ``name``: ``[n, *shape]`` or, for ragged fields, a list of
        arrays ``[len_i, *row]``.

        Raises:
            CorruptChunkError: the checksum does not match or the chunk cannot be decoded.
        """
        a, b = c * self.chunk, min((c + 1) * self.chunk, self.capacity)
        try:
            src, staged = self._source(name, c)
            data = src[a:b]
            if staged is not None and not staged.exists():  # moved into place mid-read
                data = self.array(name)[a:b]
        except Exception as e:  # zarr raises ValueError / RuntimeError depending on the codec
            raise CorruptChunkError(name, c, f"{type(e).__name__}: {e}") from e
        spec = self.specs[name]
        if spec.ragged:
            return [np.frombuffer(v, dtype=spec.dtype).reshape(-1, *spec.row_shape) for v in data]
        return data

    def _source(self, name: str, c: int) -> tuple[zarr.Array, Path | None]:
        """The array holding the committed chunk ``c`` (and the staged chunk file, if any): the
        staging copy while a committed save is still being applied, else the main array."""
        if self.generation is not None:
            staged = self.staging_dir(self.generation) / name
            key = staged / self.chunk_key(name, c)
            if key.exists():
                with _quiet():
                    return zarr.open_array(staged, mode="r"), key
        return self.array(name), None

    def chunk_files(self, name: str) -> Iterator[tuple[int, Path]]:
        """(chunk index, file) for every stored chunk of ``name``."""
        for c in range(self.n_chunks):
            path = self.root / name / self.chunk_key(name, c)
            if path.exists():
                yield c, path

    def stored_bytes(self, name: str) -> int:
        """Bytes on disk of the committed chunks of ``name``."""
        return sum(p.stat().st_size for _, p in self.chunk_files(name))

    def verify(self) -> list[tuple[str, int, str]]:
        """Decode every stored chunk; return ``(field, chunk, reason)`` for each corrupt one."""
        bad = []
        for name in self.specs:
            for c, _ in self.chunk_files(name):
                try:
                    self.read_chunk(name, c)
                except CorruptChunkError as e:
                    bad.append((name, c, e.reason))
        return bad
