"""Settings of the CRSP trainer: the LLM trainers' shared fields (``LLMConfig``) plus CRSP's
own (``python -m trainers.crsp --help`` lists them all)."""

from __future__ import annotations

from dataclasses import dataclass

from trainers.config import check_rules
from trainers.crsp.judging import CRITIC_BATCHES
from trainers.crsp.rewards import CLASS_WEIGHTS
from trainers.crsp.verdict import MODES
from trainers.llm.config import LLM_RESUMABLE, LLMConfig, check_dtype, check_llm


@dataclass
class Config(LLMConfig):
    """CRSP's settings (the base's fields, then these)."""

    run_dir: str = "runs/crsp"
    """Directory for the rollout buffer, checkpoints, seed prompts, metrics.jsonl, curve.png."""
    train_size: int = 1000
    """Seed problems generated from the task (seed --seed)."""
    steps: int = 10
    """Total training steps (a resumed run may raise it)."""
    seeds_per_step: int = 2
    """Seed problems per step; the proposer writes ``--proposer-samples`` new problems from
    each."""
    proposer_samples: int = 4
    """Proposals per seed problem: a group, whose rewards give group-relative advantages
    (1: no group, running normalisation instead)."""
    solver_samples: int = 8
    """Solver attempts per problem (seed and proposed): a group, and the solvability band
    needs several. 8: a group of equal rewards (no signal) is rarer than with 4 (with the
    solver right on a fraction p of attempts, ``p**K + (1 - p)**K`` of its correctness
    groups are flat: 0.69 at K = 4, 0.47 at K = 8 for p = 0.09)."""
    critiques_per_problem: int = 1
    """Solver attempts per problem that the critic judges (with --critic-batch first: the
    first ones; balanced: ``ceil(this * problems / 2)`` per class)."""
    proposer_reward: str = "learnability"
    """The proposer's extrinsic reward: 'learnability' (``1 - |2p - 1|`` of the solver's
    success rate p on a proposal whose stated answer the verifier confirms, 0 for any other:
    ``trainers/crsp/verify.py``; the solver attempts verified proposals only, scored against
    the verified answer) or 'band' (runs before issue 49: 1 when the solver's rate of
    agreement with the proposal's own stated answer is strictly between 0 and 1, the solver
    attempting every well-formed proposal, rewarded half by that agreement, half by the
    critic's verdicts). A run resumed from a config.json without this setting keeps 'band'."""
    proposer_gate: str = "solvable"
    """Which proposals earn any reward at all: 'solvable' (only a proposal whose stated
    answer the verifier confirms and that the solver reaches at least once earns its format,
    length, creativity and extrinsic terms; every other proposal, made up, unverifiable,
    malformed or never solved, earns exactly 0) or 'none' (every term for every proposal:
    runs before this setting, which a resumed run whose config.json lacks it keeps). Why:
    with 'none' a well-formed, novel proposal with a made-up answer earned
    ``--format-weight`` plus its creativity, about as much as a verified one, and seeds 2
    and 3 of docs/crsp.md drifted to such proposals after step 10 (0 verified in each later
    window of 40 proposals)."""
    proposer_reference: str = "warmup"
    """The proposer's reference policy (its KL term, ``--beta``): 'warmup' (its adapter as the
    format warm-up left it, ``DIR/warmup/adapters.safetensors``; the base model when the run
    has no warm-up, whose adapters start at zero) or 'base' (adapters off: runs before this
    setting, which a resumed run whose config.json lacks it keeps). Why: the reference of RL
    after supervised fine-tuning is the fine-tuned policy (Ouyang et al. 2022, "Training
    language models to follow instructions with human feedback", Sec. 3.5, Eq. 2: the KL to
    the SFT model); with 'base' the KL pulled the warmed-up proposer back to the base model,
    which writes no verifiable problem. The solver (no warm-up) and the critic keep 'base'."""
    critic_batch: str = "balanced"
    """Which attempts the critic judges (``trainers/crsp/judging.py``): 'balanced' (equal
    numbers of correct and incorrect attempts with ground truth per step, a class short
    topped up from earlier steps' attempts) or 'first' (the first --critiques-per-problem
    attempts of every problem; runs before issue 49, and what a resumed run whose
    config.json lacks this setting keeps)."""
    critic_reservoir: int = 64
    """Earlier attempts kept per class to top up a balanced critic batch (0: none)."""
    critic_samples: int = 4
    """Verdicts (each with its reason) per judged attempt: a group (1: running
    normalisation instead)."""
    verdict_loss: str = "likelihood"
    """How the critic's verdict is trained (``trainers/crsp/verdict.py``): 'likelihood' (the
    class-balanced log-likelihood of the verifier's label over both verdict continuations),
    'expected' (the exact gradient of the expected balanced reward over both) or 'sampled'
    (the sampled verdict's policy gradient only)."""
    verdict_coef: float = 1.0
    """Weight of the verdict term (not used with --verdict-loss sampled)."""
    critic_class_weights: str = "step"
    """Where the class frequency of the critic's balanced weights ``w_y = 1 / (2 freq(y))``
    comes from: 'step' (the step's judged attempts only: a step that judged one class gets
    no balance), 'window' (a decayed window of the last ``--critic-class-window`` judged
    attempts, across steps: ``rewards.ClassWindow``) or 'running' (every attempt judged so
    far: lags behind a solver that improves). All add-one smoothed. 'step' stays the default:
    its 44-step run's critic learned to rank held-out attempts (AUC 0.46 -> 0.67), the 38-step
    run with 'window' did not (0.42 -> 0.53, interval over 0.5; docs/crsp.md)."""
    critic_class_window: float = 256.0
    """Judged attempts in the window of --critic-class-weights window (>= 1)."""
    warmup_steps: int = 0
    """Supervised format warm-up steps per role (proposer, critic) before the first step of a
    new run (``trainers/crsp/warmup.py``; examples through ``rlbuffers.stream``); 0: off."""
    warmup_batch: int = 4
    """Examples per warm-up step."""
    num_iterations: int = 1
    """Updates of each role per step on the same batch (PPO epochs): from the second on, the
    importance ratio against the stored behaviour log-probs differs from 1 and clipping acts.
    > 1 needs --memory-opt."""
    max_prompt_tokens: int = 320
    """Seed prompts longer than this are left out of the order; longer role prompts are cut
    from the left (the count is logged as truncated prompts)."""
    proposer_tokens: int = 96
    """Completion limit of the proposer."""
    solver_tokens: int = 96
    """Completion limit of the solver."""
    critic_tokens: int = 32
    """Completion limit of the critic (its verdict, then the reason)."""
    proposer_length_target: int = 48
    """Target length of the proposer's length reward (tokens, <= --proposer-tokens)."""
    solver_length_target: int = 40
    """Target length of the solver's length reward (tokens, <= --solver-tokens)."""
    critic_length_target: int = 16
    """Target length of the critic's length reward (tokens, <= --critic-tokens)."""
    format_weight: float = 0.5
    """Weight of the format reward (partial credit per part of each role's format); it does
    not decay."""
    alpha0: float = 0.5
    """Weight of the intrinsic rewards (creativity, length) at step 0."""
    alpha_decay: float = 0.95
    """alpha(step) = alpha0 * alpha_decay ** step."""
    sketch_capacity: int = 1024
    """Problems the novelty sketch remembers (MinHash signatures in a ring)."""
    sketch_perm: int = 64
    """MinHash permutations per signature."""
    generate_dtype: str = "float32"
    """Weights' dtype while generating: 'float32', 'bfloat16' or 'float16'."""
    train_dtype: str = "float32"
    """Autocast dtype of the update's forward (log-probs): 'float32', 'bfloat16' or
    'float16' (the naive path ignores it)."""
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
    seed_shuffle_buffer: int = 64
    """Seed problems shuffled together by the streaming reader (``rlbuffers.stream``: an
    ``IndexSource`` permuting the token store per pass, then a ``BlockShuffle`` of this many
    samples; resumable from a few integers). 0 or 1: the per-pass permutation only."""
    prompt_cache_bytes: int = 16 << 20
    """Byte bound of the LRU cache of tokenized role prompts."""
    tensor_summary: bool = False
    """After every step, log the live tensors by owner (parameter, gradient, optimizer
    state, other), dtype and device and store them in metrics.jsonl as ``tensors``; without
    it, ``kill -USR1 PID`` asks for one after the current step."""
    buffer_capacity: int = 4096
    """Utterances the rollout buffer keeps (all roles)."""


def longest_completion(c: Config) -> int:
    """The longest completion limit of the three roles (tokens): what generation sizes its
    batches for and what the naive path pads to (with ``max_prompt_tokens``)."""
    return max(c.proposer_tokens, c.solver_tokens, c.critic_tokens)


#: ``--proposer-reward`` choices.
PROPOSER_REWARDS = ("learnability", "band")

#: ``--proposer-gate`` choices.
PROPOSER_GATES = ("solvable", "none")

#: ``--proposer-reference`` choices.
PROPOSER_REFERENCES = ("warmup", "base")

#: Settings added by issue 49, with the value a run created before them had: a resumed run
#: whose config.json lacks one keeps that behaviour (``legacy_settings``).
LEGACY = {"proposer_reward": "band", "critic_batch": "first", "proposer_gate": "none",
          "proposer_reference": "base"}


def legacy_settings(c: Config, saved: dict[str, object]) -> list[str]:
    """On ``--resume``, set each :data:`LEGACY` setting missing from the run's saved
    config (``saved``: its JSON object) to the behaviour the run was created with. Returns
    the settings changed (for the log)."""
    changed = []
    for name, old in LEGACY.items():
        if name not in saved and getattr(c, name) != old:
            setattr(c, name, old)
            changed.append(f"--{name.replace('_', '-')} {old}")
    return changed


#: Settings a resumed run may change; the rest must match the run's config.json.
RESUMABLE = LLM_RESUMABLE | {"steps", "tensor_summary"}


def length_target(c: Config, role: str) -> int:
    """``role``'s target length of the length reward (tokens, within its own cap)."""
    return {"proposer": c.proposer_length_target, "solver": c.solver_length_target,
            "critic": c.critic_length_target}[role]


def group_size(c: Config, role: str) -> int:
    """Completions per prompt of ``role`` (its group for group-relative advantages)."""
    return {"proposer": c.proposer_samples, "solver": c.solver_samples,
            "critic": c.critic_samples}[role]


def check_config(c: Config) -> None:
    """Raise ValueError naming the first setting out of range (the base's, then CRSP's)."""
    check_llm(c)
    check_dtype(c, "generate_dtype")
    check_dtype(c, "train_dtype")
    longest = c.max_prompt_tokens + longest_completion(c)
    check_rules(c, {
        "steps": (c.steps >= 1, ">= 1"),
        "max_prompt_tokens": (c.max_prompt_tokens >= 1, ">= 1"),
        "seeds_per_step": (c.seeds_per_step >= 1, ">= 1"),
        "seed_shuffle_buffer": (0 <= c.seed_shuffle_buffer <= 2**20, "in [0, 2**20]"),
        "solver_samples": (c.solver_samples >= 2, ">= 2 (the solvability band)"),
        "critiques_per_problem": (0 <= c.critiques_per_problem <= c.solver_samples,
                                  "in [0, --solver-samples]"),
        "proposer_samples": (c.proposer_samples >= 1, ">= 1"),
        "critic_samples": (c.critic_samples >= 1, ">= 1"),
        "warmup_steps": (c.warmup_steps >= 0 and c.warmup_steps * c.warmup_batch < c.train_size,
                         ">= 0, and --warmup-steps x --warmup-batch < --train-size (each "
                         "example is a training problem)"),
        "warmup_batch": (c.warmup_batch >= 1, ">= 1"),
        "num_iterations": (c.num_iterations >= 1 and (c.memory_opt or c.num_iterations == 1),
                           ">= 1 (> 1 only with --memory-opt)"),
        "proposer_length_target": (1 <= c.proposer_length_target <= c.proposer_tokens,
                                   f"in [1, --proposer-tokens={c.proposer_tokens}]"),
        "solver_length_target": (1 <= c.solver_length_target <= c.solver_tokens,
                                 f"in [1, --solver-tokens={c.solver_tokens}]"),
        "critic_length_target": (1 <= c.critic_length_target <= c.critic_tokens,
                                 f"in [1, --critic-tokens={c.critic_tokens}]"),
        "format_weight": (c.format_weight >= 0, ">= 0"),
        "verdict_loss": (c.verdict_loss in MODES, f"one of {', '.join(MODES)}"),
        "verdict_coef": (c.verdict_coef >= 0, ">= 0"),
        "critic_class_weights": (c.critic_class_weights in CLASS_WEIGHTS,
                                 f"one of {', '.join(CLASS_WEIGHTS)}"),
        "critic_class_window": (c.critic_class_window >= 1, ">= 1"),
        "proposer_reward": (c.proposer_reward in PROPOSER_REWARDS,
                            f"one of {', '.join(PROPOSER_REWARDS)}"),
        "proposer_gate": (c.proposer_gate in PROPOSER_GATES,
                          f"one of {', '.join(PROPOSER_GATES)}"),
        "proposer_reference": (c.proposer_reference in PROPOSER_REFERENCES and (
            c.proposer_reference == "base" or c.memory_opt or not c.warmup_steps),
            f"one of {', '.join(PROPOSER_REFERENCES)} ('warmup' with --warmup-steps needs "
            "the memory-optimised update: --no-memory-opt's reference is a frozen copy of "
            "the base; pass --proposer-reference base)"),
        "critic_batch": (c.critic_batch in CRITIC_BATCHES, f"one of {', '.join(CRITIC_BATCHES)}"),
        "critic_reservoir": (c.critic_reservoir >= 0, ">= 0"),
        "lora_rank": (c.lora_rank >= 1, ">= 1 (roles are adapters)"),
        "alpha0": (c.alpha0 >= 0, ">= 0"),
        "alpha_decay": (0 < c.alpha_decay <= 1, "in (0, 1]"),
        "sketch_capacity": (c.sketch_capacity >= 1, ">= 1"),
        "sketch_perm": (c.sketch_perm >= 1, ">= 1"),
        "prompt_cache_bytes": (c.prompt_cache_bytes >= 0, ">= 0"),
        "buffer_capacity": (c.buffer_capacity >= 1, ">= 1"),
        "micro_batch_tokens": (c.micro_batch_tokens >= 0, ">= 0 (0: planned)"),
        "pack_tokens": (c.pack_tokens >= longest,
                        f">= --max-prompt-tokens + the longest completion ({longest})"),
    })
