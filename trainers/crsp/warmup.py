"""A short format warm-up before self-play (``--warmup-steps``): supervised LoRA steps per role
on targets written in the role's format, fed through ``rlbuffers.stream`` (the pipeline's own
consumer inside a trainer): the examples tokenized once into two aligned token stores (prompts
and targets, ``DIR/warmup/<role>/``), read by a seeded, resumable ``IndexSource`` (its state is
two integers: pass and position, so a warm-up resumes exactly mid-epoch), each batch packed
with ``pack_shared_prefix`` and scored by the chunked log-probs (``packed_logprobs``).

Targets: the proposer's are other reasoning-gym problems of the task with their answers
(``"<q></problem><answer>a</answer>"`` after a seed problem's prompt); the critic's are solver
attempts at training problems labelled by the task's verifier (``"correct</verdict> ..."`` or
``"incorrect</verdict> ..."``). The solver gets none (its accuracy is what self-play must
raise)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlbuffers.stream.sources import IndexSource
from rlbuffers.stream.token_store import TokenStore, TokenStoreWriter
from trainers.crsp.formats import STOP, VERDICTS
from trainers.crsp.roles import Prompts, activate
from trainers.llm.generation import generate
from trainers.llm.packed_logprobs import packed_batch, packed_logprobs
from trainers.llm.settings import Packing
from trainers.llm.tasks import extract_answer

#: The adapters right after the format warm-up, before step 1, in the run directory
#: (``trainers.crsp.evaluate --steps 0,warmup,N`` separates what the supervised warm-up gave
#: from what self-play added).
WARMUP_ADAPTERS = "warmup/adapters.safetensors"

log = logging.getLogger("trainers.crsp.warmup")
WARMUP_ROLES = ("proposer", "critic")


def warmup_references(cfg: Any, path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """``{"proposer": its LoRA tensors as the warm-up left them}`` (read from ``path``, the
    run's :data:`WARMUP_ADAPTERS`, by a new run and a resumed one alike) with
    ``--proposer-reference warmup`` and a warm-up (``cfg``: the run's ``Config``); else ``{}``
    (every role's reference: adapters off).

    Raises:
        rlbuffers.safe_load.CorruptCheckpointError: the file is missing or damaged.
    """
    if cfg.proposer_reference != "warmup" or not cfg.warmup_steps:
        return {}
    from rlbuffers.safe_load import load_safetensors

    return {"proposer": {n: v for n, v in load_safetensors(path, device="cpu").items()
                         if ".proposer." in n}}


def proposer_examples(problems: Any, n: int) -> list[tuple[str, str]]:
    """``(user message, target)`` pairs: problem ``i``'s prompt, problem ``i + 1``'s question
    and answer in the proposer's format (``n`` pairs, ``n + 1`` problems read)."""
    return [("Problem:\n" + problems[i]["question"],
             f"{problems[i + 1]['question']}</problem><answer>{problems[i + 1]['answer']}"
             "</answer>") for i in range(n)]


def critic_examples(problems: Any, attempts: list[str], score: Any) -> list[tuple[str, str]]:
    """``(user message, target)`` pairs of solver ``attempts`` (text, one per problem in
    order), each labelled by ``score(answer, entry)``: the verdict, then a short reason."""
    out = []
    for i, text in enumerate(attempts):
        got = extract_answer(text)[0]
        ok = bool(got) and score(got, problems[i]) == 1.0
        reason = f" The answer is {problems[i]['answer']}."
        out.append((f"Problem:\n{problems[i]['question']}\n\nSolution:\n{text}",
                    VERDICTS[ok] + reason))
    return out


def write_examples(path: Path, role: str, examples: list[tuple[str, str]], prompts: Prompts,
                   tok: Any) -> None:
    """Tokenize ``role``'s examples once into ``path/prompts`` and ``path/targets`` (aligned
    token stores; a target ends with EOS unless the role stops at a closing tag)."""
    eos = [tok.eos_token_id] if STOP[role] is None else []
    with TokenStoreWriter(path / "prompts") as wp, TokenStoreWriter(path / "targets") as wt:
        for user, target in examples:
            wp.extend([prompts(role, user)])
            wt.extend([np.asarray(tok(target, add_special_tokens=False)["input_ids"] + eos,
                                  np.int64)])


def warmup_stream(n: int, seed: int, state: dict[str, Any] | None) -> IndexSource:
    """Example indices in a seeded permutation per pass, without end; ``state``: resumes."""
    src = IndexSource(range(n), seed=seed, cycle=True)
    if state:
        src.load_state_dict(state)
    return src


def sft_steps(model: Any, role: str, opt: torch.optim.Optimizer, store: Path, packing: Packing,
              pad_id: int, batch: int, steps: int, seed: int,
              state: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[float]]:
    """``steps`` supervised steps of ``role``'s adapter on ``batch`` examples each (mean
    negative log-likelihood of the target tokens, AdamW ``opt``), from the stream position
    ``state`` (None: the start). Returns the stream's new state (plain data) and the
    losses."""
    prompts, targets = TokenStore(store / "prompts"), TokenStore(store / "targets")
    stream = warmup_stream(len(prompts), seed, state)
    it = iter(stream)
    activate(model, role)
    model.train()
    losses = []
    device = next(model.parameters()).device
    for _ in range(steps):
        idx = [next(it) for _ in range(batch)]
        tg = [np.asarray(targets[i], np.int64) for i in idx]
        n = sum(len(t) for t in tg)
        rows = packed_batch([np.asarray(prompts[i], np.int64) for i in idx], [[t] for t in tg],
                            packing, pad_id, {"weight": [np.full(len(t), 1 / n, np.float32)
                                                         for t in tg]})
        rows = {k: v.to(device) for k, v in rows.items()}
        lp = packed_logprobs(model, rows, packing)
        loss = -(lp * rows["weight"][rows["mask"]]).sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return stream.state_dict(), losses


def warm_up(cfg: Any, model: Any, tok: Any, prompts: Prompts,
            opts: dict[str, torch.optim.Optimizer], problems: Any, score: Any, run_dir: Path
            ) -> dict[str, float]:
    """``--warmup-steps`` supervised steps of the proposer and the critic (``opts``: their
    AdamW optimizers) on ``--warmup-steps * --warmup-batch`` examples each, written once to
    ``run_dir/warmup/<role>`` (critic examples: one attempt of the untrained solver at each
    of the first training problems, labelled by ``score``). Returns each role's first and
    last loss (``warmup_<role>_loss_first`` / ``_last``)."""
    n = cfg.warmup_steps * cfg.warmup_batch
    if n + 1 > len(problems):
        from trainers.config import ConfigError

        raise ConfigError(f"--warmup-steps: {cfg.warmup_steps} x --warmup-batch "
                          f"{cfg.warmup_batch} examples need more than --train-size "
                          f"{len(problems)} problems")
    activate(model, "solver")
    sampling = cfg.sampling(cfg.solver_tokens, generate_dtype=cfg.generate_dtype)
    attempts = generate(model, tok, [prompts("solver", problems[i]["question"])
                                     for i in range(n)], sampling, n_per_prompt=1,
                        max_new=cfg.solver_tokens)
    examples = {"proposer": proposer_examples(problems, n),
                "critic": critic_examples(problems, [tok.decode(c, skip_special_tokens=True)
                                                     for c, _ in attempts], score)}
    out = {}
    for role in WARMUP_ROLES:
        path = run_dir / "warmup" / role
        if not (path / "targets").exists():
            write_examples(path, role, examples[role], prompts, tok)
        _, losses = sft_steps(model, role, opts[role], path,
                              cfg.packing(cfg.pack_tokens, cfg.train_dtype), tok.pad_token_id,
                              cfg.warmup_batch, cfg.warmup_steps, cfg.seed)
        out[f"warmup_{role}_loss_first"], out[f"warmup_{role}_loss_last"] = losses[0], losses[-1]
        log.info("warm-up of the %s: %d steps, loss %.3f -> %.3f", role, cfg.warmup_steps,
                 losses[0], losses[-1])
    return out
