"""Where the Zarr tier's chunks live and how they read back: a commit's arrays
(``versions/g<N>/<field>``), their ``zarr.json`` checked against a manifest, a stored chunk
decoded into rows, and whether a reader's commit is still kept."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from rlbuffers.errors import NotABufferError, SnapshotReclaimedError, UnsafePathError
from rlbuffers.spec import FieldSpec
from rlbuffers.storage.location import Location
from rlbuffers.storage.manifest import Manifest, read_manifest, upgrade
from rlbuffers.storage.manifest_schema import check_arrays

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
