"""Evolutionary Reinforcement Learning (ERL) with a TD3 learner, on an rlbuffers replay buffer.

ERL (Khadka & Tumer, "Evolution-Guided Policy Gradient in Reinforcement Learning", NeurIPS
2018): a population of actors is evolved by selection, crossover and mutation on episode
return (fitness); every rollout of every actor feeds one shared replay buffer; a gradient
learner trains off that buffer (TD3 here: Fujimoto, van Hoof & Meger, "Addressing Function
Approximation Error in Actor-Critic Methods", ICML 2018, instead of the paper's DDPG) and its
actor is copied into the population every few generations, replacing the weakest.

Every generation ends with ``Run.commit`` (``trainers.common``): the checkpoint goes to
``ckpt/generation-N`` (temporary directory + fsync + rename), then ``buf.save()`` commits the
buffer with ``metadata={"trainer_generation": N, ...}``. The buffer commit is the commit point
of the whole generation: ``--resume`` (even after ``kill -9``) reads the generation from the
buffer and loads the matching checkpoint, so trainer and buffer always agree.

    python -m trainers.erl --env HalfCheetah-v5 --generations 20 --run-dir runs/erl
    python -m trainers.erl --run-dir runs/erl --resume --generations 40
    python -m trainers.erl --run-dir runs/erl2 --workers 2          # episodes on 2 Ray actors
    rlbuffers inspect runs/erl/buffer

Episodes run as jobs on a rollout pool (``rlbuffers.rollouts``): in this process by default,
on ``--workers`` Ray actors (``--ray-address`` for a cluster); the run is the same on any number
of workers. The actor network and the episode job live in ``trainers/erl/rollout.py``, the
evolution operators in ``evolution.py``, the TD3 learner in ``td3.py``, the flags in
``config.py``.

Writes into ``--run-dir``: ``config.json``, ``buffer/`` (the replay buffer),
``ckpt/generation-N/`` (``state.json``: trainer counters and history; ``population.pt``,
``learner.pt`` (networks, targets, optimizers), ``rng.pt``, ``best_actor.pt``),
``metrics.jsonl`` (one JSON line per generation), ``eval.jsonl`` (the learner's deterministic
evaluations, ``--eval-every``: ``evaluate.py``) and ``curve.png`` (learning curve).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlbuffers import FieldSpec, ReplayBuffer, rollouts
from rlbuffers.memory import MemoryMonitor
from rlbuffers.rollouts.pool import RolloutPool
from rlbuffers.safe_load import load_torch, restoring
from trainers.common import (
    Run,
    check_optimizer,
    check_state,
    check_unit,
    load_rng,
    open_run,
    rng_states,
)
from trainers.config import start
from trainers.curves import Series, plot_curve
from trainers.erl.config import RESUMABLE, Config, check_config
from trainers.erl.evaluate import Evaluation, check_evals, metrics_fields
from trainers.erl.evolution import evolve
from trainers.erl.offline import check_offline, make_mixture, open_offline
from trainers.erl.rollout import Actor, actor_weights, episode_job, make_env
from trainers.erl.td3 import Learner, td3_update
from trainers.phases import Phases
from trainers.summary import finish

log = logging.getLogger("trainers.erl")
MIB = 2**20


def buffer_fields(obs_dim: int, act_dim: int) -> dict[str, FieldSpec]:
    """The buffer's fields: one transition of a continuous-control env."""
    return {"obs": FieldSpec((obs_dim,), "float32"), "action": FieldSpec((act_dim,), "float32"),
            "reward": FieldSpec((), "float32"), "next_obs": FieldSpec((obs_dim,), "float32"),
            "terminated": FieldSpec((), "bool"), "truncated": FieldSpec((), "bool")}


def make_pool(cfg: Config) -> RolloutPool:
    """The rollout pool ``cfg`` asks for (``rlbuffers.rollouts.make_pool``; Ray imported only
    for a Ray pool).

    Raises:
        ValueError: ``rollout_backend`` is not '', 'inprocess' or 'ray'; ``workers`` < 1.
    """
    return rollouts.make_pool(cfg.rollout_backend, cfg.workers, address=cfg.ray_address,
                              torch_threads=1)


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


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def memory_plan(cfg: Config, fields: dict[str, FieldSpec], population: list[Actor],
                learner: Learner) -> dict[str, int]:
    """The run's memory figures (bytes), logged at INFO and put in every metrics row: one
    transition, the buffer at capacity (raw, before compression: it lives on disk), a TD3
    batch, the population, and the learner (networks, targets and Adam's two moments of the
    trained networks)."""
    transition = sum(math.prod(f.shape) * np.dtype(f.dtype).itemsize for f in fields.values())
    trained = module_bytes(learner.actor) + module_bytes(learner.critic)
    plan = {"transition_bytes": transition, "buffer_capacity": cfg.buffer_capacity,
            "buffer_raw_bytes": transition * cfg.buffer_capacity,
            "batch_bytes": transition * cfg.batch_size,
            "population_bytes": sum(module_bytes(a) for a in population),
            "learner_bytes": module_bytes(learner) + 2 * trained}
    log.info("memory plan: buffer %s transitions x %d B = %.1f MiB raw (on disk); TD3 batch "
             "%d x %d B; population %d actors %.2f MiB; learner %.2f MiB (actor, twin critic, "
             "targets, Adam moments); %d rollout worker(s), %d train thread(s)",
             f"{cfg.buffer_capacity:,}", transition, plan["buffer_raw_bytes"] / MIB,
             cfg.batch_size, transition, len(population), plan["population_bytes"] / MIB,
             plan["learner_bytes"] / MIB, cfg.workers, cfg.train_threads)
    return plan


def progress_line(row: dict[str, Any], cfg: Config, seconds: float) -> str:
    """The one-line progress print of a generation (``seconds``: the generation's, commit
    included; the commit's own figures are its log line, ``trainers.common.commit_line``)."""
    return (f"gen {row['generation']:4d}/{cfg.generations} | best {row['best_fitness']:9.1f} "
            f"mean {row['mean_fitness']:9.1f} | learner {row['learner_return']:9.1f} | "
            f"steps {row['env_steps']:>9,} | buffer {row['buffer_size']:>9,} | "
            f"rss {row['rss_bytes'] / MIB:.0f}MiB peak {row['peak_rss_bytes'] / MIB:.0f}MiB | "
            f"{seconds:.1f}s")


def draw_curve(path: Path, history: list[dict[str, Any]], *, env: str) -> None:
    """``curve.png``: the best actor's fitness, the population mean and the learner's return
    against env steps."""
    plot_curve(path, history, x="env_steps", xlabel="env steps", ylabel="episode return",
               title=f"ERL + TD3 on {env}",
               series=[Series("best_fitness", "best actor (fitness)"),
                       Series("mean_fitness", "population mean"),
                       Series("learner_return", "TD3 learner (noisy)"),
                       Series("eval_return_mean", "TD3 learner, no noise (eval mean)")])


def restore(run: Run, fresh: dict[str, Any], population: list[Actor], learner: Learner,
            rng: np.random.Generator) -> dict[str, Any]:
    """Load the run's last complete generation into the population, the learner and the
    RNGs (``run.history`` and ``metrics.jsonl`` too); returns the trainer state (shaped like
    ``fresh``).

    Raises:
        rlbuffers.CorruptCheckpointError: a file is missing, damaged, refused (torch files
            are read with ``weights_only=True``) or does not fit these networks (one line).
    """
    ckpt = run.checkpoint
    assert ckpt is not None
    state = run.load_state()
    template = {k: v for k, v in fresh.items() if k != "evals"}  # absent in older runs
    check_state(state, {"trainer": template}, ckpt / "state.json")
    check_unit(state["trainer"], run, ckpt / "state.json")
    with restoring(ckpt / "population.pt", f"{len(population)} actors' state dicts"):
        for actor, sd in zip(population, load_torch(ckpt / "population.pt"), strict=True):
            actor.load_state_dict(sd)
    with restoring(ckpt / "learner.pt", "the TD3 learner's full state"):
        learner.load_full_state(load_torch(ckpt / "learner.pt"))
        check_optimizer(learner.actor_opt)
        check_optimizer(learner.critic_opt)
        if type(learner.updates) is not int:
            raise TypeError(f"'updates' = {learner.updates!r}")
    load_rng(ckpt / "rng.pt", rng)
    trainer = dict(state["trainer"])
    trainer["evals"] = check_evals(trainer.get("evals"), ckpt / "state.json")
    return trainer


def main(argv: list[str] | None = None) -> None:
    cfg = start(Config, argv, module="trainers.erl", doc=__doc__, resumable=RESUMABLE,
                check=check_config)
    torch.set_num_threads(cfg.train_threads)
    monitor = MemoryMonitor(warn_below_available_bytes=cfg.warn_below_available_mib * MIB)
    mem = monitor.check()
    print(f"memory at start: this process's RSS {mem.rss_bytes / MIB:,.0f} MiB, "
          f"{mem.available_bytes / MIB:,.0f} MiB available to it", flush=True)

    env = make_env(cfg.env, cfg.max_episode_steps)  # its spaces only
    obs_dim, act_dim = env.observation_space.shape[0], env.action_space.shape[0]
    low, high = env.action_space.low, env.action_space.high
    env.close()
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)  # unused by ERL, seeded so that rng.pt is the same run to run
    rng = np.random.default_rng(cfg.seed)
    population = [Actor(obs_dim, act_dim, cfg.hidden, low, high) for _ in range(cfg.pop_size)]
    learner = Learner(obs_dim, act_dim, cfg, low, high)
    trainer: dict[str, Any] = {"generation": 0, "env_steps": 0, "episodes": 0,
                               "wall_seconds": 0.0,
                               "evals": []}  # evaluation rows (trainers/erl/evaluate.py)
    offline_kind = ""
    if cfg.offline_data:  # checked before the run directory is made
        offline_kind = check_offline(cfg.offline_data, obs_dim, act_dim)
        trainer["mixture"] = None  # the mixture's state (rlbuffers.Mixture.state_dict)
    fields = buffer_fields(obs_dim, act_dim)
    curve = functools.partial(draw_curve, env=cfg.env)

    def create(d: Path) -> None:
        ReplayBuffer.create(d / "buffer", capacity=cfg.buffer_capacity, fields=fields,
                            seed=cfg.seed).close()

    with contextlib.ExitStack() as stack:
        pool = make_pool(cfg)  # first: a pool that cannot start leaves no run directory behind
        stack.callback(pool.close)
        run = open_run(cfg, unit="generation", create=create, curve=curve)
        stack.callback(run.close)
        buf = run.buf
        assert buf is not None
        if run.resumed:
            assert run.checkpoint is not None
            trainer = restore(run, trainer, population, learner, rng)
            print(f"resumed {cfg.run_dir} at generation {trainer['generation']}: "
                  f"{trainer['env_steps']:,} env steps, buffer {len(buf):,} transitions",
                  flush=True)
        plan = memory_plan(cfg, fields, population, learner)
        evaluation = stack.enter_context(Evaluation(cfg, run, trainer, learner.actor))
        batches: Any = buf  # what TD3 batches are drawn from: the buffer, or a mixture
        if offline_kind:
            offline = open_offline(cfg.offline_data, offline_kind, cfg.run_dir)
            stack.callback(offline.close)
            batches = make_mixture(offline, buf, cfg.offline_fraction, cfg.seed,
                                   trainer["mixture"])

        # The ERL loop (Khadka & Tumer 2018, Algorithm 1), one generation per iteration.
        try:
            for gen in range(trainer["generation"] + 1, cfg.generations + 1):
                t0 = time.perf_counter()
                figures: dict[str, Any] = {"generation": gen}  # phases say "(generation N)"
                phases = Phases(monitor, figures)
                # 1-2. Evaluate the population, and one exploration episode of the learner
                # (uniformly random before learning_starts), on the rollout workers; every
                # transition goes into the shared buffer, the population's in order, then the
                # learner's.
                with phases("rollout"):
                    fitness, learner_return, steps, nodes = collect(
                        cfg, pool, population, learner, buf, rng, trainer)
                    trainer["env_steps"] += steps
                # 3. TD3 gradient steps, sampled from everything all actors have collected.
                with phases("update"):
                    n_updates = (int(cfg.updates_per_step * steps)
                                 if len(buf) >= cfg.learning_starts else 0)
                    for _ in range(n_updates):
                        td3_update(learner, batches.sample(cfg.batch_size), cfg)
                # 4. Evolve; every sync_every generations the learner's actor replaces the
                # weakest.
                with phases("evolve"):
                    best = population[int(np.argmax(fitness))]
                    population = evolve(population, fitness, cfg, rng)
                    if gen % cfg.sync_every == 0:
                        population[-1].load_state_dict(learner.actor.state_dict())
                # Evaluation: the learner's actor without noise, on its own env (no RNG, no
                # buffer: training is the same without it).
                evaluated = evaluation.after_generation(gen, learner.updates, phases)
                # 5. Commit: checkpoint, then the buffer commit that makes generation `gen`
                # complete; its row goes to metrics.jsonl and the curve.
                trainer["generation"] = gen
                trainer["wall_seconds"] += time.perf_counter() - t0
                if offline_kind:
                    trainer["mixture"] = batches.state_dict()
                mem = monitor.check()
                row = {"generation": gen, "env_steps": trainer["env_steps"],
                       "best_fitness": float(fitness.max()),
                       "mean_fitness": float(fitness.mean()),
                       "learner_return": learner_return, "fitness": fitness.tolist(),
                       "td3_updates": learner.updates, "buffer_size": len(buf),
                       "wall_seconds": round(trainer["wall_seconds"], 2),
                       "rollout_nodes": nodes, **figures, "rss_bytes": mem.rss_bytes,
                       "peak_rss_bytes": mem.peak_rss_bytes,
                       "available_bytes": mem.available_bytes, **plan,
                       **metrics_fields(evaluated)}
                with phases("commit", timed=False):  # its seconds: the commit's own line
                    run.commit(gen, row, state={"trainer": dict(trainer)},
                               torch_files={"population.pt": [a.state_dict() for a in population],
                                            "learner.pt": learner.full_state(),
                                            "rng.pt": rng_states(rng),
                                            "best_actor.pt": best.state_dict()},
                               metadata={"env_steps": trainer["env_steps"]})
                    evaluation.save()
                # 6. Progress: the per-phase line (INFO) and the one-line summary.
                phases.log("generation", gen)
                print(progress_line(row, cfg, time.perf_counter() - t0), flush=True)
            finish(run, ["best_fitness", "mean_fitness", "learner_return", "env_steps"])
        except KeyboardInterrupt:
            run.exit_interrupted()
