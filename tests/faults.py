"""Deterministic fault injection at the filesystem calls (SQLite-style crash testing).

:class:`FaultInjector` counts every filesystem operation the process makes (opening a file for
writing, ``pwrite``, ``fsync``, rename/replace/link, unlink/rmdir, mkdir) and, at the k-th one:

- ``mode="crash"``: the process "dies": that operation and every later one raise
  :class:`SimulatedCrash` (a ``BaseException``, so no ``except Exception`` handler can carry on
  writing), which is what a SIGKILL between two system calls leaves on disk;
- ``mode="error"``: that one operation fails with ``OSError(errno)`` (EIO, ENOSPC), and the
  process goes on;
- ``mode="kill"``: the process sends itself SIGKILL just before that operation (a real death,
  threads and all, at a chosen point instead of a timed one: tests/test_crash.py).

Reads are not counted. The patches are on the ``os`` module and ``io.open``, so threads
(zarr's I/O, the parallel fsyncs) are covered too.
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class SimulatedCrash(BaseException):
    """The injected crash (everything after it fails too)."""


#: os functions that change the filesystem, by the kind of operation they are.
OS_OPS = {
    "pwrite": "write", "write": "write", "fsync": "fsync", "fdatasync": "fsync",
    "replace": "rename", "rename": "rename", "link": "rename",
    "unlink": "unlink", "remove": "unlink", "rmdir": "unlink",
    "mkdir": "mkdir", "ftruncate": "write", "truncate": "write",
}


class FaultInjector:
    """Count filesystem operations; inject a crash or an I/O error at operation ``at``.

    Args:
        at: 1-based index of the operation to hit; None only counts.
        mode: ``"crash"``, ``"error"`` or ``"kill"``.
        error: the errno of an injected ``OSError``.
    """

    def __init__(self, at: int | None = None, mode: str = "crash", error: int = errno.EIO):
        self.at, self.mode, self.error = at, mode, error
        self.count = 0
        self.crashed = False
        self.ops: list[str] = []
        self._lock = threading.Lock()

    def hit(self, kind: str, what: Any) -> None:
        """Called before each operation; raises where the plan says."""
        with self._lock:
            if self.crashed:
                raise SimulatedCrash(f"dead since op {self.at}")
            self.count += 1
            self.ops.append(f"{kind} {what}")
            if self.count != self.at:
                return
            if self.mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.mode == "crash":
                self.crashed = True
                raise SimulatedCrash(f"crash at op {self.count}: {kind} {what}")
        raise OSError(self.error, f"injected {os.strerror(self.error)} at op {self.count}",
                      str(what))

    @contextmanager
    def installed(self) -> Iterator[FaultInjector]:
        """Patch the filesystem calls for the duration of the block."""
        saved: dict[tuple[Any, str], Callable[..., Any]] = {}

        def wrap(owner: Any, name: str, kind: str) -> None:
            real = getattr(owner, name)
            saved[(owner, name)] = real

            def patched(*args: Any, **kwargs: Any) -> Any:
                self.hit(kind, args[0] if args else "")
                return real(*args, **kwargs)

            setattr(owner, name, patched)

        for name, kind in OS_OPS.items():
            if hasattr(os, name):
                wrap(os, name, kind)
        real_open = io.open

        def opening(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            if any(c in mode for c in "wax+"):
                self.hit("write", file)
            return real_open(file, mode, *args, **kwargs)

        saved[(io, "open")] = real_open
        saved[(builtins, "open")] = builtins.open
        io.open = builtins.open = opening  # type: ignore[assignment]
        try:
            yield self
        finally:
            for (owner, name), real in saved.items():
                setattr(owner, name, real)
