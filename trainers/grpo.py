"""GRPO on a small causal LM, on CPU: rollouts in an rlbuffers replay buffer, chunked log-probs.

Group Relative Policy Optimization (Shao et al. 2024, "DeepSeekMath", Sec. 4.1, Eq. 3): for
each prompt, sample a group of G completions, score them, and use each completion's reward
relative to its group (``(r - mean) / std``) as the advantage of all its tokens in a clipped
surrogate (PPO, Schulman et al. 2017, Eq. 7) with a KL penalty to a reference policy (the k3
estimator, Schulman 2020, "Approximating KL divergence").

What rlbuffers does here:

- every completion goes into a ``ReplayBuffer`` (ragged prompt / completion ids, behaviour and
  reference log-probs per token; reward, advantage, group, policy version, step) committed
  every step; ``--num-iterations mu > 1`` re-reads whole groups from it with a
  ``GroupSampler`` and reuses them with the importance ratio against the stored behaviour
  log-probs (the paper's mu inner iterations);
- prompts are tokenized once into a memory-mapped token store and read in a seeded,
  resumable order;
- groups are packed (best-fit decreasing, the prompt once per row, no padding inside a row)
  into rows of up to ``--micro-batch-tokens`` (a longer group alone in a row of up to
  ``--pack-tokens``); per-token log-probs come from the
  chunked ``token_logprobs`` (never the ``[B, T, V]`` logits); ``AdaptiveMicroBatch`` runs
  the rows as micro-batches under ``--memory-budget`` with gradient accumulation;
- the reference policy is the same weights with LoRA adapters disabled (``--lora-rank``), or,
  in full fine-tuning, the initial weights memory-mapped from the run directory only while
  reference log-probs are computed (right after generation; stored in the buffer), so no
  second model sits in memory during the update;
- every step is an atomic checkpoint (``rlbuffers.checkpoint``) whose commit point is the
  buffer commit: ``--resume`` after ``kill -9`` continues from the last complete step.

Output in ``--run-dir``: ``metrics.jsonl`` (one line per step), ``curve.png``, ``eval.json``
(held-out accuracy before and after), ``buffer/`` (``rlbuffers inspect`` works on it).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import sys
import time
import warnings
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from rlbuffers import FieldSpec, ReplayBuffer
from rlbuffers.checkpoint import Checkpoints, create_run, load_state
from rlbuffers.memory import AdaptiveMicroBatch, MemoryMonitor
from rlbuffers.memory.activations import profile_activations
from rlbuffers.memory.process import reuse_heap, trim_heap
from rlbuffers.memory.reference import reference_bytes_saved
from rlbuffers.samplers import GroupSampler
from rlbuffers.stream.token_store import TokenStore, build_token_store
from rlbuffers.stream.tokenize import TextTokenizer
from trainers.common import (
    pyplot,
    restore_metrics,
    rng_states,
    save_figure,
    set_rng_states,
    start,
    write_atomic,
)
from trainers.generation import generate, memory_budget
from trainers.grpo_config import RESUMABLE, Config, check_config
from trainers.lm import load_causal_lm
from trainers.math_tasks import (
    asdiv_problems,
    extract_answer,
    numeric_match,
    render,
    task_problems,
    wilson,
)
from trainers.packed_logprobs import lm_parts, packed_batch, packed_logprobs, reference_logprobs

MIB = 2**20
log = logging.getLogger("trainers.grpo")


# ------------------------------------------------------------------------------------------
# Data: reasoning-gym problems, chat template, token store, seeded resumable order
# ------------------------------------------------------------------------------------------
def prompt_store(cfg: Config, tok: Any, model_dir: Path, path: Path) -> None:
    """Tokenize the training prompts once into a memory-mapped token store at ``path``."""
    problems = task_problems(cfg.task, cfg.train_size, cfg.seed, cfg.task_config)
    tokenizer = TextTokenizer.from_file(model_dir / "tokenizer.json")
    build_token_store(path, (render(tok, p["question"]) for p in problems), tokenizer,
                      total=cfg.train_size, progress=False)


def prompt_order(store: TokenStore, cfg: Config, epoch: int) -> np.ndarray:
    """Epoch ``epoch``'s order of the usable prompt indices (seeded, so a resume rebuilds it)."""
    usable = np.array([i for i in range(len(store)) if store.length(i) <= cfg.max_prompt_tokens])
    if len(usable) < cfg.prompts_per_step:
        raise ValueError(f"--max-prompt-tokens: only {len(usable)} prompts fit in "
                         f"{cfg.max_prompt_tokens} tokens, need {cfg.prompts_per_step}")
    return np.random.default_rng([cfg.seed, epoch]).permutation(usable)


def next_prompts(store: TokenStore, cfg: Config, data: dict[str, int]) -> list[int]:
    """The next ``prompts_per_step`` prompt indices; advances ``data`` (epoch, position)."""
    out: list[int] = []
    while len(out) < cfg.prompts_per_step:
        order = prompt_order(store, cfg, data["epoch"])
        take = order[data["position"]:data["position"] + cfg.prompts_per_step - len(out)]
        out += take.tolist()
        data["position"] += len(take)
        if data["position"] >= len(order):
            data["epoch"], data["position"] = data["epoch"] + 1, 0
    return out


# ------------------------------------------------------------------------------------------
# Model: policy (full or LoRA), reference, packed chunked log-probs
# ------------------------------------------------------------------------------------------
def make_policy(cfg: Config) -> tuple[Any, Any, Path]:
    from trainers.lm import smollm2_dir

    model_dir = Path(cfg.model) if cfg.model else smollm2_dir()
    model, tok = load_causal_lm(model_dir)
    torch.manual_seed(cfg.seed)
    if cfg.lora_rank:
        from peft import LoraConfig, get_peft_model

        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated")  # peft
        model = get_peft_model(model, LoraConfig(
            r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                            "down_proj"]))
    if wants_checkpointing(model, cfg):
        base = model.get_base_model() if cfg.lora_rank else model
        if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5
            base.activation_checkpointing_enable({"use_reentrant": False})
        else:
            base.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        if cfg.lora_rank:
            model.enable_input_require_grads()
    return model, tok, model_dir


def activation_bytes(model: Any, cfg: Config, tokens: int = 128) -> int:
    """Bytes autograd saves for backward over the largest update micro-batch (``--micro-batch-
    tokens``, or one row of ``--pack-tokens`` holding a long group) without activation
    checkpointing: ``profile_activations`` of the decoder on ``tokens / 2``
    and ``tokens`` tokens under ``--train-dtype`` autocast, extrapolated linearly to the
    micro-batch (the saved bytes are a fixed part, e.g. autocast's bf16 weight copies, plus a
    part per token; attention under SDPA saves no ``[T, T]`` scores)."""
    base = model.get_base_model() if cfg.lora_rank else model
    decoder = base.get_decoder()
    dtype = getattr(torch, cfg.train_dtype)
    was_training = model.training
    model.train()

    def saved(n: int) -> int:
        ids = torch.zeros((1, n), dtype=torch.long)

        def forward() -> torch.Tensor:
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                return decoder(input_ids=ids, use_cache=False).last_hidden_state.float().sum()

        return profile_activations(list(decoder.layers), forward,
                                   exclude=model.parameters()).total_bytes

    most = max(cfg.micro_batch_tokens, cfg.pack_tokens)  # a long group's row stands alone
    n = max(2, min(tokens, most))
    small, large = saved(n // 2), saved(n)
    model.train(was_training)
    trim_heap()
    per_token = (large - small) / (n - n // 2)
    return int(large + per_token * (most - n))


def wants_checkpointing(model: Any, cfg: Config) -> bool:
    """``--gradient-checkpointing``: 'on', 'off', or 'auto': on when one micro-batch's saved
    activations (:func:`activation_bytes`) exceed the memory budget, since recompute costs
    ~25% of the update (so off with ``--memory-budget none``)."""
    if cfg.gradient_checkpointing != "auto":
        return cfg.gradient_checkpointing == "on"
    budget = memory_budget(cfg)
    if budget is None:
        return False
    need = activation_bytes(model, cfg)
    log.info("activations of a %d-token micro-batch: %.0f MiB, budget %.0f MiB: "
             "checkpointing %s", max(cfg.micro_batch_tokens, cfg.pack_tokens), need / MIB,
             budget / MIB, "on" if need > budget else "off")
    return need > budget


# ------------------------------------------------------------------------------------------
# Rollouts: generation, rewards, group-relative advantages
# ------------------------------------------------------------------------------------------
def group_advantages(rewards: np.ndarray, g: int, scale: str) -> tuple[np.ndarray, float]:
    """Group-relative advantages (float32[N], N = groups * g, group members contiguous):
    ``r - mean`` divided by the group's std when ``scale == "group"``; a group whose rewards
    are all equal gets 0 (no signal, no division by 0). Also the fraction of such groups."""
    r = rewards.reshape(-1, g).astype(np.float64)
    std = r.std(axis=1, ddof=1, keepdims=True)
    adv = r - r.mean(axis=1, keepdims=True)
    flat = std[:, 0] < 1e-6
    if scale == "group":
        adv = np.where(flat[:, None], 0.0, adv / np.maximum(std, 1e-6))
    return adv.reshape(-1).astype(np.float32), float(flat.mean())


def score_group(problems: Any, indices: list[int], texts: list[str], cfg: Config
                ) -> dict[str, np.ndarray]:
    """Rewards of completions (G per problem, in order): reasoning-gym's ``score_answer`` on
    the extracted answer (1.0 correct, 0.01 a wrong number, 0 none) plus the format reward."""
    correct, fmt = [], []
    for k, text in enumerate(texts):
        entry = problems[indices[k // cfg.group_size]]
        answer, formatted = extract_answer(text)
        correct.append(float(problems.score_answer(answer, entry)) if answer else 0.0)
        fmt.append(formatted)
    c, f = np.array(correct, np.float32), np.array(fmt, bool)
    return {"correctness": c, "formatted": f, "reward": c + cfg.format_reward * f}


# ------------------------------------------------------------------------------------------
# Loss and update
# ------------------------------------------------------------------------------------------
def token_weights(comp_lens: list[int], cfg: Config) -> list[np.ndarray]:
    """Each completion token's weight in the loss (the normalisation of --loss-norm)."""
    n = len(comp_lens)
    if cfg.loss_norm == "sequence":
        return [np.full(k, 1.0 / (k * n), np.float32) for k in comp_lens]
    denom = sum(comp_lens) if cfg.loss_norm == "token" else n * cfg.max_completion_tokens
    return [np.full(k, 1.0 / denom, np.float32) for k in comp_lens]


def update(model: Any, opt: torch.optim.Optimizer, amb: AdaptiveMicroBatch,
           batch: dict[str, torch.Tensor], cfg: Config, n_tokens: int,
           record_behaviour: bool) -> dict[str, Any]:
    """One optimizer step on packed rows: clipped surrogate + beta * k3 KL, token weights in
    ``batch['weight']``. With ``record_behaviour`` the batch's ``old`` log-probs are the
    current ones (ratio 1, as in the first of the mu iterations) and are returned."""
    out = accumulate_gradients(model, amb, batch, cfg, n_tokens, record_behaviour)
    grad_norm = 0.0
    if cfg.max_grad_norm:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(
            [p for p in model.parameters() if p.requires_grad], cfg.max_grad_norm))
    opt.step()
    opt.zero_grad(set_to_none=True)
    return {**out, "grad_norm": grad_norm}


def accumulate_gradients(model: Any, amb: AdaptiveMicroBatch, batch: dict[str, torch.Tensor],
                         cfg: Any, n_tokens: int, record_behaviour: bool) -> dict[str, Any]:
    """The loss of :func:`update` backpropagated micro-batch by micro-batch into ``.grad``
    (no optimizer step); returns its statistics and, with ``record_behaviour``, the current
    log-probs (float32[n_tokens])."""
    eps_lo, eps_hi = cfg.epsilon, cfg.epsilon_high or cfg.epsilon
    flat = {k: torch.zeros(n_tokens) for k in ("logprob", "kl", "clipped")}
    rows = len(batch["input_ids"])
    model.train()

    def step_fn(micro: dict[str, torch.Tensor]) -> torch.Tensor:
        m = micro["mask"]
        lp = packed_logprobs(model, micro, cfg)
        old = lp.detach() if record_behaviour else micro["old"][m]
        ratio = torch.exp(lp - old)
        adv = micro["advantage"][m]
        clipped = ratio.clamp(1 - eps_lo, 1 + eps_hi)
        per_token = -torch.minimum(ratio * adv, clipped * adv)
        idx = micro["index"][m]
        if cfg.beta:
            d = micro["ref"][m] - lp
            kl = torch.exp(d) - d - 1
            per_token = per_token + cfg.beta * kl
            flat["kl"][idx] = kl.detach()
        flat["logprob"][idx] = lp.detach()
        flat["clipped"][idx] = ((ratio * adv > clipped * adv).float()).detach()
        # AdaptiveMicroBatch scales by len(micro) / rows: this makes the sum over all rows.
        return (per_token * micro["weight"][m]).sum() * rows / len(m)

    stats = amb.run(batch, step_fn)
    return {"loss": stats.loss, "kl": float(flat["kl"].mean()),
            "clip_fraction": float(flat["clipped"].mean()),
            "micro_batch": stats.micro_batch, "retries": stats.retries,
            "behaviour": flat["logprob"] if record_behaviour else None}


# ------------------------------------------------------------------------------------------
# The buffer of rollouts, checkpoints, evaluation, progress
# ------------------------------------------------------------------------------------------
def buffer_fields() -> dict[str, FieldSpec]:
    """One completion per transition; a group is one episode (``done`` on its last member)."""
    return {"prompt_ids": FieldSpec((None,), "int32"),
            "completion_ids": FieldSpec((None,), "int32"),
            "behaviour_logprobs": FieldSpec((None,), "float32"),
            "ref_logprobs": FieldSpec((None,), "float32"),
            "reward": FieldSpec((), "float32"), "correctness": FieldSpec((), "float32"),
            "advantage": FieldSpec((), "float32"), "group": FieldSpec((), "int64"),
            "policy_version": FieldSpec((), "int64"), "step": FieldSpec((), "int64"),
            "completion_truncated": FieldSpec((), "bool"), "done": FieldSpec((), "bool")}


def group_sampler(cfg: Config) -> GroupSampler:
    return GroupSampler(cfg.group_size, newest=cfg.reuse_groups or cfg.prompts_per_step)


def trainable_state(model: Any, cfg: Config) -> dict[str, torch.Tensor]:
    if cfg.lora_rank:
        return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    return {}


def save_weights(model: Any, cfg: Config, path: Path) -> None:
    from safetensors.torch import save_file, save_model

    if cfg.lora_rank:
        save_file(trainable_state(model, cfg), str(path))
    else:
        save_model(model, str(path))


def load_weights(model: Any, cfg: Config, path: Path) -> None:
    from safetensors.torch import load_file, load_model

    if cfg.lora_rank:
        missing = model.load_state_dict(load_file(str(path)), strict=False).unexpected_keys
        if missing:
            raise RuntimeError(f"{path}: unexpected adapter keys {missing[:3]}")
    else:
        load_model(model, str(path))


@torch.no_grad()
def evaluate(model: Any, tok: Any, cfg: Config, problems: Any, asdiv: list[dict[str, Any]]
             ) -> dict[str, Any]:
    """Greedy accuracy on the held-out sets, with a 95% Wilson interval."""
    out: dict[str, Any] = {}
    sets = [("task", problems, lambda a, e: float(problems.score_answer(a, e) == 1.0))]
    sets += [("asdiv", asdiv, lambda a, e: numeric_match(a, e["answer"]))] if asdiv else []
    for name, items, correct in sets:
        if not items or not len(items):
            continue
        prompts = [np.array(tok(render(tok, e["question"]), add_special_tokens=False)
                            ["input_ids"]) for e in items]
        texts = [tok.decode(c, skip_special_tokens=True)
                 for c, _ in generate(model, tok, prompts, cfg, n_per_prompt=1, greedy=True)]
        hits = [correct(extract_answer(t)[0], e) if extract_answer(t)[0] else 0.0
                for t, e in zip(texts, items, strict=True)]
        k, n = float(sum(hits)), len(hits)
        out[name] = {"accuracy": k / n, "n": n, "ci95": list(wilson(k, n))}
    return out


def plot_curve(path: Path, history: list[dict[str, Any]], cfg: Config) -> None:
    plt = pyplot()
    steps = [h["step"] for h in history]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=80)
    ax.plot(steps, [h["reward_mean"] for h in history], label="reward (mean)")
    ax.plot(steps, [h["accuracy"] for h in history], label="accuracy (rollouts)")
    ax2 = ax.twinx()
    ax2.plot(steps, [h["kl"] for h in history], color="gray", alpha=0.6, label="KL (right)")
    ax.set(xlabel="step", ylabel="reward / accuracy", title=f"GRPO on {cfg.task}")
    ax.grid(alpha=0.3)
    fig.legend(loc="upper left", fontsize=8)
    save_figure(fig, path)


def open_run(cfg: Config, model: Any, tok: Any, model_dir: Path
             ) -> tuple[ReplayBuffer, Path | None]:
    """Create the run (prompts, reference weights, buffer: all at once or not at all), or
    reopen it at its last complete step (the checkpoint of the buffer's last commit)."""
    run_dir = Path(cfg.run_dir)
    ckpts = Checkpoints(run_dir / "ckpt", prefix="step", keep=cfg.keep_checkpoints)
    if not cfg.resume:
        def make(d: Path) -> None:
            (d / "ckpt").mkdir()
            prompt_store(cfg, tok, model_dir, d / "prompts")
            if cfg.beta and not cfg.lora_rank:
                torch.save(model.state_dict(), d / "reference.pt")
            ReplayBuffer.create(d / "buffer", capacity=cfg.buffer_groups * cfg.group_size,
                                fields=buffer_fields(), sampler=group_sampler(cfg),
                                seed=cfg.seed).close()

        create_run(run_dir, dataclasses.asdict(cfg), make)
        return ReplayBuffer.open(run_dir / "buffer"), None
    buf = ReplayBuffer.open(run_dir / "buffer", mode="r+")
    step = int(buf.metadata.get("trainer_step", 0))
    ckpts.prune(step)
    return buf, ckpts.latest(step)


def progress(row: dict[str, Any]) -> dict[str, str]:
    return {"reward": f"{row['reward_mean']:.3f}", "acc": f"{row['accuracy']:.2f}",
            "kl": f"{row['kl']:.4f}", "len": f"{row['completion_tokens_mean']:.0f}",
            "tok/s": f"{row['tokens_per_s']:.1f}", "peak": f"{row['peak_rss_bytes'] / MIB:.0f}M"}


# ------------------------------------------------------------------------------------------
# The loop
# ------------------------------------------------------------------------------------------
def train_step(cfg: Config, model: Any, tok: Any, opt: torch.optim.Optimizer,
               amb: AdaptiveMicroBatch, buf: ReplayBuffer, store: TokenStore, problems: Any,
               trainer: dict[str, Any], monitor: MemoryMonitor,
               wait_save: Any = lambda: None) -> dict[str, Any]:
    """Generate, score, reference, update (mu iterations), add to the buffer; returns the
    step's metrics row (the caller checkpoints and commits). ``wait_save()`` is called before
    the weights or the buffer change: the previous step's checkpoint may still be writing."""
    step, row = trainer["step"] + 1, {}
    times: dict[str, float] = {}
    peaks: dict[str, int] = {}
    indices = next_prompts(store, cfg, trainer["data"])
    prompts = [np.asarray(store[i], np.int64) for i in indices]

    def phase(name: str) -> Any:
        return _Phase(monitor, name, times, peaks)

    with phase("generate"):
        torch.set_num_threads(cfg.generate_threads)
        rollouts = generate(model, tok, prompts, cfg, n_per_prompt=cfg.group_size)
        torch.set_num_threads(cfg.train_threads or os.cpu_count() or 1)
    completions = [c for c, _ in rollouts]
    truncated = np.array([t for _, t in rollouts])
    comp_lens = [len(c) for c in completions]
    with phase("score"):
        texts = tok.batch_decode(completions, skip_special_tokens=True)
        scores = score_group(problems, indices, texts, cfg)
        adv, flat_groups = group_advantages(scores["reward"], cfg.group_size, cfg.scale_rewards)
    g = cfg.group_size
    groups = [completions[i:i + g] for i in range(0, len(completions), g)]
    weights = token_weights(comp_lens, cfg)
    per_token = {"advantage": [np.full(n, a, np.float32) for n, a in zip(comp_lens, adv,
                                                                            strict=True)],
                 "weight": weights}
    batch = packed_batch(prompts, groups, cfg, tok.pad_token_id, per_token,
                         row_tokens=cfg.micro_batch_tokens)
    n_tok = sum(comp_lens)
    cuts = np.cumsum([0] + comp_lens)
    ref_flat = torch.zeros(n_tok)
    if cfg.beta:
        with phase("reference"):
            ref_flat = reference_logprobs(model, batch, cfg, Path(cfg.run_dir))
        batch["ref"] = torch.zeros_like(batch["advantage"])
        batch["ref"][batch["mask"]] = ref_flat[batch["index"][batch["mask"]]]
    with phase("save_wait"):
        wait_save()
    with phase("update"):
        upd = update(model, opt, amb, batch, cfg, n_tok, record_behaviour=True)
    behaviour = upd.pop("behaviour").numpy()
    ref_np = ref_flat.numpy()
    g0 = trainer["groups"]
    with phase("buffer"):
        buf.extend({"prompt_ids": [prompts[k // g].astype(np.int32)
                                   for k in range(len(completions))],
                    "completion_ids": [c.astype(np.int32) for c in completions],
                    "behaviour_logprobs": [behaviour[a:b] for a, b in pairwise(cuts)],
                    "ref_logprobs": [ref_np[a:b] if cfg.beta else ref_np[:0]
                                     for a, b in pairwise(cuts)],
                    "reward": scores["reward"], "correctness": scores["correctness"],
                    "advantage": adv,
                    "group": np.repeat(np.arange(g0, g0 + len(prompts)), cfg.group_size),
                    "policy_version": np.full(len(completions), step - 1),
                    "step": np.full(len(completions), step), "completion_truncated": truncated,
                    "done": np.tile(np.arange(cfg.group_size) == cfg.group_size - 1,
                                    len(prompts))})
    trainer["groups"] = g0 + len(prompts)
    for _ in range(cfg.num_iterations - 1):
        with phase("update"):
            upd = reuse_iteration(cfg, model, opt, amb, buf, tok)
    row.update({"step": step, "reward_mean": float(scores["reward"].mean()),
                "reward_std": float(scores["reward"].std()),
                "accuracy": float((scores["correctness"] == 1.0).mean()),
                "format_rate": float(scores["formatted"].mean()),
                "zero_std_groups": flat_groups, "truncated_fraction": float(truncated.mean()),
                "completion_tokens_mean": float(np.mean(comp_lens)),
                "completion_tokens": n_tok,
                "tokens_per_s": n_tok / max(times["generate"], 1e-9),
                "packed_rows": int(len(batch["input_ids"])),
                **{k: v for k, v in upd.items()}})
    # What the chunked head saved: fp32 logits and their gradient over the packed tokens.
    saved = 2 * 4 * int(batch["mask"].numel()) * lm_parts(model)[1].shape[0]
    monitor.record_saving("chunked_logprobs", saved)
    row["memory_saved_bytes"] = saved
    row.update({f"seconds_{k}": v for k, v in times.items()})
    row.update({f"peak_rss_{k}_bytes": v for k, v in peaks.items()})
    return row


class _Phase:
    """``with``: one phase's seconds and peak RSS of this step (and the monitor's record)."""

    def __init__(self, monitor: MemoryMonitor, name: str, times: dict[str, float],
                 peaks: dict[str, int]) -> None:
        self.cm, self.name, self.times, self.peaks = monitor.phase(name), name, times, peaks

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()
        self.pk = self.cm.__enter__()

    def __exit__(self, *exc: Any) -> None:
        trim_heap()  # freed activations leave RSS: the next phase's peak does not include them
        self.cm.__exit__(*exc)
        self.times[self.name] = self.times.get(self.name, 0.0) + time.perf_counter() - self.t0
        self.peaks[self.name] = max(self.peaks.get(self.name, 0), self.pk.peak_rss_bytes)


def reuse_iteration(cfg: Config, model: Any, opt: torch.optim.Optimizer,
                    amb: AdaptiveMicroBatch, buf: ReplayBuffer, tok: Any) -> dict[str, Any]:
    """One more update on whole groups re-read from the buffer (GroupSampler), with the
    ratio against their stored behaviour log-probs."""
    s = buf.sample(cfg.prompts_per_step)
    flat = lambda name: [x for grp in s[name] for x in grp]  # noqa: E731
    prompts = [grp[0].astype(np.int64) for grp in s["prompt_ids"]]  # a group shares its prompt
    groups = [[c.astype(np.int64) for c in grp] for grp in s["completion_ids"]]
    comp_lens = [len(c) for grp in groups for c in grp]
    adv = s["advantage"].reshape(-1)
    per_token = {"advantage": [np.full(n, a, np.float32) for n, a in zip(comp_lens, adv,
                                                                            strict=True)],
                 "weight": token_weights(comp_lens, cfg), "old": flat("behaviour_logprobs")}
    if cfg.beta:
        per_token["ref"] = flat("ref_logprobs")
    batch = packed_batch(prompts, groups, cfg, tok.pad_token_id, per_token,
                         row_tokens=cfg.micro_batch_tokens)
    out = update(model, opt, amb, batch, cfg, sum(comp_lens), record_behaviour=False)
    out.pop("behaviour")
    return out


def save_step(cfg: Config, model: Any, opt: torch.optim.Optimizer, buf: ReplayBuffer,
              ckpts: Checkpoints, step: int, frozen: dict[str, Any],
              history: list[dict[str, Any]], row: dict[str, Any]) -> None:
    """Checkpoint ``step`` (weights and optimizer state as they are: unchanged until the next
    update, which waits for this; ``frozen``: RNG and trainer state taken when the step
    ended), commit the buffer (the commit names the step: it makes the checkpoint the resume
    point), then log the step's metrics line and curve."""
    t0, run_dir = time.perf_counter(), Path(cfg.run_dir)
    ckpts.write(step, torch_files={"optimizer.pt": opt.state_dict(), "rng.pt": frozen["rng"]},
                writers={"weights.safetensors": lambda p: save_weights(model, cfg, p)},
                state=frozen["state"])
    report = buf.save(metadata={"trainer_step": step})
    ckpts.prune(step)
    row["seconds_save"] = time.perf_counter() - t0
    row["save_bytes"] = report.bytes_written
    history.append(row)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    plot_curve(run_dir / "curve.png", history, cfg)


class BackgroundSave:
    """One save at a time on a worker thread; :meth:`wait` re-raises its error."""

    def __init__(self) -> None:
        from concurrent.futures import Future, ThreadPoolExecutor

        self.pool = ThreadPoolExecutor(1, thread_name_prefix="save")
        self.future: Future[None] | None = None

    def start(self, fn: Any) -> None:
        self.wait()
        self.future = self.pool.submit(fn)

    def wait(self) -> None:
        if self.future is not None:
            future, self.future = self.future, None
            future.result()

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def main(argv: list[str] | None = None) -> None:
    cfg = start(Config, argv, module="trainers.grpo", doc=__doc__, resumable=RESUMABLE,
                check=check_config)
    torch.set_num_threads(cfg.train_threads or os.cpu_count() or 1)
    if cfg.reuse_heap:  # large blocks reused within a phase (no page faults), trimmed after
        reuse_heap()
    monitor = MemoryMonitor()
    model, tok, model_dir = make_policy(cfg)
    buf, ckpt = open_run(cfg, model, tok, model_dir)
    run_dir = Path(cfg.run_dir)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, fused=True)  # one kernel
    budget = memory_budget(cfg)
    amb = AdaptiveMicroBatch(model, budget_bytes=budget, grow_after=10,
                             max_tokens=cfg.micro_batch_tokens, tokens_key="real")
    rng = np.random.default_rng(cfg.seed)
    trainer: dict[str, Any] = {"step": 0, "groups": 0, "data": {"epoch": 0, "position": 0},
                               "eval": {}}
    history: list[dict[str, Any]] = []
    if ckpt is not None:
        load_weights(model, cfg, ckpt / "weights.safetensors")
        opt.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True))
        set_rng_states(torch.load(ckpt / "rng.pt", weights_only=False), rng)
        state = load_state(ckpt)
        trainer, history = state["trainer"], state["history"]
        amb.load_state_dict(state["micro_batch"])
        monitor.load_state_dict(state["monitor"])
        restore_metrics(run_dir / "metrics.jsonl", history, "step")
        print(f"resumed {run_dir} at step {trainer['step']}", flush=True)
    if cfg.lora_rank:
        monitor.record_saving("shared_reference", reference_bytes_saved(model))
    store = TokenStore(run_dir / "prompts")
    problems = task_problems(cfg.task, cfg.train_size, cfg.seed, cfg.task_config)
    held_out = task_problems(cfg.task, cfg.eval_size, cfg.seed + 1_000_003, cfg.task_config) \
        if cfg.eval_size else []
    asdiv = asdiv_problems(cfg.eval_asdiv) if cfg.eval_asdiv else []
    ckpts = Checkpoints(run_dir / "ckpt", prefix="step", keep=cfg.keep_checkpoints)
    saver = BackgroundSave()
    try:
        if cfg.evaluate and "before" not in trainer["eval"] and trainer["step"] == 0:
            trainer["eval"]["before"] = evaluate(model, tok, cfg, held_out, asdiv)
            print(f"held-out accuracy before: {json.dumps(trainer['eval']['before'])}",
                  flush=True)
        bar = tqdm(total=cfg.steps, initial=trainer["step"], desc="GRPO steps", unit="step")
        while trainer["step"] < cfg.steps:
            t0 = time.perf_counter()
            row = train_step(cfg, model, tok, opt, amb, buf, store, problems, trainer, monitor,
                             wait_save=lambda: saver.wait())
            trainer["step"] = row["step"]
            row["step_seconds"] = time.perf_counter() - t0
            row["peak_rss_bytes"] = max(v for k, v in row.items() if k.startswith("peak_rss_"))
            # Checkpoint + commit in the background, overlapping the next step's generation
            # (weights, optimizer state and buffer stay unchanged until wait_save()).
            saver.wait()  # (done already: the update waited for it) history is complete
            frozen = {"rng": rng_states(rng), "state": copy.deepcopy({
                "trainer": trainer, "history": history + [row],
                "micro_batch": amb.state_dict(), "monitor": monitor.state_dict()})}
            saver.start(lambda a=(trainer["step"], frozen, row): save_step(
                cfg, model, opt, buf, ckpts, a[0], a[1], history, a[2]))
            bar.set_postfix(progress(row))
            bar.update(1)
        saver.wait()
        bar.close()
        if cfg.evaluate and "after" not in trainer["eval"]:
            trainer["eval"]["after"] = evaluate(model, tok, cfg, held_out, asdiv)
            print(f"held-out accuracy after: {json.dumps(trainer['eval']['after'])}", flush=True)
        write_atomic(run_dir / "eval.json", json.dumps(trainer["eval"], indent=1).encode())
    except KeyboardInterrupt:
        saver.wait()
        sys.exit(f"interrupted; step {buf.metadata.get('trainer_step', 0)} is the last complete "
                 f"one: continue with --resume --run-dir {cfg.run_dir}")
    finally:
        saver.close()
        buf.close()


if __name__ == "__main__":
    main()
