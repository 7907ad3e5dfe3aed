"""Rollout workers: run episode jobs on several workers and get their trajectories back, for
a learner that alone writes the replay buffer.

- :class:`InProcessPool`: runs each job in this process (no extra dependency; the default).
- :func:`make_pool`: one of them by name (``"inprocess"``, ``"ray"``, ``""``: by worker count).
- :class:`RayPool`: Ray actors on this machine or a Ray cluster (``pip install ray``; imported
  only when used). Weights go into Ray's object store once per update and every worker reads
  them from there; a worker that dies is replaced and its job re-run, and every result carries
  its job id, so each job's trajectories reach the learner exactly once.
- :class:`PacedGeneration` and :class:`StalenessGate`: groups generated ahead of the learner
  on such a pool, within a staleness bound kept by pacing, never by discarding.

See ``docs/scale.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlbuffers.lazy import lazy_attributes

if TYPE_CHECKING:
    from rlbuffers.rollouts.factory import make_pool
    from rlbuffers.rollouts.inprocess import InProcessPool
    from rlbuffers.rollouts.pool import RolloutPool, RolloutResult
    from rlbuffers.rollouts.ray_pool import RayPool
    from rlbuffers.rollouts.staleness import Group, PacedGeneration, StalenessGate

_LAZY = {"InProcessPool": "rlbuffers.rollouts.inprocess", "RayPool": "rlbuffers.rollouts.ray_pool",
         "RolloutPool": "rlbuffers.rollouts.pool", "RolloutResult": "rlbuffers.rollouts.pool",
         "make_pool": "rlbuffers.rollouts.factory", "Group": "rlbuffers.rollouts.staleness",
         "PacedGeneration": "rlbuffers.rollouts.staleness",
         "StalenessGate": "rlbuffers.rollouts.staleness"}
__getattr__ = lazy_attributes(__name__, _LAZY)
__all__ = ["Group", "InProcessPool", "PacedGeneration", "RayPool", "RolloutPool",
           "RolloutResult", "StalenessGate", "make_pool"]
