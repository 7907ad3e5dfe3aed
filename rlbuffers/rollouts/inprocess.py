"""The default rollout pool: every job runs in this process, one after another."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from rlbuffers.rollouts.pool import JobFn, RolloutResult


class InProcessPool:
    """Runs each job in this process when its result is asked for, in the order asked.

    Same interface as :class:`~rlbuffers.rollouts.RayPool`, no dependency, no copies: the
    job gets the very ``weights`` object given to :meth:`set_weights` (so do not change it in
    place before the jobs submitted under it have run). ``workers`` slots stand in for Ray's
    workers (job ``i`` is recorded as run by slot ``i % workers``, as ``RayPool`` assigns it);
    they share this process, so they never run at the same time.

    Args:
        workers: worker slots (>= 1).

    Raises:
        ValueError: ``workers`` < 1.
    """

    def __init__(self, workers: int = 1) -> None:
        if int(workers) != workers or workers < 1:
            raise ValueError(f"workers: expected an integer >= 1, got {workers!r}")
        self.workers = int(workers)
        self._ids = itertools.count()
        self._pending: dict[int, tuple[JobFn, Any, tuple[Any, ...]]] = {}
        self._weights: Any = None
        self.version = 0

    def set_weights(self, weights: Any) -> int:
        self._weights, self.version = weights, self.version + 1
        return self.version

    def submit(self, fn: JobFn, *args: Any) -> int:
        job_id = next(self._ids)
        self._pending[job_id] = (fn, self._weights, args)
        return job_id

    def results(self, job_ids: Sequence[int]) -> list[RolloutResult]:
        missing = [j for j in job_ids if j not in self._pending]
        if missing or len(set(job_ids)) != len(job_ids):
            bad = missing[0] if missing else next(j for j in job_ids if job_ids.count(j) > 1)
            raise KeyError(f"job_ids: {bad} was never submitted, was already returned or is "
                           "asked twice")
        out = []
        for job_id in job_ids:  # a job that raises leaves every asked job pending
            fn, weights, args = self._pending[job_id]
            out.append(RolloutResult(job_id, fn(weights, *args), worker=job_id % self.workers,
                                     node="local"))
        for job_id in job_ids:
            del self._pending[job_id]
        return out

    def close(self) -> None:
        self._pending.clear()
