"""The persistent-tier engine this library uses: the one module that names the implementation
(:class:`~rlbuffers.storage.zarr_tier.ZarrTier`); everything else types against
:class:`~rlbuffers.storage.persistent.PersistentTier` and gets its tiers here."""

from __future__ import annotations

from rlbuffers.storage.location import Location
from rlbuffers.storage.manifest import Manifest
from rlbuffers.storage.persistent import PersistentTier
from rlbuffers.storage.zarr_tier import ZarrTier


def open_tier(loc: Location, commit: int | None = None) -> PersistentTier:
    """The tier at ``loc`` as of its last commit, or of the kept ``commit``.

    Raises:
        NotABufferError: no buffer there. FormatVersionError: a newer format.
        SnapshotReclaimedError: ``commit`` is not kept (or never existed).
    """
    return ZarrTier.open(loc, commit)


def new_tier(loc: Location, manifest: Manifest) -> PersistentTier:
    """Create an empty store at ``loc`` and commit ``manifest`` (commit 0, no chunks).

    Raises:
        OSError: the store could not be written.
    """
    return ZarrTier.create(loc, manifest)


def tier_of(loc: Location, manifest: Manifest) -> PersistentTier:
    """The tier at ``loc`` as of ``manifest``, a commit already on storage there (no read)."""
    return ZarrTier(loc, manifest)
