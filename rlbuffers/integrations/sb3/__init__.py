"""Stable-Baselines3 and CleanRL integration (the ``sb3`` extra: ``pip install 'rlbuffers[sb3]'``).

- :class:`ZarrReplayBuffer`, :class:`ZarrDictReplayBuffer`: drop-in replacements for SB3's
  ``ReplayBuffer`` / ``DictReplayBuffer`` that keep the transitions on disk
  (``DQN(..., replay_buffer_class=ZarrReplayBuffer, replay_buffer_kwargs={"path": ...})``, or
  CleanRL's ``rb = ZarrReplayBuffer(buffer_size, obs_space, act_space, device, path=...)``).
- :class:`CommitCallback`: commit the buffer (and save the model) every N steps.
- :func:`resume`: restore model, buffer and RNG states from the last commit.
- :func:`rng_state`, :func:`restore_rng`: the RNG states SB3 draws from, as JSON.

The SB3 pickle conversion (:mod:`~rlbuffers.integrations.sb3.convert`, ``rlbuffers convert
sb3``) reads SB3's files without SB3; the drop-in names import Stable-Baselines3 (and torch) on
first use, and without it an ImportError names the extra.

Modules: ``buffer`` (the drop-ins), ``arrays``/``layout``/``pointer``/``sample``/``checks``
(their parts), ``her`` (hindsight relabelling), ``checkpoint`` and ``rng`` (commits and resume),
``convert``/``pickle_reader``/``inert_pickle``/``pickle_dtypes`` (SB3 pickles, read as data).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlbuffers.lazy import lazy_attributes

if TYPE_CHECKING:
    from rlbuffers.integrations.sb3.buffer import (
        META_KEY,
        ZarrDictReplayBuffer,
        ZarrReplayBuffer,
    )
    from rlbuffers.integrations.sb3.checkpoint import CommitCallback, resume
    from rlbuffers.integrations.sb3.her import ZarrHerReplayBuffer
    from rlbuffers.integrations.sb3.rng import restore_rng, rng_state

#: name -> module of the names imported on first use (each of those modules imports SB3).
_LAZY = {
    "META_KEY": "rlbuffers.integrations.sb3.buffer",
    "ZarrDictReplayBuffer": "rlbuffers.integrations.sb3.buffer",
    "ZarrReplayBuffer": "rlbuffers.integrations.sb3.buffer",
    "CommitCallback": "rlbuffers.integrations.sb3.checkpoint",
    "resume": "rlbuffers.integrations.sb3.checkpoint",
    "ZarrHerReplayBuffer": "rlbuffers.integrations.sb3.her",
    "restore_rng": "rlbuffers.integrations.sb3.rng",
    "rng_state": "rlbuffers.integrations.sb3.rng",
}

__getattr__ = lazy_attributes(__name__, _LAZY)

__all__ = ["META_KEY", "CommitCallback", "ZarrDictReplayBuffer", "ZarrHerReplayBuffer",
           "ZarrReplayBuffer", "restore_rng", "resume", "rng_state"]
