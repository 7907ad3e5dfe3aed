"""Reading back what a run directory holds, as data only: the one loader of the trainers and
:mod:`rlbuffers.checkpoint`.

A run directory may come from somebody else (a colleague's run, a download), so nothing read
from it may run code: torch files are read with ``torch.load(weights_only=True)`` only (no
pickle ``GLOBAL`` but torch's own tensor types), JSON with :mod:`json`, safetensors with
``safetensors``. Every file is opened with ``O_NOFOLLOW | O_NONBLOCK`` and checked with
``fstat`` to be a regular file, so a symlink planted at its name is refused rather than
followed and a FIFO cannot hang the read; the loaders then read that open file (through
``/proc/self/fd/N`` where a library wants a path), not the name again.

Every failure is one line naming the file, what was expected and what was found:
:class:`RunFileError` (a setting or state file such as ``config.json``) or
:class:`~rlbuffers.errors.CorruptCheckpointError` (a checkpoint file: truncated, bit-flipped,
a pickle asking for code).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlbuffers.errors import CorruptCheckpointError, RLBuffersError

__all__ = ["RunFileError", "load_json", "load_safetensors", "load_torch", "one_line",
           "open_regular", "read_bytes", "restoring"]

_JSON_TYPES = {dict: "a JSON object", list: "a JSON list", str: "a JSON string",
               int: "a JSON integer", float: "a JSON number", bool: "true or false"}


class RunFileError(RLBuffersError, ValueError):
    """A file of a run directory (``config.json``, ``state.json``, ``checksums.json`` ...) is
    missing, not a regular file, or does not hold what it should.

    Attributes:
        path: the file. field: the offending part (``"file"``, ``"JSON"``, a key).
        expected: what it should hold. actual: what it holds.
    """

    def __init__(self, path: str | os.PathLike[str], field: str, expected: str,
                 actual: str) -> None:
        super().__init__(one_line(f"{path}: {field}: expected {expected}, got {actual}"))
        self.path, self.field, self.expected, self.actual = Path(path), field, expected, actual


def one_line(text: str, limit: int = 300) -> str:
    """``text`` on one line (newlines folded into spaces), cut to ``limit`` characters."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[:limit - 3] + "..."


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return f"mode {stat.filemode(mode)}"


def open_regular(path: str | os.PathLike[str], error: type[RLBuffersError] = RunFileError
                 ) -> int:
    """A read-only descriptor (blocking, close-on-exec) of the regular file ``path``; the
    last component is not followed if it is a symlink, and a FIFO is never waited on.

    Raises:
        RunFileError (or ``error``, built with the same four arguments): the file is missing,
            a symlink, a FIFO, a socket, a device or a directory.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as e:
        actual = {errno.ENOENT: "nothing (missing)", errno.ELOOP: "a symlink",
                  errno.ENOTDIR: "a path through a non-directory",
                  errno.ENXIO: "a socket or device", errno.EACCES: "a file it may not read"
                  }.get(e.errno or 0, f"{type(e).__name__}: {e.strerror}")
        raise _error(error, path, "file", "a regular file", actual) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _error(error, path, "file", "a regular file", _kind(st.st_mode))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _error(error: type[RLBuffersError], path: Any, field: str, expected: str,
           actual: str) -> RLBuffersError:
    if error is RunFileError:
        return RunFileError(path, field, expected, actual)
    return error(one_line(f"{path}: {field}: expected {expected}, got {actual}"))


def _fd_path(fd: int, path: str | os.PathLike[str]) -> str:
    """A name of the open file ``fd`` for libraries that take a path (``/proc/self/fd/N`` on
    Linux, else ``path`` itself)."""
    proc = f"/proc/self/fd/{fd}"
    return proc if os.path.exists(proc) else os.fspath(path)


def read_bytes(path: str | os.PathLike[str], *, limit: int = 1 << 30,
               error: type[RLBuffersError] = RunFileError) -> bytes:
    """The bytes of the regular file ``path`` (see :func:`open_regular`).

    Raises:
        RunFileError (or ``error``): as :func:`open_regular`, or the file is over ``limit``
            bytes.
    """
    fd = open_regular(path, error)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        if size > limit:
            raise _error(error, path, "size", f"at most {limit:,} bytes", f"{size:,} bytes")
        return f.read(limit + 1)[:limit]


def load_json(path: str | os.PathLike[str], expected_type: type = dict, *,
              error: type[RLBuffersError] = RunFileError) -> Any:
    """The JSON value of the file ``path``, which must be of ``expected_type`` (``dict``:
    an object, ``list``, ...).

    Raises:
        RunFileError (or ``error``): the file is missing, not a regular file, not UTF-8, not
            JSON, or its top-level value is not of ``expected_type``.
    """
    data = read_bytes(path, limit=256 << 20, error=error)
    try:
        value = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise _error(error, path, "encoding", "UTF-8 text", f"byte {e.start}: "
                     f"{data[e.start:e.start + 1]!r}") from None
    except json.JSONDecodeError as e:
        raise _error(error, path, "JSON", "valid JSON",
                     f"{e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise _error(error, path, "JSON", "valid JSON", "nesting too deep") from None
    want = _JSON_TYPES.get(expected_type, expected_type.__name__)
    if not isinstance(value, expected_type) or (expected_type in (int, float)
                                                and isinstance(value, bool)):
        raise _error(error, path, "top level", want, _describe(value))
    return value


def _describe(value: Any) -> str:
    for t, name in ((bool, "true or false"), (dict, "a JSON object"), (list, "a JSON list"),
                    (str, "a JSON string"), (int, "a JSON integer"), (float, "a JSON number")):
        if isinstance(value, t):
            return f"{name} ({one_line(repr(value), 60)})"
    return "null" if value is None else repr(value)


def load_torch(path: str | os.PathLike[str], *, map_location: Any = None,
               mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)``: tensors and plain data only (a pickle that
    asks for any other Python object, e.g. a function to call, is refused before anything
    runs). ``mmap``: tensors are mapped from the file instead of read (for large files that
    are read once).

    Raises:
        CorruptCheckpointError: the file is missing, not a regular file, truncated, damaged,
            or asks for Python objects (one line naming the file).
    """
    import pickle

    import torch

    fd = open_regular(path, CorruptCheckpointError)
    try:
        with os.fdopen(os.dup(fd), "rb") as f:
            source: Any = _fd_path(fd, path) if mmap else f
            try:
                return torch.load(source, weights_only=True, map_location=map_location,
                                  mmap=mmap)
            except pickle.UnpicklingError as e:
                text = str(e)
                why = next((line.strip() for line in text.splitlines()
                            if "Unsupported" in line or "GLOBAL" in line), text)
                raise CorruptCheckpointError(one_line(
                    f"{path}: pickle: expected tensors and plain data only "
                    f"(torch.load weights_only=True), got {why}")) from None
            except (RuntimeError, EOFError, ValueError, OSError, KeyError, IndexError,
                    TypeError, AttributeError, OverflowError, MemoryError,
                    RecursionError) as e:
                raise CorruptCheckpointError(one_line(
                    f"{path}: file: expected a complete torch file, got "
                    f"{type(e).__name__}: {e}")) from None
    finally:
        os.close(fd)


def load_safetensors(path: str | os.PathLike[str], *, device: str = "cpu",
                     into: Any = None) -> dict[str, Any]:
    """``safetensors.torch.load_file`` of the regular file ``path`` onto ``device`` (a
    ``torch.device`` string); with ``into`` (a module), ``safetensors.torch.load_model`` of
    it into that module instead (tied weights restored), returning ``{}``.

    Raises:
        CorruptCheckpointError: the file is missing, not a regular file, truncated, damaged,
            or (``into``) does not fit the module (one line naming the file).
    """
    from safetensors.torch import load_file, load_model

    fd = open_regular(path, CorruptCheckpointError)
    try:
        if into is not None:
            load_model(into, _fd_path(fd, path), device=device)
            return {}
        return load_file(_fd_path(fd, path), device=device)
    except Exception as e:  # noqa: BLE001 - SafetensorError and friends: one line
        if type(e).__name__ == "OutOfMemoryError":
            raise
        raise CorruptCheckpointError(one_line(
            f"{path}: file: expected a complete safetensors file of this model, got "
            f"{type(e).__name__}: {e}")) from None
    finally:
        os.close(fd)


@contextlib.contextmanager
def restoring(path: str | os.PathLike[str], expected: str, field: str = "state"
              ) -> Iterator[None]:
    """Turn a failure to apply what was read from ``path`` (a state dict of the wrong keys
    or shapes, a missing key, a value of the wrong type) into one
    :class:`~rlbuffers.errors.CorruptCheckpointError` line naming ``path`` and ``expected``;
    rlbuffers' own errors pass unchanged.

    Raises:
        CorruptCheckpointError: ``f"{path}: {field}: expected {expected}, got <error>"``.
    """
    try:
        yield
    except RLBuffersError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError,
            OverflowError, AssertionError) as e:
        if type(e).__name__ == "OutOfMemoryError":  # not the file's fault
            raise
        got = f"missing key {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
        raise CorruptCheckpointError(one_line(f"{path}: {field}: expected {expected}, got "
                                              f"{got}")) from None
