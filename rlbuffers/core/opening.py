"""Creating and opening a buffer's tiers: field and sampler checks, the persistent tier of a new
buffer (commit 0), the writer lock around construction, and the sampler and generator rebuilt
from a commit."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from rlbuffers import spec
from rlbuffers.errors import ManifestError
from rlbuffers.sampling import samplers
from rlbuffers.sampling.samplers import EPISODE_ID, Sampler
from rlbuffers.spec import FieldSpec
from rlbuffers.storage import framestack_columns
from rlbuffers.storage.create import create_tier
from rlbuffers.storage.engine import open_tier
from rlbuffers.storage.location import Location, make_location
from rlbuffers.storage.lock import WriterLock, probe
from rlbuffers.storage.manifest import KEEP_COMMITS, Manifest
from rlbuffers.storage.persistent import PersistentTier
from rlbuffers.storage.store import working_dir_of, writer_lock_path

#: Keys that ``sample`` adds next to the fields (no field may take them).
SAMPLE_KEYS = ("indices", "weights")
#: Default bytes of decoded chunks a reader (``mode="r"``) keeps: ``ReplayBuffer.open``'s
#: ``cache_bytes``.
READ_CACHE_BYTES = 256 * 2**20

B = TypeVar("B")


def new_tier(path: str | os.PathLike[str], *, capacity: int, fields: Mapping[str, FieldSpec],
             chunk_transitions: int | None, codec: str | Mapping[str, str], sampler: Sampler,
             seed: int | None, working_dir: str | os.PathLike[str] | None, overwrite: bool,
             storage_options: Mapping[str, Any] | None, keep_commits: int | None,
             next_of: Mapping[str, str] | None) -> tuple[PersistentTier, Path]:
    """The persistent tier of a new, empty buffer (commit 0) and its working directory; the
    arguments are :meth:`rlbuffers.ReplayBuffer.create`'s.

    Raises:
        FieldError: an invalid field name or spec. ValueError: a bad capacity, chunk size or
        codec. FileExistsError: ``path`` is not empty and ``overwrite`` is False.
        BufferLockedError: ``overwrite`` of a buffer a writer has open.
    """
    spec.check_field_specs(fields, SAMPLE_KEYS)
    checked_next_of = framestack_columns.check_next_of(fields, next_of, SAMPLE_KEYS)
    loc = make_location(path, dict(storage_options or {}))
    wdir = working_dir_of(loc, working_dir)
    if overwrite and isinstance(loc.root, Path):
        probe(writer_lock_path(loc, wdir))  # never overwrite a buffer a writer has open
    tier = create_tier(
        loc, capacity=capacity, fields=fields,
        internal={EPISODE_ID: FieldSpec((), "int64"), **sampler.extra_columns,
                  **framestack_columns.side_columns(fields, checked_next_of)},
        next_of=checked_next_of, chunk_transitions=chunk_transitions, codec=codec,
        sampler_state=sampler.state_dict(), seed=seed, overwrite=overwrite,
        keep_commits=KEEP_COMMITS if keep_commits is None else keep_commits)
    return tier, wdir


def with_writer_lock(loc: Any, wdir: Path, build: Callable[[WriterLock], B]) -> B:
    """``build(lock)`` with the writer lock of the buffer at ``loc`` taken first, released if
    ``build`` fails.

    Raises:
        BufferLockedError: another writer holds the lock.
    """
    path = writer_lock_path(loc, wdir)
    if not isinstance(loc.root, Path):
        path.parent.mkdir(parents=True, exist_ok=True)
    lock = WriterLock.acquire(path)
    try:
        return build(lock)
    except BaseException:
        lock.release()
        raise


def check_open_mode(mode: str, commit: int | None, cache_bytes: int | None = None) -> None:
    """Raise ValueError unless ``mode`` is ``"r"`` or ``"r+"`` (``"r"`` when ``commit`` or
    ``cache_bytes`` is given) and ``cache_bytes`` is None or an int >= 0."""
    if mode not in ("r", "r+") or (commit is not None and mode != "r"):
        raise ValueError(f"mode: expected 'r' or 'r+' ('r' with commit), got {mode!r}")
    if cache_bytes is None:
        return
    if isinstance(cache_bytes, bool) or not isinstance(cache_bytes, (int, np.integer)) \
            or cache_bytes < 0:
        raise ValueError(f"cache_bytes: expected an int >= 0 (bytes), got {cache_bytes!r}")
    if mode != "r":
        raise ValueError("cache_bytes: only readers (mode='r') decode chunks through a cache; "
                         "a writer (mode='r+') reads its uncompressed working tier")


def sampler_and_rng(m: Manifest, path: Path | str,
                    sampler: Sampler | None = None) -> tuple[Sampler, np.random.Generator]:
    """The sampler (``sampler`` if given, else rebuilt from commit ``m``) and the buffer's
    generator as of commit ``m``.

    Raises:
        ManifestError: the commit's sampler or generator state is not one they accept (the
        field, expected and actual value named).
    """
    try:
        built = sampler or samplers.sampler_from_state(m.sampler)
    except Exception as e:
        raise ManifestError(str(path), "sampler", "the state_dict() of a registered "
                            f"sampler ({type(e).__name__}: {e})", repr(m.sampler)[:120]) \
            from None
    try:
        rng = samplers.generator_from_state(m.rng)
    except Exception as e:
        raise ManifestError(str(path), "rng", "a bit_generator.state "
                            f"({type(e).__name__}: {e})", repr(m.rng)[:120]) from None
    return built, rng


def open_checked(loc: Location, commit: int | None = None) -> PersistentTier:
    """The persistent tier of the buffer at ``loc`` (commit ``commit``, None: the last), with
    the commit's sampler and generator states checked as :func:`sampler_and_rng` checks them:
    what ``inspect``, ``verify``, ``repair`` and ``export`` read, so a tampered state fails
    there as it fails ``ReplayBuffer.open``.

    Raises:
        NotABufferError, ManifestError, FormatVersionError, SnapshotReclaimedError: as
        :func:`rlbuffers.storage.engine.open_tier`, and ManifestError for a bad sampler or
        generator state.
    """
    tier = open_tier(loc, commit)
    sampler_and_rng(tier.manifest, str(loc))
    return tier
