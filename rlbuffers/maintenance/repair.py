"""``repair``: rewrite damaged committed chunks from a working tier that still holds their rows.

A chunk of the last commit that fails its checksum, is missing or truncated can be rewritten
when the writer's working tier (uncompressed, on local disk) still mirrors that commit for the
chunk's slots: ``state.json`` vouches for the tier (same buffer, written in this boot, same
commit) and none of the chunk's base chunks changed since the commit. The repair is a new
commit (its number + 1) with the same contents, so readers of the damaged commit are not
disturbed; chunks that cannot be repaired are reported, not guessed.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from rlbuffers.core.opening import open_checked
from rlbuffers.storage.lease import remove_foreign
from rlbuffers.storage.location import Location, make_location
from rlbuffers.storage.lock import WriterLock
from rlbuffers.storage.persistent import PersistentTier
from rlbuffers.storage.store import working_dir_of, writer_lock_path
from rlbuffers.storage.working import WorkingTier

log = logging.getLogger(__name__)


def repair(
    path: str | os.PathLike[str],
    *,
    working_dir: str | os.PathLike[str] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Verify the last commit of the buffer at ``path`` and rewrite its damaged chunks from the
    working tier where it can (it takes the writer lock: not while a writer has it open).

    Args:
        working_dir: the writer's working tier (default as ``ReplayBuffer.open``).

    It also removes what ``readers/`` holds that is not a lease (FIFOs, directories,
    symlinks, lease files without a commit: :func:`rlbuffers.storage.lease.foreign_entries`).

    Returns:
        ``{"commit": the commit now on disk, "repaired": [{field, chunk, reason}],
        "unrepairable": [{field, chunk, reason, why}], "removed": [{path, what}]}``
        (``path`` relative to the buffer).

    Raises:
        NotABufferError, FormatVersionError, ManifestError: as ``ReplayBuffer.open``.
        BufferLockedError: a writer has the buffer open. OSError: the repair
        commit could not be written (the damaged commit is left as it was).
    """
    loc = make_location(path, storage_options)
    open_checked(loc)  # no buffer or an invalid manifest: raised before the lock is taken
    wdir = working_dir_of(loc, working_dir)
    lock = WriterLock.acquire(writer_lock_path(loc, wdir))
    try:
        removed = [{"path": p, "what": w} for p, w in remove_foreign(loc)]
        return {**_repair(loc, wdir), "removed": removed}
    finally:
        lock.release()


def _repair(loc: Location, wdir: Path) -> dict[str, Any]:
    tier = open_checked(loc)
    m = tier.manifest
    bad = tier.verify()
    report: dict[str, Any] = {"commit": m.commit, "repaired": [], "unrepairable": []}
    if not bad:
        return report
    why_not, working = _working_tier(wdir, tier)
    good = []
    for name, c, reason in bad:
        entry = {"field": name, "chunk": c, "reason": reason}
        if working is None:
            report["unrepairable"].append({**entry, "why": why_not})
        elif m.layout.base_of(name, [c]) & set(working.state.get("dirty_chunks", [])):
            report["unrepairable"].append(
                {**entry, "why": "the working tier changed these rows since the commit"})
        else:
            good.append((name, c, entry))
    if good and working is not None:
        gen = m.commit + 1
        tier.abort()
        try:
            for name, c, _ in good:
                a, b = m.layout.stored_slots(name, c)
                tier.stage_chunks(gen, name, c, working.columns[name].read_range(a, b))
            tier.commit(m.replace(commit=gen, committed_at=time.time()))
            working.write_state(gen, working.state.get("dirty_chunks", []))
        except BaseException:
            if not tier.committed(gen):
                tier.abort()
            raise
        finally:
            working.close()
        tier.apply(gen)
        report["commit"] = gen
        report["repaired"] = [entry for _, _, entry in good]
        log.info("%s: repaired %d chunk(s) in commit %d", loc, len(good), gen)
    elif working is not None:
        working.close()
    return report


def _working_tier(wdir: Path, tier: PersistentTier) -> tuple[str, WorkingTier | None]:
    """The working tier at ``wdir`` if it mirrors ``tier``'s commit, else why not."""
    m = tier.manifest
    try:
        working = WorkingTier(wdir, m.specs, m.capacity, m.layout.base_chunk_rows,
                              create=False, buffer_id=m.buffer_id)
    except (OSError, ValueError) as e:
        return f"no usable working tier at {wdir} ({type(e).__name__}: {e})", None
    if not working.trusted(m.buffer_id):
        working.close()
        return f"the working tier at {wdir} is another buffer's or from another boot", None
    if working.state.get("commit") != m.commit:
        working.close()
        return (f"the working tier at {wdir} mirrors commit "
                f"{working.state.get('commit')}, not {m.commit}"), None
    return "", working
