"""GRPO's generation workers (``trainers/grpo/async_generation.py``, issue 48) in process, on
the tiny random LM of ``tests/tiny_lm.py``: a step's groups are the synchronous loop's prompts,
their behaviour and reference log-probs are those of the weights that generated them (the
version recorded), a sync sends only the LoRA adapters (every weight in full fine-tuning), and
a group run again samples the same tokens. The Ray pool with a worker killed mid-flight:
``tests/test_async_ray.py``."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from tests.heavy import require

require("reasoning_gym", "transformers", "peft", "tokenizers")

from rlbuffers.rollouts import InProcessPool  # noqa: E402
from tests.tiny_lm import make_tiny_lm_dir  # noqa: E402
from trainers.common import open_token_store  # noqa: E402
from trainers.grpo.async_generation import (  # noqa: E402
    GenerationWorkers,
    generate_groups,
    policy_weights,
    step_metrics,
)
from trainers.grpo.config import Config  # noqa: E402
from trainers.grpo.policy import make_policy  # noqa: E402
from trainers.llm.packed_logprobs import (  # noqa: E402
    packed_batch,
    packed_logprobs,
    packed_reference_logprobs,
)
from trainers.llm.prompts import next_prompts, prompt_store  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

ASYNC = {"generation_workers": 1, "max_staleness": 1, "sync_every": 1, "ray_address": "",
         "generation_backend": "inprocess", "is_truncation": 2.0}


def async_config(tiny, run_dir, **kw):
    return Config(**{"model": str(tiny), "run_dir": str(run_dir), "task": "basic_arithmetic",
                     "train_size": 40, "prompts_per_step": 2, "group_size": 3,
                     "max_completion_tokens": 8, "max_prompt_tokens": 120, "pack_tokens": 200,
                     "memory_budget": "none", "beta": 0.04, "steps": 4, **ASYNC, **kw})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_lm_dir(tmp_path_factory.mktemp("tiny"))


def make_store(tiny, path):
    """The run's tokenized prompts (as a new run of :func:`async_config` makes them)."""
    cfg = async_config(tiny, "unused")
    _, tok, model_dir = make_policy(cfg)
    prompt_store(cfg.task, cfg.train_size, cfg.seed, cfg.task_config, tok, model_dir, path)
    return open_token_store(path, len(tok))


@pytest.fixture(scope="module")
def store(tiny, tmp_path_factory):
    return make_store(tiny, tmp_path_factory.mktemp("prompts") / "prompts")


def learner_logprobs(model, tok, cfg, prompts, completions, reference=False):
    g = cfg.group_size
    groups = [completions[i:i + g] for i in range(0, len(completions), g)]
    packing = cfg.packing(cfg.pack_tokens, cfg.train_dtype)
    batch = packed_batch(prompts, groups, packing, tok.pad_token_id, {})
    n = sum(len(c) for c in completions)
    with torch.no_grad():
        if reference:
            return packed_reference_logprobs(model, batch, packing, None, n).numpy()
        out = torch.zeros(n)
        out[batch["index"][batch["mask"]]] = packed_logprobs(model, batch, packing)
    return out.numpy()


def test_steps_train_the_sync_prompts_with_the_generating_weights_logprobs(tiny, store,
                                                                         tmp_path):
    cfg = async_config(tiny, tmp_path, lora_rank=2)
    model, tok, _ = make_policy(cfg)
    trainer = {"step": 0, "groups": 0, "data": {"epoch": 0, "position": 0}}
    workers = GenerationWorkers(cfg, model, store, trainer, None, pool=InProcessPool(1))
    order = copy.deepcopy(trainer["data"])

    first = workers.next_step()
    assert first.indices == next_prompts(store, cfg.max_prompt_tokens, 2, cfg.seed, order)
    assert first.versions.tolist() == [0, 0] and len(first.completions) == 6
    np.testing.assert_allclose(first.behaviour, learner_logprobs(
        model, tok, cfg, first.prompts, first.completions), atol=1e-5)
    np.testing.assert_allclose(first.ref, learner_logprobs(
        model, tok, cfg, first.prompts, first.completions, reference=True), atol=1e-5)
    assert step_metrics(first)["staleness_max"] == 0

    with torch.no_grad():  # "the update of step 1": new adapter weights, synced as version 1
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.5)
    workers.updated(model, 1)
    second = workers.next_step()  # generated under version 0 while step 1 trained: stale by 1
    assert second.indices == next_prompts(store, cfg.max_prompt_tokens, 2, cfg.seed, order)
    assert second.versions.tolist() == [0, 0]
    m = step_metrics(second)
    assert m["staleness_max"] == 1 and m["staleness_mean"] == 1.0
    now = learner_logprobs(model, tok, cfg, second.prompts, second.completions)
    assert np.abs(now - second.behaviour).max() > 1e-3  # the old weights' log-probs, stored
    workers.updated(model, 2)
    third = workers.next_step()
    assert third.versions.tolist() == [1, 1]  # submitted after the sync of version 1
    np.testing.assert_allclose(third.behaviour, learner_logprobs(
        model, tok, cfg, third.prompts, third.completions), atol=1e-5)
    workers.close()


@pytest.mark.parametrize("lora", [2, 0])
def test_a_sync_sends_the_adapters_only_with_lora_and_a_rerun_samples_the_same_group(
        tiny, store, tmp_path, lora):
    cfg = async_config(tiny, tmp_path, lora_rank=lora, beta=0.0)
    model, _, _ = make_policy(cfg)
    weights = policy_weights(model)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(weights) == trained
    if lora:
        assert all("lora_" in n for n in weights)
    else:
        assert len(weights) == len(list(model.parameters()))
    assert all(w.dtype == np.float32 for w in weights.values())
    prompt = np.asarray(store[0], np.int64)
    a, = generate_groups(weights, 0, 5, [0], [prompt], cfg, None)
    generate_groups(weights, 0, 6, [0], [prompt], cfg, None)  # another group between
    b, = generate_groups(weights, 0, 5, [0], [prompt], cfg, None)
    assert all(np.array_equal(x, y) for x, y in zip(a["completions"], b["completions"],
                                                     strict=True))
    np.testing.assert_array_equal(a["behaviour"], b["behaviour"])
    assert a["ref"].size == 0  # no KL term


# ----- several groups per job (--groups-per-job J: one generate call for J groups) -----


def test_jobs_of_several_groups_train_the_sync_prompts_with_the_generating_logprobs(
        tiny, store, tmp_path):
    """P = 4, J = 2 (two jobs a step), K = 1, LoRA with a KL term: each step's groups are the
    synchronous loop's prompts, with the log-probs of the weights that generated them; a
    job run again (another between) samples the same tokens, and they are the workers'."""
    from trainers.grpo.async_generation import job_seed
    cfg = async_config(tiny, tmp_path, lora_rank=2, prompts_per_step=4, groups_per_job=2)
    model, tok, _ = make_policy(cfg)
    trainer = {"step": 0, "groups": 0, "data": {"epoch": 0, "position": 0}}
    weights0 = policy_weights(model)
    workers = GenerationWorkers(cfg, model, store, trainer, None, pool=InProcessPool(1))
    assert workers.gen.groups_per_job == 2 and workers.gen.in_flight == 4
    order = copy.deepcopy(trainer["data"])
    first = workers.next_step()
    assert first.indices == next_prompts(store, cfg.max_prompt_tokens, 4, cfg.seed, order)
    assert first.versions.tolist() == [0] * 4 and len(first.completions) == 12
    np.testing.assert_allclose(first.behaviour, learner_logprobs(
        model, tok, cfg, first.prompts, first.completions), atol=1e-5)
    np.testing.assert_allclose(first.ref, learner_logprobs(
        model, tok, cfg, first.prompts, first.completions, reference=True), atol=1e-5)

    again = generate_groups(weights0, 0, 2, first.indices[2:], first.prompts[2:], cfg, None)
    generate_groups(weights0, 0, 0, first.indices[:2], first.prompts[:2], cfg, None)
    rerun = generate_groups(weights0, 0, 2, first.indices[2:], first.prompts[2:], cfg, None)
    for a, b in zip(again, rerun, strict=True):
        assert all(np.array_equal(x, y) for x, y in zip(a["completions"], b["completions"],
                                                         strict=True))
        np.testing.assert_array_equal(a["behaviour"], b["behaviour"])
        np.testing.assert_array_equal(a["ref"], b["ref"])
    made = [c for g in again for c in g["completions"]]
    assert all(np.array_equal(x, y) for x, y in zip(made, first.completions[6:], strict=True))
    assert job_seed(cfg.seed, 2, 1) != job_seed(cfg.seed, 2, 2) != job_seed(cfg.seed, 4, 2)

    with torch.no_grad():  # "the update of step 1", synced as version 1
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.5)
    workers.updated(model, 1)
    second = workers.next_step()  # made under version 0 while step 1 trained
    assert second.indices == next_prompts(store, cfg.max_prompt_tokens, 4, cfg.seed, order)
    assert second.versions.tolist() == [0] * 4
    assert step_metrics(second)["staleness_max"] == 1
    workers.updated(model, 2)
    third = workers.next_step()
    assert third.indices == next_prompts(store, cfg.max_prompt_tokens, 4, cfg.seed, order)
    assert third.versions.tolist() == [1] * 4
    np.testing.assert_allclose(third.behaviour, learner_logprobs(
        model, tok, cfg, third.prompts, third.completions), atol=1e-5)
    workers.close()


def test_groups_per_job_auto_rule_and_refusals():
    """0 (auto): the largest divisor of P at most ceil(P / N); one group per job keeps the
    seed of one group (the behaviour before --groups-per-job); J must divide P and needs
    workers."""
    from trainers.config import ConfigError
    from trainers.grpo.async_generation import group_seed, job_seed
    from trainers.grpo.config import check_config, groups_per_job
    auto = {n: groups_per_job(Config(prompts_per_step=4, generation_workers=n))
            for n in (1, 2, 3, 4, 8)}
    assert auto == {1: 4, 2: 2, 3: 2, 4: 1, 8: 1}
    assert groups_per_job(Config(prompts_per_step=6, generation_workers=4)) == 2
    assert groups_per_job(Config(prompts_per_step=4, generation_workers=1,
                                 groups_per_job=1)) == 1
    assert job_seed(3, 17, 1) == group_seed(3, 17)
    with pytest.raises(ConfigError, match=r"--groups-per-job: expected 0 \(auto\), or a "
                                          r"divisor of --prompts-per-step \(4\) with "
                                          r"--generation-workers, got 3"):
        check_config(Config(prompts_per_step=4, generation_workers=1, groups_per_job=3))
    with pytest.raises(ConfigError, match="--groups-per-job"):
        check_config(Config(prompts_per_step=4, generation_workers=0, groups_per_job=2))
