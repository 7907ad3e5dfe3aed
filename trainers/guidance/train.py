"""The guidance trainer's loop (``python -m trainers.guidance``), top to bottom: setup
(:func:`build`: pool, models, placement, run directory, optimizers, micro-batch plans), then per
iteration (:func:`iterate`): collect episodes on the rollout pool, score them, write them to
the buffer, the reference log-probs, critic TD steps, advantages, the actor and guidance
policy steps, the value step, the target update; then the commit (``Run.commit``: checkpoint
``ckpt/iteration-N``, buffer commit, metrics, curve)."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

import trainers.guidance
from rlbuffers import ReplayBuffer
from rlbuffers.memory import AdaptiveMicroBatch, MemoryMonitor, auto_budget, polyak_update_
from rlbuffers.memory.process import trim_heap
from rlbuffers.memory.reference import reference_bytes_saved
from rlbuffers.rollouts import make_pool
from rlbuffers.rollouts.pool import RolloutPool
from trainers import common
from trainers.config import evaluated, start
from trainers.guidance import evaluation
from trainers.guidance.advantages import mixed, outcomes, role_utterances
from trainers.guidance.agent_init import load_agent_init
from trainers.guidance.config import RESUMABLE, Config, check_config
from trainers.guidance.critic import (
    DoubleCritic,
    advantages,
    critic_batch,
    critic_inputs,
    make_critic,
    td_error,
    td_loss,
    value_batch,
    value_loss,
)
from trainers.guidance.data import create_buffer, draw_curve, episode_rows, next_problems
from trainers.guidance.placement import describe, place
from trainers.guidance.policy import (
    micro_batches,
    policy_step,
    utterance_batch,
    utterance_reference_logprobs,
    utterance_step_cost,
)
from trainers.guidance.resume import checkpoint_files, load_checkpoint
from trainers.guidance.rollout import (
    POLICIES,
    ROLES,
    Policies,
    collect,
    generation_sampling,
    longest_utterances,
    make_policies,
    play,
)
from trainers.llm.checkpointing import set_gradient_checkpointing
from trainers.llm.device import resolve_device, to_device
from trainers.llm.evaluation import (
    HELD_OUT_SEED,
    Key,
    correctness,
    held_out,
    task_correct,
    training_keys,
)
from trainers.llm.policy_loss import clip_and_step
from trainers.llm.tasks import extract_answer, task_problems
from trainers.phases import Count, Phases, heartbeat
from trainers.summary import finish, fixed, format_eval, write_eval

log = logging.getLogger("trainers.guidance")
MIB = 2**20


def train_threads(cfg: Config) -> int:
    """torch threads of phase 2 (``--train-threads``; 0: all CPUs)."""
    return cfg.train_threads or os.cpu_count() or 1


def update_budget(spec: str, device: torch.device) -> int | None:
    """``--memory-budget`` of the policy steps' micro-batches, on the training ``device``:
    bytes, or ``auto`` (that device's free memory less a margin), or None (``none``)."""
    if spec == "none":
        return None
    return int(spec) if spec.isdigit() else auto_budget(device=device)


def score(problems: Any, index: int, text: str, partial_credit: bool = False) -> float:
    """The reward of ``text`` as an answer to ``problems[index]``: the shared
    ``trainers.llm.evaluation.correctness`` of the answer ``extract_answer`` finds (1.0 right,
    0.0 for a wrong number and for no answer alike; ``partial_credit``: reasoning-gym's
    ``score_answer`` itself, e.g. 0.01 for a wrong number)."""
    answer, _ = extract_answer(text)
    return correctness(problems, problems[index], answer, partial_credit)


@dataclass
class Learner:
    """Everything the training process holds (built by :func:`build`)."""

    cfg: Config
    device: torch.device
    policies: Policies
    tok: Any
    critic: DoubleCritic
    target: DoubleCritic
    ctok: Any
    opts: dict[str, torch.optim.Optimizer]
    ambs: dict[str, AdaptiveMicroBatch]
    run: common.Run
    pool: RolloutPool
    problems: Any
    monitor: MemoryMonitor
    rng: np.random.Generator
    trainer: dict[str, Any]
    plans: dict[str, Any]
    """The memory plan's numbers (budget, placement, micro-batches), in every metrics row."""
    init_peak_rss_bytes: int = 0
    """Peak RSS while this process loaded the models."""

    @property
    def buf(self) -> ReplayBuffer:
        assert self.run.buf is not None
        return self.run.buf

    def close(self) -> None:
        """Close the pool and the run (waits for nothing else)."""
        POLICIES.pop(self.cfg.run_dir, None)
        try:
            self.pool.close()
        finally:
            self.run.close()


@torch.no_grad()
def evaluate(learner: Learner, problems: list[dict[str, Any]], train_keys: set[Key]
             ) -> dict[str, Any]:
    """Greedy two-turn episodes (one hint each) on held-out ``problems``, scored without
    partial credit: ``trainers.guidance.evaluation.evaluate``'s result (each turn's accuracy
    with its Wilson interval and overlap with ``train_keys``, the hint's effect)."""
    cfg = learner.cfg

    def play_greedy(questions: list[str]) -> dict[str, Any]:
        torch.set_num_threads(cfg.generate_threads)
        count = Count(3 * len(questions), "utterances done (answer, hint, revision each)")
        try:
            with heartbeat(f"held-out evaluation: {len(questions)} problems", count=count):
                return play(learner.policies, learner.tok, questions,
                            generation_sampling(cfg, learner.policies, learner.device),
                            hints=1, greedy=True,
                            max_answer_tokens=cfg.max_answer_tokens,
                            max_hint_tokens=cfg.max_hint_tokens, on_finished=count.add,
                            keep_hint=cfg.keep_hint)
        finally:
            torch.set_num_threads(train_threads(cfg))

    out = evaluation.evaluate(play_greedy, problems, task_correct(cfg.task, cfg.task_config),
                              train_keys=train_keys)
    trim_heap()  # the generation's freed pages back to the system (as after every phase)
    return {**out, "agent_frozen": cfg.freeze_agent, "hint_reward": cfg.hint_reward,
            "keep_hint": cfg.keep_hint}


def iterate(learner: Learner) -> dict[str, Any]:
    """One iteration: phase 1 (a turn-1 answer per problem, K hints on it and a revision
    after each), scores, buffer, reference, phase 2 (the critic's TD error on the fresh
    utterances, its TD steps, advantages, actor, guidance, value, target); returns its
    metrics row (the caller commits)."""
    L, cfg, tr = learner, learner.cfg, learner.trainer
    it, row, K = tr["iteration"] + 1, {}, cfg.hints_per_answer
    phases = Phases(L.monitor, row)
    indices = next_problems(cfg.episodes_per_iteration, cfg.train_size, cfg.seed, tr["data"])
    with phases("generate"):
        torch.set_num_threads(cfg.generate_threads)
        episodes = collect(L.pool, L.policies, [L.problems[i]["question"] for i in indices],
                           cfg, it)
        torch.set_num_threads(train_threads(cfg))
    # correctness [E, 1 + K]: turn 1, then turn 2 after each hint (utterances 0, 2, 4, ...)
    scores = np.array([[score(L.problems, i, ep["texts"][u], partial_credit=cfg.partial_credit)
                        for u in range(0, 2 * K + 1, 2)]
                       for i, ep in zip(indices, episodes, strict=True)], np.float32)
    c1, c2 = scores[:, 0], scores[:, 1:]
    with phases("buffer"):
        fresh = episode_rows(episodes, scores, tr["episodes"], it, cfg.hint_reward)
        L.buf.extend(fresh)
        tr["episodes"] += len(episodes)
    # This iteration's utterances per role (agent: turn 1s, then turn 2s, none when frozen;
    # guidance: the hints of --hint-reward's groups): group advantages, LM batches (on the
    # device), critic inputs.
    pick, group, a_hint, flat = role_utterances(c1, c2, cfg.scale_rewards, cfg.hint_reward)
    batches, crit = {}, {}
    for role in ROLES:
        if not pick[role] or role in L.policies.frozen:
            continue
        obs = [episodes[e]["observations"][u] for e, u in pick[role]]
        acts = [episodes[e]["actions"][u] for e, u in pick[role]]
        crit[role] = {"obs": critic_inputs(L.ctok, L.tok, obs, cfg.critic_max_tokens,
                                           keep_end=True),
                      "act": critic_inputs(L.ctok, L.tok, acts, cfg.critic_max_tokens,
                                           keep_end=False)}
        batches[role] = to_device(utterance_batch(obs, acts, L.tok.pad_token_id,
                                                  np.zeros(len(obs))), L.device)
    if cfg.beta:
        with phases("reference"):
            for role, batch in batches.items():
                utterance_reference_logprobs(
                    L.policies, batch, L.ambs[role].micro_batch or len(batch["target"]),
                    chunk_tokens=cfg.chunk_tokens, temperature=cfg.temperature)
    with phases("critic"):
        row.update(critic_steps(L, fresh, crit, batches, group))
    for role, name in (("agent", "actor"), ("guidance", "guidance")):
        if role in L.policies.frozen:  # --freeze-agent: no step, no gradient, no optimizer
            continue
        st = {"loss": 0.0, "kl": 0.0, "grad_norm": 0.0, "micro_batch": 0}
        with phases(name):
            if role in batches:  # no wrong turn-1 answer: no guidance step this iteration
                st = policy_step(L.policies, role, L.opts[role], L.ambs[role], batches[role],
                                 cfg)
        row.update({f"{name}_loss": st["loss"], f"kl_{role}": st["kl"],
                    f"grad_norm_{role}": st["grad_norm"], f"micro_batch_{role}": st["micro_batch"]})
    with phases("value"):
        loss = value_loss(L.critic, L.target, value_batch(L.buf, L.policies, L.tok, L.ctok, cfg,
                                                          it))
        loss.backward()
        clip_and_step(list(L.critic.parameters()), L.opts["critic"], cfg.max_grad_norm)
        row["value_loss"] = float(loss.detach())
    with phases("target"):
        polyak_update_(L.target, L.critic, cfg.tau)
    row.update({"iteration": it, "episodes": len(episodes),
                **outcomes(c1, c2, a_hint, cfg.hint_reward), "flat_groups": flat,
                "agent_frozen": cfg.freeze_agent,
                "reward_mean": float(c2.mean()),
                "answer_tokens_mean": float(np.mean(
                    [len(ep["actions"][u]) for ep in episodes for u in range(0, 2 * K + 1, 2)])),
                "hint_tokens_mean": float(np.mean(
                    [len(ep["actions"][u]) for ep in episodes for u in range(1, 2 * K, 2)])),
                "buffer_utterances": len(L.buf), "peak_rss_bytes": phases.peak_rss_bytes(),
                "init_peak_rss_bytes": L.init_peak_rss_bytes, **L.plans})
    phases.log("iteration", it)
    return row


def critic_steps(L: Learner, fresh: dict[str, Any], crit: dict[str, Any],
                 batches: dict[str, Any], group: dict[str, np.ndarray]) -> dict[str, Any]:
    """The critic's part of phase 2: its TD error on the iteration's ``fresh`` rows before
    (``td_error``: data it has not trained on, so whether it tracks) and after
    (``td_error_after``) its ``--critic-steps`` TD steps on buffer samples; then each role's
    critic advantage ``Q - V`` (ArCHer), mixed into the ``group`` advantages when
    ``--critic-mix`` > 0 and the TD error is under ``--critic-td-threshold``, set as
    ``batches[role]["advantage"]``. Returns the metrics."""
    cfg, row = L.cfg, {}
    row["td_error"] = td_error(L.critic, L.target, fresh, L.ctok, L.tok, cfg.critic_max_tokens,
                               cfg.gamma)
    trusted = row["td_error"] < cfg.critic_td_threshold
    stats = []
    for _ in range(cfg.critic_steps):
        loss, st = td_loss(L.critic, L.target, critic_batch(
            L.buf, L.ctok, L.tok, cfg.critic_batch, cfg.critic_max_tokens), cfg.gamma)
        loss.backward()
        clip_and_step(list(L.critic.parameters()), L.opts["critic"], cfg.max_grad_norm)
        stats.append({"critic_loss": float(loss.detach()), **st})
    for key in ("critic_loss", "td_target_mean", "q_mean"):
        row[key] = float(np.mean([s[key] for s in stats])) if stats else 0.0
    row["td_error_after"] = td_error(L.critic, L.target, fresh, L.ctok, L.tok,
                                     cfg.critic_max_tokens, cfg.gamma)
    row["critic_mixed"] = bool(trusted and cfg.critic_mix > 0)
    for role in ROLES:
        adv = advantages(L.critic, crit[role]) if role in crit else None
        if adv is not None:
            batches[role]["advantage"] = torch.from_numpy(mixed(
                group[role], adv["advantage"], cfg.critic_mix, trusted)).to(L.device)
        for key, name in (("q", "q"), ("v", "v"), ("advantage", "advantage")):
            row[f"{name}_{role}_mean"] = float(adv[key].mean()) if adv is not None else 0.0
    return row


def build(cfg: Config) -> Learner:
    """Pool, models (shared or naive layout), placement, run directory, optimizers,
    micro-batch plans and gradient checkpointing; loads the last complete checkpoint on
    --resume. The memory plan is logged at INFO."""
    device = resolve_device(cfg.device)
    monitor = MemoryMonitor(device=device)  # CUDA peaks recorded on a CUDA device
    # first: a pool that cannot start leaves no run directory behind
    pool = make_pool(cfg.rollout_backend, cfg.workers, address=cfg.ray_address)
    run = None
    try:
        with monitor.phase("init") as init:
            policies, tok, _ = make_policies(cfg, naive=cfg.naive_init)
            if cfg.freeze_agent:
                policies.freeze("agent")
            critic, target, ctok = make_critic(cfg)
        # a new run only (a resumed one restores its adapters), before the run directory
        start_eval = {"agent_init": load_agent_init(policies, cfg.agent_init, cfg)} \
            if cfg.agent_init and not cfg.resume else {}
        plan = place(policies, critic, target, device, auto_budget())
        if not cfg.naive_init:
            saved = reference_bytes_saved(policies.models["agent"])
            monitor.record_saving("shared_reference", saved)
            monitor.record_saving("shared_guidance", saved)
        POLICIES[cfg.run_dir] = (policies, tok)
        run = common.open_run(cfg, unit="iteration", create=partial(create_buffer, cfg),
                              curve=partial(draw_curve, task=cfg.task))
        problems = task_problems(cfg.task, cfg.train_size, cfg.seed, cfg.task_config)
        longest = longest_utterances(tok, [problems[i]["question"] for i in range(len(problems))],
                                     cfg.max_answer_tokens, cfg.max_hint_tokens,
                                     keep_hint=cfg.keep_hint)
        opts, ambs, plans = setup_updates(cfg, device, policies, tok, critic, plan,
                                          longest)
        learner = Learner(
            cfg=cfg, device=device, policies=policies, tok=tok, critic=critic, target=target,
            ctok=ctok, opts=opts, ambs=ambs, run=run, pool=pool, problems=problems,
            monitor=monitor, rng=np.random.default_rng(cfg.seed),
            trainer={"iteration": 0, "episodes": 0, "data": {"epoch": 0, "position": 0},
                     "eval": start_eval},
            plans=plans, init_peak_rss_bytes=init.peak_rss_bytes)
        if run.resumed:
            load_checkpoint(learner)
    except BaseException:
        POLICIES.pop(cfg.run_dir, None)
        pool.close()
        if run is not None:
            run.close()
        raise
    return learner


def setup_updates(cfg: Config, device: torch.device, policies: Policies, tok: Any,
                  critic: DoubleCritic, plan: Any, longest: dict[str, int]
                  ) -> tuple[dict[str, torch.optim.Optimizer], dict[str, AdaptiveMicroBatch],
                             dict[str, Any]]:
    """The AdamW optimizers (critic and each trained adapter: none for a frozen agent), each
    trained adapter's micro-batches (planned under the policy step's budget on ``device``
    from the memory per token of a step measured on the agent's longest utterances, with the
    agent's adapter or, frozen, the guidance one's, for each role's ``longest[role]``-token
    utterances) and gradient checkpointing of the policy model(s); returns the optimizers,
    the micro-batches and the plans' numbers (logged at INFO)."""
    lrs = {"agent": cfg.actor_lr, "guidance": cfg.guidance_lr}
    trained = [r for r in ROLES if r not in policies.frozen]
    opts: dict[str, torch.optim.Optimizer] = {
        r: torch.optim.AdamW(policies.adapter_params(r), lr=lrs[r], weight_decay=0.0)
        for r in trained}
    opts["critic"] = torch.optim.AdamW(critic.parameters(), lr=cfg.critic_lr, weight_decay=0.0)
    budget = update_budget(cfg.memory_budget, device)
    log.info("memory budget of a policy step: %s (--memory-budget %s, on %s)",
             "none" if budget is None else f"{budget / MIB:,.0f} MiB", cfg.memory_budget, device)
    E, K = cfg.episodes_per_iteration, cfg.hints_per_answer
    ambs, plans = {}, {"memory_budget_bytes": budget, **describe(plan)}
    cost = None
    if budget is not None:  # once: the longest utterances (a real step on 1 and 3 of them)
        with heartbeat(f"measuring a policy step's memory on {longest['agent']}-token "
                       "utterances"):
            cost = utterance_step_cost(policies, trained[0], longest["agent"],
                                       cfg.max_answer_tokens, tok.pad_token_id, cfg, budget)
        trim_heap()  # the probe's pages back to the system before the evaluation
    for role, items in (("agent", E * (1 + K)), ("guidance", E * K)):
        if role in policies.frozen:
            continue
        ambs[role], mb = micro_batches(role, policies.use(role), budget, items, longest[role],
                                       cost)
        plans[f"micro_batch_planned_{role}"] = mb["micro_batch"]
        plans[f"utterance_tokens_planned_{role}"] = longest[role]
        if "activation_bytes_per_item" in mb:
            plans[f"activation_bytes_per_utterance_{role}"] = mb["activation_bytes_per_item"]
    policies.use("agent")
    first = "agent" if "agent" in ambs else "guidance"
    tokens = (ambs[first].micro_batch or 1) * longest[first]  # a micro-batch's, at most
    for name, model in policies.unique_models().items():
        if name != "reference_copy":
            gc = set_gradient_checkpointing(
                model, cfg.gradient_checkpointing, tokens=tokens, budget=budget,
                layers=cfg.checkpoint_layers, fraction=cfg.activation_fraction)
            log.info("gradient checkpointing of %s: %s, layers %s", name, gc["mode"],
                     gc["layers"])
            plans[f"checkpointed_layers_{name}"] = gc["layers"]
    return opts, ambs, plans


def main(argv: list[str] | None = None) -> None:
    cfg = start(Config, argv, module="trainers.guidance", doc=trainers.guidance.__doc__ or "",
                resumable=RESUMABLE, check=check_config, evaluates=lambda c: c.eval_size > 0)
    torch.set_num_threads(train_threads(cfg))
    learner = build(cfg)
    evals = learner.trainer.setdefault("eval", {})
    try:
        if cfg.eval_size:
            held, report = held_out(cfg.task, cfg.task_config, learner.problems, cfg.eval_size,
                                    cfg.seed + HELD_OUT_SEED)
            keys = training_keys(learner.problems)
            log.info("held-out problems: %d, overlap with the %d training problems by content "
                     "(normalised text, operands): %d (%d candidates, %d dropped as training "
                     "problems)", len(held), report["train_problems"], report["overlap"],
                     report["candidates"], report["dropped_training"])
        if cfg.eval_size and "before" not in evals and learner.trainer["iteration"] == 0:
            evals["before"] = {**evaluate(learner, held, keys), "held_out": report}
            log.info("held-out before: %s", format_eval(evals["before"]))
        bar = tqdm(total=cfg.iterations, initial=learner.trainer["iteration"], unit="it",
                   desc="guidance iterations", disable=cfg.quiet)
        while learner.trainer["iteration"] < cfg.iterations:
            t0 = time.perf_counter()
            row = iterate(learner)
            learner.trainer["iteration"] = row["iteration"]
            if cfg.eval_size and cfg.eval_every and row["iteration"] % cfg.eval_every == 0:
                result = {**evaluate(learner, held, keys), "iteration": row["iteration"]}
                evals.setdefault("every", {})[str(row["iteration"])] = result
                row.update(evaluation.flat(result))
                log.info("held-out at iteration %d: %s", row["iteration"], format_eval(result))
            row["iteration_seconds"] = time.perf_counter() - t0
            learner.run.commit(row["iteration"], row, **checkpoint_files(learner))
            bar.set_postfix({"t1": f"{row['turn1_accuracy']:.2f}",
                             "t2": f"{row['turn2_accuracy']:.2f}",
                             "td": fixed(row["td_error"]),
                             "peak": f"{row['peak_rss_bytes'] / MIB:.0f}M"})
            bar.update(1)
        bar.close()
        run = learner.run
        if cfg.eval_size and (cfg.evaluate_again or not evaluated(run.dir, run.unit, run.done)):
            evals["after"] = {**evaluate(learner, held, keys), "held_out": report}
            log.info("held-out after: %s", format_eval(evals["after"]))
            write_eval(run, evals, run.done)
        finish(run, ["turn1_accuracy", "turn2_accuracy", "critic_loss"], evals)
    except KeyboardInterrupt:
        learner.run.exit_interrupted()
    finally:
        learner.close()
