"""The rollout side of the guidance trainer: the agent and guidance policies (two LoRA adapters
over one base model, or the seed's separate copies), the episode job that rollout workers run
(imported by name on Ray workers: turn 1, hint, turn 2) and phase 1, the jobs of an iteration
on a rollout pool."""

from __future__ import annotations

import contextlib
import dataclasses
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
GUIDE_SYSTEM = ("You are a math tutor. Read the problem and the student's answer, then write one "
                "short hint that helps the student check or fix it. Do not give the final answer.")
#: The "keep your answer" hint (``--keep-hint``): offered in the guidance prompt, and with
#: ``candidate`` the last of the K hints of every turn-1 answer.
KEEP_HINT = "Your answer is correct. Keep it."
KEEP_OFFER = f" If the student's answer is already right, reply exactly: {KEEP_HINT}"


def guidance_prompt(tok: Any, question: str, answer: str, keep: bool = False) -> str:
    """The guidance model's chat prompt: the problem and the agent's turn-1 answer (``keep``:
    the system prompt offers :data:`KEEP_HINT`)."""
    user = f"Problem: {question}\n\nStudent's answer: {answer}\n\nWrite a short hint."
    system = GUIDE_SYSTEM + (KEEP_OFFER if keep else "")
    return str(tok.apply_chat_template([{"role": "system", "content": system},
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
    of the base, and the reference is a third copy (``reference``). A role in ``frozen``
    (``--freeze-agent``) never has gradients: ``use`` clears ``requires_grad`` on its adapter,
    which peft's ``set_adapter`` sets on the active adapter.
    """

    def __init__(self, models: dict[str, Any], reference: Any | None = None) -> None:
        self.models, self.reference_model = models, reference
        self.frozen: set[str] = set()

    def use(self, role: str) -> Any:
        model = self.models[role]
        model.set_adapter(role)
        for r in self.frozen:
            for p in self.adapter_params(r):
                p.requires_grad_(False)
        return model

    def freeze(self, role: str) -> None:
        """Fix ``role``'s adapter: no gradient from now on (see ``use``)."""
        self.frozen.add(role)
        for p in self.adapter_params(role):
            p.requires_grad_(False)

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


def weight_copy_bytes(model: torch.nn.Module, sampling: Sampling) -> int:
    """Bytes of the weight copies ``trainers.llm.generation.generate`` holds while it decodes
    with ``model``: the merged copy of every LoRA-adapted weight (``merged_lora``, in
    ``sampling.generate_dtype``) and, on the CPU with ``packed_weights``, the oneDNN-packed
    copy of every ``torch.nn.Linear`` weight, the LM head included (``packed_linears``).
    For SmolLM2-135M: 425 MB merged + 538 MB packed (fp32)."""
    from peft.tuners.lora import Linear as LoraLinear

    size = getattr(torch, sampling.generate_dtype).itemsize
    merged = sum(m.get_base_layer().weight.numel() * size for m in model.modules()
                 if isinstance(m, LoraLinear))
    cpu = next(model.parameters()).device.type == "cpu"
    packed = sum(m.weight.numel() * size for m in model.modules()
                 if type(m) is torch.nn.Linear) if cpu and sampling.packed_weights else 0
    return merged + packed


def generation_sampling(cfg: Config, policies: Policies, device: Any = None) -> Sampling:
    """The :class:`Sampling` of every utterance (``cfg.utterance_sampling``) with the
    generation batches sized so that a generate call stays inside ``--memory-budget``
    (issue 49): ``generate`` sizes its batch from the KV cache of prompt + completion (and two
    rows of logits) per sequence, but it also holds :func:`weight_copy_bytes` while it
    decodes, and the cache exists twice for a moment (the prefill's cache beside the
    preallocated one, and the kept rows' copy when finished sequences are dropped). So the
    batch gets ``(budget - weight copies) / 2``; at least one sequence. With no budget:
    unchanged."""
    s = cfg.utterance_sampling(device)
    if s.memory_budget is None:
        return s
    left = max(0, s.memory_budget - weight_copy_bytes(policies.models["agent"], s))
    return dataclasses.replace(s, memory_budget=left // 2)


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
         max_answer_tokens: int, max_hint_tokens: int, hints: int,
         greedy: bool = False, on_finished: Any = None, keep_hint: str = "off"
         ) -> dict[str, Any]:
    """Episodes of ``questions``: turn 1, then ``hints`` hints of the guidance model on that
    answer and a turn 2 after each, every utterance batched over the questions; answers at
    most ``max_answer_tokens`` long, hints ``max_hint_tokens`` (``greedy``: argmax decoding,
    for evaluation). Returns ``observations``, ``actions`` (int32 token arrays), ``texts`` and
    ``truncated``, each a list per question of its ``1 + 2 * hints`` utterances in the order
    turn 1, hint 1, turn 2 after hint 1, hint 2, ... (so an utterance's next observation is
    the next one's observation, except a turn 2's). ``on_finished(k)``: told as utterances
    finish (``generate``'s). ``keep_hint`` (``--keep-hint``): ``prompt`` or ``candidate``
    offer :data:`KEEP_HINT` in the guidance prompt; ``candidate`` also makes it the last of
    the ``hints`` (>= 2) hints of every answer, its tokens ending with EOS as a sampled hint's
    do (never when ``greedy`` or with one hint: the evaluation's hint is the model's own)."""
    encode = lambda text: np.asarray(tok.encode(text, add_special_tokens=False))  # noqa: E731
    n = len(questions)

    def run(role: str, prompts: list[np.ndarray], per: int) -> tuple[list[Any], ...]:
        max_new = max_hint_tokens if role == "guidance" else max_answer_tokens
        out = generate(policies.use(role), tok, prompts, sampling, n_per_prompt=per,
                       max_new=max_new, greedy=greedy, on_finished=on_finished)
        acts = [c.astype(np.int32) for c, _ in out]
        return acts, [t for _, t in out], tok.batch_decode(acts, skip_special_tokens=True)

    first = [encode(render(tok, q)) for q in questions]
    a1, t1, x1 = run("agent", first, 1)
    guide = [encode(guidance_prompt(tok, q, a, keep=keep_hint != "off"))
             for q, a in zip(questions, x1, strict=True)]
    canned = int(keep_hint == "candidate" and hints >= 2 and not greedy)
    ah, th, xh = run("guidance", guide, hints - canned)  # question-major: question i together
    if canned:  # the keep hint after each question's hints - 1 sampled ones
        keep = np.append(encode(KEEP_HINT), tok.eos_token_id).astype(np.int32)
        s = hints - 1
        ah = [x for i in range(n) for x in [*ah[i * s:(i + 1) * s], keep]]
        th = [x for i in range(n) for x in [*th[i * s:(i + 1) * s], False]]
        xh = [x for i in range(n) for x in [*xh[i * s:(i + 1) * s], KEEP_HINT]]
    revise = [encode(revision_prompt(tok, questions[j // hints], x1[j // hints], h))
              for j, h in enumerate(xh)]
    a2, t2, x2 = run("agent", revise, 1)
    out: dict[str, Any] = {k: [] for k in ("observations", "actions", "texts", "truncated")}
    for i in range(n):
        ks = range(i * hints, (i + 1) * hints)
        out["observations"].append([first[i].astype(np.int32)] + [
            x for k in ks for x in (guide[i].astype(np.int32), revise[k].astype(np.int32))])
        for key, (one, h, two) in (("actions", (a1, ah, a2)), ("texts", (x1, xh, x2)),
                                   ("truncated", (t1, th, t2))):
            out[key].append([one[i]] + [x for k in ks for x in (h[k], two[k])])
    return out


def longest_utterances(tok: Any, questions: list[str], max_answer_tokens: int,
                       max_hint_tokens: int, keep_hint: str = "off") -> dict[str, int]:
    """Tokens (prompt + action) of each role's longest utterance over ``questions``, counted
    from the chat templates: the agent's is a turn 2 (the revision prompt holds the question,
    turn 1's answer and the hint, then the revision), the guidance model's a hint
    (``keep_hint``: the prompt's offer counted, and with ``candidate`` a hint as long as
    :data:`KEEP_HINT` with its EOS when that is longer than ``max_hint_tokens``)."""
    q = max(questions, key=lambda x: len(tok.encode(x, add_special_tokens=False)))
    count = lambda text: len(tok.encode(text, add_special_tokens=False))  # noqa: E731
    hint = max(max_hint_tokens, count(KEEP_HINT) + 1) if keep_hint == "candidate" \
        else max_hint_tokens
    return {"agent": count(revision_prompt(tok, q, "", "")) + 2 * max_answer_tokens + hint,
            "guidance": count(guidance_prompt(tok, q, "", keep_hint != "off"))
            + max_answer_tokens + hint}


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
        return play(policies, tok, questions, generation_sampling(cfg, policies),
                    max_answer_tokens=cfg.max_answer_tokens,
                    max_hint_tokens=cfg.max_hint_tokens, hints=cfg.hints_per_answer,
                    keep_hint=cfg.keep_hint)


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
