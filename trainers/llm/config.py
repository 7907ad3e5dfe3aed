"""The config base of the LLM trainers (GRPO, CRSP, guidance): the fields they share, with
their validation, declared once; each trainer's ``Config`` extends it with its own fields and
sets its defaults by declaring a field again."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainers.config import MAX_THREADS, RUN_RESUMABLE, RunConfig, check_rules, check_run
from trainers.llm.checkpointing import MODES
from trainers.llm.settings import Packing, PolicyLoss, Sampling, parse_budget
from trainers.llm.tasks import check_task

DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class LLMConfig(RunConfig):
    """Fields every LLM trainer has."""

    evaluate_again: bool = False
    """With --resume: run the final held-out evaluation again although eval.json holds it for
    the last step (GRPO, guidance; a run at its target otherwise exits at once)."""
    model: str = ""
    """Local transformers causal-LM directory with a tokenizer ('': SmolLM2-135M-Instruct)."""
    task: str = "gsm_symbolic"
    """reasoning-gym task of the training problems (e.g. basic_arithmetic)."""
    task_config: str = "{}"
    """JSON keyword arguments of the task's reasoning-gym dataset (e.g. for basic_arithmetic:
    '{"min_terms": 2, "max_terms": 2, "max_digits": 1}')."""
    train_size: int = 2000
    """Training problems generated from the task (seed --seed)."""
    device: str = "auto"
    """Where the trained weights, their optimizer state and the batches live: 'auto' (CUDA
    when available), 'cpu', 'cuda' or 'cuda:N'; other models are placed by the plan."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts (log-probs use the same)."""
    top_p: float = 1.0
    """Nucleus sampling of the rollouts (1: off)."""
    lora_rank: int = 16
    """LoRA rank (peft) on the attention and MLP projections."""
    lora_alpha: int = 32
    """LoRA alpha."""
    lr: float = 1e-4
    """AdamW learning rate."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm (0: off)."""
    beta: float = 0.04
    """KL coefficient (k3 estimator) to the reference policy; 0 skips the reference."""
    epsilon: float = 0.2
    """Clipping range: ratio in [1 - epsilon, 1 + epsilon-high]."""
    epsilon_high: float = 0.0
    """Upper clipping range (0: same as --epsilon; DAPO, Yu et al. 2025, uses 0.28)."""
    chunk_tokens: int = 512
    """Tokens per chunk of the LM head in token_logprobs."""
    memory_budget: str = "auto"
    """Extra bytes a generation batch or update micro-batch may use: an integer, 'auto'
    (available memory less a margin) or 'none'."""
    generation_batch: int = 64
    """Most sequences per generate call (fewer when the memory budget allows fewer; 0: no
    cap)."""
    gradient_checkpointing: str = "off"
    """Recompute decoder activations in backward: 'off', 'all', 'selective' (the layers
    --checkpoint-layers names) or 'auto' ('all' when one micro-batch's profiled activations
    exceed the memory budget)."""
    checkpoint_layers: str = "auto"
    """With 'selective': comma-separated decoder layer indices, or 'auto': the fewest layers
    that a measured profile shows bring the saved bytes to --activation-fraction."""
    activation_fraction: float = 0.5
    """With --checkpoint-layers auto: the fraction of the profiled saved-for-backward bytes
    the checkpointed model may keep."""
    generate_threads: int = 1
    """torch threads while generating (decoding is overhead-bound: more rarely help)."""
    train_threads: int = 0
    """torch threads for log-probs and the update (0: all CPUs)."""

    def sampling(self, max_completion_tokens: int, device: Any = None, **overrides: Any
                 ) -> Sampling:
        """The :class:`Sampling` of these settings (the budget read now on ``device``:
        ``auto`` follows the memory that device has at the call)."""
        return Sampling(max_completion_tokens=max_completion_tokens,
                        temperature=self.temperature, top_p=self.top_p,
                        generation_batch=self.generation_batch,
                        memory_budget=parse_budget(self.memory_budget, device), **overrides)

    def packing(self, pack_tokens: int, train_dtype: str = "float32") -> Packing:
        """The :class:`Packing` of these settings for rows of ``pack_tokens``."""
        return Packing(pack_tokens=pack_tokens, chunk_tokens=self.chunk_tokens,
                       train_dtype=train_dtype, temperature=self.temperature)

    def policy_loss(self) -> PolicyLoss:
        """The :class:`PolicyLoss` of these settings."""
        return PolicyLoss(epsilon=self.epsilon, epsilon_high=self.epsilon_high, beta=self.beta)


#: Settings of :class:`LLMConfig` that a resumed run may change.
LLM_RESUMABLE = RUN_RESUMABLE | {"device", "memory_budget", "generation_batch",
                                 "generate_threads", "train_threads"}


def check_llm(c: LLMConfig) -> None:
    """Validate the :class:`LLMConfig` fields.

    Raises:
        ValueError: ``--flag: expected ..., got ...`` for the first field out of range.
    """
    check_run(c)
    layers_ok = c.checkpoint_layers == "auto" or all(
        x.strip().isdigit() for x in c.checkpoint_layers.split(","))
    check_rules(c, {
        "train_size": (c.train_size >= 1, ">= 1"),
        "device": (c.device in ("auto", "cpu", "cuda") or (
            c.device.startswith("cuda:") and c.device[5:].isdigit()),
            "'auto', 'cpu', 'cuda' or 'cuda:N'"),
        "temperature": (c.temperature > 0, "> 0"), "top_p": (0 < c.top_p <= 1, "in (0, 1]"),
        "model": model_dir_ok(c.model),
        "lora_rank": (c.lora_rank >= 0, ">= 0"), "lr": (c.lr > 0, "> 0"),
        "lora_alpha": (c.lora_alpha >= 1, ">= 1"),
        "max_grad_norm": (c.max_grad_norm >= 0, ">= 0"),
        "beta": (c.beta >= 0, ">= 0"), "epsilon": (c.epsilon > 0, "> 0"),
        "epsilon_high": (c.epsilon_high >= 0, ">= 0"),
        "chunk_tokens": (c.chunk_tokens >= 1, ">= 1"),
        "memory_budget": (c.memory_budget in ("auto", "none") or c.memory_budget.isdigit(),
                          "an integer (bytes), 'auto' or 'none'"),
        "generation_batch": (c.generation_batch >= 0, ">= 0"),
        "gradient_checkpointing": (c.gradient_checkpointing in MODES,
                                   "'auto', 'off', 'all' or 'selective'"),
        "checkpoint_layers": (layers_ok, "'auto' or comma-separated layer indices"),
        "activation_fraction": (0 <= c.activation_fraction <= 1, "in [0, 1]"),
        "generate_threads": (1 <= c.generate_threads <= MAX_THREADS, f"in [1, {MAX_THREADS}]"),
        "train_threads": (0 <= c.train_threads <= MAX_THREADS, f"in [0, {MAX_THREADS}]"),
    })
    check_task(c.task, c.task_config)


def model_dir_ok(path: str, what: str = "a model directory holding config.json"
                 ) -> tuple[bool, str]:
    """``(ok, expected)`` of a ``--model``-like flag: '' (the default model) or a directory
    holding ``config.json`` (checked before anything loads)."""
    return (not path or (Path(path) / "config.json").is_file(),
            f"{what} (or '' for the default)")


def check_dtype(c: Any, name: str) -> None:
    """Raise ValueError unless ``c.<name>`` is one of :data:`DTYPES`."""
    check_rules(c, {name: (getattr(c, name) in DTYPES, "'float32', 'bfloat16' or 'float16'")})
