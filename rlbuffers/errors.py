"""One exception tree for rlbuffers.

Every error subclasses :class:`RLBuffersError` and the builtin it behaves like, so callers can
catch either (``except rlbuffers.FieldError`` or ``except ValueError``).
"""

from __future__ import annotations


class RLBuffersError(Exception):
    """Base class of every error raised by rlbuffers."""


class FieldError(RLBuffersError, ValueError):
    """A transition field is unknown, missing, or has the wrong shape or dtype."""


class BufferEmptyError(RLBuffersError, IndexError):
    """Sampling or indexing a buffer that holds too few transitions."""


class NotABufferError(RLBuffersError, FileNotFoundError):
    """A path holds no rlbuffers buffer (no manifest, or not a Zarr group)."""


class FormatVersionError(RLBuffersError, ValueError):
    """A buffer was written by a newer format version than this rlbuffers reads."""


class ReadOnlyError(RLBuffersError, PermissionError):
    """A write was attempted on a buffer opened with ``mode="r"``."""


class CorruptChunkError(RLBuffersError, OSError):
    """A committed chunk failed its crc32c checksum, could not be decoded, or is missing or
    truncated (the manifest lists every committed chunk with its size)."""

    def __init__(self, field: str, chunk: int, reason: str) -> None:
        super().__init__(f"field {field!r}: chunk {chunk} is corrupt ({reason})")
        self.field = field
        self.chunk = chunk
        self.reason = reason


class BufferClosedError(RLBuffersError, ValueError):
    """An operation on a buffer after ``close()``."""


class BufferExistsError(RLBuffersError, FileExistsError):
    """``ReplayBuffer.create`` on a non-empty path without ``overwrite=True``."""


class NotPrioritizedError(RLBuffersError, TypeError):
    """``update_priorities`` on a buffer whose sampler is not prioritized."""


class SnapshotReclaimedError(RLBuffersError, LookupError):
    """A reader's commit is no longer kept (the writer reclaimed it after ``keep_commits``
    newer commits); ``refresh()`` moves the reader to the latest commit."""


class CorruptCheckpointError(RLBuffersError, OSError):
    """A checkpoint file is missing or fails the crc32c recorded when it was written."""


class UnsafePickleError(RLBuffersError, ValueError):
    """A pickle asks the restricted unpickler (:mod:`rlbuffers.integrations.sb3.inert_pickle`) for
    something it
    refuses: an object dtype or a dtype state that differs from what numpy computes, a scalar
    or array whose bytes do not match its dtype and shape, an array without its data or with
    other strides than numpy's own, a length beyond the bytes left in the file, more memory
    than its budget, more objects than its limit, or nesting deeper than its limit."""


class ManifestError(NotABufferError):
    """``manifest.json`` (or a kept ``history/g<N>.json``) breaks the manifest schema: a key is
    missing, of the wrong type, out of range, inconsistent with another key, or with what is
    on disk (``docs/format.md``). Nothing is written or deleted when it is raised.

    Attributes:
        key: the offending key (dotted path, e.g. ``fields.obs.shape``).
        expected: what the schema requires. actual: what the manifest holds (``repr``).
    """

    def __init__(self, where: str, key: str, expected: str, actual: str) -> None:
        super().__init__(f"{where}: malformed manifest (key {key!r}: expected {expected}, "
                         f"got {actual})")
        self.where, self.key, self.expected, self.actual = where, key, expected, actual


class BufferLockedError(RLBuffersError, OSError):
    """A second writer (``mode="r+"``, ``create``, ``repair``) on a buffer another writer holds
    open; the message names the holder (pid, host) from the lock file ``writer.lock``."""


class UnsafePathError(RLBuffersError, PermissionError):
    """A path the buffer would write or delete leaves the buffer's directory (a symlink
    inside it, or a name that resolves elsewhere)."""
