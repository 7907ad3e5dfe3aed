"""Small helpers of the Zarr persistent tier (``rlbuffers/storage/zarr_tier.py``): error
naming, zarr's warnings, directory listings, and the check that keeps zarr from opening a
planted FIFO or directory as an array's metadata."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from rlbuffers.errors import CorruptChunkError
from rlbuffers.storage.location import Location

#: What zarr and its codecs raise for a chunk that does not decode: a checksum mismatch
#: (crc32c: ValueError), a bad Blosc or zstd frame (RuntimeError / ValueError), a vlen-bytes
#: frame of the wrong length (IndexError / ValueError). I/O errors (OSError) are not among them.
DECODE_ERRORS = (ValueError, RuntimeError, IndexError, TypeError)


@contextmanager
def naming(path: str) -> Iterator[None]:
    """Add ``path`` to an OSError that names no file (``write()`` and ``fsync()`` failing
    with ENOSPC or EIO do not), so that the message says where the save was writing."""
    try:
        yield
    except OSError as e:
        if e.filename is not None or e.errno is None or isinstance(e, CorruptChunkError):
            raise
        raise OSError(e.errno, e.strerror, path) from e


@contextmanager
def quiet() -> Iterator[None]:
    """Silence zarr's note that vlen-bytes (our ragged encoding) is not in the v3 spec yet."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"The data type \(VariableLengthBytes")
        yield


def numbers(names: list[str], suffix: str) -> list[int]:
    """The commit numbers of ``g<N><suffix>`` entries of a directory listing."""
    out = []
    for n in names:
        core = n[1 : len(n) - len(suffix)] if n.endswith(suffix) else ""
        if n.startswith("g") and core.isdigit():
            out.append(int(core))
    return out


def check_array_meta(loc: Location, rel: str) -> None:
    """Before zarr opens the array ``rel`` of a local buffer: its ``zarr.json``, if present,
    must be a regular file reached without a symlink (zarr reads it with a blocking ``open``
    that follows symlinks: a FIFO there would hang the reader, a symlink read another file).

    Raises:
        UnsafePathError: ``rel/zarr.json`` or a directory on its way is a symlink, a FIFO, a
            socket, a device or a directory.
    """
    if loc.root is None:
        return
    try:
        loc.size(f"{rel}/zarr.json")  # LocalLocation.size: lstat after an O_NOFOLLOW walk
    except FileNotFoundError:
        return  # missing: zarr says so
