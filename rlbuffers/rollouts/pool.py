"""What a rollout pool does (:class:`RolloutPool`) and what a job gives back
(:class:`RolloutResult`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

#: A job: ``fn(weights, *args) -> data`` where ``weights`` is what the last
#: :meth:`RolloutPool.set_weights` gave, and ``data`` is plain data (dicts, lists, numpy
#: arrays). It must be importable by name on the workers (a module-level function).
JobFn = Callable[..., Any]


@dataclass(frozen=True)
class RolloutResult:
    """One finished job.

    Attributes:
        job_id: the id :meth:`RolloutPool.submit` returned.
        data: what the job function returned (numpy arrays come back zero-copy from Ray's
            object store where Ray allows, i.e. read-only views).
        worker: index of the worker slot that ran it (0 .. workers - 1).
        node: id of the machine (Ray node id; ``"local"`` in process).
        attempts: times it was sent to a worker: 1, or more when the worker running it (or
            holding it in its queue) died and it was sent again.
    """

    job_id: int
    data: Any
    worker: int
    node: str
    attempts: int = 1


class RolloutPool(Protocol):
    """Rollout workers behind one interface; the learner owns the buffer, workers never see it.

    Attributes:
        workers: how many jobs can run at once.
    """

    workers: int

    def set_weights(self, weights: Any) -> int:
        """Share ``weights`` (e.g. a list of ``state_dict`` s) with every worker for the jobs
        submitted from now on; returns the new weights version (1, 2, ...)."""
        ...

    def submit(self, fn: JobFn, *args: Any) -> int:
        """Queue ``fn(weights, *args)``; returns its job id (0, 1, ...)."""
        ...

    def results(self, job_ids: Sequence[int]) -> list[RolloutResult]:
        """Wait for the jobs and return their results in the order of ``job_ids``, each
        exactly once (a job whose worker died is re-run on a new worker).

        Raises:
            KeyError: an id never submitted or already returned.
            Exception: what a job function raised.
        """
        ...

    def close(self) -> None:
        """Stop the workers."""
        ...
