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
    python -m trainers.erl --run-dir runs/erl2 --workers 2          # episodes on 2 Ray actors
    rlbuffers inspect runs/erl/buffer

Episodes run as jobs on a rollout pool (``rlbuffers.rollouts``): in this process by default,
on ``--workers`` Ray actors (``--ray-address`` for a cluster); the run is the same on any number
of workers. The actor network and the episode job live in ``trainers/erl_rollout.py``.

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
from collections import Counter
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
from rlbuffers.rollouts.inprocess import InProcessPool
from rlbuffers.rollouts.pool import RolloutPool
from trainers import common
from trainers.common import (
    pyplot,
    restore_metrics,
    rng_states,
    save_figure,
    set_rng_states,
)
from trainers.erl_rollout import Actor, actor_weights, episode_job

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
    """Rollout workers running the population's and the learner's episodes (1: in this
    process; more: Ray actors, one torch thread each). The run is the same for any number."""
    ray_address: str = ""
    """Ray cluster for the workers ('auto' on a machine of a cluster started with 'ray start';
    '': a local Ray instance of --workers CPUs, started when more than 1 worker is asked)."""
    rollout_backend: str = ""
    """'inprocess' or 'ray' ('': Ray when --workers > 1 or --ray-address is given)."""


#: Settings a resumed run may change; the rest must match the run's config.json.
RESUMABLE = {"run_dir", "resume", "generations", "warn_below_available_mib", "torch_threads",
             "workers", "ray_address", "rollout_backend"}


def parse_config(argv: list[str] | None = None) -> Config:
    """Build the Config from command-line flags (one ``--flag`` per field); on ``--resume``
    start from ``run_dir/config.json`` and apply only the flags in RESUMABLE."""
    return common.parse_config(Config, argv, prog="python -m trainers.erl",
                               description=__doc__.split("\n\n")[0], resumable=RESUMABLE)


# ------------------------------------------------------------------------------------------
# Networks
# ------------------------------------------------------------------------------------------
# The actor (obs -> action in the env's box) lives in trainers/erl_rollout.py, with the episode
# job that rollout workers import; here: the learner's critic.
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
# Rollouts: episodes as jobs on a rollout pool, their transitions into the buffer
# ------------------------------------------------------------------------------------------
def episode_seed(cfg: Config, episode: int) -> int:
    """Env reset seed of the run's ``episode``-th episode (so a resumed run replays exactly)."""
    return int(np.random.SeedSequence([cfg.seed, episode]).generate_state(1)[0])


def learner_warm(cfg: Config, buffer_size: int, population_episodes: int) -> bool | None:
    """Whether the learner's episode of this generation uses its actor (True) or random
    actions (False): it does once the buffer, with the population's transitions of this
    generation, holds ``learning_starts``. None: only those transitions can tell."""
    if buffer_size >= cfg.learning_starts:
        return True
    if buffer_size + population_episodes * cfg.max_episode_steps < cfg.learning_starts:
        return False
    return None


def collect(cfg: Config, pool: RolloutPool, population: list[Actor], learner: Learner,
            buf: ReplayBuffer, rng: np.random.Generator, trainer: dict[str, Any]
            ) -> tuple[np.ndarray, float, int, dict[str, int]]:
    """Steps 1-2 of a generation on the rollout pool: every actor's ``episodes_per_actor``
    noise-free episodes and the learner's exploration episode run as jobs (weights shared once);
    the transitions go into ``buf`` in population order, then the learner's.

    Every episode keeps the env seed of the sequential run (``episode_seed`` of its number) and
    the learner's episode draws its noise from ``rng``'s stream (its state travels with the job
    and comes back), so results do not depend on the number of workers. The learner's job is
    submitted with the population's unless whether it acts or explores at random depends on how
    many transitions the population's episodes bring.

    Returns (fitness float64[pop_size], learner's return, env steps, episodes run per node).
    """
    e, first = cfg.episodes_per_actor, trainer["episodes"]
    spec = {"env": cfg.env, "max_episode_steps": cfg.max_episode_steps, "hidden": cfg.hidden}
    pool.set_weights({"population": [actor_weights(a) for a in population],
                      "learner": actor_weights(learner.actor)})
    ids = [pool.submit(episode_job, spec, episode_seed(cfg, first + i * e + k), i)
           for i in range(len(population)) for k in range(e)]
    trainer["episodes"] += len(ids) + 1

    def learner_job(warm: bool) -> int:
        return pool.submit(episode_job, spec, episode_seed(cfg, first + len(ids)),
                           -1 if warm else None, rng.bit_generator.state, cfg.exploration_noise)

    warm = learner_warm(cfg, len(buf), len(ids))
    learner_id = None if warm is None else learner_job(warm)
    results = pool.results(ids)
    for r in results:
        buf.extend(r.data["rows"])
    if learner_id is None:
        learner_id = learner_job(len(buf) >= cfg.learning_starts)
    mine = pool.results([learner_id])[0]
    rng.bit_generator.state = mine.data["rng_state"]
    buf.extend(mine.data["rows"])
    results.append(mine)
    fitness = np.array([r.data["return"] for r in results[:-1]]).reshape(-1, e).mean(axis=1)
    steps = sum(len(r.data["rows"]["reward"]) for r in results)
    return fitness, mine.data["return"], steps, dict(Counter(r.node for r in results))


def make_pool(cfg: Config) -> RolloutPool:
    """The rollout pool ``cfg`` asks for (Ray imported only for a Ray pool).

    Raises:
        ValueError: ``rollout_backend`` is not '', 'inprocess' or 'ray'; ``workers`` < 1.
    """
    backend = cfg.rollout_backend or ("ray" if cfg.workers > 1 or cfg.ray_address
                                      else "inprocess")
    if backend == "inprocess":
        return InProcessPool(cfg.workers)
    if backend == "ray":
        from rlbuffers.rollouts import RayPool

        return RayPool(cfg.workers, address=cfg.ray_address or None, torch_threads=1)
    raise ValueError(f"rollout_backend: expected '', 'inprocess' or 'ray', got {backend!r}")


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


def run_generations(cfg: Config, pool: RolloutPool, population: list[Actor], learner: Learner,
                    buf: ReplayBuffer, rng: np.random.Generator, trainer: dict[str, Any],
                    history: list[dict[str, Any]], monitor: MemoryMonitor) -> None:
    """The ERL loop (Khadka & Tumer 2018, Algorithm 1), from the generation after
    ``trainer["generation"]`` up to ``cfg.generations``; episodes run on ``pool``."""
    run_dir = Path(cfg.run_dir)
    for gen in range(trainer["generation"] + 1, cfg.generations + 1):
        t0 = time.perf_counter()
        # 1-2. Evaluate the population, and one exploration episode of the learner (uniformly
        # random before learning_starts), on the rollout workers; every transition goes into
        # the shared buffer, the population's in order, then the learner's.
        fitness, learner_return, steps, nodes = collect(cfg, pool, population, learner, buf,
                                                         rng, trainer)
        trainer["env_steps"] += steps
        rollout_seconds = time.perf_counter() - t0
        # 3. TD3 gradient steps, sampled from everything all actors have collected.
        n_updates = int(cfg.updates_per_step * steps) if len(buf) >= cfg.learning_starts else 0
        for _ in range(n_updates):
            td3_update(learner, buf.sample(cfg.batch_size), cfg)
        update_seconds = time.perf_counter() - t0 - rollout_seconds
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
               "rollout_seconds": round(rollout_seconds, 3),
               "update_seconds": round(update_seconds, 3), "rollout_nodes": nodes,
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

    env = gym.make(cfg.env, max_episode_steps=cfg.max_episode_steps)  # its spaces only
    obs_dim, act_dim = env.observation_space.shape[0], env.action_space.shape[0]
    low, high = env.action_space.low, env.action_space.high
    env.close()
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    population = [Actor(obs_dim, act_dim, cfg.hidden, low, high) for _ in range(cfg.pop_size)]
    learner = Learner(obs_dim, act_dim, cfg, low, high)
    trainer = {"generation": 0, "env_steps": 0, "episodes": 0, "wall_seconds": 0.0}
    history: list[dict[str, Any]] = []

    pool = make_pool(cfg)  # first: a pool that cannot start leaves no run directory behind
    try:
        buf, state = open_run(cfg, obs_dim, act_dim)
        if state is not None:
            for actor, sd in zip(population, state["population"], strict=True):
                actor.load_state_dict(sd)
            learner.load_full_state(state["learner"])
            set_rng_states(state["rng"], rng)
            trainer, history = state["trainer"], state["history"]
            print(f"resumed {cfg.run_dir} at generation {trainer['generation']}: "
                  f"{trainer['env_steps']:,} env steps, buffer {len(buf):,} transitions",
                  flush=True)
        try:
            run_generations(cfg, pool, population, learner, buf, rng, trainer, history, monitor)
        except KeyboardInterrupt:
            sys.exit(f"interrupted; generation {buf.metadata.get('trainer_generation', 0)} is "
                     f"the last complete one: continue with --resume --run-dir {cfg.run_dir}")
        finally:
            buf.close()
    finally:
        pool.close()


if __name__ == "__main__":
    main()
