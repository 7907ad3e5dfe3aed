"""Where the Zarr tier's chunks live and how they read back: a commit's arrays
(``versions/g<N>/<field>``), their ``zarr.json`` checked against a manifest, a stored chunk
decoded into rows, and whether a reader's commit is still kept."""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import google_crc32c
import numpy as np
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, ZstdCodec
from zarr.codecs.bytes import Endian

from rlbuffers.errors import NotABufferError, SnapshotReclaimedError, UnsafePathError
from rlbuffers.spec import FieldSpec
from rlbuffers.storage.location import Location
from rlbuffers.storage.manifest import Manifest, read_manifest, upgrade
from rlbuffers.storage.manifest_schema import check_arrays
from rlbuffers.storage.safe_files import write_all

#: The directory of the arrays written by commits >= 1 (``versions/g<N>/<field>``).
VERSIONS = "versions"


def check_against_arrays(loc: Location, m: Manifest, rel: str) -> None:
    """:func:`check_arrays` of manifest ``m`` (read from ``rel``) against the arrays at
    ``loc``."""
    if m.chunks is None and m.format_version >= 3:
        return
    check_arrays({n: array_meta(loc, n) for n in m.specs},
                 upgrade(json.loads(json.dumps(m.to_json()))), f"{loc}/{rel}")


def array_meta(loc: Location, name: str) -> Any:
    """The ``zarr.json`` object of column ``name``'s array, or None if missing or unreadable."""
    try:
        return json.loads(loc.read_bytes(f"{name}/zarr.json"))
    except UnsafePathError:  # a symlink or FIFO there: say so, not "missing"
        raise
    except (OSError, ValueError, RecursionError):
        return None


def array_path(name: str, commit: int) -> str:
    """The array (relative to the buffer) holding chunks of ``name`` written by
    ``commit``: ``versions/g<N>/<name>``; commit 0 is ``<name>`` itself (the chunks of
    format 1-2 buffers)."""
    return name if commit == 0 else f"{VERSIONS}/g{commit}/{name}"


def decode_chunk(spec: FieldSpec, data: Any) -> Any:
    """A chunk as read from its array: ``[n, *shape]`` as is, or for a ragged field (stored as
    variable-length bytes) a list of arrays ``[len_i, *row]`` of the field's dtype."""
    if spec.ragged:
        return [np.frombuffer(v, dtype=spec.dtype).reshape(-1, *spec.row_shape)
                for v in np.asarray(data, dtype=object)]
    return data


def check_kept(loc: Location, m: Manifest) -> None:
    """Raise :class:`SnapshotReclaimedError` if the writer at ``loc`` no longer keeps commit
    ``m`` (a reader's chunk went missing because it was reclaimed, not corrupted)."""
    try:
        head = read_manifest(loc)
    except NotABufferError:
        return
    if m.commit <= head.commit - head.keep_commits:
        raise SnapshotReclaimedError(
            f"{loc}: commit {m.commit} is no longer kept (the latest is "
            f"{head.commit}, keep_commits={head.keep_commits}); call refresh()")


def ragged_blob(rows: list[Any]) -> np.ndarray:
    """Rows of a ragged field (arrays) as the object array of bytes that Zarr writes."""
    blob = np.empty(len(rows), dtype=object)
    blob[:] = [np.ascontiguousarray(v).tobytes() for v in rows]
    return blob


# -- writing whole chunks without zarr's array machinery ---------------------------------------
#: Threads that encode and write the chunks of one run (Blosc, zstd, crc32c and file writes
#: release the GIL).
ENCODE_THREADS = 4
_POOL: tuple[int, ThreadPoolExecutor] | None = None


def chunk_encoder(arr: Any) -> Callable[[np.ndarray], bytes] | None:
    """The bytes Zarr stores for one whole chunk of ``arr`` (its rows, C order), made by the
    array's own codec objects: ``bytes`` (little-endian), then Blosc or zstd (if any), then
    the crc32c of the result, appended little-endian. None for any other codec chain (or a
    big-endian host, or a fill value other than 0): write through Zarr then.

    Zarr's ``__setitem__`` spent ~8x the encoding time on its own machinery for 4 MiB
    chunks of LZ4-compressed frames (tools/bench/bench_torchrl.py, docs/torchrl.md)."""
    codecs = tuple(arr.metadata.codecs)
    if sys.byteorder != "little" or len(codecs) not in (2, 3) or arr.metadata.fill_value != 0:
        return None
    first, last, mid = codecs[0], codecs[-1], codecs[1:-1]
    if not (isinstance(first, BytesCodec) and first.endian in (Endian.little, None)
            and isinstance(last, Crc32cCodec)):
        return None
    comp: Any = None
    if mid:
        if isinstance(mid[0], BloscCodec):
            comp = mid[0]._blosc_codec
        elif isinstance(mid[0], ZstdCodec):
            comp = mid[0]._zstd_codec
        else:
            return None

    def encode(rows: np.ndarray) -> bytes:
        raw = np.ascontiguousarray(rows).reshape(-1).view(np.uint8)
        body = bytes(comp.encode(raw)) if comp is not None else raw.tobytes()
        return body + struct.pack("<I", google_crc32c.value(body))

    return encode


def write_chunks(loc: Location, dst: str, keys: list[str], data: np.ndarray, rows: int,
                 encode: Callable[[np.ndarray], bytes]) -> list[int]:
    """Encode ``data`` (``[n, *shape]``: ``len(keys)`` chunks of ``rows`` rows, the last
    possibly short: padded with zeros, the fill value, as Zarr stores it) and write chunk
    ``i`` to ``dst/keys[i]`` below the local ``loc``, several chunks at once. The files are
    not fsynced here (the commit syncs its tree); a file already there is replaced, a
    symlink there is refused (``O_NOFOLLOW``). Returns each chunk file's size in bytes."""

    def one(i: int) -> int:
        part = data[i * rows:(i + 1) * rows]
        if len(part) < rows:
            part = np.concatenate([part, np.zeros((rows - len(part), *part.shape[1:]),
                                                  part.dtype)])
        blob = encode(part)
        path = loc.full(f"{dst}/{keys[i]}")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_all(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                          | os.O_CLOEXEC, 0o644), blob)
        return len(blob)

    global _POOL
    if _POOL is None or _POOL[0] != os.getpid():
        _POOL = (os.getpid(), ThreadPoolExecutor(ENCODE_THREADS,
                                                 thread_name_prefix="rlbuffers-encode"))
    jobs = [_POOL[1].submit(one, i) for i in range(len(keys))]
    wait(jobs)  # all of them, even after a failure: none writes once the save has moved on
    return [job.result() for job in jobs]
