"""rlbuffers: RL training data on disk instead of in RAM.

Replay buffers on Zarr with bounded-memory incremental saves and exact resume
(:class:`ReplayBuffer`), samplers (uniform, prioritized, sequence), and a streaming token
pipeline (:mod:`rlbuffers.stream`).
"""

from rlbuffers.buffer import ReplayBuffer, SaveReport
from rlbuffers.errors import (
    BufferClosedError,
    BufferEmptyError,
    BufferExistsError,
    CorruptChunkError,
    FieldError,
    FormatVersionError,
    NotABufferError,
    NotPrioritizedError,
    ReadOnlyError,
    RLBuffersError,
)
from rlbuffers.samplers import (
    PrioritizedSampler,
    Sampler,
    SequenceSampler,
    UniformSampler,
    register_sampler,
)
from rlbuffers.spec import FieldSpec

__all__ = [
    "BufferClosedError",
    "BufferEmptyError",
    "BufferExistsError",
    "CorruptChunkError",
    "FieldError",
    "FieldSpec",
    "FormatVersionError",
    "NotABufferError",
    "NotPrioritizedError",
    "PrioritizedSampler",
    "RLBuffersError",
    "ReadOnlyError",
    "ReplayBuffer",
    "Sampler",
    "SaveReport",
    "SequenceSampler",
    "UniformSampler",
    "register_sampler",
]

__version__ = "0.1.0"
