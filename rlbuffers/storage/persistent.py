"""The interface of the persistent tier: what the buffer, the saver, ``inspect`` and the
converter need from the compressed, committed copy of a buffer, so that its engine (Zarr with a
hand-written staging protocol today: :class:`~rlbuffers.storage.zarr_tier.ZarrTier`; a
transactional Zarr engine tomorrow) can change without touching them.

Stored-chunk indices count in each field's stored chunks (see :mod:`rlbuffers.storage.layout`).
"""

from __future__ import annotations

from typing import Any, Protocol

from rlbuffers.storage.location import Location
from rlbuffers.storage.manifest import Manifest


class PersistentTier(Protocol):
    """A committed, compressed store of a buffer's columns.

    Construction (classmethods of the implementation): ``create(loc, manifest)`` makes an empty
    store and commits ``manifest`` as commit 0; ``open(loc)`` opens the last commit.
    """

    loc: Location
    #: the commit this tier reads (updated by :meth:`commit`).
    manifest: Manifest

    def stage_chunks(self, commit: int, name: str, c: int, data: Any) -> int:
        """Write stored chunks ``c, c+1, ...`` of column ``name`` for the uncommitted
        ``commit``, invisible to readers until :meth:`commit`.

        Args:
            data: their rows, ``[n, *shape]`` (fixed) or a list of n arrays ``[len_i, *row]``
                (ragged); every chunk but the last must be whole.

        Returns:
            bytes written (compressed).

        Raises:
            OSError: the write failed (e.g. disk full); nothing is committed.
        """
        ...

    def commit(self, manifest: Manifest) -> None:
        """Make the staged chunks of ``manifest.commit`` durable and commit ``manifest``
        atomically: afterwards every reader that opens sees exactly this commit.

        Raises:
            OSError: the commit failed; the previous commit is intact.
        """
        ...

    def apply(self, commit: int) -> int:
        """Finish the committed ``commit`` (idempotent; also after a crash mid-way) and drop
        anything staged by uncommitted saves. Returns the number of chunk files it moved."""
        ...

    def abort(self) -> None:
        """Drop everything staged and not committed."""
        ...

    def read_chunk(self, name: str, c: int) -> Any:
        """Decode stored chunk ``c`` of ``name`` as of :attr:`manifest`.

        Raises:
            CorruptChunkError: the chunk fails its checksum or does not decode.
            OSError: the chunk could not be read (permission, network): not corruption.
        """
        ...

    def stored_chunks(self, name: str) -> dict[int, int]:
        """Stored chunk index -> stored bytes, for every chunk of ``name`` written so far."""
        ...

    def verify(self) -> list[tuple[str, int, str]]:
        """Decode every stored chunk; ``(field, chunk, reason)`` for each corrupt one.

        Raises:
            OSError: a chunk could not be read at all.
        """
        ...
