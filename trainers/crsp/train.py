"""CRSP (Cognition via Rewarded Self-Play): three roles of one LM trained against each other.

A *proposer* turns a seed problem (reasoning-gym, read from a memory-mapped token store:
trajectory seeding) into a new problem with its answer; a *solver* answers seed and proposed
problems (``--solver-samples`` attempts each); a *critic* judges attempts with a verdict.
Rewards are multi-dimensional (``trainers/crsp/rewards.py``: correctness, critique agreement,
solvability band, creativity against a MinHash sketch, length; intrinsic terms weighted by a
decaying alpha; each role normalised by running statistics).

Update, per role (TR-RPG: a trust-region, KL-regularised policy gradient): per token,
``-min(w * A, clip(w, 1 - eps, 1 + eps_high) * A) + beta * k3`` with ``w`` the importance
ratio to the behaviour policy (PPO's clipped surrogate, Schulman et al. 2017, Eq. 7) and
``k3 = exp(ref - logp) - (ref - logp) - 1``, the unnormalised reverse KL to the reference
(Schulman 2020; Zhang et al. 2025, "On the Design of KL-Regularized Policy Gradient Algorithms
for LLM Reasoning", arXiv 2505.17508, Sec. 3, which shows k3 is the unnormalised KL), mean over
each completion's tokens then over the role's completions.

Memory (``--memory-opt``, the default): one frozen base shared by the three roles, each a LoRA
adapter (peft), the reference is the base with adapters disabled (no copy); roles are updated
one after another (one role's activations at a time); groups packed with the prompt once per
row (``pack_shared_prefix``); per-token log-probs from the chunked LM head (never
``[B, T, V]``); ``AdaptiveMicroBatch`` micro-batches with gradient accumulation; role prompts
tokenized through a byte-bounded LRU. ``--no-memory-opt`` computes the same losses the naive
way (the comparison baseline): a full copy of the model as reference, full ``[B, T, V]``
logits, all three roles' graphs alive at once, one full batch padded to a fixed length.

``--device``: the base and the adapters (trained), their optimizer state and the batches on
the resolved device; the naive path's reference copy where ``place_models`` plans it. Under
``torchrun`` (``trainers.crsp.fsdp``) the base is sharded over the ranks. Each step logs its
phases (rollout, update, buffer) with seconds and peak memory; the start logs the memory
plan (budget, placement, micro-batches, checkpointing, savings).
"""


from __future__ import annotations

import itertools
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlbuffers import ReplayBuffer
from rlbuffers.cache import ByteLRUCache
from rlbuffers.memory import AdaptiveMicroBatch, MemoryMonitor, RunningMeanStd, auto_budget
from rlbuffers.memory.reference import reference_bytes_saved
from rlbuffers.stream.sources import IndexSource
from rlbuffers.stream.stages import BlockShuffle, Stage
from rlbuffers.stream.token_store import TokenStore, build_token_store
from rlbuffers.stream.tokenize import TextTokenizer
from trainers.common import Run, open_run, open_token_store, rng_states, write_atomic
from trainers.config import start
from trainers.crsp.buffer import buffer_fields, utterances
from trainers.crsp.config import (
    RESUMABLE,
    Config,
    check_config,
    legacy_settings,
    longest_completion,
)
from trainers.crsp.formats import render
from trainers.crsp.judging import Reservoir
from trainers.crsp.naive import naive_grads
from trainers.crsp.resume import load_checkpoint
from trainers.crsp.rewards import (
    RESERVOIR,
    TRUTH,
    WINDOW,
    ClassWindow,
    NoveltySketch,
    alpha_schedule,
    rolling_balanced_accuracy,
)
from trainers.crsp.roles import ROLES, Prompts, make_model, role_parameters, set_checkpointing
from trainers.crsp.rollout import rollout
from trainers.crsp.update import micro_batches, optimised_grads
from trainers.crsp.warmup import WARMUP_ADAPTERS, warm_up, warmup_references
from trainers.curves import Series, plot_curve
from trainers.llm.device import place_models, resolve_device
from trainers.llm.model import model_dir
from trainers.llm.policy_loss import clip_and_step
from trainers.llm.settings import parse_budget
from trainers.llm.tasks import task_problems
from trainers.phases import Phases
from trainers.summary import finish, fixed

log = logging.getLogger("trainers.crsp")
MIB = 2**20


@dataclass
class Trainer:
    """Everything a step reads or changes besides the buffer; its plain-data state (``step``,
    ``groups``, the seed stream's ``data``) and the reward state are checkpointed."""

    cfg: Config
    device: torch.device
    model: Any
    tok: Any
    reference: Any
    opts: dict[str, torch.optim.Optimizer]
    amb: AdaptiveMicroBatch
    prompts: Prompts
    sketch: NoveltySketch
    stats: dict[str, Any]  # RunningMeanStd per role and TRUTH; ClassWindow at WINDOW;
    # with --critic-batch balanced, the judging.Reservoir at RESERVOIR
    rng: np.random.Generator
    state: dict[str, Any]  # step, groups, data order (plain data)
    plan: dict[str, Any]  # the memory plan's numbers (in every metrics row)
    alpha: Any  # the cached schedule step -> weight of the intrinsic rewards
    fsdp_units: list[Any] | None = None  # the sharded decoder layers under torchrun
    # role -> its reference adapter tensors (--proposer-reference warmup, after a warm-up)
    references: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return {"trainer": self.state, "sketch": self.sketch.state_dict(),
                "stats": {r: s.state_dict() for r, s in self.stats.items()},
                "micro_batch": self.amb.state_dict(), "truncated_prompts": self.prompts.truncated}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state["trainer"]
        self.sketch.load_state_dict(state["sketch"])
        for r, s in state["stats"].items():
            self.stats[r].load_state_dict(s)
        self.amb.load_state_dict(state["micro_batch"])
        self.prompts.truncated = state["truncated_prompts"]

    def step_role(self, role: str) -> None:
        """Clip ``role``'s adapter gradients and take its optimizer's step."""
        clip_and_step(role_parameters(self.model, role), self.opts[role], self.cfg.max_grad_norm)


def seed_stream(items: int | list[int], seed: int, shuffle_buffer: int) -> Stage:
    """Indices of the seed problems (rows of the token store ``DIR/seeds``; ``items``: the
    usable ones, or an int n for all of ``range(n)``), streamed without end:
    ``rlbuffers.stream``'s ``IndexSource`` (a seeded permutation per pass) through a
    ``BlockShuffle`` of ``shuffle_buffer`` samples (``--seed-shuffle-buffer``). Its
    ``state_dict()`` (a few integers) resumes it exactly."""
    indices = range(items) if isinstance(items, int) else items
    stage: Stage = IndexSource(indices, seed=seed, cycle=True)
    if shuffle_buffer > 1:
        stage = BlockShuffle(stage, shuffle_buffer, seed=seed)
    return stage


def usable_seeds(store: TokenStore, max_prompt_tokens: int, need: int) -> list[int]:
    """Indices of the seed prompts of at most ``max_prompt_tokens`` tokens (the longer ones
    are left out of the order: they could not be packed with a completion).

    Raises:
        ValueError: fewer than ``need`` fit (``--max-prompt-tokens`` named).
    """
    usable = [i for i in range(len(store)) if store.length(i) <= max_prompt_tokens]
    if len(usable) < need:
        raise ValueError(f"--max-prompt-tokens: only {len(usable)} of {len(store)} seed "
                         f"prompts fit in {max_prompt_tokens} tokens, need {need}")
    return usable


def next_seeds(t: Trainer, store: TokenStore, problems: Any, usable: list[int]
               ) -> list[dict[str, Any]]:
    """The step's ``--seeds-per-step`` seed problems (question, reasoning-gym entry and the
    solver's prompt, memory-mapped from the token store) drawn from ``usable``; advances the
    stream's state."""
    stream = seed_stream(usable, t.cfg.seed, t.cfg.seed_shuffle_buffer)
    if t.state["data"]:
        stream.load_state_dict(t.state["data"])
    indices = list(itertools.islice(stream, t.cfg.seeds_per_step))
    t.state["data"] = stream.state_dict()
    return [{"question": problems[i]["question"], "entry": problems[i], "prompt_ids": store[i]}
            for i in indices]


def update(t: Trainer, batches: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every role's gradients and optimizer step: sharded (torchrun), role by role (memory
    optimised) or all roles at once (``--no-memory-opt``)."""
    cfg, pad_id = t.cfg, t.tok.pad_token_id
    packing, loss = cfg.packing(cfg.pack_tokens, cfg.train_dtype), cfg.policy_loss()
    if t.fsdp_units is not None:
        from trainers.crsp.fsdp import sharded_grads
        return sharded_grads(t.model, batches, packing, loss, pad_id, t.amb, t.step_role)
    if cfg.memory_opt:
        return optimised_grads(t.model, batches, packing, loss, pad_id, t.amb, t.step_role,
                               cfg.num_iterations, t.references)
    grads = naive_grads(t.model, t.reference, batches, loss, cfg.temperature,
                        cfg.max_prompt_tokens + longest_completion(cfg), pad_id)
    for role in grads:
        t.step_role(role)
    return grads


def rollout_step(t: Trainer, seeds: list[dict[str, Any]], score: Any, step: int
                 ) -> tuple[dict[str, Any], dict[str, float]]:
    """Step ``step``'s rollout (``trainers.crsp.rollout.rollout``); under torchrun rank 0
    generates on the unsharded base and the others receive its result."""
    def run_rollout() -> Any:
        return rollout(t.cfg, t.model, t.tok, t.prompts, seeds, score, t.sketch, t.stats,
                       t.alpha, step=step - 1)

    if t.fsdp_units is None:
        return run_rollout()
    from trainers.crsp.fsdp import rollout_on_rank0
    return rollout_on_rank0(t.fsdp_units, run_rollout)


def tensor_summary(monitor: MemoryMonitor, step: int) -> dict[str, Any]:
    """The live tensors by owner, dtype and device (logged; plain data for the row)."""
    summary = monitor.tensor_summary(top_k=5).to_dict()
    log.info("step %d: live tensors %.1f MiB: %s", step, summary["total_bytes"] / MIB,
             ", ".join(f"{g['owner']} {g['dtype']} {g['bytes'] / MIB:,.1f} MiB"
                       for g in summary["groups"]))
    return summary


def draw_curve(path: Path, history: list[dict[str, Any]]) -> None:
    """``curve.png``: each role's mean reward and format score, the proposals' well-formed
    rate, the solver's accuracy on seed problems and the critic's verdicts (fraction saying
    correct against the fraction of judged attempts that are, and balanced accuracy over
    the last 10 steps: a step alone often judges attempts of one class only)."""
    window = rolling_balanced_accuracy(history, 10)
    history = [{**h, "critic_balanced_accuracy_10": w} for h, w in zip(history, window,
                                                                        strict=True)]
    plot_curve(path, history, x="step", xlabel="step",
               series=[*(Series(f"{r}_reward", f"{r} reward") for r in ROLES),
                       *(Series(f"{r}_format", f"{r} format") for r in ROLES),
                       Series("proposals_valid", "proposals well formed"),
                       Series("seed_accuracy", "solver accuracy (seeds)"),
                       Series("critic_says_correct", "critic says correct"),
                       Series("critic_truth_correct", "judged attempts correct"),
                       Series("critic_balanced_accuracy_10",
                              "critic balanced accuracy (10 steps)")],
               ylabel="mean per step", title="CRSP per-role rewards and formats")


def step_budget(spec: str, device: torch.device) -> int | None:
    """``--memory-budget`` in bytes: an integer, none (None) or auto: what the training
    device has left (CUDA free memory on a CUDA device, available RAM otherwise)."""
    return parse_budget(spec, device)


def setup(cfg: Config, device: torch.device, rank: int, world: int
          ) -> tuple[Trainer, Run, MemoryMonitor]:
    """The model (adapters on ``device``; the naive path's reference placed by
    ``place_models``), its checkpointing, the run directory (created by rank 0), optimizers,
    micro-batching and the memory plan (logged), restored from the last complete step."""
    monitor = MemoryMonitor(device=device)  # logs RAM, the cgroup limit, CPUs and CUDA devices
    budget = step_budget(cfg.memory_budget, device)
    model, tok, reference = make_model(cfg, device)
    plan: dict[str, Any] = {"memory_budget_bytes": budget, "device": str(device)}
    if reference is not None:  # --no-memory-opt: the copy where the plan has room
        placed, placement = place_models({"reference": reference}, {"reference": "frozen"},
                                         device, cpu_bytes=auto_budget())
        reference = placed["reference"]
        plan["reference_device"] = placement.device["reference"]
    ckpt_plan = set_checkpointing(model, cfg, budget)
    plan["checkpointed_layers"] = ckpt_plan["layers"]

    def create(d: Path) -> None:  # the solver's prompts (CRSP's system prompt) tokenized once
        problems = task_problems(cfg.task, cfg.train_size, cfg.seed, cfg.task_config)
        build_token_store(d / "seeds", (render(tok, "solver", p["question"]) for p in problems),
                          TextTokenizer.from_file(model_dir(cfg.model) / "tokenizer.json"),
                          total=cfg.train_size, progress=False)
        ReplayBuffer.create(d / "buffer", capacity=cfg.buffer_capacity,
                            fields=buffer_fields(), seed=cfg.seed).close()

    def open_(owner: bool) -> Run:
        return open_run(cfg, unit="step", create=create, curve=draw_curve, owner=owner)

    run = open_(True) if rank == 0 else None
    if world > 1:
        torch.distributed.barrier()  # rank 0 has created the run
    run = run or open_(False)
    opts = {r: torch.optim.AdamW(role_parameters(model, r), lr=cfg.lr, weight_decay=0.0,
                                 fused=True)
            for r in ROLES}
    packing = cfg.packing(cfg.pack_tokens, cfg.train_dtype)
    amb = micro_batches(model, cfg, packing, tok.pad_token_id,
                        budget if world == 1 else None)  # ranks must agree
    plan["micro_batch_tokens"] = amb.max_tokens
    units = None
    if world > 1:
        from trainers.crsp.fsdp import shard_base
        units = shard_base(model)
    t = Trainer(cfg, device, model, tok, reference, opts, amb,
                Prompts(tok, cfg.max_prompt_tokens, ByteLRUCache(cfg.prompt_cache_bytes),
                        verifiable=cfg.proposer_reward == "learnability"),
                NoveltySketch(cfg.sketch_capacity, cfg.sketch_perm, cfg.seed),
                {**{r: RunningMeanStd() for r in (*ROLES, TRUTH)},
                 WINDOW: ClassWindow(cfg.critic_class_window),
                 **({RESERVOIR: Reservoir(cfg.critic_reservoir)}
                    if cfg.critic_batch == "balanced" else {})},
                np.random.default_rng(cfg.seed),
                {"step": 0, "groups": 0, "data": {}}, plan,
                alpha_schedule(cfg.alpha0, cfg.alpha_decay), units)
    plan["saving_shared_reference_bytes"] = reference_bytes_saved(model) if cfg.memory_opt \
        else 0
    monitor.record_saving("shared_reference", plan["saving_shared_reference_bytes"])
    if ckpt_plan.get("saving_bytes"):  # per micro-batch of --micro-batch-tokens
        plan["saving_checkpointing_bytes"] = ckpt_plan["saving_bytes"]
        monitor.record_saving("selective_checkpointing", ckpt_plan["saving_bytes"])
    log.info("memory plan: device %s, budget %s, micro-batches of %d tokens (rows of %d), "
             "checkpointing %s (layers %s), shared reference saves %.1f MiB%s",
             device, "none" if budget is None else f"{budget / MIB:,.0f} MiB",
             amb.max_tokens, cfg.pack_tokens, ckpt_plan["mode"], ckpt_plan["layers"],
             plan["saving_shared_reference_bytes"] / MIB,
             f", reference copy on {plan['reference_device']}" if reference is not None else "")
    if run.resumed:
        load_checkpoint(t, run, monitor)
    return t, run, monitor


def adapter_tensors(t: Trainer) -> dict[str, torch.Tensor]:
    """Every role's LoRA adapters (the ``lora_`` parameters), detached, on the CPU."""
    return {n: p.detach().cpu() for n, p in t.model.named_parameters() if "lora_" in n}


def save_warmup_adapters(t: Trainer, path: Path) -> None:
    """:func:`adapter_tensors` to ``path`` (safetensors), replaced atomically."""
    from safetensors.torch import save

    write_atomic(path, save(adapter_tensors(t)))


def commit(t: Trainer, run: Run, monitor: MemoryMonitor, row: dict[str, Any]) -> None:
    """Checkpoint the step (adapters, optimizers, RNG, trainer state), then the buffer commit
    (the commit point), then ``row`` into metrics.jsonl and the curve (``Run.commit``)."""
    from safetensors.torch import save_file

    adapters = adapter_tensors(t)
    run.commit(t.state["step"], row,
               state={**t.state_dict(), "monitor": monitor.state_dict()},
               torch_files={"optimizers.pt": {r: o.state_dict() for r, o in t.opts.items()},
                            "rng.pt": rng_states(t.rng)},
               writers={"adapters.safetensors": lambda p: save_file(adapters, str(p))})


def start_ranks(cfg: Config) -> tuple[torch.device, int, int]:
    """``(device, rank, world)``: one process, or a torchrun rank (process group joined)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))  # WORLD_SIZE: set by torchrun
    if world == 1:
        return resolve_device(cfg.device), 0, 1
    if not cfg.memory_opt:
        sys.exit("--no-memory-opt runs on one process only (it is the 1-rank baseline)")
    if cfg.num_iterations > 1 or cfg.warmup_steps:
        sys.exit("--num-iterations > 1 and --warmup-steps run on one process only")
    from trainers.crsp.fsdp import init_distributed, rank_device
    device = rank_device(cfg.device)
    rank, world = init_distributed(device)
    return device, rank, world


def keep_legacy(cfg: Config) -> None:
    """On ``--resume``, a run created before a setting existed keeps its old behaviour
    (``config.legacy_settings``, logged)."""
    if not cfg.resume:
        return
    from rlbuffers.safe_load import load_json

    kept = legacy_settings(cfg, load_json(Path(cfg.run_dir) / "config.json", dict))
    if kept:
        log.info("resuming a run created before these settings: keeping %s", ", ".join(kept))


def main(argv: list[str] | None = None) -> None:
    cfg = start(Config, argv, module="trainers.crsp", doc=__doc__, resumable=RESUMABLE,
                check=check_config)
    keep_legacy(cfg)
    device, rank, world = start_ranks(cfg)
    train_threads = cfg.train_threads or os.cpu_count() or 1
    torch.set_num_threads(train_threads)
    t, run, monitor = setup(cfg, device, rank, world)
    store = open_token_store(run.dir / "seeds", len(t.tok))
    usable = usable_seeds(store, cfg.max_prompt_tokens, cfg.seeds_per_step)
    log.info("seed prompts: %d of %d fit --max-prompt-tokens %d", len(usable), len(store),
             cfg.max_prompt_tokens)
    problems = task_problems(cfg.task, cfg.train_size, cfg.seed, cfg.task_config)
    if cfg.warmup_steps and not run.resumed:  # a new run: the format warm-up first
        t.plan.update(warm_up(cfg, t.model, t.tok, t.prompts, t.opts, problems,
                              problems.score_answer, run.dir))
        save_warmup_adapters(t, run.dir / WARMUP_ADAPTERS)
    t.references = warmup_references(cfg, run.dir / WARMUP_ADAPTERS)
    summary_asked = threading.Event()  # kill -USR1 PID: a tensor summary after this step
    in_main = threading.current_thread() is threading.main_thread()
    old_handler = signal.signal(signal.SIGUSR1, lambda *_: summary_asked.set()) if in_main \
        else None
    finished = False
    try:
        while t.state["step"] < cfg.steps:
            t0, step = time.perf_counter(), t.state["step"] + 1
            row: dict[str, Any] = {"step": step}
            phases = Phases(monitor, row)
            seeds = next_seeds(t, store, problems, usable)
            with phases("rollout"):  # every role's utterances, rewards and advantages
                torch.set_num_threads(cfg.generate_threads)
                batches, metrics = rollout_step(t, seeds, problems.score_answer, step)
                torch.set_num_threads(train_threads)
            with phases("update"):  # reference log-probs, TR-RPG loss, a step per role
                grads = update(t, batches)
            with phases("buffer"):  # rank 0 owns the run directory
                if run.buf is not None:
                    run.buf.extend(utterances(batches, grads, step, t.state["groups"]))
            t.state["groups"] += sum(len(batches[r].prompts) for r in ROLES)
            t.state["step"] = step
            row.update({**metrics, **{f"{r}_loss": grads[r]["loss"] for r in grads},
                        **{f"{r}_kl": float(grads[r].get("kl", 0.0)) for r in grads},
                        **{f"{r}_clip_fraction": grads[r]["clip_fractions"][-1]
                           for r in grads if "clip_fractions" in grads[r]},
                        "utterances": int(sum(len(batches[r].completions) for r in ROLES)),
                        "ranks": world, **t.plan})
            if cfg.tensor_summary or summary_asked.is_set():
                summary_asked.clear()
                row["tensors"] = tensor_summary(monitor, step)
            phases.log("step", step)
            if rank == 0:  # rank 0 owns the run directory
                row["step_seconds"] = time.perf_counter() - t0
                row["peak_rss_bytes"] = phases.peak_rss_bytes()
                commit(t, run, monitor, row)
                log.info("step %d/%d: rewards %s", step, cfg.steps,
                         ", ".join(f"{r} {fixed(row[f'{r}_reward'], 2)}" for r in ROLES))
        finished = True
        finish(run, [f"{r}_reward" for r in ROLES])
    except KeyboardInterrupt:
        run.exit_interrupted()
    finally:
        run.close()
        if in_main:
            signal.signal(signal.SIGUSR1, old_handler)
        if world > 1:
            from trainers.crsp.fsdp import close_distributed
            close_distributed(finished)
