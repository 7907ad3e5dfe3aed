"""The in-process rollout pool (``rlbuffers.rollouts.InProcessPool``): job ids, results in the
order asked and each exactly once, weights versions, worker slots, failing jobs. The Ray pool
is tested in ``tests/test_rollouts_ray.py``."""

from __future__ import annotations

import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from rlbuffers.rollouts import InProcessPool, make_pool

REPO = Path(__file__).resolve().parents[1]


def trajectory(weights, seed, length):
    """A fake trajectory: obs float32[length, 3] from ``seed``, scaled by the shared
    ``weights["scale"]``."""
    rng = np.random.default_rng(seed)
    return {"obs": (rng.normal(size=(length, 3)) * weights["scale"]).astype(np.float32)}


def expected(seed, length=5, scale=2.0):
    return trajectory({"scale": np.float32(scale)}, seed, length)["obs"]


def test_job_ids_count_up_and_results_come_in_the_order_asked():
    pool = InProcessPool()
    assert pool.set_weights({"scale": np.float32(2.0)}) == 1
    ids = [pool.submit(trajectory, s, 5) for s in range(4)]
    assert ids == [0, 1, 2, 3]
    res = pool.results([2, 0])
    assert [r.job_id for r in res] == [2, 0]
    assert [(r.worker, r.node, r.attempts) for r in res] == [(0, "local", 1)] * 2
    np.testing.assert_array_equal(res[0].data["obs"], expected(2))
    np.testing.assert_array_equal(res[1].data["obs"], expected(0))
    assert [r.job_id for r in pool.results([3, 1])] == [3, 1]


def test_each_result_is_returned_exactly_once():
    pool = InProcessPool()
    pool.set_weights({"scale": np.float32(2.0)})
    a, b = pool.submit(trajectory, 0, 5), pool.submit(trajectory, 1, 5)
    pool.results([a])
    with pytest.raises(KeyError, match="job_ids: 0 was never submitted, was already returned"):
        pool.results([a])
    with pytest.raises(KeyError, match="job_ids: 1 .* asked twice"):
        pool.results([b, b])
    with pytest.raises(KeyError, match="job_ids: 7 was never submitted"):
        pool.results([7])
    assert [r.job_id for r in pool.results([b])] == [b]  # a refused ask consumed nothing


def test_jobs_keep_the_weights_they_were_submitted_under():
    pool = InProcessPool()
    pool.set_weights({"scale": np.float32(2.0)})
    old = pool.submit(trajectory, 7, 5)
    assert pool.set_weights({"scale": np.float32(3.0)}) == 2
    new = pool.submit(trajectory, 7, 5)
    got = pool.results([new, old])
    np.testing.assert_array_equal(got[0].data["obs"], expected(7, scale=3.0))
    np.testing.assert_array_equal(got[1].data["obs"], expected(7, scale=2.0))


def test_worker_slots_take_jobs_round_robin_as_ray_does():
    pool = InProcessPool(workers=3)
    pool.set_weights({"scale": np.float32(1.0)})
    ids = [pool.submit(trajectory, s, 2) for s in range(7)]
    assert [r.worker for r in pool.results(ids)] == [0, 1, 2, 0, 1, 2, 0]


def test_a_failing_job_raises_and_every_asked_job_stays_pending():
    calls = []

    def flaky(weights, n):
        calls.append(n)
        if len(calls) == 2:
            raise ValueError("job failed on purpose")
        return {"n": np.array([n])}

    pool = InProcessPool()
    ids = [pool.submit(flaky, 0), pool.submit(flaky, 1)]
    with pytest.raises(ValueError, match="job failed on purpose"):
        pool.results(ids)
    assert [int(r.data["n"][0]) for r in pool.results(ids)] == [0, 1]  # asked again: run again


@pytest.mark.parametrize("workers", [0, -1, 1.5])
def test_bad_workers_are_named(workers):
    with pytest.raises(ValueError, match=rf"workers: expected an integer >= 1, got {workers}"):
        InProcessPool(workers)


def test_importing_rlbuffers_and_the_in_process_pool_does_not_import_ray():
    code = ("import sys, rlbuffers, rlbuffers.rollouts\n"
            "from rlbuffers.rollouts import InProcessPool, RolloutResult\n"
            "InProcessPool(2)\n"
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert out.strip() == "[]"


class _FakeRayPool:
    """Stands in for RayPool in the module make_pool imports it from (no Ray started)."""

    def __init__(self, workers, *, address=None, torch_threads=1):
        self.workers, self.address, self.torch_threads = workers, address, torch_threads


@pytest.fixture
def fake_ray(monkeypatch):
    module = types.ModuleType("rlbuffers.rollouts.ray_pool")
    module.RayPool = _FakeRayPool
    monkeypatch.setitem(sys.modules, "rlbuffers.rollouts.ray_pool", module)
    return module


@pytest.mark.parametrize(("backend", "workers", "address", "expected"), [
    ("", 1, None, InProcessPool),
    ("", 1, "", InProcessPool),  # an empty address is no address
    ("", 2, None, _FakeRayPool),
    ("", 1, "auto", _FakeRayPool),
    ("inprocess", 3, None, InProcessPool),
    ("ray", 1, None, _FakeRayPool),
])
def test_make_pool_picks_the_backend(fake_ray, backend, workers, address, expected):
    pool = make_pool(backend, workers, address=address, torch_threads=2)
    assert type(pool) is expected and pool.workers == workers
    if expected is _FakeRayPool:
        assert (pool.address, pool.torch_threads) == (address or None, 2)


@pytest.mark.parametrize(("backend", "workers", "match"), [
    ("dask", 1, "backend: expected '', 'inprocess' or 'ray', got 'dask'"),
    ("Ray", 2, "backend: expected '', 'inprocess' or 'ray', got 'Ray'"),
    ("", 0, "workers: expected an integer >= 1, got 0"),
    ("ray", -1, "workers: expected an integer >= 1, got -1"),
    ("inprocess", 1.5, "workers: expected an integer >= 1, got 1.5"),
    ("", True, "workers: expected an integer >= 1, got True"),
])
def test_make_pool_names_a_bad_argument(fake_ray, backend, workers, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        make_pool(backend, workers)


def test_make_pool_in_process_does_not_import_ray():
    code = ("import sys\nfrom rlbuffers.rollouts import make_pool\n"
            "assert type(make_pool('', 1)).__name__ == 'InProcessPool'\n"
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert out.strip() == "[]"
