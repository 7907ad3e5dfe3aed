"""Rollout workers as Ray actors, on this machine or on a Ray cluster."""

from __future__ import annotations

import itertools
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlbuffers.rollouts.pool import JobFn, RolloutResult

log = logging.getLogger(__name__)


class _Worker:
    """The actor: runs jobs one at a time (Ray queues the rest)."""

    def __init__(self, slot: int, torch_threads: int) -> None:
        self.slot = slot
        if torch_threads:
            try:
                import torch

                torch.set_num_threads(torch_threads)
            except ImportError:
                pass

    def run(self, job_id: int, fn: JobFn, weights: Any, *args: Any) -> dict[str, Any]:
        import ray

        return {"job_id": job_id, "data": fn(weights, *args), "worker": self.slot,
                "node": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    def pid(self) -> int:
        return os.getpid()


@dataclass
class _Job:
    fn: JobFn
    weights: Any  # an ObjectRef of the weights version it was submitted under
    args: tuple[Any, ...]
    slot: int
    ref: Any = None
    attempts: int = 0


class RayPool:
    """``workers`` Ray actors running rollout jobs (see :class:`~rlbuffers.rollouts.pool.
    RolloutPool` for the interface).

    Weights: :meth:`set_weights` puts them in Ray's object store once (``ray.put``); every job
    gets the reference, which Ray resolves on the worker (numpy arrays zero-copy, read-only).
    Jobs go to the workers round-robin by job id; actors are spread over the cluster's nodes
    (``SPREAD``). A worker that dies (killed, node lost) is replaced by a new actor in its slot
    and its unfinished jobs are run again there; results are keyed by job id, so each job's
    data comes back exactly once. A local Ray instance this pool started is shut down by
    :meth:`close`; one that was already running (``ray.init`` by the caller) is left alone.

    Args:
        workers: actors (>= 1), each reserving ``cpus_per_worker`` CPUs.
        address: a Ray cluster to join (``"auto"``, ``"ray://host:10001"``, ...); its nodes
            must be able to import the job functions (install the project there). None starts
            (or reuses) a local Ray instance with ``workers * cpus_per_worker`` CPUs whose
            workers get this process's ``sys.path`` and its niceness (Ray's own default
            starts workers 15 nice levels below their raylet, so that on a busy machine any
            other process, the learner included, takes their core and generation starves).
        cpus_per_worker: CPUs each actor reserves (Ray spreads actors over nodes by these).
        torch_threads: ``torch.set_num_threads`` in each actor (0: leave torch's default).
        max_attempts: runs of one job before giving up on it (a job that kills every worker).

    Raises:
        ValueError: ``workers`` or ``cpus_per_worker`` < 1.
        ImportError: Ray is not installed (``pip install -c constraints.txt -e ".[ray]"``).
    """

    def __init__(self, workers: int, *, address: str | None = None, cpus_per_worker: float = 1,
                 torch_threads: int = 1, max_attempts: int = 3) -> None:
        if int(workers) < 1:
            raise ValueError(f"workers: expected >= 1, got {workers}")
        if not cpus_per_worker > 0:
            raise ValueError(f"cpus_per_worker: expected > 0, got {cpus_per_worker}")
        try:
            import ray
        except ImportError as e:
            raise ImportError("RayPool needs ray: pip install -c constraints.txt -e "
                              "'.[ray]'") from e
        self._ray = ray
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
            if address is None:  # local workers import job functions the way this process does
                kwargs["num_cpus"] = max(1, int(workers * cpus_per_worker))
                kwargs["runtime_env"] = {"env_vars": {
                    "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}}
                # the workers' nice increment over the raylet's (this process's); Ray's: 15
                kwargs["_system_config"] = {"worker_niceness": 0}
            ray.init(address=address or "local", **kwargs)  # "local": never join a stray one
        self.workers = int(workers)
        self._cpus, self._threads = cpus_per_worker, torch_threads
        self._remote = ray.remote(max_restarts=0, max_task_retries=0)(_Worker)
        self._actors = [self._new_actor(s) for s in range(self.workers)]
        self._ids = itertools.count()
        self._jobs: dict[int, _Job] = {}
        self._finished: dict[int, RolloutResult] = {}
        self._weights: Any = ray.put(None)
        self.version = 0
        self.replaced = 0
        self.max_attempts = int(max_attempts)

    def _new_actor(self, slot: int) -> Any:
        return self._remote.options(num_cpus=self._cpus, scheduling_strategy="SPREAD").remote(
            slot, self._threads)

    def actor(self, slot: int) -> Any:
        """The Ray actor handle now serving worker ``slot`` (e.g. for ``ray.kill`` in a
        fault-injection test)."""
        return self._actors[slot]

    def worker_pids(self) -> list[int]:
        """Process id of each worker slot's actor (for tests and monitoring)."""
        return list(self._ray.get([a.pid.remote() for a in self._actors]))

    def set_weights(self, weights: Any) -> int:
        self._weights, self.version = self._ray.put(weights), self.version + 1
        return self.version

    def _launch(self, job_id: int, job: _Job) -> None:
        job.attempts += 1
        job.ref = self._actors[job.slot].run.remote(job_id, job.fn, job.weights, *job.args)

    def submit(self, fn: JobFn, *args: Any) -> int:
        job_id = next(self._ids)
        job = _Job(fn, self._weights, args, slot=job_id % self.workers)
        self._jobs[job_id] = job
        self._launch(job_id, job)
        return job_id

    def _replace(self, slot: int) -> None:
        """A new actor in ``slot``; every unfinished job of that slot runs again on it."""
        self._ray.kill(self._actors[slot], no_restart=True)
        self._actors[slot] = self._new_actor(slot)
        self.replaced += 1
        for job_id, job in self._jobs.items():
            if job.slot == slot and job_id not in self._finished:
                if job.attempts >= self.max_attempts:
                    raise RuntimeError(f"job {job_id}: its worker died {job.attempts} times")
                log.warning("rollout worker %d died: job %d runs again (attempt %d)", slot,
                            job_id, job.attempts + 1)
                self._launch(job_id, job)

    def results(self, job_ids: Sequence[int]) -> list[RolloutResult]:
        ray = self._ray
        unknown = [j for j in job_ids if j not in self._jobs]
        if unknown or len(set(job_ids)) != len(job_ids):
            bad = unknown[0] if unknown else next(j for j in job_ids if job_ids.count(j) > 1)
            raise KeyError(f"job_ids: {bad} was never submitted, was already returned or is "
                           "asked twice")
        while any(j not in self._finished for j in job_ids):
            waiting = {self._jobs[j].ref: j for j in job_ids if j not in self._finished}
            ready, _ = ray.wait(list(waiting), num_returns=1)
            job_id = waiting[ready[0]]
            try:
                out = ray.get(ready[0])
            except ray.exceptions.RayActorError:
                self._replace(self._jobs[job_id].slot)
                continue
            self._finished[job_id] = RolloutResult(job_id, out["data"], out["worker"],
                                                   out["node"], self._jobs[job_id].attempts)
        for j in job_ids:
            del self._jobs[j]
        return [self._finished.pop(j) for j in job_ids]

    def close(self) -> None:
        for actor in self._actors:
            self._ray.kill(actor, no_restart=True)
        self._actors = []
        self._jobs.clear()
        self._finished.clear()
        if self._owns_ray:
            self._ray.shutdown()
            self._owns_ray = False
