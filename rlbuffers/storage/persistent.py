"""The interface of the persistent tier: what the buffer, the storage facade, the saver, the
reader, ``inspect``, ``verify``/``repair`` and ``export`` need from the compressed, committed
copy of a buffer, so that its engine (Zarr with a hand-written staging protocol today:
:class:`~rlbuffers.storage.zarr_tier.ZarrTier`; a transactional Zarr engine tomorrow) can change
without touching them. They type against :class:`PersistentTier` and get a tier from
:mod:`rlbuffers.storage.engine`, the one module that names the implementation.

Stored-chunk indices count in each field's stored chunks (see :mod:`rlbuffers.storage.layout`).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from rlbuffers.spec import FieldSpec
from rlbuffers.storage.layout import ChunkLayout
from rlbuffers.storage.location import Location
from rlbuffers.storage.manifest import Manifest


@runtime_checkable
class PersistentTier(Protocol):
    """A committed, compressed store of a buffer's columns.

    Construction (:mod:`rlbuffers.storage.engine`): ``new_tier(loc, manifest)`` makes an empty
    store and commits ``manifest`` as commit 0; ``open_tier(loc, commit)`` opens the last (or a
    kept) commit.
    """

    #: where the store is.
    loc: Location
    #: the commit this tier reads (updated by :meth:`commit`).
    manifest: Manifest
    #: every column (user fields, then internal ones) -> spec; fixed at create.
    specs: dict[str, FieldSpec]
    #: capacity and chunk sizes; fixed at create.
    layout: ChunkLayout

    def reopen(self, commit: int | None = None) -> PersistentTier:
        """The same store as of its last commit now (or of the kept ``commit``).

        Raises:
            SnapshotReclaimedError: ``commit`` is not kept.
        """
        ...

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

    def committed(self, commit: int) -> bool:
        """Whether the store's last commit is already ``commit`` (after an error during
        :meth:`commit`: the commit may have happened); if so this tier reads it from now on."""
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
