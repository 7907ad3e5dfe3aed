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
from rlbuffers.memory.reference import reference_bytes_saved
from rlbuffers.rollouts import make_pool
from rlbuffers.rollouts.pool import RolloutPool
from trainers import common
from trainers.config import evaluated, start
from trainers.curves import Series, plot_curve
from trainers.guidance.config import RESUMABLE, Config, check_config
from trainers.guidance.critic import (
    DoubleCritic,
    advantages,
    critic_batch,
    critic_inputs,
    make_critic,
    td_loss,
    value_batch,
    value_loss,
)
from trainers.guidance.data import buffer_fields, episode_rows, next_problems
from trainers.guidance.placement import describe, place
from trainers.guidance.policy import (
    micro_batches,
    policy_step,
    utterance_batch,
    utterance_reference_logprobs,
)
from trainers.guidance.rollout import POLICIES, ROLES, Policies, collect, make_policies, play
from trainers.llm.checkpointing import set_gradient_checkpointing
from trainers.llm.device import resolve_device, to_device
from trainers.llm.policy_loss import clip_and_step
from trainers.llm.tasks import extract_answer, task_problems, wilson
from trainers.phases import Phases, heartbeat
from trainers.summary import finish, format_eval, write_eval

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


def score(problems: Any, index: int, text: str) -> float:
    """reasoning-gym's ``score_answer`` of the answer extracted from ``text`` (1.0 right)."""
    answer, _ = extract_answer(text)
    return float(problems.score_answer(answer, problems[index])) if answer else 0.0


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
def evaluate(learner: Learner, problems: Any) -> dict[str, Any]:
    """Greedy two-turn episodes on held-out ``problems``: turn-1 and turn-2 accuracy with 95%
    Wilson intervals, the share of episodes turn 2 fixes (hint uptake) and breaks."""
    cfg = learner.cfg
    torch.set_num_threads(cfg.generate_threads)
    questions = [problems[i]["question"] for i in range(len(problems))]
    with heartbeat(f"held-out evaluation: {len(questions)} problems"):
        ep = play(learner.policies, learner.tok, questions,
                  cfg.utterance_sampling(learner.device), max_answer_tokens=cfg.max_answer_tokens,
                  max_hint_tokens=cfg.max_hint_tokens, greedy=True)
    torch.set_num_threads(train_threads(cfg))
    right = np.array([[score(problems, i, texts[k]) == 1.0 for k in (0, 2)]
                      for i, texts in enumerate(ep["texts"])])
    n, out = len(right), {}
    for name, hits in (("turn1", right[:, 0]), ("turn2", right[:, 1])):
        out[name] = {"accuracy": float(hits.mean()), "n": n,
                     "ci95": list(wilson(float(hits.sum()), n))}
    out["hint_uptake"] = float((~right[:, 0] & right[:, 1]).mean())
    out["turn2_breaks"] = float((right[:, 0] & ~right[:, 1]).mean())
    return out


def iterate(learner: Learner) -> dict[str, Any]:
    """One iteration: phase 1 (episodes), scores, buffer, reference, phase 2 (critic,
    advantages, actor, guidance, value, target); returns its metrics row (the caller
    commits)."""
    L, cfg, tr = learner, learner.cfg, learner.trainer
    it, row = tr["iteration"] + 1, {}
    phases = Phases(L.monitor, row)
    indices = next_problems(cfg.episodes_per_iteration, cfg.train_size, cfg.seed, tr["data"])
    with phases("generate"):
        torch.set_num_threads(cfg.generate_threads)
        episodes = collect(L.pool, L.policies, [L.problems[i]["question"] for i in indices],
                           cfg, it)
        torch.set_num_threads(train_threads(cfg))
    scores = np.array([[score(L.problems, i, ep["texts"][k]) for k in (0, 2)]
                       for i, ep in zip(indices, episodes, strict=True)], np.float32)
    with phases("buffer"):
        L.buf.extend(episode_rows(episodes, scores, tr["episodes"], it))
        tr["episodes"] += len(episodes)
    # This iteration's utterances per role: LM batches (on the device) and critic inputs.
    batches, crit = {}, {}
    for role, turns in (("agent", (0, 2)), ("guidance", (1,))):
        obs = [ep["observations"][k] for k in turns for ep in episodes]
        acts = [ep["actions"][k] for k in turns for ep in episodes]
        crit[role] = {"obs": critic_inputs(L.ctok, L.tok, obs, cfg.critic_max_tokens,
                                           keep_end=True),
                      "act": critic_inputs(L.ctok, L.tok, acts, cfg.critic_max_tokens,
                                           keep_end=False)}
        batches[role] = to_device(utterance_batch(obs, acts, L.tok.pad_token_id,
                                                  np.zeros(len(obs))), L.device)
    if cfg.beta:
        with phases("reference"):
            for role in ROLES:
                utterance_reference_logprobs(
                    L.policies, batches[role],
                    L.ambs[role].micro_batch or len(batches[role]["target"]),
                    chunk_tokens=cfg.chunk_tokens, temperature=cfg.temperature)
    with phases("critic"):
        stats = []
        for _ in range(cfg.critic_steps):
            loss, st = td_loss(L.critic, L.target, critic_batch(
                L.buf, L.ctok, L.tok, cfg.critic_batch, cfg.critic_max_tokens), cfg.gamma)
            loss.backward()
            clip_and_step(list(L.critic.parameters()), L.opts["critic"], cfg.max_grad_norm)
            stats.append({"critic_loss": float(loss.detach()), **st})
        for key in ("critic_loss", "td_target_mean", "q_mean"):
            row[key] = float(np.mean([s[key] for s in stats])) if stats else 0.0
        for role in ROLES:
            adv = advantages(L.critic, crit[role])
            batches[role]["advantage"] = torch.from_numpy(adv["advantage"]).to(L.device)
            row.update({f"q_{role}_mean": float(adv["q"].mean()),
                        f"v_{role}_mean": float(adv["v"].mean()),
                        f"advantage_{role}_mean": float(adv["advantage"].mean())})
    for role, name in (("agent", "actor"), ("guidance", "guidance")):
        with phases(name):
            st = policy_step(L.policies, role, L.opts[role], L.ambs[role], batches[role], cfg)
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
    right = scores == 1.0
    row.update({"iteration": it, "episodes": len(episodes),
                "turn1_accuracy": float(right[:, 0].mean()),
                "turn2_accuracy": float(right[:, 1].mean()),
                "hint_uptake": float((~right[:, 0] & right[:, 1]).mean()),
                "turn2_breaks": float((right[:, 0] & ~right[:, 1]).mean()),
                "reward_mean": float(scores[:, 1].mean()),
                "answer_tokens_mean": float(np.mean([len(ep["actions"][k]) for ep in episodes
                                                     for k in (0, 2)])),
                "hint_tokens_mean": float(np.mean([len(ep["actions"][1]) for ep in episodes])),
                "buffer_utterances": len(L.buf), "peak_rss_bytes": phases.peak_rss_bytes(),
                "init_peak_rss_bytes": L.init_peak_rss_bytes, **L.plans})
    phases.log("iteration", it)
    return row


def checkpoint_files(learner: Learner) -> dict[str, Any]:
    """``Run.commit``'s ``torch_files`` (the three AdamW states, RNG states), ``writers``
    (both adapters, critic and target critic as safetensors) and ``state`` (trainer state,
    micro-batch and monitor state)."""
    from safetensors.torch import save_file

    L = learner

    def tensors(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
        return {k: torch.as_tensor(v).detach().cpu().contiguous() for k, v in sd.items()}

    writers = {f"{r}.safetensors": (lambda p, r=r: save_file(
        tensors(L.policies.adapter_state(r)), str(p))) for r in ROLES}
    for name, m in (("critic", L.critic), ("target_critic", L.target)):
        writers[f"{name}.safetensors"] = lambda p, m=m: save_file(tensors(m.state_dict()), str(p))
    return {"torch_files": {"optimizers.pt": {k: o.state_dict() for k, o in L.opts.items()},
                            "rng.pt": common.rng_states(L.rng)},
            "writers": writers,
            "state": {"trainer": L.trainer,
                      "micro_batch": {k: a.state_dict() for k, a in L.ambs.items()},
                      "monitor": L.monitor.state_dict()}}


def load_checkpoint(learner: Learner) -> None:
    """Restore the run's last complete checkpoint (weights onto the devices they live on)."""
    from safetensors.torch import load_file

    L, ckpt = learner, learner.run.checkpoint
    assert ckpt is not None
    for role in ROLES:
        state = load_file(str(ckpt / f"{role}.safetensors"))
        L.policies.load_adapter_state(role, {k: v.numpy() for k, v in state.items()})
    L.critic.load_state_dict(load_file(str(ckpt / "critic.safetensors")))
    L.target.load_state_dict(load_file(str(ckpt / "target_critic.safetensors")))
    for k, sd in torch.load(ckpt / "optimizers.pt", weights_only=True,
                            map_location="cpu").items():
        L.opts[k].load_state_dict(sd)
    common.set_rng_states(torch.load(ckpt / "rng.pt", weights_only=False), L.rng)
    state = L.run.load_state()
    L.trainer = state["trainer"]
    for k, a in L.ambs.items():
        a.load_state_dict(state["micro_batch"][k])
    L.monitor.load_state_dict(state["monitor"])


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
            critic, target, ctok = make_critic(cfg)
        plan = place(policies, critic, target, device, auto_budget())
        if not cfg.naive_init:
            saved = reference_bytes_saved(policies.models["agent"])
            monitor.record_saving("shared_reference", saved)
            monitor.record_saving("shared_guidance", saved)
        POLICIES[cfg.run_dir] = (policies, tok)
        run = common.open_run(cfg, unit="iteration", create=partial(create_buffer, cfg),
                              curve=partial(draw_curve, task=cfg.task))
        opts, ambs, plans = setup_updates(cfg, device, policies, critic, plan)
        learner = Learner(
            cfg=cfg, device=device, policies=policies, tok=tok, critic=critic, target=target,
            ctok=ctok, opts=opts, ambs=ambs, run=run, pool=pool,
            problems=task_problems(cfg.task, cfg.train_size, cfg.seed, cfg.task_config),
            monitor=monitor, rng=np.random.default_rng(cfg.seed),
            trainer={"iteration": 0, "episodes": 0, "data": {"epoch": 0, "position": 0}},
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


def setup_updates(cfg: Config, device: torch.device, policies: Policies, critic: DoubleCritic,
                  plan: Any) -> tuple[dict[str, torch.optim.Optimizer],
                                      dict[str, AdaptiveMicroBatch], dict[str, Any]]:
    """The three AdamW optimizers, each adapter's micro-batches (planned under the policy
    step's budget on ``device``) and gradient checkpointing of the policy model(s); returns
    the optimizers, the micro-batches and the plans' numbers (logged at INFO)."""
    opts: dict[str, torch.optim.Optimizer] = {
        "agent": torch.optim.AdamW(policies.adapter_params("agent"), lr=cfg.actor_lr,
                                   weight_decay=0.0),
        "guidance": torch.optim.AdamW(policies.adapter_params("guidance"), lr=cfg.guidance_lr,
                                      weight_decay=0.0),
        "critic": torch.optim.AdamW(critic.parameters(), lr=cfg.critic_lr, weight_decay=0.0)}
    budget = update_budget(cfg.memory_budget, device)
    log.info("memory budget of a policy step: %s (--memory-budget %s, on %s)",
             "none" if budget is None else f"{budget / MIB:,.0f} MiB", cfg.memory_budget, device)
    longest = 512 + 2 * cfg.max_answer_tokens + cfg.max_hint_tokens  # a rough worst case
    ambs, plans = {}, {"memory_budget_bytes": budget, **describe(plan)}
    for role, items in (("agent", 2 * cfg.episodes_per_iteration),
                        ("guidance", cfg.episodes_per_iteration)):
        ambs[role], mb = micro_batches(role, policies.models[role], budget, items, longest,
                                       cfg.chunk_tokens)
        plans[f"micro_batch_planned_{role}"] = mb["micro_batch"]
    tokens = (ambs["agent"].micro_batch or 1) * longest  # one micro-batch's tokens, at most
    for name, model in policies.unique_models().items():
        if name != "reference_copy":
            gc = set_gradient_checkpointing(
                model, cfg.gradient_checkpointing, tokens=tokens, budget=budget,
                layers=cfg.checkpoint_layers, fraction=cfg.activation_fraction)
            log.info("gradient checkpointing of %s: %s, layers %s", name, gc["mode"],
                     gc["layers"])
            plans[f"checkpointed_layers_{name}"] = gc["layers"]
    return opts, ambs, plans


def create_buffer(cfg: Config, run_dir: Any) -> None:
    """The new run's utterance buffer (3 utterances per episode kept)."""
    ReplayBuffer.create(run_dir / "buffer", capacity=3 * cfg.buffer_episodes,
                        fields=buffer_fields(), seed=cfg.seed).close()


def draw_curve(path: Any, history: list[dict[str, Any]], *, task: str) -> None:
    """curve.png: turn-1 / turn-2 accuracy and hint uptake, critic loss on the right."""
    plot_curve(path, history, x="iteration", xlabel=f"iteration (guidance on {task})",
               series=[Series("turn1_accuracy", "turn 1 accuracy"),
                       Series("turn2_accuracy", "turn 2 accuracy"),
                       Series("hint_uptake", "hint uptake"),
                       Series("critic_loss", "critic loss", right=True)],
               ylabel="accuracy / share", title="two-turn guidance", right_label="critic loss")


def main(argv: list[str] | None = None) -> None:
    cfg = start(Config, argv, module="trainers.guidance", doc=trainers.guidance.__doc__ or "",
                resumable=RESUMABLE, check=check_config, evaluates=lambda c: c.eval_size > 0)
    torch.set_num_threads(train_threads(cfg))
    learner = build(cfg)
    held_out = task_problems(cfg.task, cfg.eval_size, cfg.seed + 1_000_003, cfg.task_config) \
        if cfg.eval_size else []
    evals = learner.trainer.setdefault("eval", {})
    try:
        if cfg.eval_size and "before" not in evals and learner.trainer["iteration"] == 0:
            evals["before"] = evaluate(learner, held_out)
            log.info("held-out before: %s", format_eval(evals["before"]))
        bar = tqdm(total=cfg.iterations, initial=learner.trainer["iteration"], unit="it",
                   desc="guidance iterations", disable=cfg.quiet)
        while learner.trainer["iteration"] < cfg.iterations:
            t0 = time.perf_counter()
            row = iterate(learner)
            learner.trainer["iteration"] = row["iteration"]
            row["iteration_seconds"] = time.perf_counter() - t0
            learner.run.commit(row["iteration"], row, **checkpoint_files(learner))
            bar.set_postfix({"t1": f"{row['turn1_accuracy']:.2f}",
                             "t2": f"{row['turn2_accuracy']:.2f}",
                             "critic": f"{row['critic_loss']:.3f}",
                             "peak": f"{row['peak_rss_bytes'] / MIB:.0f}M"})
            bar.update(1)
        bar.close()
        run = learner.run
        if cfg.eval_size and (cfg.evaluate_again or not evaluated(run.dir, run.unit, run.done)):
            evals["after"] = evaluate(learner, held_out)
            log.info("held-out after: %s", format_eval(evals["after"]))
            write_eval(run, evals, run.done)
        finish(run, ["turn1_accuracy", "turn2_accuracy", "critic_loss"], evals)
    except KeyboardInterrupt:
        learner.run.exit_interrupted()
    finally:
        learner.close()
