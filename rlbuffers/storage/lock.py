"""One writer at a time: an OS lock (``fcntl.flock``, exclusive) on ``writer.lock`` in the
buffer's directory, held by a writable buffer (``create``, ``open(mode="r+")``, ``repair``) for
its lifetime. The lock file names the holder (pid, host, time) so a second writer's error can
say who. The kernel releases a ``flock`` when its process dies, however it dies, so a lock left
by a killed writer is never stale: the next writer takes it and rewrites the holder. Readers
(``mode="r"``) never take it. ``docs/format.md`` ("One writer") documents it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
import weakref
from pathlib import Path

from rlbuffers.errors import BufferLockedError, ReadOnlyError
from rlbuffers.storage.safe_files import open_inside

log = logging.getLogger(__name__)

#: The lock file of a local buffer (for a URL buffer: ``<working dir>.lock``, on local disk).
LOCK_FILE = "writer.lock"
#: What opening a file for writing raises on a filesystem this process cannot write.
READ_ONLY_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)


def read_only_error(path: Path | str, e: OSError) -> ReadOnlyError:
    """The error for a writer on a filesystem or directory it cannot write."""
    why = "the filesystem is read-only" if e.errno == errno.EROFS else "it is not writable"
    return ReadOnlyError(f"{path}: cannot open for writing: {why} ({os.strerror(e.errno or 0)}); "
                         "open it with mode='r' to read it")


class WriterLock:
    """The exclusive ``flock`` on one lock file, held until :meth:`release`."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        # closing the descriptor releases the flock: also when an unclosed buffer is collected
        self._close = weakref.finalize(self, os.close, fd)

    @classmethod
    def acquire(cls, path: Path) -> WriterLock:
        """Take the lock at ``path`` (created if missing) without waiting.

        Raises:
            BufferLockedError: another writer holds it (in this or another process); the
                message names the holder. ReadOnlyError: the file cannot be created or opened
                for writing (read-only filesystem, no permission). UnsafePathError: the lock
                file is a symlink, a FIFO, a directory or another non-regular file, or has
                more than one hard link (it is never written through: remove it).
        """
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # O_NOFOLLOW, O_NONBLOCK + fstat: a planted FIFO or symlink never hangs or
            # redirects the writer (safe_files.py)
            fd = open_inside(path.parent, path.name, os.O_RDWR | os.O_CREAT)
        except OSError as e:
            if e.errno in READ_ONLY_ERRNOS:
                raise read_only_error(path.parent, e) from None
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise BufferLockedError(
                f"{path.parent}: another writer has this buffer open ({holder}); one writer "
                "at a time: close it first, or open with mode='r' to read") from None
        except BaseException:
            os.close(fd)
            raise
        try:
            me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(me).encode(), 0)
        except BaseException:
            os.close(fd)  # releases the lock
            raise
        return cls(path, fd)

    def release(self) -> None:
        """Release the lock (the file stays: deleting it would race with a new writer)."""
        self._close()


def _holder(fd: int) -> str:
    """``pid N on host H since T`` from a lock file's contents, or what is known."""
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info["since"])))
        return f"pid {int(info['pid'])} on host {info.get('host', '?')!s:.64} since {since}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown: the lock file names none yet"


def probe(path: Path) -> None:
    """Raise :class:`BufferLockedError` if a writer holds the lock at ``path`` (nothing if
    there is no lock file)."""
    if path.exists():
        WriterLock.acquire(path).release()
