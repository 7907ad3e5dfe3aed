"""Opening and writing files inside a directory that never follows a symlink, never blocks on a
FIFO and never leaves the directory: the one way rlbuffers (and its trainers) write into a
buffer or a run directory that somebody else may have prepared.

Every path is walked from the root one component at a time with ``O_NOFOLLOW`` (each
directory opened relative to its parent's descriptor), so a symlink anywhere below the root,
planted before or during the call, is refused rather than followed; the root itself may be a
symlink (it is resolved once, as the user named it). The file is opened with ``O_NONBLOCK``
(a FIFO cannot hang the open) and checked with ``fstat`` to be a regular file; a file written
in place must have one link (a hard link planted to a file outside would otherwise be written
through). Atomic replacements go through a temporary file with an unpredictable name created
with ``O_EXCL`` beside the target, then ``rename``, which replaces a symlink at the target
instead of following it.

Every refusal raises :class:`~rlbuffers.errors.UnsafePathError` (a ``PermissionError``) naming
the path and what was found there. ``docs/format.md`` ("Symlinks") documents the rule.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import stat
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np

from rlbuffers.errors import UnsafePathError

__all__ = ["append_inside", "check_regular", "create_npy_inside", "open_file_inside",
           "open_inside", "open_npy_inside", "parts_of", "remove_inside", "stat_inside",
           "write_atomic_inside"]

_WRITE = os.O_WRONLY | os.O_RDWR


def parts_of(rel: str | os.PathLike[str]) -> list[str]:
    """The components of the relative path ``rel``.

    Raises:
        UnsafePathError: ``rel`` is absolute, empty, or has a ``..`` or ``.`` component.
    """
    text = os.fspath(rel)
    parts = [p for p in text.split(os.sep) if p]
    if os.path.isabs(text) or not parts or any(p in (".", "..") for p in parts):
        raise UnsafePathError(f"path {text!r}: expected a relative path inside the directory "
                              "without '.' or '..' components")
    return parts


def _refusal(path: Path, what: str) -> UnsafePathError:
    return UnsafePathError(f"{path}: {what}; rlbuffers writes only regular files inside the "
                           "directory and never follows a symlink there (docs/format.md, "
                           "'Symlinks')")


def _open_dir(root: str | os.PathLike[str], parts: list[str], make_dirs: bool) -> int:
    """A descriptor of the directory ``root/parts[0]/...``, every component below the root
    opened with ``O_NOFOLLOW``; missing ones are made when ``make_dirs``."""
    dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    here = Path(root)
    try:
        for part in parts:
            here = here / part
            flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                nfd = os.open(part, flags, dir_fd=dfd)
            except FileNotFoundError:
                if not make_dirs:
                    raise
                try:
                    os.mkdir(part, 0o755, dir_fd=dfd)
                except FileExistsError:
                    pass
                nfd = _open_component(here, part, flags, dfd)
            except OSError as e:
                raise _component_error(here, part, dfd, e) from None
            os.close(dfd)
            dfd = nfd
    except BaseException:
        os.close(dfd)
        raise
    return dfd


def _open_component(here: Path, part: str, flags: int, dfd: int) -> int:
    try:
        return os.open(part, flags, dir_fd=dfd)
    except OSError as e:
        raise _component_error(here, part, dfd, e) from None


def _component_error(here: Path, part: str, dfd: int, e: OSError) -> OSError:
    # O_DIRECTORY | O_NOFOLLOW on a symlink fails with ENOTDIR (Linux) or ELOOP
    if e.errno not in (errno.ELOOP, errno.ENOTDIR):
        return e
    try:
        link = stat.S_ISLNK(os.lstat(part, dir_fd=dfd).st_mode)
    except OSError:
        link = e.errno == errno.ELOOP
    return _refusal(here, "is a symlink" if link else "is not a directory")


def open_inside(root: str | os.PathLike[str], rel: str | os.PathLike[str],
                flags: int = os.O_RDONLY, mode: int = 0o644, *,
                make_dirs: bool = False) -> int:
    """Open ``root/rel`` with ``os.open`` ``flags``, refusing anything but a regular file
    reached without a symlink.

    Args:
        root: the directory (it may itself be a symlink: it is resolved as given).
        rel: a relative path below ``root``.
        flags: ``os.open`` flags; ``O_NOFOLLOW``, ``O_NONBLOCK`` (for the open only) and
            ``O_CLOEXEC`` are added.
        mode: permission bits of a file created by ``O_CREAT``.
        make_dirs: create missing directories of ``rel`` (each with ``mkdir``, never
            through a symlink).

    Returns:
        A blocking file descriptor (the caller closes it).

    Raises:
        UnsafePathError: a component of ``rel`` is a symlink or not a directory; the file is a
            symlink, a FIFO, a socket, a device or a directory; a file opened for writing
            without ``O_CREAT | O_EXCL`` has more than one hard link.
        FileNotFoundError, OSError: as ``os.open``.
    """
    parts = parts_of(rel)
    path = Path(root, *parts)
    dfd = _open_dir(root, parts[:-1], make_dirs)
    try:
        try:
            fd = os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         mode, dir_fd=dfd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise _refusal(path, "is a symlink") from None
            if e.errno in (errno.ENXIO, errno.EISDIR):
                raise _refusal(path, "is not a regular file") from None
            raise
    finally:
        os.close(dfd)
    try:
        _check_opened(fd, path, flags)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_opened(fd: int, path: Path, flags: int) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise _refusal(path, f"is not a regular file (mode {stat.filemode(st.st_mode)})")
    fresh = flags & os.O_CREAT and flags & os.O_EXCL
    if flags & _WRITE and not fresh and st.st_nlink > 1:
        raise _refusal(path, f"has {st.st_nlink} hard links; writing it in place would "
                             "change the other names too")


def open_file_inside(root: str | os.PathLike[str], rel: str | os.PathLike[str],
                     mode: str = "rb", *, make_dirs: bool = False,
                     encoding: str | None = None) -> IO[Any]:
    """:func:`open_inside` as a Python file object; ``mode`` is one of ``"r"``, ``"rb"``,
    ``"a"``, ``"ab"``, ``"r+b"``.

    Raises:
        ValueError: another ``mode``.
        UnsafePathError: as :func:`open_inside`.
    """
    flags = {"r": os.O_RDONLY, "rb": os.O_RDONLY, "r+b": os.O_RDWR,
             "a": os.O_WRONLY | os.O_APPEND | os.O_CREAT,
             "ab": os.O_WRONLY | os.O_APPEND | os.O_CREAT}.get(mode)
    if flags is None:
        raise ValueError(f"mode: expected one of 'r', 'rb', 'r+b', 'a', 'ab', got {mode!r}")
    fd = open_inside(root, rel, flags, make_dirs=make_dirs)
    if "b" in mode:
        return os.fdopen(fd, mode)
    return os.fdopen(fd, mode, encoding=encoding or "utf-8")


def append_inside(root: str | os.PathLike[str], rel: str | os.PathLike[str],
                  data: bytes) -> None:
    """Append ``data`` to ``root/rel`` (created if missing), as :func:`open_inside`.

    Raises:
        UnsafePathError: as :func:`open_inside`.
    """
    write_all(open_inside(root, rel, os.O_WRONLY | os.O_APPEND | os.O_CREAT), data)


def write_all(fd: int, data: bytes) -> None:
    """Write every byte of ``data`` to the open descriptor ``fd`` (``os.write`` may write
    fewer), then close it, also on an error."""
    try:
        view = memoryview(data)
        while len(view):
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def write_atomic_inside(root: str | os.PathLike[str], rel: str | os.PathLike[str],
                        data: bytes | Callable[[IO[bytes]], object], *,
                        durable: bool = True, make_dirs: bool = False) -> None:
    """Replace ``root/rel`` with ``data`` (bytes, or a function writing into a binary file)
    atomically: a temporary file with an unpredictable name created with ``O_EXCL`` beside the
    target, written, fsync'd, renamed over the target (a symlink at the target is replaced,
    never followed), and the directory fsync'd (when ``durable``). A failure leaves the
    target as it was and removes the temporary file.

    Raises:
        UnsafePathError: a directory component of ``rel`` is a symlink or not a directory,
            or the target is a directory.
    """
    parts = parts_of(rel)
    dfd = _open_dir(root, parts[:-1], make_dirs)
    tmp = f".{parts[-1]}.{os.getpid()}-{uuid.uuid4().hex[:12]}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o644, dir_fd=dfd)
        try:
            with os.fdopen(fd, "wb") as f:
                if callable(data):
                    data(f)
                else:
                    f.write(data)
                f.flush()
                if durable:
                    os.fsync(f.fileno())
            try:
                os.replace(tmp, parts[-1], src_dir_fd=dfd, dst_dir_fd=dfd)
            except IsADirectoryError:
                raise _refusal(Path(root, *parts), "is a directory") from None
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except FileNotFoundError:
                pass
            raise
        if durable:
            os.fsync(dfd)
    finally:
        os.close(dfd)


def check_regular(path: str | os.PathLike[str]) -> os.stat_result:
    """``os.lstat(path)`` if ``path`` is a regular file (not a symlink).

    Raises:
        UnsafePathError: it is a symlink, FIFO, socket, device or directory.
        FileNotFoundError: it does not exist.
    """
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        what = "is a symlink" if stat.S_ISLNK(st.st_mode) else (
            f"is not a regular file (mode {stat.filemode(st.st_mode)})")
        raise _refusal(Path(path), what)
    return st


def stat_inside(root: str | os.PathLike[str], rel: str | os.PathLike[str]) -> os.stat_result:
    """``lstat`` of the regular file ``root/rel``, reached without following a symlink.

    Raises:
        UnsafePathError: a component of ``rel`` is a symlink or not a directory, or the file
            is a symlink, FIFO, socket, device or directory.
        FileNotFoundError: it does not exist.
    """
    parts = parts_of(rel)
    dfd = _open_dir(root, parts[:-1], False)
    try:
        st = os.lstat(parts[-1], dir_fd=dfd)
    finally:
        os.close(dfd)
    if not stat.S_ISREG(st.st_mode):
        what = "is a symlink" if stat.S_ISLNK(st.st_mode) else (
            f"is not a regular file (mode {stat.filemode(st.st_mode)})")
        raise _refusal(Path(root, *parts), what)
    return st


def remove_inside(root: str | os.PathLike[str], rel: str | os.PathLike[str]) -> None:
    """Remove whatever is at ``root/rel`` (a file, a symlink itself, a FIFO, a directory with
    everything below it), reached without following a symlink; nothing if it is missing.

    Raises:
        UnsafePathError: a directory component of ``rel`` is a symlink or not a directory.
    """
    parts = parts_of(rel)
    try:
        dfd = _open_dir(root, parts[:-1], False)
    except FileNotFoundError:
        return
    try:
        try:
            st = os.lstat(parts[-1], dir_fd=dfd)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):  # rmtree with dir_fd never follows a symlink below it
            shutil.rmtree(parts[-1], dir_fd=dfd)
        else:
            try:
                os.unlink(parts[-1], dir_fd=dfd)
            except FileNotFoundError:
                pass
    finally:
        os.close(dfd)


def create_npy_inside(root: str | os.PathLike[str], rel: str | os.PathLike[str],
                      dtype: Any, shape: tuple[int, ...]) -> None:
    """Replace ``root/rel`` atomically (as :func:`write_atomic_inside`, not fsync'd) with a
    ``.npy`` file of ``shape`` and ``dtype`` filled with zeros (sparse: no data is written).

    Raises:
        UnsafePathError: a directory component of ``rel`` is a symlink or not a directory.
    """
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
              "fortran_order": False, "shape": tuple(int(n) for n in shape)}
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize

    def write(f: IO[bytes]) -> None:
        try:
            np.lib.format.write_array_header_1_0(f, header)
        except ValueError:  # a header over 64 KiB
            np.lib.format.write_array_header_2_0(f, header)
        f.truncate(f.tell() + nbytes)

    write_atomic_inside(root, rel, write, durable=False)


def open_npy_inside(root: str | os.PathLike[str], rel: str | os.PathLike[str],
                    mode: str = "r") -> np.memmap:
    """A memory map of the ``.npy`` file ``root/rel`` opened as :func:`open_inside` (no
    symlink, no FIFO; for ``mode="r+"``, one hard link), with mode ``"r"`` or ``"r+"``
    (``np.lib.format.open_memmap`` follows symlinks; this maps the descriptor it checked).

    Raises:
        UnsafePathError: as :func:`open_inside`.
        ValueError: not a ``.npy`` file of format 1.0 or 2.0, a Fortran-ordered or object
            array, or shorter than its header says.
    """
    if mode not in ("r", "r+"):
        raise ValueError(f"mode: expected 'r' or 'r+', got {mode!r}")
    fd = open_inside(root, rel, os.O_RDONLY if mode == "r" else os.O_RDWR)
    with os.fdopen(fd, "rb" if mode == "r" else "r+b") as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise ValueError(f"{Path(root, rel)}: expected a .npy file of format 1.0 or 2.0, "
                             f"got {version}")
        if fortran or dtype.hasobject:
            raise ValueError(f"{Path(root, rel)}: expected a C-ordered array of plain values, "
                             f"got fortran_order={fortran}, dtype {dtype}")
        offset = f.tell()
        need = offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        size = os.fstat(f.fileno()).st_size
        if size < need:
            raise ValueError(f"{Path(root, rel)}: expected at least {need} bytes for "
                             f"{shape} {dtype}, got {size}")
        return np.memmap(f, dtype=dtype, mode="r" if mode == "r" else "r+", offset=offset,
                         shape=shape)  # type: ignore[call-overload, no-any-return]
