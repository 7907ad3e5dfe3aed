"""GRPO's generation workers on Ray (issue 48): two Ray workers on a cluster of two local nodes
(``ray.cluster_utils.Cluster``, one CPU each, so one worker per node) generate the groups of
the tiny random LM (``tests/tiny_lm.py``) under the staleness bound, with LoRA adapters synced
through the object store; a worker killed in the middle of a group
(``SIGKILL`` of its own process, the first time it runs that group: deterministic) is replaced
and the group re-issued, so every group of the run reaches the learner exactly once, in
order, and the re-run group is the one the dead worker would have made (same seed, same
weights)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.heavy import require

require("ray", "reasoning_gym", "transformers", "peft", "tokenizers")
import ray  # noqa: E402

from rlbuffers.rollouts import RayPool  # noqa: E402
from tests.test_async_generation import async_config, make_store  # noqa: E402
from tests.tiny_lm import make_tiny_lm_dir  # noqa: E402
from trainers.grpo.async_generation import (  # noqa: E402
    GenerationWorkers,
    generate_groups,
    policy_weights,
)
from trainers.grpo.policy import make_policy  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

KILLED_GROUP = 1  # the first group of worker slot 1: nothing of it finished before


def dies_in_group(weights, version, group, prompt_indices, prompts, cfg, reference):
    """``generate_groups`` of one group, except that the first run of group ``KILLED_GROUP``
    kills its own worker process (a marker file in the run directory tells the second
    run)."""
    marker = Path(cfg.run_dir) / f"killed-{group}"
    if group == KILLED_GROUP and not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return generate_groups(weights, version, group, prompt_indices, prompts, cfg, reference)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_lm_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def store(tiny, tmp_path_factory):
    return make_store(tiny, tmp_path_factory.mktemp("prompts") / "prompts")


@pytest.fixture(scope="module", autouse=True)
def two_nodes():
    """Two local Ray nodes of one CPU each, joined by this process with its ``sys.path`` (the
    workers import the job functions by name)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}})
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_a_worker_killed_mid_group_is_replaced_and_no_group_is_lost_or_twice(tiny, store,
                                                                           tmp_path):
    cfg = async_config(tiny, tmp_path, lora_rank=2, beta=0.0, steps=3, generation_workers=2)
    model, _, _ = make_policy(cfg)
    trainer = {"step": 0, "groups": 0, "data": {"epoch": 0, "position": 0}}
    pool = RayPool(2, torch_threads=1)
    pids = set(pool.worker_pids())
    workers = GenerationWorkers(cfg, model, store, trainer, None, pool=pool, job=dies_in_group)
    steps, synced = train_with_fake_updates(workers, model, cfg.steps)
    assert (tmp_path / f"killed-{KILLED_GROUP}").exists() and pool.replaced == 1
    assert set(pool.worker_pids()) != pids  # a new process in the dead one's slot
    attempts = np.concatenate([s.attempts for s in steps])
    # sent twice: group 1 and group 3, queued behind it on the same worker (4 in flight from
    # the start: slot 1 holds groups 1 and 3); group 5 goes to the new worker
    assert attempts.tolist() == [1, 2, 1, 2, 1, 1]
    # every group once, in the synchronous loop's prompt order, within the bound
    from trainers.llm.prompts import next_prompts
    order = {"epoch": 0, "position": 0}
    for s in steps:
        assert s.indices == next_prompts(store, cfg.max_prompt_tokens, 2, cfg.seed, order)
        assert s.counters["staleness_max"] <= cfg.max_staleness
    versions = np.concatenate([s.versions for s in steps])
    assert versions.tolist()[:2] == [0, 0] and versions.max() >= 1  # later groups: new weights
    nodes = [n for s in steps for n in s.nodes]
    assert len(set(nodes)) == 2  # groups from both machines
    # the re-issued group is the one its weights and seed make (here, in this process)
    s = steps[KILLED_GROUP // 2]
    k = KILLED_GROUP % 2
    want, = generate_groups(synced[int(s.versions[k])], int(s.versions[k]), KILLED_GROUP,
                            [s.indices[k]], [s.prompts[k]], cfg, None)
    got = s.completions[k * 3:(k + 1) * 3]
    assert all(np.array_equal(a, b) for a, b in zip(got, want["completions"], strict=True))
    workers.close()


KILLED_JOB = 2  # J = 2: the first job of worker slot 1 (groups 2 and 3)


def dies_in_job(weights, version, first, prompt_indices, prompts, cfg, reference):
    """``generate_groups``, except that the first run of the job from group ``KILLED_JOB``
    kills its own worker process (a marker file in the run directory tells the second run)."""
    marker = Path(cfg.run_dir) / f"killed-job-{first}"
    if first == KILLED_JOB and not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return generate_groups(weights, version, first, prompt_indices, prompts, cfg, reference)


def test_a_worker_killed_mid_job_of_two_groups_is_replaced_and_the_job_reissued_whole(
        tiny, store, tmp_path):
    """P = 4, J = 2 (``--groups-per-job``), two workers: the worker running groups 2-3 dies;
    its jobs (2-3 running, 6-7 queued) are re-sent whole, every group reaches the learner
    once, in order, and the re-sent job is token for token the one its weights and seed
    make."""
    cfg = async_config(tiny, tmp_path, lora_rank=2, beta=0.0, steps=3, generation_workers=2,
                       prompts_per_step=4, groups_per_job=2)
    model, _, _ = make_policy(cfg)
    trainer = {"step": 0, "groups": 0, "data": {"epoch": 0, "position": 0}}
    pool = RayPool(2, torch_threads=1)
    workers = GenerationWorkers(cfg, model, store, trainer, None, pool=pool, job=dies_in_job)
    steps, synced = train_with_fake_updates(workers, model, cfg.steps)
    assert (tmp_path / f"killed-job-{KILLED_JOB}").exists() and pool.replaced == 1
    attempts = np.concatenate([s.attempts for s in steps])
    assert attempts.tolist() == [1, 1, 2, 2, 1, 1, 2, 2, 1, 1, 1, 1]
    from trainers.llm.prompts import next_prompts
    order = {"epoch": 0, "position": 0}
    for s in steps:
        assert s.indices == next_prompts(store, cfg.max_prompt_tokens, 4, cfg.seed, order)
        assert s.counters["staleness_max"] <= cfg.max_staleness
    s = steps[0]
    version = int(s.versions[2])
    assert s.versions[3] == version
    want = generate_groups(synced[version], version, KILLED_JOB, s.indices[2:4], s.prompts[2:4],
                           cfg, None)
    made = [c for g in want for c in g["completions"]]
    assert all(np.array_equal(a, b) for a, b in zip(s.completions[6:12], made, strict=True))
    workers.close()


def train_with_fake_updates(workers: Any, model: Any, n: int) -> tuple[list[Any], dict[int, Any]]:
    """``n`` learner steps against ``workers``: take a step's groups, then an "update" (noise
    on the trainable weights, synced as version ``step``). Returns the steps' groups and the
    weights of every version, 0 to ``n``."""
    steps, synced = [], {0: policy_weights(model)}
    for step in range(1, n + 1):
        steps.append(workers.next_step())
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(torch.randn_like(p) * 0.1)
        synced[step] = policy_weights(model)
        workers.updated(model, step)
    return steps, synced
