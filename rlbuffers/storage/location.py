"""Where a persistent tier lives: a local directory, or any fsspec URL (``s3://``, ``gs://``,
``memory://``...). Local directories get fsync'd, rename-based atomic writes; object stores
get single-object PUTs, which replace an object atomically."""

from __future__ import annotations

import logging
import os
import shutil
import stat
from abc import ABC, abstractmethod
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import fsspec

from rlbuffers.errors import NotABufferError, UnsafePathError
from rlbuffers.storage.safe_files import (
    open_inside,
    remove_inside,
    stat_inside,
    write_atomic_inside,
)

log = logging.getLogger(__name__)

#: Threads that fsync the files of a save at once (see :meth:`LocalLocation.sync_tree`).
SYNC_THREADS = 8


def fsync_path(path: str | os.PathLike[str], *, follow: bool = True) -> None:
    """fsync a file, or a directory so that a rename inside it survives power loss. The open
    never blocks (a FIFO is fsync'd as is: nothing); with ``follow=False`` a symlink is
    skipped instead of followed."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if not follow and os.path.islink(path):
            return
        raise e
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_inside(base: str | os.PathLike[str], path: str | os.PathLike[str]) -> None:
    """Raise :class:`UnsafePathError` unless ``path``, with every symlink followed, lies in
    ``base`` (also resolved): the check before any write or delete of the buffer's files."""
    real_base = os.path.realpath(base)
    real = os.path.realpath(path)
    if real != real_base and not real.startswith(real_base.rstrip(os.sep) + os.sep):
        raise UnsafePathError(f"{path}: resolves to {real}, outside {real_base}; rlbuffers "
                              "does not write or delete through a symlink that leaves the "
                              "buffer's directory (docs/format.md, 'Symlinks')")


class Location(ABC):
    """A root directory or URL plus the operations the persistent tier needs, each taking a
    path relative to the root (``"obs/c/0/0"``). Get one with :func:`make_location`, which
    picks :class:`LocalLocation` (a directory: fsync'd, rename-based atomic writes) or
    :class:`FsspecLocation` (any fsspec URL: single-object PUTs) by the URL."""

    #: whether the root is a local directory (renames and fsync exist; create can be atomic).
    local: bool
    #: the root as given. storage_options: fsspec options (URLs only).
    url: str
    storage_options: dict[str, Any]
    #: the local directory (absolute), or None for a URL.
    root: Path | None
    fs: Any
    _base: str

    def __str__(self) -> str:
        return self.url

    @property
    def path(self) -> Path | str:
        """The buffer's directory (a ``Path``) or URL (a ``str``)."""
        return self.root if self.root is not None else self.url

    def full(self, rel: str = "") -> str:
        """Path of ``rel`` as the filesystem sees it."""
        return f"{self._base}/{rel}" if rel else self._base

    @abstractmethod
    def check_inside(self, rel: str) -> None:
        """Raise :class:`UnsafePathError` if ``rel`` resolves outside the root (local
        directories: symlinks are followed; object stores have none)."""

    @abstractmethod
    def zarr_args(self, rel: str = "") -> dict[str, Any]:
        """``store`` (and ``storage_options``) arguments for ``zarr.open_*``."""

    # -- queries --------------------------------------------------------------------------
    def exists(self, rel: str = "") -> bool:
        return bool(self.fs.exists(self.full(rel)))

    def is_dir(self, rel: str = "") -> bool:
        return bool(self.fs.isdir(self.full(rel)))

    def listdir(self, rel: str = "") -> list[str]:
        """Names directly under ``rel`` (empty if it does not exist)."""
        try:
            listing = self.fs.ls(self.full(rel), detail=False)
        except FileNotFoundError:
            return []
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in listing]

    def files(self, rel: str = "") -> dict[str, int]:
        """Every file below ``rel``: relative path (to ``rel``) -> size in bytes."""
        base = self.full(rel)
        if not self.fs.exists(base):
            return {}
        found = self.fs.find(base, detail=True)
        return {p[len(base) + 1 :]: int(info["size"]) for p, info in found.items()}

    def size(self, rel: str) -> int:
        return int(self.fs.size(self.full(rel)))

    def read_bytes(self, rel: str) -> bytes:
        """Contents of ``rel``.

        Raises:
            NotABufferError: the root does not exist. FileNotFoundError: ``rel`` does not.
        """
        try:
            return bytes(self.fs.cat_file(self.full(rel)))
        except FileNotFoundError:
            if not self.is_dir():
                msg = f"{self.url}: not an rlbuffers buffer (no such directory)"
                raise NotABufferError(msg) from None
            raise

    # -- writes ---------------------------------------------------------------------------
    @abstractmethod
    def write_atomic(self, rel: str, data: bytes) -> None:
        """Replace ``rel`` with ``data`` atomically."""

    @abstractmethod
    def copy(self, src: str, dst: str) -> None:
        """Copy the file ``src`` to ``dst``."""

    @abstractmethod
    def move(self, src: str, dst: str) -> None:
        """Move ``src`` over ``dst``."""

    @abstractmethod
    def remove_file(self, rel: str) -> None:
        """Delete the file ``rel`` (nothing if it is already gone)."""

    @abstractmethod
    def remove_tree(self, rel: str) -> None:
        """Delete everything below ``rel`` (nothing if it is already gone)."""

    @abstractmethod
    def sync_tree(self, rel: str) -> None:
        """Make every file and directory below ``rel`` durable."""

    @abstractmethod
    def sync_dirs(self, rels: Iterable[str]) -> None:
        """Make the directories ``rels`` (and renames into them) durable."""


class LocalLocation(Location):
    """A local directory: atomic writes are temp file, fsync, rename, fsync of the directory."""

    local = True
    root: Path

    def __init__(self, path: str | os.PathLike[str]) -> None:
        text = os.fspath(path)
        self.url = text
        self.storage_options = {}
        # Absolute: fsspec lists files by absolute path, and ``files()`` strips the root.
        self.root = Path(os.path.abspath(text.split("://", 1)[1] if "://" in text else text))
        self.fs = fsspec.filesystem("file")
        self._base = str(self.root)

    def zarr_args(self, rel: str = "") -> dict[str, Any]:
        return {"store": self.full(rel)}

    def check_inside(self, rel: str) -> None:
        check_inside(self.root, self.root / rel)

    def read_bytes(self, rel: str) -> bytes:
        """Contents of the regular file ``rel``, reached without following a symlink below
        the root and opened without blocking (``safe_files.open_inside``).

        Raises:
            NotABufferError: the root does not exist. FileNotFoundError: ``rel`` does not.
            NotADirectoryError: the root is a file.
            UnsafePathError: ``rel`` or a directory on its way is a symlink, a FIFO, a
                socket, a device, or (``rel``) a directory.
        """
        try:
            fd = open_inside(self.root, rel, os.O_RDONLY)
        except FileNotFoundError:
            if not self.root.is_dir():
                msg = f"{self.url}: not an rlbuffers buffer (no such directory)"
                raise NotABufferError(msg) from None
            raise
        with os.fdopen(fd, "rb") as f:
            return f.read()

    def size(self, rel: str) -> int:
        """Bytes of the regular file ``rel`` (reached without following a symlink).

        Raises:
            FileNotFoundError: it does not exist. UnsafePathError: it, or a directory on its
                way, is a symlink or not a regular file (directory).
        """
        return int(stat_inside(self.root, rel).st_size)

    def write_atomic(self, rel: str, data: bytes) -> None:
        """Replace ``rel`` with ``data`` atomically: a temporary file of an unpredictable name
        created with ``O_EXCL``, fsync, rename (over a symlink at ``rel``, never through it)
        and fsync of the directory; directories below the root are walked without following
        symlinks (``safe_files.write_atomic_inside``).

        Raises:
            UnsafePathError: ``rel`` resolves outside the root, or a directory on the way is
                a symlink or not a directory.
        """
        self.check_inside(rel)
        parent = (self.root / rel).parent
        new_dir = not parent.is_dir()
        self.root.mkdir(parents=True, exist_ok=True)
        write_atomic_inside(self.root, rel, data, make_dirs=True)
        if new_dir:
            fsync_path(parent.parent)

    def copy(self, src: str, dst: str) -> None:
        """Copy the regular file ``src`` to ``dst`` (replaced atomically, never written
        through a symlink).

        Raises:
            UnsafePathError: as :meth:`write_atomic`; ``src`` is not a regular file."""
        self.check_inside(dst)
        fd = open_inside(self.root, src, os.O_RDONLY)
        with os.fdopen(fd, "rb") as f:
            data = f.read()
        self.root.mkdir(parents=True, exist_ok=True)
        write_atomic_inside(self.root, dst, data, make_dirs=True, durable=False)

    def move(self, src: str, dst: str) -> None:
        """Rename ``src`` over ``dst``."""
        self.check_inside(src)
        self.check_inside(dst)
        (self.root / dst).parent.mkdir(parents=True, exist_ok=True)
        os.replace(self.root / src, self.root / dst)

    def _check_parent(self, rel: str) -> Path:
        """``root/rel`` after checking that its directory lies inside the root (the entry
        itself is not resolved: a symlink there is removed, never followed)."""
        path = self.root / rel
        check_inside(self.root, path if path == self.root else path.parent)
        return path

    def remove_file(self, rel: str) -> None:
        """Delete ``rel`` (a symlink there: the link itself); a ``rel`` whose directory is
        reached through a symlink is not this buffer's file and is left alone (logged)."""
        self._check_parent(rel)
        try:
            remove_inside(self.root, rel)
        except UnsafePathError as e:
            log.info("not deleting through a symlink: %s", e)

    def remove_tree(self, rel: str) -> None:
        """Delete ``rel`` and everything below it; a symlink (or any other non-directory) at
        ``rel`` is unlinked itself, never followed (``shutil.rmtree`` does not follow
        symlinks below it either)."""
        path = self._check_parent(rel)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if path == self.root or stat.S_ISDIR(st.st_mode):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass

    def sync_tree(self, rel: str) -> None:
        """fsync every file and directory below ``rel``."""
        if not (self.root / rel).exists():
            return
        paths = []
        for dirpath, _, names in os.walk(self.root / rel):  # never into a symlinked directory
            paths += [os.path.join(dirpath, name) for name in names]
            paths.append(dirpath)
        _fsync_all(paths, follow=False)

    def sync_dirs(self, rels: Iterable[str]) -> None:
        """fsync the directories ``rels``, so renames into them and their creation survive
        power loss."""
        _fsync_all([self.root / rel for rel in rels if (self.root / rel).is_dir()])


class FsspecLocation(Location):
    """An fsspec URL (``s3://``, ``gs://``, ``memory://``...): each write is one PUT, which
    replaces an object atomically and is durable when it returns."""

    local = False

    def __init__(self, url: str, protocol: str, storage_options: dict[str, Any]) -> None:
        self.url = url
        self.storage_options = dict(storage_options)
        self.fs = fsspec.filesystem(protocol, **self.storage_options)
        self._base = self.fs._strip_protocol(url).rstrip("/")
        self.root = None

    def zarr_args(self, rel: str = "") -> dict[str, Any]:
        return {"store": f"{self.url.rstrip('/')}/{rel}" if rel else self.url,
                "storage_options": self.storage_options}

    def check_inside(self, rel: str) -> None:
        """Nothing to check: object stores have no symlinks, and keys are not resolved."""

    def write_atomic(self, rel: str, data: bytes) -> None:
        """One PUT of ``data`` at ``rel``."""
        self.fs.pipe_file(self.full(rel), data)

    def copy(self, src: str, dst: str) -> None:
        self.fs.copy(self.full(src), self.full(dst))

    def move(self, src: str, dst: str) -> None:
        """Copy ``src`` to ``dst``, then delete ``src`` (object stores have no rename)."""
        self.fs.copy(self.full(src), self.full(dst))
        self.fs.rm_file(self.full(src))

    def remove_file(self, rel: str) -> None:
        try:
            self.fs.rm_file(self.full(rel))
        except FileNotFoundError:
            pass

    def remove_tree(self, rel: str) -> None:
        if self.fs.exists(self.full(rel)):
            self.fs.rm(self.full(rel), recursive=True)

    def sync_tree(self, rel: str) -> None:
        """Nothing to do: a PUT is durable when it returns."""

    def sync_dirs(self, rels: Iterable[str]) -> None:
        """Nothing to do: object stores have no directories."""


def make_location(url: str | os.PathLike[str],
                  storage_options: dict[str, Any] | None = None) -> Location:
    """The :class:`Location` of ``url``: a :class:`LocalLocation` for a path or a ``file://``
    / ``local://`` URL, else a :class:`FsspecLocation` for the URL's protocol.

    Raises:
        ValueError: ``storage_options`` given with a local path (they are for URLs only).
    """
    text = os.fspath(url)
    protocol = text.split("://", 1)[0] if "://" in text else "file"
    options = dict(storage_options or {})
    if protocol in ("file", "local"):
        if options:
            raise ValueError(f"storage_options: only for URLs, got {options} "
                             f"with the local path {text!r}")
        return LocalLocation(text)
    return FsspecLocation(text, protocol, options)


def _fsync_all(paths: list[Any], *, follow: bool = True) -> None:
    """fsync ``paths`` in parallel threads, so the filesystem can commit them in few journal
    transactions instead of one per path (a sequential loop waits for one commit each);
    ``follow=False`` skips symlinks instead of following them."""
    with ThreadPoolExecutor(SYNC_THREADS, thread_name_prefix="rlbuffers-fsync") as pool:
        for _ in pool.map(lambda p: fsync_path(p, follow=follow), paths):
            pass
