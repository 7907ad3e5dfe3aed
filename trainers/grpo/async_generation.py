"""GRPO's generation workers (``--generation-workers N``): N rollout workers (Ray actors,
``rlbuffers.rollouts``), each with its own copy of the policy, generate whole groups ahead of
the learner under the ``--max-staleness`` bound (``rlbuffers.rollouts.PacedGeneration``:
paced, never discarded), with the weights synced every ``--sync-every`` steps through Ray's
object store (LoRA: the adapters only). See ``docs/async.md``.

A job is J = ``--groups-per-job`` consecutive groups of one step (``groups_per_job``; J
divides P, so jobs are aligned to steps): the worker samples the job's J x G completions with
its weights in one ``generate`` call (seeded by :func:`job_seed`: the run's seed, the job's
first group and J, so a job re-run after its worker died, or after a resume with the same J,
samples the same tokens from the same weights), then computes with those weights the behaviour
log-probs (the ``generation`` log-probs of the truncated importance weights,
``--is-truncation``) and, with a KL term, the reference log-probs. The learner scores the
groups, owns the buffer (it alone writes and commits it) and updates.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlbuffers.rollouts import PacedGeneration, StalenessGate, make_pool
from trainers.grpo.config import Config, groups_per_job
from trainers.grpo.policy import make_policy
from trainers.llm.generation import generate
from trainers.llm.packed_logprobs import packed_batch, packed_logprobs, packed_reference_logprobs
from trainers.llm.prompts import next_prompts

#: The policy copy of this worker process (built by its first job): model, tokenizer, version.
_WORKER: dict[str, Any] = {}


def policy_weights(model: Any) -> dict[str, np.ndarray]:
    """What a sync sends: the trained parameters as float32 numpy arrays (CPU copies) by
    name: the LoRA adapters only with ``--lora-rank``, else every weight. Numpy, so that Ray's
    object store shares them with the workers of a node without a copy."""
    return {n: p.detach().to("cpu", torch.float32).numpy().copy()
            for n, p in model.named_parameters() if p.requires_grad}


def group_seed(seed: int, group: int) -> int:
    """The sampling seed of group ``group`` (int): a function of the run's seed and the
    group's index alone, so a re-run samples the same tokens with the same weights."""
    return int(np.random.SeedSequence([seed, group]).generate_state(1)[0])


def job_seed(seed: int, first_group: int, groups: int) -> int:
    """The sampling seed of the job of ``groups`` groups from ``first_group`` (int): a
    function of the run's seed, the job's first group and its size alone (one group:
    :func:`group_seed`, the seed of one group per job), so a re-run samples the same tokens
    with the same weights."""
    if groups == 1:
        return group_seed(seed, first_group)
    return int(np.random.SeedSequence([seed, first_group, groups]).generate_state(1)[0])


def _worker_policy(cfg: Config, weights: dict[str, np.ndarray], version: int) -> dict[str, Any]:
    """This process's policy copy, built once per run (``make_policy``: the learner's model
    and adapters), with the parameters of ``version`` loaded when it is not the one it
    holds."""
    run = (cfg.run_dir, cfg.model, cfg.lora_rank, cfg.seed)  # versions are per run
    if not _WORKER or _WORKER["run"] != run:
        model, tok, _ = make_policy(cfg)
        _WORKER.update(run=run, model=model, tok=tok, version=None)
    if _WORKER["version"] != version:
        params = dict(_WORKER["model"].named_parameters())
        missing = sorted(set(weights) - set(params))
        if missing:
            raise ValueError(f"weights: names the worker's policy does not have: {missing[:3]}")
        with torch.no_grad():
            for name, value in weights.items():
                params[name].copy_(torch.from_numpy(np.asarray(value)))
        _WORKER["version"] = version
    return _WORKER


def generate_groups(weights: dict[str, np.ndarray], version: int, first_group: int,
                    prompt_indices: list[int], prompts: list[np.ndarray], cfg: Config,
                    reference: str | None) -> list[dict[str, Any]]:
    """The job of J = ``len(prompts)`` groups ``first_group``.., on a worker: G =
    ``--group-size`` completions of each prompt (int64 token ids), J x G rows sampled in one
    ``generate`` call with the weights of ``version`` (seed :func:`job_seed`: for one group,
    :func:`group_seed`), and their
    per-token log-probs under those weights (``behaviour``) and under the reference policy
    (``ref``, with ``--beta``: the adapters disabled, or the initial weights read from
    ``reference``, a path this worker must be able to read), the J groups packed together.
    Returns a list of J plain-data groups, each: ``group``, ``prompt_index``, ``version``,
    ``completions`` (G int64 arrays), ``truncated`` (bool[G]), ``behaviour`` and ``ref``
    (float32[the group's completion tokens], completions in order; ``ref`` empty without a
    KL term), ``pid``.

    Raises:
        ValueError: ``prompt_indices`` and ``prompts`` of different lengths, or empty.
    """
    if not prompts or len(prompt_indices) != len(prompts):
        raise ValueError(f"prompt_indices, prompts: expected the same number (>= 1), got "
                         f"{len(prompt_indices)} and {len(prompts)}")
    state = _worker_policy(cfg, weights, version)
    model, tok = state["model"], state["tok"]
    prompts = [np.asarray(p, np.int64) for p in prompts]
    g = cfg.group_size
    torch.manual_seed(job_seed(cfg.seed, first_group, len(prompts)))
    sampling = cfg.sampling(cfg.max_completion_tokens, torch.device("cpu"),
                            generate_dtype=cfg.generate_dtype, packed_weights=cfg.packed_weights)
    rollouts = generate(model, tok, prompts, sampling, n_per_prompt=g)
    completions = [c for c, _ in rollouts]
    packing = cfg.packing(cfg.pack_tokens, cfg.train_dtype)
    batch = packed_batch(prompts, [completions[i:i + g] for i in range(0, len(completions), g)],
                         packing, tok.pad_token_id, {}, row_tokens=cfg.micro_batch_tokens)
    n = sum(len(c) for c in completions)
    behaviour = torch.zeros(n)
    model.eval()
    with torch.no_grad():
        behaviour[batch["index"][batch["mask"]]] = packed_logprobs(model, batch, packing)
        ref = (packed_reference_logprobs(model, batch, packing,
                                         Path(reference) if reference else None, n)
               if cfg.beta else torch.zeros(0))
    truncated = np.array([t for _, t in rollouts])
    ends = np.cumsum([0] + [sum(len(c) for c in completions[i:i + g])
                            for i in range(0, len(completions), g)])
    return [{"group": first_group + k, "prompt_index": index, "version": version,
             "completions": completions[k * g:(k + 1) * g],
             "truncated": truncated[k * g:(k + 1) * g],
             "behaviour": behaviour[ends[k]:ends[k + 1]].numpy().copy(),
             "ref": (ref[ends[k]:ends[k + 1]] if cfg.beta else ref).numpy().copy(),
             "pid": os.getpid()} for k, index in enumerate(prompt_indices)]


@dataclass
class StepGroups:
    """A step's P groups from the workers, in the order the learner consumes them.

    Attributes:
        indices: prompt indices (into the run's prompt store), one per group.
        prompts: the prompts (int64 token arrays), one per group.
        completions: the G * P completions, group by group.
        truncated: bool[G * P], cut at ``--max-completion-tokens``.
        behaviour: float32[completion tokens], the generating weights' log-probs.
        ref: float32[completion tokens] of the reference policy, or None without a KL term.
        versions: int64[P], the weights version that generated each group.
        attempts: int64[P], times each group was sent to a worker.
        nodes: the machine (Ray node id) that generated each group.
        counters: ``PacedGeneration.counters()`` of the step (staleness, waits).
    """

    indices: list[int]
    prompts: list[np.ndarray]
    completions: list[np.ndarray]
    truncated: np.ndarray
    behaviour: np.ndarray
    ref: np.ndarray | None
    versions: np.ndarray
    attempts: np.ndarray
    nodes: list[str]
    counters: dict[str, float]


class GenerationWorkers:
    """The learner's side of ``--generation-workers``: the pool, the bound, the prompt order
    and the weight syncs.

    Args:
        cfg: the run's settings (``generation_workers``, ``max_staleness``, ``sync_every``,
            ``ray_address``, ``generation_backend``).
        model: the learner's policy (synced now as version ``trainer['step']``).
        store: the run's prompt token store.
        trainer: the trainer state of the last complete step (``step``, ``groups``,
            ``data``: the prompt order's position after the groups consumed); groups in
            flight at a crash are regenerated from there.
        reference: the initial weights' file (full fine-tuning with ``--beta``), else None.
        pool: a started rollout pool (tests); None: ``make_pool`` from ``cfg``.
        job: the job function (tests: one that kills its worker); :func:`generate_groups`.
    """

    def __init__(self, cfg: Config, model: Any, store: Any, trainer: dict[str, Any],
                 reference: Path | None, pool: Any = None, job: Any = None) -> None:
        self.cfg, self.store = cfg, store
        self.reference = str(reference) if reference is not None else None
        self.pool = pool or make_pool(cfg.generation_backend or "ray", cfg.generation_workers,
                                      address=cfg.ray_address or None,
                                      torch_threads=cfg.generate_threads)
        p, self.groups_per_job = cfg.prompts_per_step, groups_per_job(cfg)
        self._data = copy.deepcopy(trainer["data"])  # the submit side of the prompt order
        self._batch: list[int] = []
        self._next = trainer["groups"]
        gate = StalenessGate(cfg.max_staleness, p, first_group=trainer["groups"],
                             first_version=trainer["step"])
        # in flight: the next step's P groups (made while the learner updates), or one job
        # running and one queued per worker when there are more workers than that
        j = self.groups_per_job
        self.gen = PacedGeneration(self.pool, job or generate_groups, gate, self._args,
                                   in_flight=max(p, 2 * cfg.generation_workers * j),
                                   total_groups=trainer["groups"]
                                   + (cfg.steps - trainer["step"]) * p, groups_per_job=j)
        self.gen.sync(policy_weights(model), trainer["step"])

    def _args(self, group: int) -> tuple[Any, ...]:
        """The job arguments of the J groups from ``group``: the prompts are drawn P at a
        time, in the synchronous loop's order, so step s trains on the same prompts with or
        without workers (J divides P: a job's prompts are of one step)."""
        if group != self._next:
            raise RuntimeError(f"group {group} asked out of order (expected {self._next})")
        if not self._batch:
            self._batch = next_prompts(self.store, self.cfg.max_prompt_tokens,
                                       self.cfg.prompts_per_step, self.cfg.seed, self._data)
        j = self.groups_per_job
        self._next += j
        indices, self._batch = self._batch[:j], self._batch[j:]
        prompts = [np.asarray(self.store[i], np.int64) for i in indices]
        return indices, prompts, self.cfg, self.reference

    def next_step(self, expect: list[int] | None = None) -> StepGroups:
        """The next step's P groups (waits for them: ``learner_wait_seconds``).

        Raises:
            RuntimeError: their prompts are not ``expect`` (the learner's own prompt order:
                the two orders went apart, e.g. a resume from another position).
        """
        groups = self.gen.next_groups(self.cfg.prompts_per_step)
        data = [g.data for g in groups]
        if expect is not None and [d["prompt_index"] for d in data] != list(expect):
            raise RuntimeError(f"generation workers: groups of prompts "
                               f"{[d['prompt_index'] for d in data]}, the learner expected "
                               f"{list(expect)}")
        ref = np.concatenate([d["ref"] for d in data]) if self.cfg.beta else None
        return StepGroups(indices=[d["prompt_index"] for d in data],
                          prompts=[np.asarray(self.store[d["prompt_index"]], np.int64)
                                   for d in data],
                          completions=[np.asarray(c) for d in data for c in d["completions"]],
                          truncated=np.concatenate([d["truncated"] for d in data]),
                          behaviour=np.concatenate([d["behaviour"] for d in data]),
                          ref=ref, versions=np.array([g.version for g in groups], np.int64),
                          attempts=np.array([g.attempts for g in groups], np.int64),
                          nodes=[g.node for g in groups],
                          counters=self.gen.counters())

    def updated(self, model: Any, step: int) -> None:
        """After the update of ``step``: sync the weights every ``--sync-every`` steps (the
        new version is ``step``), else submit what the bound admits."""
        if step % self.cfg.sync_every == 0:
            self.gen.sync(policy_weights(model), step)
        else:
            self.gen.fill()

    def close(self) -> None:
        """Stop the workers (groups in flight are dropped: a resume regenerates them)."""
        self.pool.close()


def start_workers(cfg: Config, model: Any, store: Any, trainer: dict[str, Any],
                  reference: Path | None) -> GenerationWorkers | None:
    """:class:`GenerationWorkers` with ``--generation-workers`` > 0, else None (the
    synchronous loop)."""
    return GenerationWorkers(cfg, model, store, trainer, reference) \
        if cfg.generation_workers else None


def add_generation_logprobs(batch: dict[str, torch.Tensor], got: StepGroups | None,
                            device: torch.device) -> None:
    """Put the generating weights' per-token log-probs into the packed ``batch`` as
    ``generation`` (float32 ``[R, T]`` like ``advantage``, 0 off the completion tokens), the
    input of ``--is-truncation``; nothing without workers (``got`` None)."""
    if got is None:
        return
    mask = batch["mask"]
    batch["generation"] = torch.zeros_like(batch["advantage"])
    batch["generation"][mask] = torch.from_numpy(got.behaviour).to(device)[batch["index"][mask]]


def behaviour_logprobs(upd: dict[str, Any], got: StepGroups | None, row: dict[str, Any]
                       ) -> np.ndarray:
    """The behaviour log-probs to store (float32[completion tokens]): the update's recorded
    ones (``upd['behaviour']``, popped) in the synchronous loop, the generating weights' with
    workers (then the update's importance-ratio statistics go into the metrics ``row``)."""
    recorded = upd.pop("behaviour").numpy()
    if got is None:
        return recorded
    row.update({k: v for k, v in upd.items() if k.startswith("is_")})
    return got.behaviour


def record_versions(rows: dict[str, Any], got: StepGroups | None, group_size: int
                    ) -> dict[str, Any]:
    """The buffer ``rows`` of a step, with workers the weights version that generated each
    group as ``policy_version``."""
    if got is not None:
        rows["policy_version"] = np.repeat(got.versions, group_size)
    return rows


def after_update(workers: GenerationWorkers | None, got: StepGroups | None, model: Any,
                 step: int, row: dict[str, Any]) -> None:
    """With workers, after the step's updates: the weights to the workers every
    ``--sync-every`` steps and the step's worker metrics into ``row``."""
    if workers is not None and got is not None:
        workers.updated(model, step)
        row.update(step_metrics(got))


def step_metrics(got: StepGroups) -> dict[str, Any]:
    """The metrics row's fields of a step with workers: ``staleness_max``,
    ``staleness_mean``, ``generation_wait_seconds``, ``learner_wait_seconds``,
    ``generation_paced`` (holds of the bound), ``generation_retries`` (groups re-sent after
    a worker died) and ``generation_nodes`` (groups per machine, by Ray node id)."""
    c = got.counters
    return {"staleness_max": int(c["staleness_max"]), "staleness_mean": float(c["staleness_mean"]),
            "generation_wait_seconds": float(c["generation_wait_seconds"]),
            "learner_wait_seconds": float(c["learner_wait_seconds"]),
            "generation_paced": int(c["paced"]),
            "generation_retries": int((got.attempts - 1).sum()),
            "generation_nodes": {n: got.nodes.count(n) for n in sorted(set(got.nodes))}}
