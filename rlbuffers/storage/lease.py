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

Anything else in ``readers/`` (a FIFO, a directory, a symlink, a socket, a lease whose JSON does
not name a commit) is not a lease: the writer's scan skips it without opening it for more than a
non-blocking ``fstat`` (a FIFO cannot hang it, a directory cannot make it raise), and
:func:`foreign_entries` lists it for ``rlbuffers verify`` (``--repair`` removes it).

A lease belongs to the process that took it: a ``fork``ed child inherits the reader object but
neither releases nor deletes its parent's lease (its ``close()`` only closes its copy of the
descriptor, which leaves the parent's shared ``flock`` held).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import stat
import time
import uuid
import weakref
from pathlib import Path

from rlbuffers.storage.location import Location
from rlbuffers.storage.safe_files import open_inside

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
        #: the process that took the lease: only it deletes the file (a forked child does not)
        self.pid = os.getpid()
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
            # never through a symlinked or non-directory readers/ (safe_files.py)
            fd = open_inside(loc.root, f"{READERS}/{tmp.name}",
                             os.O_RDWR | os.O_CREAT | os.O_EXCL, make_dirs=True)
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
        """Delete the lease file and drop its lock; in a forked child (another pid than the
        one that took the lease) only close the child's copy of the descriptor: the parent's
        lease stays, locked, on disk."""
        if self._close.alive:
            if os.getpid() == self.pid:
                _unlink(self.path)
            self._close()


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def leased_commits(loc: Location) -> set[int]:
    """The commits that live readers of the local buffer at ``loc`` hold leases on; deletes the
    leases of readers that are gone (their lock is free). Entries that are not regular files
    are skipped (never opened in a way that blocks, never deleted, never raised about).

    Returns:
        a set of commit numbers (empty for a URL buffer or without ``readers/``).
    """
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
                st = os.lstat(path)
            except OSError:
                continue
            old = time.time() - st.st_mtime > TMP_EXPIRY_SECONDS
            if old and stat.S_ISREG(st.st_mode) and _live_commit(path) is None:
                _unlink(path)
    return held


def _open_regular(path: Path) -> int | None:
    """A read-only descriptor of ``path`` if it is a regular file (opened without following
    a symlink and without blocking on a FIFO), else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:  # released meanwhile, a symlink, a socket
        return None
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _commit_of(fd: int) -> int | None:
    """The commit a lease file names, or None if its JSON names none."""
    try:
        commit = json.loads(os.pread(fd, 4096, 0))["commit"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None
    return commit if isinstance(commit, int) and not isinstance(commit, bool) else None


def _live_commit(path: Path) -> int | None:
    """The commit of a held lease; None (and the file deleted) for a lease nobody holds, None
    (and nothing done) for anything that is not a regular file."""
    fd = _open_regular(path)
    if fd is None:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a live reader holds it
            return _commit_of(fd)
        except OSError:
            return None
        _unlink(path)  # its reader is gone
        return None
    finally:
        os.close(fd)


def foreign_entries(loc: Location) -> list[tuple[str, str]]:
    """What in ``readers/`` is not a lease a reader could hold: ``(path relative to the
    buffer, what it is)`` for each FIFO, directory, symlink, socket, device, unexpected name,
    or held lease file whose JSON names no commit. The writer ignores all of them;
    :func:`remove_foreign` deletes them. Read-only: nothing is changed.

    Returns:
        a list sorted by path (empty for a URL buffer or without ``readers/``).
    """
    if loc.root is None:
        return []
    folder = loc.root / READERS
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        return []
    if not stat.S_ISDIR(st.st_mode):
        return [(READERS, _kind(st.st_mode))]
    out = []
    for name in sorted(os.listdir(folder)):
        what = _foreign(folder / name, name)
        if what:
            out.append((f"{READERS}/{name}", what))
    return out


def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISLNK, "a symlink"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISREG, "a regular file")):
        if test(mode):
            return what
    return f"mode {stat.filemode(mode)}"


def _foreign(path: Path, name: str) -> str | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return f"{_kind(st.st_mode)}, not a lease file"
    if name.startswith(".tmp-"):
        return None
    if not name.endswith(SUFFIX):
        return f"a regular file with an unexpected name (expected <pid>-<id>{SUFFIX})"
    fd = _open_regular(path)
    if fd is None:
        return None
    try:
        if _commit_of(fd) is None:
            return "a lease file whose JSON names no commit (expected {\"commit\": N, ...})"
        return None
    finally:
        os.close(fd)


def remove_foreign(loc: Location) -> list[tuple[str, str]]:
    """Delete what :func:`foreign_entries` lists (a symlink itself, never its target; a
    directory with everything below it). Call it with the writer lock held.

    Returns:
        what was removed, as :func:`foreign_entries` lists it.
    """
    removed = []
    for rel, what in foreign_entries(loc):
        path = loc.root / rel  # type: ignore[operator]
        try:
            if stat.S_ISDIR(os.lstat(path).st_mode):
                shutil.rmtree(path)  # rmtree never follows symlinks below it
            else:
                os.unlink(path)
        except OSError as e:
            if e.errno != errno.ENOENT:
                log.warning("%s: could not remove %s (%s)", loc, rel, e)
                continue
        removed.append((rel, what))
    return removed
