"""ERL on rollout workers (``python -m trainers.erl --workers W [--ray-address ADDR]``): the
run is the same bit for bit on one worker, on two in-process worker slots and on two Ray workers
spread over a two-node cluster; a run started on the cluster resumes on one worker in process
and still ends equal.

The reference is a one-worker run made by this test session (``reference``), so the comparison
holds on any CPU. ``RECORDED`` is what ``trainers/erl.py`` (now the package ``trainers/erl/``)
gave before rollout workers existed (commit a5d7b72, sequential episodes in the learner's
process) on the development machine (AMD EPYC, torch 2.13.0 CPU, gymnasium 1.4.0, mujoco
4.0.0); commit 8515fd3 matched it bit for bit there. The float results (fitness, returns,
hashes) depend on the CPU's rounding (an Intel Xeon with AVX-512 gives other values from
generation 1), so only the counts it holds (steps, updates, buffer size per generation) are
checked against it everywhere.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from rlbuffers import ReplayBuffer
from tests.heavy import require
from tests.test_erl import metrics, run_trainer
from trainers.erl.config import Config
from trainers.erl.rollout import episode_job
from trainers.erl.train import learner_warm, make_pool

# 3 actors x 2 episodes + the learner's = 7 episodes of 50 steps per generation; the learner
# explores at random in generation 1, decides from the population's transitions in 2 (350 + 300
# >= 500) and uses its actor in 3; TD3 runs from generation 2; the learner joins the population
# after generation 2.
ARGS = ["--env", "HalfCheetah-v5", "--max-episode-steps", "50", "--pop-size", "3",
        "--hidden", "16", "--learning-starts", "500", "--batch-size", "32", "--sync-every", "2",
        "--episodes-per-actor", "2"]
# per generation: (generation, env_steps, td3_updates, buffer_size) of the recorded run
RECORDED_COUNTS = [(1, 350, 0, 350), (2, 700, 175, 700), (3, 1050, 350, 1050)]


def digest(run: Path) -> dict:
    """Metrics per generation and SHA-256 digests of the buffer and the final networks."""
    keys = ("generation", "env_steps", "td3_updates", "buffer_size", "fitness",
            "learner_return")
    out = {"metrics": [{k: m[k] for k in keys} for m in metrics(run)]}
    with ReplayBuffer.open(run / "buffer", mode="r") as buf:
        rows, h = buf[:], hashlib.sha256()
        for name in sorted(rows):
            h.update(name.encode())
            h.update(np.ascontiguousarray(rows[name]).tobytes())
        out["buffer_sha256"] = h.hexdigest()
    last = max((run / "ckpt").glob("generation-*"), key=lambda p: int(p.name.split("-")[1]))
    h = hashlib.sha256()
    population, learner = (torch.load(last / f, weights_only=True)
                           for f in ("population.pt", "learner.pt"))
    for sd in [*population, learner["nets"]]:
        for name in sorted(sd):
            h.update(name.encode())
            h.update(sd[name].numpy().tobytes())
    out["networks_sha256"] = h.hexdigest()
    return out


def counts(run: Path) -> list[tuple]:
    return [(m["generation"], m["env_steps"], m["td3_updates"], m["buffer_size"])
            for m in metrics(run)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The digest of a 3-generation run on one worker (the default, in process)."""
    run = tmp_path_factory.mktemp("erl-reference") / "run"
    run_trainer(run, *ARGS, "--generations", "3")
    assert all(set(m["rollout_nodes"]) == {"local"} for m in metrics(run))
    return digest(run), counts(run)


def test_one_worker_keeps_the_counts_recorded_before_workers_existed(reference):
    out, n = reference
    assert n == RECORDED_COUNTS
    assert [len(m["fitness"]) for m in out["metrics"]] == [3, 3, 3]


def test_two_in_process_worker_slots_repeat_it(tmp_path, reference):
    run_trainer(tmp_path / "run", *ARGS, "--generations", "3", "--workers", "2",
                "--rollout-backend", "inprocess")
    assert digest(tmp_path / "run") == reference[0]


@pytest.fixture(scope="module")
def two_nodes():
    """A Ray cluster of two local nodes, one CPU each (so two workers land one per node)."""
    require("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    yield cluster.address
    cluster.shutdown()


def test_two_ray_workers_on_two_nodes_repeat_it_and_resume_on_one_worker(tmp_path, two_nodes,
                                                                          reference):
    run = tmp_path / "run"
    run_trainer(run, *ARGS, "--generations", "2", "--workers", "2", "--ray-address", two_nodes)
    for m in metrics(run):  # every result records its node: both nodes ran episodes
        assert len(m["rollout_nodes"]) == 2 and sum(m["rollout_nodes"].values()) == 7, m
    config = json.loads((run / "config.json").read_text())
    assert (config["workers"], config["ray_address"]) == (2, two_nodes)
    out = run_trainer(run, "--resume", "--generations", "3", "--workers", "1",
                      "--ray-address", "").stdout
    assert "at generation 2" in out
    assert set(metrics(run)[-1]["rollout_nodes"]) == {"local"}
    assert digest(run) == reference[0]


# -- the pieces, in process -------------------------------------------------------------------
def test_the_learner_waits_for_the_population_only_when_its_transitions_decide():
    cfg = Config(learning_starts=500, max_episode_steps=50)
    assert learner_warm(cfg, 500, 6) is True
    assert learner_warm(cfg, 199, 6) is False  # 199 + 6 x 50 < 500 whatever happens
    assert learner_warm(cfg, 200, 6) is None  # 200 + 300 >= 500 if no episode ends early


def test_a_bad_rollout_backend_is_named():
    with pytest.raises(ValueError, match="backend: expected '', 'inprocess' or 'ray', "
                                         "got 'dask'"):
        make_pool(Config(rollout_backend="dask"))


def test_an_episode_with_random_actions_needs_the_generator_state():
    spec = {"env": "Pendulum-v1", "max_episode_steps": 5, "hidden": 8}
    with pytest.raises(ValueError, match="rng_state: an episode with random actions"):
        episode_job({}, spec, 0, None)
    rng = np.random.default_rng(3)
    out = episode_job({}, spec, 0, None, rng.bit_generator.state, 0.1)
    assert out["rows"]["reward"].shape == (5,)
    rng.uniform(-2, 2, size=(5, 1))  # the job drew five random actions from the same stream
    assert out["rng_state"] == rng.bit_generator.state
