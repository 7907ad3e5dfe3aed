"""rlbuffers: RL training data on disk instead of in RAM.

Replay buffers on Zarr with bounded-memory incremental saves and exact resume
(:class:`ReplayBuffer`), samplers (uniform, prioritized, sequence, group), and a streaming
token pipeline (:mod:`rlbuffers.stream`).

The buffer, spec and sampler names are imported on first use (PEP 562), so the command line
(``rlbuffers --help``) starts without importing zarr or numpy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlbuffers.errors import (
    BufferClosedError,
    BufferEmptyError,
    BufferExistsError,
    BufferLockedError,
    CorruptCheckpointError,
    CorruptChunkError,
    FieldError,
    FormatVersionError,
    ManifestError,
    NotABufferError,
    NotPrioritizedError,
    ReadOnlyError,
    RLBuffersError,
    SnapshotReclaimedError,
    UnsafePathError,
    UnsafePickleError,
)
from rlbuffers.lazy import lazy_attributes

if TYPE_CHECKING:
    from rlbuffers.buffer import ReplayBuffer, SaveReport
    from rlbuffers.packed import Packed
    from rlbuffers.padded import Padded
    from rlbuffers.sampling.mixture import LinearFraction, Mixture, mix
    from rlbuffers.sampling.samplers import (
        GroupSampler,
        PrioritizedSampler,
        Sampler,
        SequenceSampler,
        UniformSampler,
        register_sampler,
    )
    from rlbuffers.spec import FieldSpec

#: name -> module of the names imported on first use.
_LAZY = {
    "ReplayBuffer": "rlbuffers.buffer", "SaveReport": "rlbuffers.buffer",
    "FieldSpec": "rlbuffers.spec", "Packed": "rlbuffers.packed",
    "Padded": "rlbuffers.padded",
    **{n: "rlbuffers.sampling.mixture" for n in ("LinearFraction", "Mixture", "mix")},
    **{n: "rlbuffers.sampling.samplers" for n in ("GroupSampler", "PrioritizedSampler", "Sampler",
                                         "SequenceSampler", "UniformSampler",
                                         "register_sampler")},
}


__getattr__ = lazy_attributes(__name__, _LAZY)


__all__ = [
    "BufferClosedError",
    "BufferEmptyError",
    "BufferExistsError",
    "BufferLockedError",
    "CorruptCheckpointError",
    "CorruptChunkError",
    "FieldError",
    "FieldSpec",
    "FormatVersionError",
    "GroupSampler",
    "LinearFraction",
    "ManifestError",
    "Mixture",
    "NotABufferError",
    "NotPrioritizedError",
    "Packed",
    "Padded",
    "PrioritizedSampler",
    "RLBuffersError",
    "ReadOnlyError",
    "ReplayBuffer",
    "Sampler",
    "SaveReport",
    "SequenceSampler",
    "SnapshotReclaimedError",
    "UniformSampler",
    "UnsafePickleError",
    "UnsafePathError",
    "mix",
    "register_sampler",
]

__version__ = "0.1.0"
