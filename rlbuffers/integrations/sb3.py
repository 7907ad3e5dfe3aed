"""Stable-Baselines3 and CleanRL integration (the ``sb3`` extra: ``pip install 'rlbuffers[sb3]'``).

- :class:`ZarrReplayBuffer`, :class:`ZarrDictReplayBuffer`: drop-in replacements for SB3's
  ``ReplayBuffer`` / ``DictReplayBuffer`` that keep the transitions on disk
  (``DQN(..., replay_buffer_class=ZarrReplayBuffer, replay_buffer_kwargs={"path": ...})``, or
  CleanRL's ``rb = ZarrReplayBuffer(buffer_size, obs_space, act_space, device, path=...)``).
- :class:`CommitCallback`: commit the buffer (and save the model) every N steps.
- :func:`resume`: restore model, buffer and RNG states from the last commit.
- :func:`rng_state`, :func:`restore_rng`: the RNG states SB3 draws from, as JSON.

Importing this module imports Stable-Baselines3 (and torch); without it, ImportError names
the extra.
"""

from __future__ import annotations

from rlbuffers.integrations import require

require("stable_baselines3", "sb3")

from rlbuffers.integrations.sb3_buffer import (  # noqa: E402
    META_KEY,
    ZarrDictReplayBuffer,
    ZarrReplayBuffer,
)
from rlbuffers.integrations.sb3_checkpoint import CommitCallback, resume  # noqa: E402
from rlbuffers.integrations.sb3_her import ZarrHerReplayBuffer  # noqa: E402
from rlbuffers.integrations.sb3_rng import restore_rng, rng_state  # noqa: E402

__all__ = ["META_KEY", "CommitCallback", "ZarrDictReplayBuffer", "ZarrHerReplayBuffer",
           "ZarrReplayBuffer", "restore_rng", "resume", "rng_state"]
