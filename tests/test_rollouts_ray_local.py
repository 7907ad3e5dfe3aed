"""A ``RayPool`` that starts its own local Ray instance (the trainers' default, no
``--ray-address``): its workers run at this process's niceness, not Ray's default of 15 levels
lower (which let any busy process, the learner included, starve generation: a GRPO generation
worker beside two other jobs took 430 s for a step's groups that take ~20 s), and ``close``
shuts the instance down. Its own module: the other Ray tests share an instance started by
their fixtures, which a pool does not own."""

from __future__ import annotations

import os

from tests.heavy import require

require("ray")
import ray

from rlbuffers.rollouts import RayPool


def test_an_owned_local_instance_runs_workers_at_this_process_niceness():
    assert not ray.is_initialized()
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    pool = RayPool(1, torch_threads=1)
    try:
        (pid,) = pool.worker_pids()
        assert pid != os.getpid()
        assert os.getpriority(os.PRIO_PROCESS, pid) == mine
    finally:
        pool.close()
    assert not ray.is_initialized()  # the pool started it, the pool shut it down
