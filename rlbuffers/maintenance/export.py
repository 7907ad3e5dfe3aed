"""``export_commit``: one commit of a buffer as a plain Zarr v3 group (one array per field,
every chunk in place), for tools that read Zarr but not the chunk table of format 3.

The live layout (``docs/format.md``) keeps each chunk version in the array of the commit
that wrote it, so a commit can be read with plain ``zarr`` and the manifest (the recipe is in
``docs/format.md``); ``export_commit`` does that once and writes the result out.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import zarr

from rlbuffers.core.opening import open_checked
from rlbuffers.deprecation import UNSET, renamed_keyword
from rlbuffers.storage.location import make_location
from rlbuffers.storage.zarr_tier import _quiet


def export_commit(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    commit: int | None = None,
    generation: int | None = UNSET,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, int]:
    """Write the commit ``commit`` (default: the last) of the buffer at ``path`` to a new
    Zarr v3 group at ``out``: an array per column with the buffer's shapes, chunks and codecs,
    indexed by slot, and the commit's manifest (JSON) in the group attribute ``rlbuffers``.
    Memory is bounded by one chunk at a time. ``generation``: deprecated spelling of
    ``commit``.

    Returns:
        ``{"commit": N, "chunks": chunks copied}``.

    Raises:
        NotABufferError, SnapshotReclaimedError, CorruptChunkError: as ``ReplayBuffer.open``.
        FileExistsError: ``out`` exists and is not empty.
    """
    commit = renamed_keyword("generation", generation, "commit", commit)
    tier = open_checked(make_location(path, storage_options), commit)
    dst = make_location(out)
    if dst.exists() and dst.listdir():
        raise FileExistsError(f"out: {dst} already exists and is not empty")
    m = tier.manifest
    zarr.open_group(**dst.zarr_args(), mode="w", zarr_format=3,
                            attributes={"rlbuffers": {"export_of": str(tier.loc),
                                                      "manifest": m.to_json()}})
    copied = 0
    for name in m.specs:  # same array metadata (shape, chunks, codecs, attributes)
        dst.write_atomic(f"{name}/zarr.json", tier.loc.read_bytes(f"{name}/zarr.json"))
        with _quiet():
            arr = zarr.open_array(**dst.zarr_args(name), mode="r+")
        for c in sorted(tier.stored_chunks(name)):
            rows = tier.read_chunk(name, c)
            a, _ = tier.layout.stored_slots(name, c)
            if m.specs[name].ragged:
                blob = np.empty(len(rows), dtype=object)
                blob[:] = [np.ascontiguousarray(v).tobytes() for v in rows]
                rows = blob
            arr[a:a + len(rows)] = rows
            copied += 1
    return {"commit": m.commit, "chunks": copied}
