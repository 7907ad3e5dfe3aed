"""The default rollout pool: every job runs in this process, one after another."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from rlbuffers.rollouts.pool import JobFn, RolloutResult


class InProcessPool:
    """Runs each job in this process when its result is asked for (``workers`` is 1).

    Same interface as :class:`~rlbuffers.rollouts.RayPool`, no dependency, no copies: the
    job gets the very ``weights`` object given to :meth:`set_weights`.
    """

    workers = 1

    def __init__(self) -> None:
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
        out = []
        for job_id in job_ids:
            if job_id not in self._pending:
                raise KeyError(f"job_ids: {job_id} was never submitted or was already returned")
            fn, weights, args = self._pending.pop(job_id)
            out.append(RolloutResult(job_id, fn(weights, *args), worker=0, node="local"))
        return out

    def close(self) -> None:
        self._pending.clear()
