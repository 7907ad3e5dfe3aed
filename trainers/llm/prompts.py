"""Training prompts: tokenized once into a memory-mapped token store, read in a seeded,
resumable order (an epoch's permutation of the usable prompts and a position in it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from rlbuffers.stream.token_store import TokenStore, build_token_store
from rlbuffers.stream.tokenize import TextTokenizer
from trainers.llm.tasks import render, task_problems


def prompt_store(task: str, size: int, seed: int, task_config: str, tok: Any,
                 model_dir: Path, path: Path) -> None:
    """Tokenize the chat prompts of ``size`` problems of reasoning-gym's ``task`` (seed
    ``seed``) once into a memory-mapped token store at ``path``."""
    problems = task_problems(task, size, seed, task_config)
    tokenizer = TextTokenizer.from_file(model_dir / "tokenizer.json")
    build_token_store(path, (render(tok, p["question"]) for p in problems), tokenizer,
                      total=size, progress=False)


def prompt_order(store: TokenStore, max_prompt_tokens: int, per_step: int, seed: int,
                 epoch: int) -> np.ndarray:
    """Epoch ``epoch``'s order of the prompt indices no longer than ``max_prompt_tokens``
    (seeded by ``(seed, epoch)``, so a resume rebuilds it).

    Raises:
        trainers.config.ConfigError: (a ValueError) fewer than ``per_step`` prompts fit
            (``--max-prompt-tokens`` named; one line from the console).
    """
    from trainers.config import ConfigError

    usable = np.array([i for i in range(len(store)) if store.length(i) <= max_prompt_tokens])
    if len(usable) < per_step:
        raise ConfigError(f"--max-prompt-tokens: only {len(usable)} prompts fit in "
                         f"{max_prompt_tokens} tokens, need {per_step}")
    return np.random.default_rng([seed, epoch]).permutation(usable)


def next_prompts(store: TokenStore, max_prompt_tokens: int, per_step: int, seed: int,
                 data: dict[str, int]) -> list[int]:
    """The next ``per_step`` prompt indices; advances ``data`` (``epoch``, ``position``: the
    plain-data order state a checkpoint keeps)."""
    out: list[int] = []
    while len(out) < per_step:
        order = prompt_order(store, max_prompt_tokens, per_step, seed, data["epoch"])
        take = order[data["position"]:data["position"] + per_step - len(out)]
        out += take.tolist()
        data["position"] += len(take)
        if data["position"] >= len(order):
            data["epoch"], data["position"] = data["epoch"] + 1, 0
    return out
