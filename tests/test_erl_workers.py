"""ERL on rollout workers (``python -m trainers.erl --workers W [--ray-address ADDR]``): the
run is the one the trainer gave before it had workers, bit for bit, on one worker, on two
in-process worker slots and on two Ray workers spread over a two-node cluster; a run started
on the cluster resumes on one worker in process and still ends equal.

``RECORDED`` was written by ``trainers/erl.py`` as it was before rollout workers existed
(commit a5d7b72, sequential episodes in the learner's process), running ``ARGS`` on the
development machine (x86-64, torch 2.13.0 CPU, gymnasium 1.4.0, mujoco 4.0.0): fitness and
learner returns per generation, a SHA-256 of every buffer column, and one of the population's
and the learner's networks after generation 3. Another CPU type or library version may round
differently; the runs compared with each other below (workers vs one worker) hold anywhere.
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
from trainers import erl, erl_rollout

# 3 actors x 2 episodes + the learner's = 7 episodes of 50 steps per generation; the learner
# explores at random in generation 1, decides from the population's transitions in 2 (350 + 300
# >= 500) and uses its actor in 3; TD3 runs from generation 2; the learner joins the population
# after generation 2.
ARGS = ["--env", "HalfCheetah-v5", "--max-episode-steps", "50", "--pop-size", "3",
        "--hidden", "16", "--learning-starts", "500", "--batch-size", "32", "--sync-every", "2",
        "--episodes-per-actor", "2"]
RECORDED = {
    "metrics": [
        {"generation": 1, "env_steps": 350, "td3_updates": 0, "buffer_size": 350,
         "fitness": [-0.31806922718998787, -5.731830738431661, 1.6638373510622722],
         "learner_return": -33.46140007286883},
        {"generation": 2, "env_steps": 700, "td3_updates": 175, "buffer_size": 700,
         "fitness": [1.58547712554169, -3.8185202296100744, 3.8883948020366272],
         "learner_return": -22.232650183506397},
        {"generation": 3, "env_steps": 1050, "td3_updates": 350, "buffer_size": 1050,
         "fitness": [6.486020846208815, 1.752943115690106, -16.971698074854878],
         "learner_return": -9.437094322325256},
    ],
    "buffer_sha256": "d352d8daedadb0d11aa426ca9cd3fa4c16661517b1406aa3b5247497cd7bcb32",
    "networks_sha256": "b39f2726d947551c32b8522954d1329726385a187dbd6a9e11f382baf15d883d",
}


def digest(run: Path) -> dict:
    """What RECORDED holds, from a finished run directory."""
    keys = ("generation", "env_steps", "td3_updates", "buffer_size", "fitness",
            "learner_return")
    out = {"metrics": [{k: m[k] for k in keys} for m in metrics(run)]}
    with ReplayBuffer.open(run / "buffer", mode="r") as buf:
        rows, h = buf[:], hashlib.sha256()
        for name in sorted(rows):
            h.update(name.encode())
            h.update(np.ascontiguousarray(rows[name]).tobytes())
        out["buffer_sha256"] = h.hexdigest()
    last = max((run / "ckpt").glob("gen-*"), key=lambda p: int(p.name.split("-")[1]))
    state, h = torch.load(last / "state.pt", weights_only=True), hashlib.sha256()
    for sd in [*state["population"], state["learner"]["nets"]]:
        for name in sorted(sd):
            h.update(name.encode())
            h.update(sd[name].numpy().tobytes())
    out["networks_sha256"] = h.hexdigest()
    return out


def test_one_worker_repeats_the_run_recorded_before_workers_existed(tmp_path):
    run_trainer(tmp_path / "run", *ARGS, "--generations", "3")
    assert digest(tmp_path / "run") == RECORDED
    assert all(set(m["rollout_nodes"]) == {"local"} for m in metrics(tmp_path / "run"))


def test_two_in_process_worker_slots_repeat_it(tmp_path):
    run_trainer(tmp_path / "run", *ARGS, "--generations", "3", "--workers", "2",
                "--rollout-backend", "inprocess")
    assert digest(tmp_path / "run") == RECORDED


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


def test_two_ray_workers_on_two_nodes_repeat_it_and_resume_on_one_worker(tmp_path, two_nodes):
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
    assert digest(run) == RECORDED


# -- the pieces, in process -------------------------------------------------------------------
def test_the_learner_waits_for_the_population_only_when_its_transitions_decide():
    cfg = erl.Config(learning_starts=500, max_episode_steps=50)
    assert erl.learner_warm(cfg, 500, 6) is True
    assert erl.learner_warm(cfg, 199, 6) is False  # 199 + 6 x 50 < 500 whatever happens
    assert erl.learner_warm(cfg, 200, 6) is None  # 200 + 300 >= 500 if no episode ends early


def test_a_bad_rollout_backend_is_named():
    with pytest.raises(ValueError, match="rollout_backend: expected '', 'inprocess' or 'ray', "
                                         "got 'dask'"):
        erl.make_pool(erl.Config(rollout_backend="dask"))


def test_an_episode_with_random_actions_needs_the_generator_state():
    spec = {"env": "Pendulum-v1", "max_episode_steps": 5, "hidden": 8}
    with pytest.raises(ValueError, match="rng_state: an episode with random actions"):
        erl_rollout.episode_job({}, spec, 0, None)
    rng = np.random.default_rng(3)
    out = erl_rollout.episode_job({}, spec, 0, None, rng.bit_generator.state, 0.1)
    assert out["rows"]["reward"].shape == (5,)
    rng.uniform(-2, 2, size=(5, 1))  # the job drew five random actions from the same stream
    assert out["rng_state"] == rng.bit_generator.state
