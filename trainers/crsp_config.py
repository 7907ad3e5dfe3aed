"""Settings of ``trainers/crsp.py``: every tunable of the trainer and of its memory
optimisations in one dataclass (``python -m trainers.crsp --help`` lists them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Config:
    run_dir: str = "runs/crsp"
    """Directory for the rollout buffer, checkpoints, seed prompts, metrics.jsonl, curve.png."""
    model: str = ""
    """Local transformers causal-LM directory with a tokenizer ('': SmolLM2-135M-Instruct)."""
    task: str = "gsm_symbolic"
    """reasoning-gym task of the seed problems."""
    task_config: str = "{}"
    """JSON keyword arguments of the task's reasoning-gym dataset."""
    train_size: int = 1000
    """Seed problems generated from the task (seed --seed)."""
    steps: int = 10
    """Total training steps (a resumed run may raise it)."""
    seeds_per_step: int = 2
    """Seed problems per step; the proposer writes one new problem from each."""
    solver_samples: int = 4
    """Solver attempts per problem (seed and proposed): the solvability band needs several."""
    critiques_per_problem: int = 2
    """Solver attempts per problem that the critic judges (the first ones)."""
    max_prompt_tokens: int = 320
    """Seed prompts longer than this are left out of the order; longer role prompts are cut
    from the left (the count is logged as truncated prompts)."""
    proposer_tokens: int = 96
    """Completion limit of the proposer."""
    solver_tokens: int = 96
    """Completion limit of the solver."""
    critic_tokens: int = 48
    """Completion limit of the critic."""
    length_target: int = 64
    """Target completion length of the length reward (tokens)."""
    temperature: float = 1.0
    """Sampling temperature (log-probs use the same)."""
    top_p: float = 1.0
    """Nucleus sampling (1: off)."""
    lora_rank: int = 16
    """Rank of each role's LoRA adapter over the one shared base."""
    lora_alpha: int = 32
    """LoRA alpha."""
    lr: float = 1e-4
    """AdamW learning rate (one optimizer per role)."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm, per role (0: off)."""
    beta: float = 0.04
    """KL coefficient to the reference policy (the base with adapters disabled)."""
    epsilon: float = 0.2
    """Trust region: importance ratio clipped to [1 - epsilon, 1 + epsilon-high]."""
    epsilon_high: float = 0.0
    """Upper end of the trust region (0: same as --epsilon)."""
    alpha0: float = 0.5
    """Weight of the intrinsic rewards (creativity, length) at step 0."""
    alpha_decay: float = 0.95
    """alpha(step) = alpha0 * alpha_decay ** step."""
    sketch_capacity: int = 1024
    """Problems the novelty sketch remembers (MinHash signatures in a ring)."""
    sketch_perm: int = 64
    """MinHash permutations per signature."""
    memory_opt: bool = True
    """False (--no-memory-opt): the original path, the comparison baseline: a full copy of the
    model as reference, full [B, T, V] logits, all roles' graphs at once, one full batch,
    every sequence padded to the fixed length."""
    pack_tokens: int = 512
    """Tokens per packed row (shared-prefix packing); >= longest prompt + completion."""
    micro_batch_tokens: int = 512
    """Tokens per micro-batch (whole rows); halved by AdaptiveMicroBatch under pressure.
    0: planned at start from the measured cost of 1 and 2 rows and --memory-budget (the
    most rows that fit; one row with --memory-budget none)."""
    chunk_tokens: int = 512
    """Tokens per chunk of the LM head in token_logprobs."""
    memory_budget: str = "auto"
    """Extra bytes a generation batch or micro-batch may use: integer, 'auto' or 'none'."""
    generation_batch: int = 64
    """Most sequences per generate call (0: no cap)."""
    gradient_checkpointing: str = "off"
    """Activation checkpointing of decoder layers: 'off', 'all', or 'selective' (the layers
    --checkpoint-layers names, e.g. those a memory profile shows dominate)."""
    checkpoint_layers: str = "auto"
    """With 'selective': comma-separated decoder layer indices, or 'auto': the fewest layers
    that a measured profile of the bytes each layer saves for backward (one row of
    --micro-batch-tokens) shows bring them to --activation-fraction."""
    activation_fraction: float = 0.5
    """With --checkpoint-layers auto: the fraction of the profiled saved-for-backward bytes
    the checkpointed model may keep (the largest layers are checkpointed first)."""
    seed_shuffle_buffer: int = 64
    """Seed problems shuffled together by the streaming reader (``rlbuffers.stream``: an
    ``IndexSource`` permuting the token store per pass, then a ``BlockShuffle`` of this many
    samples; resumable from a few integers). 0 or 1: the per-pass permutation only."""
    prompt_cache_bytes: int = 16 << 20
    """Byte bound of the LRU cache of tokenized role prompts."""
    threads: int = 0
    """torch threads (0: all CPUs)."""
    tensor_summary: bool = False
    """After every step, print the live tensors by owner (parameter, gradient, optimizer
    state, other), dtype and device and store them in metrics.jsonl as ``tensors``; without
    it, ``kill -USR1 PID`` asks for one after the current step."""
    buffer_capacity: int = 4096
    """Utterances the rollout buffer keeps (all roles)."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept."""
    seed: int = 0
    """Seed of the data, the sampling and the adapters' initialisation."""
    resume: bool = False
    """Continue the run in --run-dir from its last complete step."""

    # Names the shared helpers (generation, packing) read.
    @property
    def max_completion_tokens(self) -> int:
        return max(self.proposer_tokens, self.solver_tokens, self.critic_tokens)

    @property
    def loss_norm(self) -> str:
        return "sequence"

    @property
    def prompts_per_step(self) -> int:
        return self.seeds_per_step


#: Settings a resumed run may change; the rest must match the run's config.json.
RESUMABLE = {"run_dir", "resume", "steps", "threads", "memory_budget", "generation_batch",
             "tensor_summary"}


def check_config(c: Config) -> None:
    """Raise ValueError naming the first setting out of range."""
    longest = c.max_prompt_tokens + c.max_completion_tokens
    rules = {"steps": (c.steps >= 1, ">= 1"),
             "seeds_per_step": (c.seeds_per_step >= 1, ">= 1"),
             "seed_shuffle_buffer": (c.seed_shuffle_buffer >= 0, ">= 0"),
             "solver_samples": (c.solver_samples >= 2, ">= 2 (the solvability band)"),
             "critiques_per_problem": (0 <= c.critiques_per_problem <= c.solver_samples,
                                       "in [0, --solver-samples]"),
             "lora_rank": (c.lora_rank >= 1, ">= 1 (roles are adapters)"),
             "temperature": (c.temperature > 0, "> 0"), "top_p": (0 < c.top_p <= 1, "in (0, 1]"),
             "beta": (c.beta >= 0, ">= 0"), "epsilon": (c.epsilon > 0, "> 0"),
             "alpha_decay": (0 < c.alpha_decay <= 1, "in (0, 1]"),
             "micro_batch_tokens": (c.micro_batch_tokens >= 0, ">= 0 (0: planned)"),
             "pack_tokens": (c.pack_tokens >= longest,
                             f">= --max-prompt-tokens + the longest completion ({longest})"),
             "gradient_checkpointing": (c.gradient_checkpointing in ("off", "all", "selective"),
                                        "'off', 'all' or 'selective'"),
             "checkpoint_layers": (c.checkpoint_layers == "auto" or all(
                 x.strip().isdigit() for x in c.checkpoint_layers.split(",")),
                 "'auto' or comma-separated layer indices"),
             "activation_fraction": (0 <= c.activation_fraction <= 1, "in [0, 1]"),
             "memory_budget": (c.memory_budget in ("auto", "none") or c.memory_budget.isdigit(),
                               "an integer (bytes), 'auto' or 'none'")}
    for name, (ok, expected) in rules.items():
        if not ok:
            raise ValueError(f"--{name.replace('_', '-')}: expected {expected}, got "
                             f"{getattr(c, name)!r}")
