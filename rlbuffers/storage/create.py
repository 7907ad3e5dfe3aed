"""Making a new, empty buffer on storage: check the arguments, plan the chunks, write the
persistent tier and commit 0."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np

from rlbuffers.errors import BufferExistsError
from rlbuffers.ring import RingState
from rlbuffers.spec import FieldSpec
from rlbuffers.storage.compression import DEFAULT_CODEC, check_codec
from rlbuffers.storage.engine import new_tier, tier_of
from rlbuffers.storage.layout import ChunkLayout, plan_stored_chunk_rows
from rlbuffers.storage.location import LocalLocation, Location, fsync_path
from rlbuffers.storage.manifest import FORMAT_VERSION, STACKED_FORMAT_VERSION, Manifest
from rlbuffers.storage.manifest_schema import check_limits
from rlbuffers.storage.persistent import PersistentTier

#: Target raw bytes of one chunk of the largest field when ``chunk_transitions`` is None.
AUTO_CHUNK_BYTES = 4 * 2**20


def positive_int(name: str, value: Any) -> int:
    """``value`` as an int.

    Raises:
        ValueError: not an integer >= 1 (the message names ``name``).
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    return int(value)


def create_tier(
    loc: Location,
    *,
    capacity: Any,
    fields: Mapping[str, FieldSpec],
    internal: dict[str, FieldSpec],
    chunk_transitions: int | None,
    codec: str | Mapping[str, str],
    sampler_state: dict[str, Any],
    seed: int | None,
    overwrite: bool,
    keep_commits: int,
    next_of: Mapping[str, str] | None = None,
) -> PersistentTier:
    """Create an empty buffer at ``loc`` and commit it as commit 0 (arguments as for
    ``ReplayBuffer.create``; ``internal``: the internal columns and their specs; a buffer
    with stacked fields or ``next_of`` is format 4, any other format 3). On local
    disk this is atomic: the buffer appears whole or not at all.

    Raises:
        ValueError: a bad capacity, chunk size, codec or keep_commits.
        BufferExistsError: ``loc`` is not empty and ``overwrite`` is False.
    """
    capacity = positive_int("capacity", capacity)
    if chunk_transitions is None:
        row = max(spec.column.estimate_bytes() for spec in fields.values())
        chunk_transitions = max(1, min(capacity, AUTO_CHUNK_BYTES // max(row, 1)))
    base = positive_int("chunk_transitions", chunk_transitions)
    keep = positive_int("keep_commits", keep_commits)
    problem = check_limits(capacity, base, keep)
    if problem:
        raise ValueError(f"{problem[0]}: expected {problem[1]}, got {problem[2]}")
    codecs = {n: check_codec(codec if isinstance(codec, str) else codec.get(n, DEFAULT_CODEC), n)
              for n in fields}
    if loc.exists() and loc.listdir():
        if not overwrite:
            raise BufferExistsError(f"{loc}: already exists and is not empty "
                                    "(pass overwrite=True)")
        loc.remove_tree("")
    specs = {**{n: s.column for n, s in fields.items()}, **internal}
    stacked = next_of or any(s.stack_axis is not None for s in fields.values())
    manifest = Manifest(
        buffer_id=uuid.uuid4().hex,
        layout=ChunkLayout(capacity, base, plan_stored_chunk_rows(specs, base, capacity,
                                                                 size_by=fields)),
        fields=dict(fields), codecs=codecs, internal=internal, ring=RingState(capacity),
        commit=0, committed_at=time.time(), sampler=sampler_state,
        rng=dict(np.random.Generator(np.random.PCG64(seed)).bit_generator.state),
        keep_commits=keep, next_of=dict(next_of or {}),
        format_version=STACKED_FORMAT_VERSION if stacked else FORMAT_VERSION,
    )
    if not isinstance(loc, LocalLocation):  # no directory rename: creation is not atomic
        return new_tier(loc, manifest)
    # Build the buffer beside its final place, then rename it there: a crash leaves either no
    # buffer (plus a hidden leftover, removed by the next create) or a whole one.
    parent, name = loc.root.parent, loc.root.name
    parent.mkdir(parents=True, exist_ok=True)
    for old in parent.glob(f".{name}.creating-*"):
        shutil.rmtree(old, ignore_errors=True)
    tmp = parent / f".{name}.creating-{uuid.uuid4().hex[:8]}"
    try:
        built = new_tier(LocalLocation(tmp), manifest).manifest
        os.rename(tmp, loc.root)  # onto a missing or empty directory
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed create leaves nothing behind
        raise
    fsync_path(parent)
    return tier_of(loc, built)
