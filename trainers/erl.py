"""Evolutionary Reinforcement Learning (ERL) with a TD3 learner, on an rlbuffers replay buffer.

ERL (Khadka & Tumer, "Evolution-Guided Policy Gradient in Reinforcement Learning", NeurIPS
2018): a population of actors is evolved by selection, crossover and mutation on episode
return (fitness); every rollout of every actor feeds one shared replay buffer; a gradient
learner trains off that buffer (TD3 here: Fujimoto, van Hoof & Meger, "Addressing Function
Approximation Error in Actor-Critic Methods", ICML 2018, instead of the paper's DDPG) and its
actor is copied into the population every few generations, replacing the weakest.

Every generation ends with an atomic checkpoint: the trainer state goes to ``ckpt/gen-N``
(temporary directory + fsync + rename), then ``buf.save()`` commits the buffer with
``metadata={"trainer_generation": N}``. The buffer commit is the commit point of the whole
generation: ``--resume`` (even after ``kill -9``) reads the generation from the buffer and
loads the matching checkpoint, so trainer and buffer always agree.

    python -m trainers.erl --env HalfCheetah-v5 --generations 20 --run-dir runs/erl
    python -m trainers.erl --run-dir runs/erl --resume --generations 40
    rlbuffers inspect runs/erl/buffer

Writes into ``--run-dir``: ``config.json``, ``buffer/`` (the replay buffer), ``ckpt/gen-N/``
(``state.pt``: population, learner, optimizers, RNG states, history; ``best_actor.pt``),
``metrics.jsonl`` (one JSON line per generation) and ``curve.png`` (learning curve).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rlbuffers import FieldSpec, ReplayBuffer
from rlbuffers.checkpoint import Checkpoints, create_run
from rlbuffers.memory import MemoryMonitor
from trainers import common
from trainers.common import (
    pyplot,
    restore_metrics,
    rng_states,
    save_figure,
    set_rng_states,
)

MIB = 2**20


# ------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------
@dataclass
class Config:
    """Everything a run depends on; saved as ``run_dir/config.json``."""

    env: str = "HalfCheetah-v5"
    """Gymnasium environment id with Box observations and Box actions."""
    run_dir: str = "runs/erl"
    """Directory for the buffer, checkpoints, metrics.jsonl and curve.png."""
    resume: bool = False
    """Continue the run in run_dir from its last complete generation (config from the run)."""
    generations: int = 100
    """Generation to stop after (counted from the start of the run, also when resuming)."""
    seed: int = 0
    """Seeds torch, numpy, the buffer's sampler and every episode's env reset."""
    max_episode_steps: int = 1000
    """Steps per episode before truncation."""
    pop_size: int = 5
    """Actors in the evolving population (ERL's k)."""
    episodes_per_actor: int = 1
    """Episodes each actor runs per generation; its fitness is their mean return."""
    elite_fraction: float = 0.2
    """Fraction of the population kept unchanged as elites (at least one)."""
    tournament_size: int = 3
    """Actors drawn per tournament when selecting parents."""
    crossover_prob: float = 0.5
    """Probability that an offspring is a crossover of two parents, else a copy of one."""
    mutation_prob: float = 0.9
    """Probability that an offspring is mutated."""
    mutation_frac: float = 0.1
    """Fraction of the weights of each layer a mutation perturbs."""
    mutation_strength: float = 0.1
    """Std of the Gaussian mutation, relative to the weight's magnitude."""
    super_mutation_prob: float = 0.05
    """Probability that a perturbed weight gets a 10x stronger mutation."""
    reset_prob: float = 0.05
    """Probability that a perturbed weight is reset to N(0, 1)."""
    sync_every: int = 5
    """Copy the learner's actor into the population every this many generations (ERL's omega)."""
    hidden: int = 128
    """Width of the two hidden layers of actors and critics (128 as in ERL's actors)."""
    buffer_capacity: int = 1_000_000
    """Transitions the replay buffer holds (the oldest are overwritten beyond it)."""
    learning_starts: int = 10_000
    """Transitions in the buffer before the learner trains (it acts at random until then)."""
    updates_per_step: float = 0.5
    """TD3 gradient steps per env step collected in the generation, all actors (ERL used 1.0;
    0.5 halves the compute, which dominates on a 2-core machine)."""
    batch_size: int = 256
    """Transitions per TD3 gradient step."""
    gamma: float = 0.99
    """Discount factor."""
    tau: float = 0.005
    """Polyak factor of the target networks."""
    actor_lr: float = 3e-4
    """Adam learning rate of the learner's actor."""
    critic_lr: float = 3e-4
    """Adam learning rate of the twin critics."""
    policy_noise: float = 0.2
    """Std of the target-policy smoothing noise (fraction of the action range)."""
    noise_clip: float = 0.5
    """Clip of the target-policy smoothing noise (fraction of the action range)."""
    policy_delay: int = 2
    """Critic updates per actor and target update (TD3's delayed policy update)."""
    exploration_noise: float = 0.1
    """Std of the Gaussian noise on the learner's actions (fraction of the action range)."""
    keep_checkpoints: int = 2
    """Complete checkpoint directories kept in run_dir/ckpt."""
    warn_below_available_mib: int = 1024
    """Log a warning when available memory falls below this many MiB."""
    torch_threads: int = 1
    """torch intra-op threads (1 is fastest on 2 cores with an env beside it)."""
    workers: int = 1
    """Rollout workers evaluating the population (1: in this process, one actor after another;
    more: Ray actors, each actor's episodes seeded as in the sequential run)."""
    ray_address: str = ""
    """Ray cluster to run the workers on ('auto' after 'ray start'; '': a local Ray instance)."""


#: Settings a resumed run may change; the rest must match the run's config.json.
RESUMABLE = {"run_dir", "resume", "generations", "warn_below_available_mib", "torch_threads",
             "workers", "ray_address"}


def parse_config(argv: list[str] | None = None) -> Config:
    """Build the Config from command-line flags (one ``--flag`` per field); on ``--resume``
    start from ``run_dir/config.json`` and apply only the flags in RESUMABLE."""
    return common.parse_config(Config, argv, prog="python -m trainers.erl",
                               description=__doc__.split("\n\n")[0], resumable=RESUMABLE)


# ------------------------------------------------------------------------------------------
# Networks
# ------------------------------------------------------------------------------------------
class Actor(nn.Module):
    """Deterministic policy: obs float32[B, obs_dim] -> action float32[B, act_dim] in the
    env's action box. LayerNorm after each hidden layer keeps evolved weights well scaled."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: int, low: np.ndarray,
                 high: np.ndarray) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(obs_dim, hidden), nn.LayerNorm(hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.LayerNorm(hidden), nn.ReLU(),
            nn.Linear(hidden, act_dim), nn.Tanh(),
        )
        self.register_buffer("scale", torch.as_tensor((high - low) / 2, dtype=torch.float32))
        self.register_buffer("center", torch.as_tensor((high + low) / 2, dtype=torch.float32))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.center + self.scale * self.net(obs)


class TwinCritic(nn.Module):
    """TD3's two Q-networks: (obs [B, obs_dim], action [B, act_dim]) -> (q1 [B], q2 [B])."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: int) -> None:
        super().__init__()

        def q() -> nn.Sequential:
            return nn.Sequential(nn.Linear(obs_dim + act_dim, hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

        self.q1, self.q2 = q(), q()

    def forward(self, obs: torch.Tensor, act: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([obs, act], dim=-1)
        return self.q1(x).squeeze(-1), self.q2(x).squeeze(-1)


# ------------------------------------------------------------------------------------------
# Rollouts: one episode, its transitions ready for ReplayBuffer.extend
# ------------------------------------------------------------------------------------------
def episode_seed(cfg: Config, episode: int) -> int:
    """Env reset seed of the run's ``episode``-th episode (so a resumed run replays exactly)."""
    return int(np.random.SeedSequence([cfg.seed, episode]).generate_state(1)[0])


@torch.no_grad()
def rollout(env: gym.Env, actor: Actor | None, seed: int, rng: np.random.Generator,
            noise_std: float = 0.0) -> tuple[float, dict[str, np.ndarray]]:
    """Run one episode; ``actor=None`` acts uniformly at random.

    Returns (episode return, transitions for ``buf.extend``): ``obs``/``next_obs``
    float32[T, obs_dim], ``action`` float32[T, act_dim], ``reward`` float32[T],
    ``terminated``/``truncated`` bool[T]. ``noise_std`` adds N(0, (noise_std * half the action
    range)^2) to the actor's actions.
    """
    low, high = env.action_space.low, env.action_space.high
    obs, _ = env.reset(seed=seed)
    keys = ("obs", "action", "reward", "next_obs", "terminated", "truncated")
    rows: dict[str, list[Any]] = {k: [] for k in keys}
    total, done = 0.0, False
    while not done:
        if actor is None:
            action = rng.uniform(low, high).astype(np.float32)
        else:
            action = actor(torch.as_tensor(obs, dtype=torch.float32)).numpy()
            if noise_std > 0:
                action = action + rng.normal(0.0, noise_std * (high - low) / 2)
            action = np.clip(action, low, high).astype(np.float32)
        next_obs, reward, terminated, truncated, _ = env.step(action)
        for k, v in zip(keys, (obs, action, reward, next_obs, terminated, truncated), strict=True):
            rows[k].append(v)
        total += float(reward)
        obs, done = next_obs, terminated or truncated
    dtypes = {"terminated": np.bool_, "truncated": np.bool_}
    return total, {k: np.asarray(v, dtype=dtypes.get(k, np.float32)) for k, v in rows.items()}


def evaluate_actor(weights: list[dict[str, torch.Tensor]], index: int, spec: dict[str, Any],
                   seeds: list[int]) -> dict[str, Any]:
    """Rollout-worker job: actor ``index`` of the population ``weights`` (its ``state_dict`` s)
    runs one noise-free episode per seed on ``spec["env"]``. Returns ``{"returns": [float],
    "rows": [transitions]}``, the same as :func:`rollout` gives in the learner's process."""
    torch.set_num_threads(spec["torch_threads"])
    env = gym.make(spec["env"], max_episode_steps=spec["max_episode_steps"])
    actor = Actor(spec["obs_dim"], spec["act_dim"], spec["hidden"], np.asarray(spec["low"]),
                  np.asarray(spec["high"]))
    actor.load_state_dict(weights[index])
    unused = np.random.default_rng(0)  # noise-free: the actor acts alone
    episodes = [rollout(env, actor, seed, unused) for seed in seeds]
    env.close()
    return {"returns": [r for r, _ in episodes], "rows": [rows for _, rows in episodes]}


def evaluate_population(cfg: Config, pool: Any, population: list[Actor], env: gym.Env,
                        trainer: dict[str, Any]) -> tuple[list[list[float]], list[Any]]:
    """Every actor's episodes as jobs on ``pool`` (weights shared once); returns each actor's
    returns and transitions, in population order (the order the buffer gets them)."""
    e, first = cfg.episodes_per_actor, trainer["episodes"]
    spec = {"env": cfg.env, "max_episode_steps": cfg.max_episode_steps, "hidden": cfg.hidden,
            "obs_dim": env.observation_space.shape[0], "act_dim": env.action_space.shape[0],
            "low": env.action_space.low.tolist(), "high": env.action_space.high.tolist(),
            "torch_threads": cfg.torch_threads}
    pool.set_weights([a.state_dict() for a in population])
    ids = [pool.submit(evaluate_actor, i, spec,
                       [episode_seed(cfg, first + i * e + k) for k in range(e)])
           for i in range(len(population))]
    trainer["episodes"] += len(population) * e
    results = pool.results(ids)
    return [r.data["returns"] for r in results], [r.data["rows"] for r in results]


# ------------------------------------------------------------------------------------------
# Evolution operators (Khadka & Tumer 2018, Algorithm 1 and Section 3)
# ------------------------------------------------------------------------------------------
def tournament(fitness: np.ndarray, size: int, rng: np.random.Generator) -> int:
    """Tournament selection: index of the fittest of ``size`` actors drawn at random."""
    entrants = rng.choice(len(fitness), size=min(size, len(fitness)), replace=False)
    return int(entrants[np.argmax(fitness[entrants])])


@torch.no_grad()
def crossover(a: Actor, b: Actor, rng: np.random.Generator) -> Actor:
    """Neuron-level crossover: a child of ``a`` whose hidden/output units (a weight row and its
    bias) each come from ``b`` with probability 1/2 (ERL's layer-wise row exchange)."""
    child = copy.deepcopy(a)
    for lc, lb in zip(child.net, b.net, strict=True):
        if isinstance(lc, nn.Linear):
            rows = torch.as_tensor(rng.random(lc.out_features) < 0.5)
            lc.weight[rows] = lb.weight[rows]
            lc.bias[rows] = lb.bias[rows]
    return child


@torch.no_grad()
def mutate(actor: Actor, cfg: Config, rng: np.random.Generator) -> None:
    """ERL's Gaussian mutation, in place: in each weight matrix, ``mutation_frac`` of the
    weights w get w += N(0, (strength * |w|)^2), with strength 10x for a super mutation
    (``super_mutation_prob``), or are reset to N(0, 1) (``reset_prob``)."""
    for layer in actor.net:
        if not isinstance(layer, nn.Linear):
            continue
        w = layer.weight.view(-1)
        n = max(1, int(cfg.mutation_frac * w.numel()))
        idx = torch.as_tensor(rng.choice(w.numel(), size=n, replace=False))
        kind = rng.random(n)
        strength = np.where(kind < cfg.super_mutation_prob, 10 * cfg.mutation_strength,
                            cfg.mutation_strength)
        noise = torch.as_tensor(rng.normal(size=n) * strength, dtype=w.dtype)
        reset = torch.as_tensor(kind > 1 - cfg.reset_prob)
        new = w[idx] + noise * w[idx].abs()
        new[reset] = torch.as_tensor(rng.normal(size=int(reset.sum())), dtype=w.dtype)
        w[idx] = new.clamp(-1e6, 1e6)


def evolve(population: list[Actor], fitness: np.ndarray, cfg: Config,
           rng: np.random.Generator) -> list[Actor]:
    """One ERL generation step: elites survive unchanged; every other slot gets an offspring of
    two tournament winners (crossover with ``crossover_prob``, else a copy), then mutated with
    ``mutation_prob``. Returns the new population, elites first."""
    ranked = np.argsort(-fitness)
    n_elite = max(1, round(cfg.elite_fraction * len(population)))
    new = [population[i] for i in ranked[:n_elite]]
    while len(new) < len(population):
        a = population[tournament(fitness, cfg.tournament_size, rng)]
        b = population[tournament(fitness, cfg.tournament_size, rng)]
        child = crossover(a, b, rng) if rng.random() < cfg.crossover_prob else copy.deepcopy(a)
        if rng.random() < cfg.mutation_prob:
            mutate(child, cfg, rng)
        new.append(child)
    return new


# ------------------------------------------------------------------------------------------
# TD3 learner (Fujimoto et al. 2018, Algorithm 1)
# ------------------------------------------------------------------------------------------
class Learner(nn.Module):
    """The gradient learner: actor, twin critic, their target copies and Adam optimizers."""

    def __init__(self, obs_dim: int, act_dim: int, cfg: Config, low: np.ndarray,
                 high: np.ndarray) -> None:
        super().__init__()
        self.actor = Actor(obs_dim, act_dim, cfg.hidden, low, high)
        self.critic = TwinCritic(obs_dim, act_dim, cfg.hidden)
        self.actor_target = copy.deepcopy(self.actor).requires_grad_(False)
        self.critic_target = copy.deepcopy(self.critic).requires_grad_(False)
        self.actor_opt = torch.optim.Adam(self.actor.parameters(), lr=cfg.actor_lr)
        self.critic_opt = torch.optim.Adam(self.critic.parameters(), lr=cfg.critic_lr)
        self.updates = 0

    def full_state(self) -> dict[str, Any]:
        """Networks, targets, optimizers and update count, for ``torch.save``."""
        return {"nets": self.state_dict(), "actor_opt": self.actor_opt.state_dict(),
                "critic_opt": self.critic_opt.state_dict(), "updates": self.updates}

    def load_full_state(self, state: dict[str, Any]) -> None:
        self.load_state_dict(state["nets"])
        self.actor_opt.load_state_dict(state["actor_opt"])
        self.critic_opt.load_state_dict(state["critic_opt"])
        self.updates = state["updates"]


def td3_update(learner: Learner, batch: dict[str, np.ndarray], cfg: Config) -> float:
    """One TD3 step on a batch from ``buf.sample``: clipped double-Q target with target-policy
    smoothing (Fujimoto et al. 2018, Eq. 14-15); every ``policy_delay`` steps a deterministic
    policy-gradient step on the actor and a Polyak update of the targets. Returns critic loss."""
    obs, act, next_obs = (torch.from_numpy(batch[k]) for k in ("obs", "action", "next_obs"))
    reward = torch.from_numpy(batch["reward"])
    not_done = 1.0 - torch.from_numpy(batch["terminated"]).float()  # truncation is not terminal
    scale = learner.actor.scale
    with torch.no_grad():
        noise = (torch.randn_like(act) * cfg.policy_noise).clamp(-cfg.noise_clip, cfg.noise_clip)
        next_act = learner.actor_target(next_obs) + noise * scale
        next_act = torch.maximum(torch.minimum(next_act, learner.actor.center + scale),
                                 learner.actor.center - scale)
        next_q = torch.min(*learner.critic_target(next_obs, next_act))
        target = reward + cfg.gamma * not_done * next_q
    q1, q2 = learner.critic(obs, act)
    critic_loss = F.mse_loss(q1, target) + F.mse_loss(q2, target)
    learner.critic_opt.zero_grad()
    critic_loss.backward()
    learner.critic_opt.step()
    learner.updates += 1
    if learner.updates % cfg.policy_delay == 0:
        actor_loss = -learner.critic.q1(torch.cat([obs, learner.actor(obs)], -1)).mean()
        learner.actor_opt.zero_grad()
        actor_loss.backward()
        learner.actor_opt.step()
        with torch.no_grad():
            for net, tgt in ((learner.actor, learner.actor_target),
                             (learner.critic, learner.critic_target)):
                for p, tp in zip(net.parameters(), tgt.parameters(), strict=True):
                    tp.lerp_(p, cfg.tau)
    return float(critic_loss.detach())


# ------------------------------------------------------------------------------------------
# Checkpoints (rlbuffers.checkpoint): ckpt/gen-N first, then the buffer commit makes it real
# ------------------------------------------------------------------------------------------
def checkpoints(cfg: Config) -> Checkpoints:
    return Checkpoints(Path(cfg.run_dir) / "ckpt", prefix="gen", keep=cfg.keep_checkpoints)


# ------------------------------------------------------------------------------------------
# Progress: metrics.jsonl and curve.png
# ------------------------------------------------------------------------------------------
def plot_curve(path: Path, history: list[dict[str, Any]], env_id: str) -> None:
    """Learning curve (best / mean fitness, learner return vs env steps) to ``path`` (PNG)."""
    plt = pyplot()
    steps = [h["env_steps"] for h in history]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=80)
    ax.plot(steps, [h["best_fitness"] for h in history], label="best actor (fitness)")
    ax.plot(steps, [h["mean_fitness"] for h in history], label="population mean")
    ax.plot(steps, [h["learner_return"] for h in history], label="TD3 learner (noisy)", alpha=0.7)
    ax.set(xlabel="env steps", ylabel="episode return", title=f"ERL + TD3 on {env_id}")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    save_figure(fig, path)


def progress_line(row: dict[str, Any], cfg: Config) -> str:
    return (f"gen {row['generation']:4d}/{cfg.generations} | best {row['best_fitness']:9.1f} "
            f"mean {row['mean_fitness']:9.1f} | learner {row['learner_return']:9.1f} | "
            f"steps {row['env_steps']:>9,} | buffer {row['buffer_size']:>9,} | "
            f"save {row['save_seconds']:.2f}s {row['save_bytes'] / MIB:.1f}MiB | "
            f"rss {row['rss_bytes'] / MIB:.0f}MiB peak {row['peak_rss_bytes'] / MIB:.0f}MiB | "
            f"{row['gen_seconds']:.1f}s")


# ------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------
def buffer_fields(obs_dim: int, act_dim: int) -> dict[str, FieldSpec]:
    """The buffer's fields: one transition of a continuous-control env."""
    return {"obs": FieldSpec((obs_dim,), "float32"), "action": FieldSpec((act_dim,), "float32"),
            "reward": FieldSpec((), "float32"), "next_obs": FieldSpec((obs_dim,), "float32"),
            "terminated": FieldSpec((), "bool"), "truncated": FieldSpec((), "bool")}


def open_run(cfg: Config, obs_dim: int, act_dim: int) -> tuple[ReplayBuffer, dict[str, Any] | None]:
    """Create the run directory and its buffer, or (``--resume``) reopen the buffer at its last
    commit and load the checkpoint of that generation (None if no generation completed)."""
    run_dir, ckpts = Path(cfg.run_dir), checkpoints(cfg)
    if not cfg.resume:  # atomic: the run directory appears complete or not at all
        def make_buffer(d: Path) -> None:
            (d / "ckpt").mkdir()
            ReplayBuffer.create(d / "buffer", capacity=cfg.buffer_capacity,
                                fields=buffer_fields(obs_dim, act_dim), seed=cfg.seed).close()

        create_run(run_dir, dataclasses.asdict(cfg), make_buffer)
        return ReplayBuffer.open(run_dir / "buffer"), None
    buf = ReplayBuffer.open(run_dir / "buffer", mode="r+")
    gen = int(buf.metadata.get("trainer_generation", 0))
    ckpts.prune(gen)
    ckpt = ckpts.latest(gen)
    if ckpt is None:
        return buf, None
    state = torch.load(ckpt / "state.pt", weights_only=True)
    restore_metrics(run_dir / "metrics.jsonl", state["history"], "generation")
    return buf, state


def run_generations(cfg: Config, env: gym.Env, population: list[Actor], learner: Learner,
                    buf: ReplayBuffer, rng: np.random.Generator, trainer: dict[str, Any],
                    history: list[dict[str, Any]], monitor: MemoryMonitor,
                    pool: Any = None) -> None:
    """The ERL loop (Khadka & Tumer 2018, Algorithm 1), from the generation after
    ``trainer["generation"]`` up to ``cfg.generations``."""
    run_dir = Path(cfg.run_dir)
    for gen in range(trainer["generation"] + 1, cfg.generations + 1):
        t0 = time.perf_counter()
        # 1. Evaluate the population; every transition goes into the shared buffer.
        fitness = np.zeros(cfg.pop_size)
        steps = 0
        if pool is None:
            for i, actor in enumerate(population):
                returns = []
                for _ in range(cfg.episodes_per_actor):
                    ret, rows = rollout(env, actor, episode_seed(cfg, trainer["episodes"]), rng)
                    trainer["episodes"] += 1
                    buf.extend(rows)
                    returns.append(ret)
                    steps += len(rows["reward"])
                fitness[i] = np.mean(returns)
        else:  # the same seeds on rollout workers, added in population order
            all_returns, all_rows = evaluate_population(cfg, pool, population, env, trainer)
            for i, (returns, episodes) in enumerate(zip(all_returns, all_rows, strict=True)):
                for rows in episodes:
                    buf.extend(rows)
                    steps += len(rows["reward"])
                fitness[i] = np.mean(returns)
        # 2. One exploration episode of the learner (uniformly random before learning_starts).
        warm = len(buf) >= cfg.learning_starts
        learner_return, rows = rollout(env, learner.actor if warm else None,
                                       episode_seed(cfg, trainer["episodes"]), rng,
                                       noise_std=cfg.exploration_noise)
        trainer["episodes"] += 1
        buf.extend(rows)
        steps += len(rows["reward"])
        trainer["env_steps"] += steps
        rollout_seconds = time.perf_counter() - t0
        # 3. TD3 gradient steps, sampled from everything all actors have collected.
        n_updates = int(cfg.updates_per_step * steps) if len(buf) >= cfg.learning_starts else 0
        for _ in range(n_updates):
            td3_update(learner, buf.sample(cfg.batch_size), cfg)
        # 4. Evolve; every sync_every generations the learner's actor replaces the weakest.
        best = population[int(np.argmax(fitness))]
        population = evolve(population, fitness, cfg, rng)
        if gen % cfg.sync_every == 0:
            population[-1].load_state_dict(learner.actor.state_dict())
        # 5. Checkpoint, then commit the buffer: the commit makes generation `gen` complete.
        trainer["generation"] = gen
        trainer["wall_seconds"] += time.perf_counter() - t0
        row = {"generation": gen, "env_steps": trainer["env_steps"],
               "best_fitness": float(fitness.max()), "mean_fitness": float(fitness.mean()),
               "learner_return": learner_return, "fitness": fitness.tolist(),
               "td3_updates": learner.updates, "buffer_size": len(buf),
               "wall_seconds": round(trainer["wall_seconds"], 2)}
        history.append(row)
        checkpoints(cfg).write(gen, {
            "state.pt": {"population": [a.state_dict() for a in population],
                         "learner": learner.full_state(), "rng": rng_states(rng),
                         "trainer": trainer, "history": history, "config": dataclasses.asdict(cfg)},
            "best_actor.pt": best.state_dict(),
        })
        report = buf.save(metadata={"trainer_generation": gen, "env_steps": trainer["env_steps"]})
        checkpoints(cfg).prune(gen)
        # 6. Progress: one line, metrics.jsonl, curve.png.
        mem = monitor.check()
        row = {**row, "save_seconds": round(report.seconds, 4), "save_bytes": report.bytes_written,
               "rss_bytes": mem.rss_bytes, "peak_rss_bytes": mem.peak_rss_bytes,
               "available_bytes": mem.available_bytes,
               "rollout_seconds": round(rollout_seconds, 2),
               "gen_seconds": round(time.perf_counter() - t0, 2)}
        with open(run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        plot_curve(run_dir / "curve.png", history, cfg.env)
        print(progress_line(row, cfg), flush=True)


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(cfg.torch_threads)
    monitor = MemoryMonitor(warn_below_available_bytes=cfg.warn_below_available_mib * MIB)
    mem = monitor.check()
    print(f"start: rss {mem.rss_bytes / MIB:.0f}MiB, available {mem.available_bytes / MIB:,.0f}MiB",
          flush=True)

    env = gym.make(cfg.env, max_episode_steps=cfg.max_episode_steps)
    obs_dim, act_dim = env.observation_space.shape[0], env.action_space.shape[0]
    low, high = env.action_space.low, env.action_space.high
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    population = [Actor(obs_dim, act_dim, cfg.hidden, low, high) for _ in range(cfg.pop_size)]
    learner = Learner(obs_dim, act_dim, cfg, low, high)
    trainer = {"generation": 0, "env_steps": 0, "episodes": 0, "wall_seconds": 0.0}
    history: list[dict[str, Any]] = []

    buf, state = open_run(cfg, obs_dim, act_dim)
    if state is not None:
        for actor, sd in zip(population, state["population"], strict=True):
            actor.load_state_dict(sd)
        learner.load_full_state(state["learner"])
        set_rng_states(state["rng"], rng)
        trainer, history = state["trainer"], state["history"]
        print(f"resumed {cfg.run_dir} at generation {trainer['generation']}: "
              f"{trainer['env_steps']:,} env steps, buffer {len(buf):,} transitions", flush=True)
    pool = None
    if cfg.workers > 1:
        from rlbuffers.rollouts import RayPool

        pool = RayPool(cfg.workers, address=cfg.ray_address or None,
                       torch_threads=cfg.torch_threads)
    try:
        run_generations(cfg, env, population, learner, buf, rng, trainer, history, monitor,
                        pool)
    except KeyboardInterrupt:
        sys.exit(f"interrupted; generation {buf.metadata.get('trainer_generation', 0)} is the last "
                 f"complete one: continue with --resume --run-dir {cfg.run_dir}")
    finally:
        buf.close()
        env.close()
        if pool is not None:
            pool.close()

if __name__ == "__main__":
    main()
