"""GRPO on a small causal LM (CPU or GPU): rollouts in an rlbuffers replay buffer, chunked
log-probs.

Group Relative Policy Optimization (Shao et al. 2024, "DeepSeekMath", Sec. 4.1, Eq. 3): for
each prompt, sample a group of G completions, score them, and use each completion's reward
relative to its group (``(r - mean) / std``) as the advantage of all its tokens in a clipped
surrogate (PPO, Schulman et al. 2017, Eq. 7) with a KL penalty to a reference policy (the k3
estimator, Schulman 2020, "Approximating KL divergence").

What rlbuffers does here:

- every completion goes into a ``ReplayBuffer`` (ragged prompt / completion ids, behaviour and
  reference log-probs per token; reward, advantage, group, policy version, step) committed
  every step; ``--num-iterations mu > 1`` re-reads whole groups from it with a
  ``GroupSampler`` and reuses them with the importance ratio against the stored behaviour
  log-probs (the paper's mu inner iterations);
- prompts are tokenized once into a memory-mapped token store and read in a seeded,
  resumable order;
- groups are packed (best-fit decreasing, the prompt once per row, no padding inside a row)
  into rows of up to ``--micro-batch-tokens`` (a longer group alone in a row of up to
  ``--pack-tokens``); per-token log-probs come from the chunked ``token_logprobs`` (never the
  ``[B, T, V]`` logits); ``AdaptiveMicroBatch`` runs the rows as micro-batches under
  ``--memory-budget`` with gradient accumulation;
- the reference policy is the same weights with LoRA adapters disabled (``--lora-rank``), or,
  in full fine-tuning, the initial weights memory-mapped from the run directory only while
  reference log-probs are computed (right after generation; stored in the buffer), so no
  second model sits in memory during the update;
- every step is an atomic checkpoint (``rlbuffers.checkpoint``) whose commit point is the
  buffer commit: ``--resume`` after ``kill -9`` continues from the last complete step;
- ``--generation-workers N`` generates the groups ahead on Ray actors within
  ``--max-staleness`` versions (``rlbuffers.rollouts.PacedGeneration``), the learner owning the
  buffer (``trainers/grpo/async_generation.py``, docs/async.md).

Rewards: ``correctness + format_reward * formatted`` (``trainers/grpo/rewards.py``; a wrong
answer scores 0 like no answer unless ``--partial-credit``).

Output in ``--run-dir``: ``metrics.jsonl`` (one line per step; every ``--eval-every`` steps
the held-out point with its interval), ``curve.png``, ``eval.json`` (the held-out set's report,
whose ``overlap`` with the training problems is 0, and greedy accuracy before, at each point
and after, each with a 95% Wilson interval; ``trainers/llm/evaluation.py``), ``buffer/``
(``rlbuffers inspect`` works on it).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from rlbuffers import ReplayBuffer
from rlbuffers.memory import AdaptiveMicroBatch, MemoryMonitor
from rlbuffers.memory.placement import PlacementPlan
from rlbuffers.memory.process import reuse_heap
from rlbuffers.memory.reference import reference_bytes_saved
from rlbuffers.safe_load import load_torch, restoring
from trainers.common import (
    MONITOR_STATE,
    Run,
    check_optimizer,
    check_state,
    check_unit,
    load_rng,
    open_run,
    open_token_store,
    rng_states,
    write_atomic,
)
from trainers.config import evaluated, start
from trainers.curves import Series, plot_curve
from trainers.grpo.async_generation import (
    GenerationWorkers,
    StepGroups,
    add_generation_logprobs,
    after_update,
    behaviour_logprobs,
    record_versions,
    start_workers,
)
from trainers.grpo.config import RESUMABLE, Config, check_config
from trainers.grpo.evaluate import announce, eval_sets, evaluate_sets, point
from trainers.grpo.policy import (
    gradient_checkpointing,
    load_weights,
    make_policy,
    place_policy,
    save_weights,
    write_reference,
)
from trainers.grpo.rewards import score_group
from trainers.grpo.rollout import buffer_fields, group_sampler, per_token_inputs, rollout_rows
from trainers.grpo.update import reuse_iteration, update
from trainers.llm.device import resolve_device, to_device
from trainers.llm.generation import generate
from trainers.llm.packed_logprobs import lm_parts, packed_batch, packed_reference_logprobs
from trainers.llm.policy_loss import group_advantages
from trainers.llm.prompts import next_prompts, prompt_store
from trainers.llm.settings import Sampling, parse_budget
from trainers.llm.tasks import task_problems
from trainers.phases import Phases
from trainers.summary import finish, fixed, json_bytes, write_eval

MIB = 2**20
log = logging.getLogger("trainers.grpo")


def main(argv: list[str] | None = None) -> None:
    cfg = start(Config, argv, module="trainers.grpo", doc=__doc__, resumable=RESUMABLE,
                check=check_config, evaluates=lambda c: c.evaluate)
    torch.set_num_threads(cfg.train_threads or os.cpu_count() or 1)
    if cfg.reuse_heap:  # large blocks reused within a phase (no page faults), trimmed after
        reuse_heap()
    device = resolve_device(cfg.device)
    monitor = MemoryMonitor(device=device)

    # ----- setup: the policy, the run (prompts, reference weights, buffer), the plan -----
    model, tok, model_dir = make_policy(cfg)
    lora = cfg.lora_rank > 0

    # held-out sets disjoint from the training problems (refused before the run is made)
    problems = task_problems(cfg.task, cfg.train_size, cfg.seed, cfg.task_config)
    sets = eval_sets(cfg.task, cfg.task_config, problems, cfg.eval_size if cfg.evaluate else 0,
                     cfg.eval_asdiv if cfg.evaluate else 0, cfg.seed)
    evals: dict[str, Any] = {"points": []}  # held-out results (checkpointed with the step)
    run = open_run(cfg, unit="step", create=run_files(cfg, model, tok, model_dir),
                   curve=lambda path, history: curve(path, history, cfg.task, evals["points"]))
    buf = run.buf
    assert buf is not None
    reference = None if lora else run.dir / "reference.pt"
    model, placement = place_policy(model, device)
    device = next(model.parameters()).device
    budget = parse_budget(cfg.memory_budget, device)
    checkpointing = gradient_checkpointing(model, cfg, budget)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, fused=True)  # one kernel
    amb = AdaptiveMicroBatch(model, budget_bytes=budget, grow_after=10,
                             max_tokens=cfg.micro_batch_tokens, tokens_key="real")
    plan = memory_plan(cfg, device, budget, placement, checkpointing)
    packing = cfg.packing(cfg.pack_tokens, cfg.train_dtype)
    rng = np.random.default_rng(cfg.seed)
    trainer: dict[str, Any] = {"step": 0, "groups": 0, "data": {"epoch": 0, "position": 0},
                               "eval": evals}
    if run.resumed:  # the last complete step's weights, optimizer, RNG and trainer state
        trainer = restore(run, model, lora, opt, rng, amb, monitor)
        evals.update(trainer["eval"])
        trainer["eval"] = evals
    evals["held_out"] = sets.report
    announce(sets, cfg.steps, cfg.eval_every, cfg.max_completion_tokens)
    if lora:
        monitor.record_saving("shared_reference", reference_bytes_saved(model))
    store = open_token_store(run.dir / "prompts", len(tok))
    g = cfg.group_size

    # ----- the loop: generate, score, reference, update (mu iterations), buffer, commit -----
    workers = None  # --generation-workers: groups generated ahead by Ray actors (docs/async.md)
    try:
        workers = start_workers(cfg, model, store, trainer, reference)
        if cfg.evaluate and "before" not in evals and trainer["step"] == 0:
            before(model, tok, sampling(cfg, device), sets, evals, run.dir / "eval.json")
        bar = tqdm(total=cfg.steps, initial=trainer["step"], desc="GRPO steps", unit="step")
        while trainer["step"] < cfg.steps:
            t0 = time.perf_counter()
            step, row = trainer["step"] + 1, {"step": trainer["step"] + 1}
            phases = Phases(monitor, row)
            indices = next_prompts(store, cfg.max_prompt_tokens, cfg.prompts_per_step,
                                   cfg.seed, trainer["data"])
            prompts = [np.asarray(store[i], np.int64) for i in indices]

            with phases("generate"):  # with workers: made ahead (waits for those not ready)
                rollouts, got = generate_groups(cfg, model, tok, prompts, indices, device,
                                                workers)
            completions = [c for c, _ in rollouts]
            truncated = np.array([t for _, t in rollouts])
            comp_lens = [len(c) for c in completions]
            n_tok = sum(comp_lens)

            with phases("score"):
                texts = tok.batch_decode(completions, skip_special_tokens=True)
                scores = score_group(problems, indices, texts, g, cfg.format_reward,
                                     cfg.partial_credit)
                adv, flat_groups = group_advantages(scores["reward"], g, cfg.scale_rewards)
            groups = [completions[i:i + g] for i in range(0, len(completions), g)]
            per_token = per_token_inputs(comp_lens, adv, cfg.loss_norm, cfg.max_completion_tokens)
            batch = to_device(packed_batch(prompts, groups, packing, tok.pad_token_id, per_token,
                                           row_tokens=cfg.micro_batch_tokens), device)

            ref = None
            if cfg.beta:
                with phases("reference"):  # with workers: theirs, of the generating weights
                    ref = reference_logprobs(model, batch, packing, reference, got)
                mask = batch["mask"]
                batch["ref"] = torch.zeros_like(batch["advantage"])
                batch["ref"][mask] = ref.to(device)[batch["index"][mask]]

            add_generation_logprobs(batch, got, device)  # with workers (--is-truncation)
            with phases("save_wait"):  # the previous step's checkpoint reads the weights
                run.wait()
            with phases("update"):
                upd = update(model, opt, amb, batch, cfg, n_tok, record_behaviour=True)
            behaviour = behaviour_logprobs(upd, got, row)  # with workers: the generating ones

            with phases("buffer"):
                buf.extend(record_versions(rollout_rows(
                    prompts, completions, truncated, scores, adv, behaviour,
                    None if ref is None else ref.numpy(), group_size=g,
                    first_group=trainer["groups"], step=step), got, g))
            trainer["groups"] += len(prompts)
            for _ in range(cfg.num_iterations - 1):
                with phases("update"):
                    upd = reuse_iteration(cfg, model, opt, amb, buf, tok.pad_token_id, device)
            after_update(workers, got, model, step, row)  # weights to workers, their metrics

            row.update({"reward_mean": float(scores["reward"].mean()),
                        "reward_std": float(scores["reward"].std()),
                        "accuracy": float((scores["correctness"] == 1.0).mean()),
                        "format_rate": float(scores["formatted"].mean()),
                        "zero_std_groups": flat_groups,
                        "truncated_fraction": float(truncated.mean()),
                        "completion_tokens_mean": float(np.mean(comp_lens)),
                        "completion_tokens": n_tok,
                        "tokens_per_s": n_tok / max(row["seconds_generate"], 1e-9),
                        "packed_rows": int(len(batch["input_ids"])), **upd})
            # What the chunked head saved: fp32 logits and their gradient over the packed tokens
            saved = 2 * 4 * int(batch["mask"].numel()) * lm_parts(model)[1].shape[0]
            monitor.record_saving("chunked_logprobs", saved)
            row["memory_saved_bytes"] = saved
            row.update({**plan, "micro_batch_tokens": amb.max_tokens})
            # every --eval-every steps the held-out point, before its step's commit
            row.update(eval_point(cfg, step, phases, model, tok, device, sets, evals))
            trainer["step"] = step
            row["step_seconds"] = time.perf_counter() - t0
            row["peak_rss_bytes"] = phases.peak_rss_bytes()
            phases.log("step", step)

            # Checkpoint + buffer commit in the background, overlapping the next step's
            # generation (weights, optimizer state and buffer stay unchanged until run.wait()).
            run.commit_in_background(
                step, row, state=copy.deepcopy({"trainer": trainer,
                                                "micro_batch": amb.state_dict(),
                                                "monitor": monitor.state_dict()}),
                torch_files={"optimizer.pt": opt.state_dict(), "rng.pt": rng_states(rng)},
                writers={"weights.safetensors": lambda p: save_weights(model, lora, p)})
            bar.set_postfix(progress(row))
            bar.update(1)
        run.wait()
        bar.close()
        if cfg.evaluate and (cfg.evaluate_again or not evaluated(run.dir, "step", run.done)):
            evals["after"] = after(model, tok, sampling(cfg, device), sets, evals, trainer["step"])
            curve(run.dir / "curve.png", run.history, cfg.task, evals["points"])
        write_eval(run, evals, run.done)
        finish(run, ["reward_mean", "accuracy", "kl"], evals)
    except KeyboardInterrupt:
        run.exit_interrupted()
    finally:
        close_workers(workers)
        run.close()


def generate_groups(cfg: Config, model: Any, tok: Any, prompts: list[np.ndarray],
                    indices: list[int], device: torch.device, workers: GenerationWorkers | None
                    ) -> tuple[list[tuple[np.ndarray, bool]], StepGroups | None]:
    """The step's G completions per prompt (token arrays, truncated flags): sampled here
    with ``--generate-threads`` (the synchronous loop; no worker groups), or the groups the
    workers made ahead, with what they computed (``StepGroups``)."""
    if workers is None:
        torch.set_num_threads(cfg.generate_threads)
        rollouts = generate(model, tok, prompts, sampling(cfg, device),
                            n_per_prompt=cfg.group_size)
        torch.set_num_threads(cfg.train_threads or os.cpu_count() or 1)
        return rollouts, None
    got = workers.next_step(indices)
    return list(zip(got.completions, got.truncated, strict=True)), got


def reference_logprobs(model: Any, batch: dict[str, torch.Tensor], packing: Any,
                       reference: Path | None, got: StepGroups | None) -> torch.Tensor:
    """The reference policy's per-token log-probs (float32[completion tokens], CPU): here
    (``packed_reference_logprobs``), or the workers' (``got``)."""
    if got is None:
        return packed_reference_logprobs(model, batch, packing, reference)
    return torch.from_numpy(got.ref)


def close_workers(workers: GenerationWorkers | None) -> None:
    """Stop the generation workers, if any."""
    if workers is not None:
        workers.close()


def sampling(cfg: Config, device: torch.device) -> Sampling:
    """The rollouts' :class:`Sampling`, its memory budget read now on ``device`` (``auto``
    follows the free memory at each generate call)."""
    return cfg.sampling(cfg.max_completion_tokens, device, generate_dtype=cfg.generate_dtype,
                        packed_weights=cfg.packed_weights)


def run_files(cfg: Config, model: Any, tok: Any, model_dir: Path) -> Callable[[Path], None]:
    """What a new run directory holds besides ``config.json`` and ``ckpt/`` (``open_run``'s
    ``create``): the tokenized prompts, the initial weights as the reference policy (full
    fine-tuning with a KL term) and the empty rollout buffer."""
    def create(d: Path) -> None:
        prompt_store(cfg.task, cfg.train_size, cfg.seed, cfg.task_config, tok, model_dir,
                     d / "prompts")
        if cfg.beta and not cfg.lora_rank:
            write_reference(model, d / "reference.pt")
        ReplayBuffer.create(d / "buffer", capacity=cfg.buffer_groups * cfg.group_size,
                            fields=buffer_fields(), seed=cfg.seed,
                            sampler=group_sampler(cfg.group_size,
                                                  cfg.reuse_groups or cfg.prompts_per_step))\
            .close()

    return create


def restore(run: Run, model: Any, lora: bool, opt: torch.optim.Optimizer,
            rng: np.random.Generator, amb: AdaptiveMicroBatch, monitor: MemoryMonitor
            ) -> dict[str, Any]:
    """Load the run's last complete step into the policy, the optimizer, the RNGs, the
    micro-batch controller and the monitor (``run.history`` and ``metrics.jsonl`` too);
    returns the trainer state (step, groups, prompt order, evaluations)."""
    assert run.checkpoint is not None
    ckpt = run.checkpoint
    load_weights(model, lora, ckpt / "weights.safetensors")
    with restoring(ckpt / "optimizer.pt", "the AdamW state of this model"):
        opt.load_state_dict(load_torch(ckpt / "optimizer.pt"))
        check_optimizer(opt)
    load_rng(ckpt / "rng.pt", rng)
    state = run.load_state()
    fresh = {"trainer": {"step": 0, "groups": 0, "data": {"epoch": 0, "position": 0},
                         "eval": {"points": []}},
             "micro_batch": amb.state_dict(), "monitor": MONITOR_STATE}
    check_state(state, fresh, ckpt / "state.json")
    check_unit(state["trainer"], run, ckpt / "state.json")
    with restoring(ckpt / "state.json", "the state a GRPO step saves"):
        amb.load_state_dict(state["micro_batch"])
        monitor.load_state_dict(state["monitor"])
    return dict(state["trainer"])


def eval_point(cfg: Config, step: int, phases: Phases, model: Any, tok: Any,
               device: torch.device, sets: Any, evals: dict[str, Any]) -> dict[str, Any]:
    """The held-out task point of ``step`` when it is a multiple of ``--eval-every`` (in the
    phase ``evaluate``; added to ``evals["points"]``): its metrics row fields, else ``{}``."""
    if not (cfg.evaluate and sets.task and cfg.eval_every and step % cfg.eval_every == 0):
        return {}
    with phases("evaluate"):
        res = evaluate_sets(model, tok, sampling(cfg, device), sets, asdiv=False,
                            label=f"at step {step}")
    evals["points"].append(point(step, res["task"]))
    return point(step, res["task"])


def before(model: Any, tok: Any, sampling: Sampling, sets: Any, evals: dict[str, Any],
           path: Path) -> None:
    """The held-out results before the first step into ``evals`` (``before``, and the task's
    as the point of step 0), written to ``path`` (eval.json)."""
    evals["before"] = evaluate_sets(model, tok, sampling, sets, label="before")
    if "task" in evals["before"]:
        evals["points"].append(point(0, evals["before"]["task"]))
    write_atomic(path, json_bytes(evals))


def after(model: Any, tok: Any, sampling: Sampling, sets: Any, evals: dict[str, Any],
          step: int) -> dict[str, Any]:
    """The held-out results after the last step: the task's from the point of that step when
    there is one (same weights, greedy), else evaluated (and added as a point); ASDiv
    evaluated."""
    last = evals["points"][-1] if evals["points"] else None
    if last is None or last["step"] != step:
        out = evaluate_sets(model, tok, sampling, sets, label="after")
        if "task" in out:
            evals["points"].append(point(step, out["task"]))
        return out
    task = {"accuracy": last["eval_accuracy"], "n": last["eval_n"],
            "ci95": [last["eval_ci95_low"], last["eval_ci95_high"]],
            "overlap": last["eval_overlap"], "from_point": step}
    return {"task": task, **evaluate_sets(model, tok, sampling,
                                          dataclasses.replace(sets, task=[]), label="after")}


def memory_plan(cfg: Config, device: torch.device, budget: int | None,
                placement: PlacementPlan, checkpointing: dict[str, Any]) -> dict[str, Any]:
    """Log (INFO) the run's memory plan: the budget, where the policy lives, the
    checkpointed layers, the micro-batch and generation plan, the buffer's capacity. Returns
    its numbers for the metrics rows."""
    policy_bytes = placement.bytes_per_device.get(placement.device["policy"], 0)
    log.info("memory plan: budget %s on %s; policy %s MiB (weights, gradients, AdamW) on "
             "%s; gradient checkpointing %s (%d layers); update micro-batches of up to %d "
             "tokens (rows of up to %d); generation batches of up to %d sequences; buffer "
             "capacity %d completions (%d groups of %d)",
             "none" if budget is None else f"{budget / MIB:,.0f} MiB", device,
             f"{policy_bytes / MIB:,.1f}", placement.device["policy"], checkpointing["mode"],
             len(checkpointing["layers"]), cfg.micro_batch_tokens, cfg.pack_tokens,
             cfg.generation_batch, cfg.buffer_groups * cfg.group_size, cfg.buffer_groups,
             cfg.group_size)
    return {"memory_budget_bytes": budget, "policy_bytes": policy_bytes,
            "checkpointed_layers": len(checkpointing["layers"])}


def curve(path: Path, history: list[dict[str, Any]], task: str,
          points: list[dict[str, Any]] | None = None) -> None:
    """``curve.png``: rollout reward and accuracy per step, the held-out points (greedy
    accuracy and its 95% interval: before, every --eval-every steps, after), the KL on the
    right axis."""
    have = {h["step"] for h in history if "eval_accuracy" in h}
    rows = sorted([*history, *(p for p in points or [] if p["step"] not in have)],
                  key=lambda r: r["step"])
    plot_curve(path, rows, x="step", xlabel="step",
               series=[Series("reward_mean", "reward (mean)"),
                       Series("accuracy", "accuracy (rollouts)"),
                       Series("eval_accuracy", "held-out accuracy (greedy)"),
                       Series("eval_ci95_low", "held-out 95% interval, low"),
                       Series("eval_ci95_high", "held-out 95% interval, high"),
                       Series("kl", "KL", right=True)],
               ylabel="reward / accuracy", title=f"GRPO on {task}", right_label="KL")


def progress(row: dict[str, Any]) -> dict[str, str]:
    """The progress bar's figures of a step's row."""
    return {"reward": fixed(row["reward_mean"]), "acc": fixed(row["accuracy"], 2),
            "kl": fixed(row["kl"], 4), "len": f"{row['completion_tokens_mean']:.0f}",
            "tok/s": f"{row['tokens_per_s']:.1f}", "peak": f"{row['peak_rss_bytes'] / MIB:.0f}M"}
