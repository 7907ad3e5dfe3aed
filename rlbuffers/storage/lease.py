"""Reader leases: a reader (``ReplayBuffer.open(path, mode="r")``) of a local buffer keeps the
commit it reads from being reclaimed for as long as it is open.

Each reader holds one file ``readers/<pid>-<random>.lease`` in the buffer's directory, naming
its commit, with a shared ``flock`` on it held while the reader is open. The writer's reclaim
(after each commit, and on opening) keeps every commit named by a lease whose lock is held; a
lease whose lock it can take belongs to a reader that is gone (closed, or dead: the kernel
releases a dead process's flock), and is deleted. There is no time-based expiry: a lease lives
exactly as long as its reader's process holds it open, however long that is (a reader left
open keeps its commit's chunks on disk; close it or call ``refresh()``).

A lease appears atomically (written and locked under a temporary name, then renamed). A
reader takes its lease, then checks that its commit is still within the newest
``keep_commits`` of the head: any reclaim that could have missed the lease was for an older
head, so it cannot have dropped a commit that is still in the window after the lease is
visible. Readers that cannot write the buffer's directory (a read-only filesystem) and readers
of URL buffers read without a lease, as before: their commit is kept for ``keep_commits``
saves. ``docs/format.md`` ("Readers hold a snapshot") documents it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
import uuid
import weakref
from pathlib import Path

from rlbuffers.storage.location import Location

log = logging.getLogger(__name__)

READERS = "readers"
SUFFIX = ".lease"
#: A temporary lease file (a reader between creating and renaming it) older than this, with its
#: lock free, is a dead reader's and is deleted (seconds).
TMP_EXPIRY_SECONDS = 60.0


class ReaderLease:
    """A held lease on one commit (release with :meth:`release`; also released when the
    object is collected or the process ends)."""

    def __init__(self, path: Path, fd: int, commit: int) -> None:
        self.path, self.commit = path, commit
        self._close = weakref.finalize(self, os.close, fd)

    @classmethod
    def take(cls, loc: Location, commit: int) -> ReaderLease | None:
        """A lease on ``commit`` of the local buffer at ``loc``; None for a URL buffer or a
        directory this process cannot write (the reader then reads without one)."""
        if loc.root is None:
            return None
        folder = loc.root / READERS
        tmp = folder / f".tmp-{uuid.uuid4().hex}"
        try:
            loc.check_inside(READERS)  # UnsafePathError is an OSError: no lease
            folder.mkdir(exist_ok=True)
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except OSError as e:
            log.info("%s: reading without a lease (%s); the commit is kept for keep_commits "
                     "saves only", loc, e)
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            info = {"commit": commit, "pid": os.getpid(), "since": time.time()}
            os.pwrite(fd, json.dumps(info).encode(), 0)
            final = folder / f"{os.getpid()}-{uuid.uuid4().hex[:12]}{SUFFIX}"
            os.rename(tmp, final)
        except BaseException:
            os.close(fd)
            _unlink(tmp)
            raise
        return cls(final, fd, commit)

    def release(self) -> None:
        """Delete the lease file and drop its lock."""
        if self._close.alive:
            _unlink(self.path)
            self._close()


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def leased_commits(loc: Location) -> set[int]:
    """The commits that live readers of the local buffer at ``loc`` hold leases on; deletes the
    leases of readers that are gone (their lock is free)."""
    if loc.root is None:
        return set()
    folder = loc.root / READERS
    try:
        loc.check_inside(READERS)
        names = os.listdir(folder)
    except OSError:  # none, or a symlink out of the buffer: nothing there is honoured
        return set()
    held = set()
    for name in names:
        path = folder / name
        if name.endswith(SUFFIX):
            commit = _live_commit(path)
            if commit is not None:
                held.add(commit)
        elif name.startswith(".tmp-"):
            try:
                old = time.time() - os.lstat(path).st_mtime > TMP_EXPIRY_SECONDS
            except FileNotFoundError:
                continue
            if old and _live_commit(path) is None:
                _unlink(path)
    return held


def _live_commit(path: Path) -> int | None:
    """The commit of a held lease; None (and the file deleted) for a lease nobody holds."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:  # released meanwhile, or not a regular file
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a live reader holds it
            try:
                commit = json.loads(os.pread(fd, 4096, 0))["commit"]
            except (ValueError, KeyError, TypeError):
                return None
            return commit if isinstance(commit, int) and not isinstance(commit, bool) else None
        _unlink(path)  # its reader is gone
        return None
    finally:
        os.close(fd)
