"""The rollout side of the guidance trainer: the agent and guidance policies (two LoRA adapters
over one base model, or the seed's separate copies), the episode job that rollout workers run
(imported by name on Ray workers: turn 1, hint, turn 2) and phase 1, the jobs of an iteration
on a rollout pool."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlbuffers.rollouts.pool import RolloutPool
from trainers.guidance.config import Config
from trainers.llm.generation import generate
from trainers.llm.model import load_causal_lm, lora_config, model_dir
from trainers.llm.settings import Sampling
from trainers.llm.tasks import SYSTEM, render

ROLES = ("agent", "guidance")
TURN_ROLE = ("agent", "guidance", "agent")  # utterance k of an episode is written by ...
GUIDE_SYSTEM = ("You are a math tutor. Read the problem and the student's answer, then write one "
                "short hint that helps the student check or fix it. Do not give the final answer.")


def guidance_prompt(tok: Any, question: str, answer: str) -> str:
    """The guidance model's chat prompt: the problem and the agent's turn-1 answer."""
    user = f"Problem: {question}\n\nStudent's answer: {answer}\n\nWrite a short hint."
    return str(tok.apply_chat_template([{"role": "system", "content": GUIDE_SYSTEM},
                                        {"role": "user", "content": user}],
                                       add_generation_prompt=True, tokenize=False))


def revision_prompt(tok: Any, question: str, answer: str, hint: str) -> str:
    """The agent's turn-2 chat prompt: its turn-1 conversation, then the hint."""
    return str(tok.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question},
         {"role": "assistant", "content": answer},
         {"role": "user", "content": f"A tutor's hint: {hint}\nRevise your solution and give "
                                     "the final answer inside <answer></answer>."}],
        add_generation_prompt=True, tokenize=False))


# ------------------------------------------------------------------------------------------
# Policies: agent and guidance adapters over one base, the reference
# ------------------------------------------------------------------------------------------
class Policies:
    """The agent and guidance policies and the reference policy.

    Shared layout: ``models`` maps both roles to one peft model holding adapters ``agent`` and
    ``guidance`` (``use(role)`` switches with ``set_adapter``); the reference is that model
    with adapters disabled. Naive layout (``--naive-init``): each role has its own full copy
    of the base, and the reference is a third copy (``reference``).
    """

    def __init__(self, models: dict[str, Any], reference: Any | None = None) -> None:
        self.models, self.reference_model = models, reference

    def use(self, role: str) -> Any:
        model = self.models[role]
        model.set_adapter(role)
        return model

    @contextlib.contextmanager
    def reference(self) -> Iterator[Any]:
        if self.reference_model is not None:
            yield self.reference_model
        else:
            with self.models["agent"].disable_adapter():
                yield self.models["agent"]

    def adapter_params(self, role: str) -> list[torch.nn.Parameter]:
        return [p for n, p in self.models[role].named_parameters()
                if "lora_" in n and f".{role}." in n]

    def adapter_state(self, role: str) -> dict[str, np.ndarray]:
        from peft import get_peft_model_state_dict

        sd = get_peft_model_state_dict(self.models[role], adapter_name=role)
        return {k: v.detach().cpu().numpy().copy() for k, v in sd.items()}

    def load_adapter_state(self, role: str, state: dict[str, np.ndarray]) -> None:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(self.models[role], {k: torch.from_numpy(np.array(v))
                                                      for k, v in state.items()},
                                  adapter_name=role)

    def unique_models(self) -> dict[str, Any]:
        out = {"policy": self.models["agent"]}
        if self.models["guidance"] is not self.models["agent"]:
            out["guidance_copy"] = self.models["guidance"]
        if self.reference_model is not None:
            out["reference_copy"] = self.reference_model
        return out


def make_policies(cfg: Config, naive: bool) -> tuple[Policies, Any, Path]:
    """Load the base and add the adapters (each initialised from its own seed, so both layouts
    start from the same weights); naive: two more full copies of the base."""
    from peft import get_peft_model

    warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated")  # peft
    path = model_dir(cfg.model)
    base, tok = load_causal_lm(path)
    lora = lora_config(cfg.lora_rank, cfg.lora_alpha)
    torch.manual_seed(cfg.seed)
    agent = get_peft_model(base, lora, adapter_name="agent")
    torch.manual_seed(cfg.seed + 1)
    if not naive:
        agent.add_adapter("guidance", lora)
        agent.set_adapter("agent")
        return Policies({"agent": agent, "guidance": agent}), tok, path
    guidance = get_peft_model(load_causal_lm(path)[0], lora, adapter_name="guidance")
    reference = load_causal_lm(path)[0].eval().requires_grad_(False)
    return Policies({"agent": agent, "guidance": guidance}, reference), tok, path


# ------------------------------------------------------------------------------------------
# The episode job
# ------------------------------------------------------------------------------------------
POLICIES: dict[str, tuple[Policies, Any]] = {}  # per process: the policies jobs generate with


def worker_policies(cfg: Config) -> tuple[Policies, Any]:
    """The policies of this process: the learner's own (registered under its run directory)
    in process, else (a Ray worker) the shared layout loaded once."""
    if cfg.run_dir not in POLICIES:
        policies, tok, _ = make_policies(cfg, naive=False)
        POLICIES[cfg.run_dir] = (policies, tok)
    return POLICIES[cfg.run_dir]


def play(policies: Policies, tok: Any, questions: list[str], sampling: Sampling, *,
         max_answer_tokens: int, max_hint_tokens: int, greedy: bool = False) -> dict[str, Any]:
    """Episodes of ``questions``: turn 1, hint, turn 2, each batched over the episodes, the
    answers at most ``max_answer_tokens`` long and the hint ``max_hint_tokens`` (``greedy``:
    argmax decoding, for evaluation).
    Returns ``observations``, ``actions`` (int32 token arrays), ``texts`` and ``truncated``,
    each a list per episode of its 3 utterances."""
    encode = lambda text: np.asarray(tok.encode(text, add_special_tokens=False))  # noqa: E731
    obs, acts, texts, cut = [], [], [], []
    prompts = [encode(render(tok, q)) for q in questions]
    for turn, role in enumerate(TURN_ROLE):
        max_new = max_hint_tokens if role == "guidance" else max_answer_tokens
        out = generate(policies.use(role), tok, prompts, sampling, n_per_prompt=1,
                       max_new=max_new, greedy=greedy)
        obs.append(prompts)
        acts.append([c for c, _ in out])
        cut.append([t for _, t in out])
        texts.append(tok.batch_decode(acts[-1], skip_special_tokens=True))
        if turn == 0:
            prompts = [encode(guidance_prompt(tok, q, a))
                       for q, a in zip(questions, texts[0], strict=True)]
        elif turn == 1:
            prompts = [encode(revision_prompt(tok, q, a, h))
                       for q, a, h in zip(questions, texts[0], texts[1], strict=True)]
    per_episode = lambda xs: [list(e) for e in zip(*xs, strict=True)]  # noqa: E731
    return {"observations": per_episode([[o.astype(np.int32) for o in x] for x in obs]),
            "actions": per_episode([[a.astype(np.int32) for a in x] for x in acts]),
            "texts": per_episode(texts), "truncated": per_episode(cut)}


def rng_devices(model: torch.nn.Module) -> list[int]:
    """The CUDA device indices whose RNG sampling with ``model`` draws from (for
    ``torch.random.fork_rng``: a seeded job leaves the caller's RNG states as they were)."""
    dev = next(model.parameters()).device
    return [dev.index or 0] if dev.type == "cuda" else []


def episode_job(weights: dict[str, Any], cfg: Config, questions: list[str],
                seed: int) -> dict[str, Any]:
    """A rollout job: load the current adapter weights, play ``questions`` with torch's RNG
    seeded by ``seed`` (the learner's RNG is left as it was)."""
    policies, tok = worker_policies(cfg)
    for role in ROLES:
        policies.load_adapter_state(role, weights[role])
    with torch.random.fork_rng(devices=rng_devices(policies.models["agent"])):
        torch.manual_seed(seed)
        return play(policies, tok, questions, cfg.utterance_sampling(),
                    max_answer_tokens=cfg.max_answer_tokens,
                    max_hint_tokens=cfg.max_hint_tokens)


def collect(pool: RolloutPool, policies: Policies, questions: list[str], cfg: Config,
            iteration: int) -> list[dict[str, Any]]:
    """Phase 1: the episodes of ``questions`` as jobs of ``cfg.episodes_per_job`` on ``pool``
    (each seeded by (seed, iteration, job), so the episodes do not depend on --workers), the
    adapter weights shared once; episodes (dicts of :func:`play`'s per-episode lists) come
    back job by job, in order."""
    pool.set_weights({role: policies.adapter_state(role) for role in ROLES})
    n = cfg.episodes_per_job
    ids = [pool.submit(episode_job, cfg, questions[j:j + n],
                       int(np.random.SeedSequence([cfg.seed, iteration, j // n])
                           .generate_state(1)[0]))
           for j in range(0, len(questions), n)]
    episodes: list[dict[str, Any]] = []
    for job_id in ids:
        data = pool.results([job_id])[0].data
        episodes += [{k: data[k][e] for k in data} for e in range(len(data["texts"]))]
    return episodes
