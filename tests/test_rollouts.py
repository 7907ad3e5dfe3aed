"""Rollout pools: job ids, results in the order asked, each exactly once; Ray workers share
weights through the object store, a killed worker is replaced and its job re-run with no
lost or duplicated result, and a two-node cluster spreads the jobs over both nodes."""

from __future__ import annotations

import numpy as np
import pytest

from rlbuffers.rollouts import InProcessPool
from tests import rollout_jobs
from tests.heavy import require


def expected(seed, length=5, scale=2.0):
    return rollout_jobs.trajectory({"scale": np.float32(scale)}, seed, length)["obs"]


def test_in_process_pool_runs_jobs_in_order_once():
    pool = InProcessPool()
    assert pool.set_weights({"scale": np.float32(2.0)}) == 1
    ids = [pool.submit(rollout_jobs.trajectory, s, 5) for s in range(3)]
    assert ids == [0, 1, 2]
    res = pool.results([2, 0, 1])
    assert [r.job_id for r in res] == [2, 0, 1] and {r.node for r in res} == {"local"}
    np.testing.assert_array_equal(res[1].data["obs"], expected(0))
    with pytest.raises(KeyError, match="job_ids: 0 was never submitted or was already returned"):
        pool.results([0])
    pool.set_weights({"scale": np.float32(3.0)})  # jobs submitted before keep their version
    a = pool.submit(rollout_jobs.trajectory, 7, 5)
    np.testing.assert_array_equal(pool.results([a])[0].data["obs"], expected(7, scale=3.0))


@pytest.fixture(scope="module")
def ray_local():
    require("ray")
    import ray
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ":".join(__import__("sys").path)}})
    yield ray
    ray.shutdown()


def test_ray_pool_shares_weights_and_returns_each_job_once(ray_local):
    from rlbuffers.rollouts import RayPool
    pool = RayPool(2, torch_threads=0)
    pool.set_weights({"scale": np.float32(2.0)})
    ids = [pool.submit(rollout_jobs.trajectory, s, 5) for s in range(6)]
    res = pool.results(ids)
    assert [r.job_id for r in res] == ids and [r.worker for r in res] == [0, 1] * 3
    for s, r in enumerate(res):
        np.testing.assert_array_equal(r.data["obs"], expected(s))
        assert r.attempts == 1
    assert len({r.data["pid"] for r in res}) == 2  # two worker processes
    pool.close()


def test_a_killed_worker_is_replaced_and_its_jobs_run_again(ray_local, tmp_path):
    from rlbuffers.rollouts import RayPool
    pool = RayPool(2, torch_threads=0)
    pool.set_weights({"scale": np.float32(2.0)})
    pids = pool.worker_pids()
    marker = str(tmp_path / "died")
    ids = [pool.submit(rollout_jobs.trajectory, 0, 5),
           pool.submit(rollout_jobs.die_once, marker, 1),  # kills worker 1 on its first run
           pool.submit(rollout_jobs.trajectory, 2, 5),
           pool.submit(rollout_jobs.trajectory, 3, 5)]  # queued on worker 1 behind the kill
    res = pool.results(ids)
    assert [r.job_id for r in res] == ids  # nothing lost, nothing twice
    assert res[1].attempts == 2 and pool.replaced == 1
    np.testing.assert_array_equal(res[1].data["obs"], expected(1, length=4))
    np.testing.assert_array_equal(res[3].data["obs"], expected(3))
    assert pool.worker_pids()[0] == pids[0] and pool.worker_pids()[1] != pids[1]
    pool.close()


def test_job_errors_reach_the_learner(ray_local):
    from rlbuffers.rollouts import RayPool
    pool = RayPool(1, torch_threads=0)
    with pytest.raises(ValueError, match="job failed on purpose"):
        pool.results([pool.submit(rollout_jobs.fail)])
    pool.close()


def test_two_node_cluster_spreads_jobs_over_both_nodes():
    require("ray")
    import ray
    from ray.cluster_utils import Cluster

    from rlbuffers.rollouts import RayPool
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    try:
        ray.init(address=cluster.address, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": ":".join(__import__("sys").path)}})
        pool = RayPool(2, torch_threads=0)  # one CPU each: one actor per node
        pool.set_weights({"scale": np.float32(2.0)})
        res = pool.results([pool.submit(rollout_jobs.trajectory, s, 5) for s in range(4)])
        assert len({r.node for r in res}) == 2
        for s, r in enumerate(res):
            np.testing.assert_array_equal(r.data["obs"], expected(s))
        pool.close()
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_bad_arguments_are_named():
    require("ray")
    from rlbuffers.rollouts import RayPool
    with pytest.raises(ValueError, match="workers: expected >= 1, got 0"):
        RayPool(0)
