"""Exceptions of the streaming pipeline (all subclass :class:`rlbuffers.errors.RLBuffersError`)."""

from __future__ import annotations

from rlbuffers.errors import RLBuffersError


class ShardError(RLBuffersError, ValueError):
    """A shard URL does not resolve, cannot be read, or holds a malformed sample."""


class StreamStateError(RLBuffersError, ValueError):
    """A ``state_dict`` does not fit the loader or stage it is loaded into."""


class TokenStoreError(RLBuffersError, ValueError):
    """A token store directory is missing, incomplete, or indexed out of range."""
