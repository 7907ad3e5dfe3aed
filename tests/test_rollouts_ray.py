"""The Ray rollout pool (``rlbuffers.rollouts.RayPool``) on one local Ray instance of 2 CPUs,
shared by this module: weights put in the object store once and shared, results zero-copy, in
the order asked and each once; workers killed mid-job (by ``SIGKILL`` and by ``ray.kill`` of
the actor) are replaced and their jobs run again, with no result lost or returned twice.

The kills are deterministic: the job kills its own worker the first time it runs (a marker
file tells the second run), so nothing depends on timing. The job functions are at module
level: Ray workers import them by name. A two-node cluster is tested with ERL in
``tests/test_erl_workers.py``."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from tests.heavy import require

require("ray")
import ray

from rlbuffers.rollouts import RayPool


def trajectory(weights, seed, length):
    """A fake trajectory from ``seed``, scaled by the shared ``weights["scale"]``; also how
    the weights arrived (a read-only array: a view of the object store, not a copy)."""
    rng = np.random.default_rng(seed)
    return {"obs": (rng.normal(size=(length, 3)) * weights["scale"]).astype(np.float32),
            "weights_read_only": not weights["scale"].flags.writeable, "pid": os.getpid()}


def die_once(weights, marker, how, seed):
    """Kill this job's own worker the first time it runs (``marker`` absent): ``how`` is
    ``"sigkill"`` (the process) or ``"ray.kill"`` (the actor, through Ray). Then a trajectory."""
    m = Path(marker)
    if not m.exists():
        m.touch()
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
        threading.Event().wait(120)  # ray.kill is asynchronous: never return from this run
        raise AssertionError("ray.kill did not stop the worker")
    return trajectory(weights, seed, 4)


def fail(weights):
    raise ValueError("job failed on purpose")


def expected(seed, length=5, scale=2.0):
    return trajectory({"scale": np.float32(scale)}, seed, length)["obs"]


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    """A new local instance ('local': never a cluster already running on this machine)."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}})
    yield
    ray.shutdown()


def test_weights_are_put_once_and_results_come_back_zero_copy_in_order(monkeypatch):
    pool = RayPool(2, torch_threads=0)
    puts = []
    real_put = ray.put
    monkeypatch.setattr(ray, "put", lambda value: puts.append(value) or real_put(value))
    pool.set_weights({"scale": np.float32(2.0) * np.ones(1, np.float32)})
    ids = [pool.submit(trajectory, s, 5) for s in range(6)]
    assert ids == list(range(6)) and len(puts) == 1  # one ray.put for six jobs
    res = pool.results(ids[::-1])
    assert [r.job_id for r in res] == ids[::-1]
    assert [r.worker for r in res] == [1, 0] * 3 and {r.attempts for r in res} == {1}
    assert len({r.data["pid"] for r in res}) == 2  # two worker processes
    for r in res:
        np.testing.assert_array_equal(r.data["obs"], expected(r.job_id))
        assert r.data["weights_read_only"]  # the workers read the object store's copy
        assert not r.data["obs"].flags.writeable  # and so does the learner: no copy
    with pytest.raises(KeyError, match="job_ids: 0 was never submitted, was already returned"):
        pool.results([0])
    pool.close()
    assert ray.is_initialized()  # a pool leaves a Ray instance it did not start running


def test_killed_workers_are_replaced_and_their_jobs_run_again_once(tmp_path):
    pool = RayPool(2, torch_threads=0)
    pool.set_weights({"scale": np.float32(2.0)})
    pids = pool.worker_pids()
    ids = [pool.submit(die_once, str(tmp_path / "a"), "ray.kill", 0),  # worker 0, mid-job
           pool.submit(die_once, str(tmp_path / "b"), "sigkill", 1),  # worker 1, mid-job
           pool.submit(trajectory, 2, 5),  # queued behind the kills, on workers 0 and 1
           pool.submit(trajectory, 3, 5)]
    res = pool.results(ids)
    assert [r.job_id for r in res] == ids  # nothing lost, nothing twice
    assert [r.attempts for r in res] == [2, 2, 2, 2]  # the queued ones were sent again too
    assert pool.replaced == 2
    for r, length in zip(res, (4, 4, 5, 5), strict=True):
        np.testing.assert_array_equal(r.data["obs"], expected(r.job_id, length))
    new = pool.worker_pids()
    assert new[0] != pids[0] and new[1] != pids[1]
    with pytest.raises(KeyError):
        pool.results(ids[:1])
    pool.close()


def test_a_job_that_raises_reaches_the_learner():
    pool = RayPool(1, torch_threads=0)
    with pytest.raises(ValueError, match="job failed on purpose"):
        pool.results([pool.submit(fail)])
    pool.close()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"workers": 0}, "workers: expected >= 1, got 0"),
    ({"workers": 1, "cpus_per_worker": 0}, "cpus_per_worker: expected > 0, got 0"),
])
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RayPool(**kwargs)
