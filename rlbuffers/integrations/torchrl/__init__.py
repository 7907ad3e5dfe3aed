"""TorchRL integration (the ``torchrl`` extra): a TorchRL storage and prioritized sampler on disk.

- :class:`ZarrStorage`: a TorchRL ``Storage`` over an rlbuffers buffer (atomic incremental
  commits, resume by reopening the path, ``dumps``/``loads`` as pointers).
- :class:`ZarrPrioritizedSampler`: TorchRL's ``PrioritizedSampler`` contract on rlbuffers' sum
  tree, its priorities committed with the storage (no compiled extension needed).
- :class:`ZarrTensorDictPrioritizedReplayBuffer`: TorchRL's ``TensorDictPrioritizedReplayBuffer``
  with that sampler (TorchRL's own class builds its compiled sampler).

Modules: ``storage``, ``sampler``, ``replay_buffer``, ``keys`` (TensorDict keys and dtypes as
buffer fields). The names import TorchRL and tensordict on first use; without them an
ImportError names the extra.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlbuffers.lazy import lazy_attributes

if TYPE_CHECKING:
    from rlbuffers.integrations.torchrl.replay_buffer import (
        ZarrTensorDictPrioritizedReplayBuffer,
    )
    from rlbuffers.integrations.torchrl.sampler import ZarrPrioritizedSampler
    from rlbuffers.integrations.torchrl.storage import ZarrStorage

#: name -> module of the names imported on first use (each of those modules imports TorchRL).
_LAZY = {
    "ZarrPrioritizedSampler": "rlbuffers.integrations.torchrl.sampler",
    "ZarrStorage": "rlbuffers.integrations.torchrl.storage",
    "ZarrTensorDictPrioritizedReplayBuffer": "rlbuffers.integrations.torchrl.replay_buffer",
}

__getattr__ = lazy_attributes(__name__, _LAZY)

__all__ = ["ZarrPrioritizedSampler", "ZarrStorage", "ZarrTensorDictPrioritizedReplayBuffer"]
