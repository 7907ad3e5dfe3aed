"""The ERL trainer's settings: one ``--flag`` per field (``python -m trainers.erl --help``),
saved as ``run_dir/config.json``; :data:`RESUMABLE` names those a ``--resume`` may change."""

from __future__ import annotations

from dataclasses import dataclass

from trainers.config import (
    MAX_THREADS,
    RAY_ADDRESS,
    RUN_RESUMABLE,
    RunConfig,
    check_rules,
    check_run,
)

#: Values of ``--rollout-backend`` ('': chosen from ``--workers`` and ``--ray-address``).
BACKENDS = ("", "inprocess", "ray")


@dataclass
class Config(RunConfig):
    """Everything an ERL run depends on; saved as ``run_dir/config.json``."""

    run_dir: str = "runs/erl"
    """Directory of the run: config.json, buffer/, ckpt/, metrics.jsonl, curve.png."""
    env: str = "HalfCheetah-v5"
    """Gymnasium environment id with Box observations and Box actions."""
    generations: int = 100
    """Generation to stop after (counted from the start of the run, also when resuming)."""
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
    warn_below_available_mib: int = 1024
    """Log a warning when available memory falls below this many MiB."""
    train_threads: int = 1
    """torch intra-op threads of the TD3 updates (1 is fastest on 2 cores with an env beside
    it)."""
    workers: int = 1
    """Rollout workers running the population's and the learner's episodes (1: in this
    process; more: Ray actors, one torch thread each). The run is the same for any number."""
    ray_address: str = ""
    """Ray cluster for the workers ('auto' on a machine of a cluster started with 'ray start';
    '': a local Ray instance of --workers CPUs, started when more than 1 worker is asked)."""
    rollout_backend: str = ""
    """'inprocess' or 'ray' ('': Ray when --workers > 1 or --ray-address is given)."""
    offline_data: str = ""
    """Offline data mixed into every TD3 batch: an rlbuffers buffer directory (read-only) or a
    local Minari dataset id or directory (converted once into run_dir/offline; the offline
    extra); '': none (trainers/erl/offline.py)."""
    offline_fraction: float = 0.5
    """Share of each TD3 batch drawn from --offline-data (0.5: RLPD's symmetric sampling)."""
    eval_every: int = 5
    """Evaluate the learner (TD3's actor, no exploration noise, on a separately seeded env)
    before the first generation and after every this many; 0: never (trainers/erl/evaluate.py;
    rows in run_dir/eval.jsonl). Training is the same with or without it."""
    eval_episodes: int = 10
    """Episodes per evaluation (the same reset seeds at every evaluation)."""


#: Settings a resumed run may change; the rest must match the run's config.json.
RESUMABLE = RUN_RESUMABLE | {"generations", "warn_below_available_mib", "train_threads",
                             "workers", "ray_address", "rollout_backend"}


def check_config(c: Config) -> None:
    """Validate ``c``.

    Raises:
        ValueError: ``--flag: expected ..., got ...`` for the first field out of range.
    """
    check_run(c)

    def prob(x: float) -> tuple[bool, str]:
        return 0 <= x <= 1, "in [0, 1]"

    check_rules(c, {
        "env": _registered(c.env),
        "ray_address": (RAY_ADDRESS.fullmatch(c.ray_address) is not None,
                        "'', 'auto', 'local' or [ray://]host:port"),
        "generations": (c.generations >= 0, ">= 0"),
        "max_episode_steps": (c.max_episode_steps >= 1, ">= 1"),
        "pop_size": (c.pop_size >= 1, ">= 1"),
        "episodes_per_actor": (c.episodes_per_actor >= 1, ">= 1"),
        "elite_fraction": prob(c.elite_fraction),
        "tournament_size": (c.tournament_size >= 1, ">= 1"),
        "crossover_prob": prob(c.crossover_prob), "mutation_prob": prob(c.mutation_prob),
        "mutation_frac": prob(c.mutation_frac),
        "mutation_strength": (c.mutation_strength >= 0, ">= 0"),
        "super_mutation_prob": prob(c.super_mutation_prob), "reset_prob": prob(c.reset_prob),
        "sync_every": (c.sync_every >= 1, ">= 1"), "hidden": (c.hidden >= 1, ">= 1"),
        "buffer_capacity": (c.buffer_capacity >= 1, ">= 1"),
        "learning_starts": (c.learning_starts >= 0, ">= 0"),
        "updates_per_step": (c.updates_per_step >= 0, ">= 0"),
        "batch_size": (c.batch_size >= 1, ">= 1"), "gamma": prob(c.gamma), "tau": prob(c.tau),
        "actor_lr": (c.actor_lr > 0, "> 0"), "critic_lr": (c.critic_lr > 0, "> 0"),
        "policy_noise": (c.policy_noise >= 0, ">= 0"), "noise_clip": (c.noise_clip >= 0, ">= 0"),
        "policy_delay": (c.policy_delay >= 1, ">= 1"),
        "exploration_noise": (c.exploration_noise >= 0, ">= 0"),
        "warn_below_available_mib": (c.warn_below_available_mib >= 0, ">= 0"),
        "train_threads": (1 <= c.train_threads <= MAX_THREADS, f"in [1, {MAX_THREADS}]"),
        "workers": (c.workers >= 1, ">= 1"),
        "rollout_backend": (c.rollout_backend in BACKENDS, "'', 'inprocess' or 'ray'"),
        "offline_fraction": prob(c.offline_fraction),
        "eval_every": (c.eval_every >= 0, ">= 0"),
        "eval_episodes": (c.eval_episodes >= 1, ">= 1"),
    })


def _registered(env_id: str) -> tuple[bool, str]:
    """Whether ``env_id`` names a registered Gymnasium environment, and what is expected. A
    ``module:`` prefix (which makes Gymnasium import that module) is refused: on ``--resume``
    the id comes from the run's ``config.json``, which must not choose code to import."""
    import gymnasium as gym

    expected = "a registered Gymnasium environment id such as HalfCheetah-v5"
    if ":" in env_id:
        return False, expected + " (no 'module:' prefix: nothing is imported for it)"
    try:
        gym.spec(env_id)
    except gym.error.Error as e:
        return False, f"{expected} ({e})"
    return True, expected
