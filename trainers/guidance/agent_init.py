"""``--agent-init``: a new guidance run's agent adapter loaded from a GRPO checkpoint or from
another guidance run's checkpoint.

The GRPO trainer (``trainers/grpo``, ``save_weights``) writes a LoRA run's trained
parameters to ``ckpt/step-N/weights.safetensors`` under peft's full names with its adapter
name (``...q_proj.lora_A.default.weight``); the guidance trainer's adapters are read and set
by ``Policies.adapter_state`` / ``load_adapter_state`` under peft's names without it
(``...q_proj.lora_A.weight``), and a guidance checkpoint (``ckpt/iteration-N``) holds its
agent's adapter in ``agent.safetensors`` under those names. :func:`load_agent_init` maps
either onto the agent adapter and checks every name and shape before it changes anything.
A guidance checkpoint as the start lets an agent that trained on two turns beside a guidance
model (reading hints) be frozen in a new run (``--freeze-agent``), so that the new run's hint
effect is its guidance model's alone (docs/guidance.md).
"""

from __future__ import annotations

import hashlib
import logging
import re
from pathlib import Path
from typing import Any

from trainers.config import ConfigError

log = logging.getLogger(__name__)

FLAG = "--agent-init"
_ADAPTER_NAME = re.compile(r"\.(lora_[AB])\.[^.]+\.weight$")
_PLAIN_NAME = re.compile(r"\.lora_[AB]\.weight$")
# the file a checkpoint directory holds the agent's adapter in: GRPO's, then guidance's
FILES = ("weights.safetensors", "agent.safetensors")


def checkpoint_file(path: str | Path) -> Path:
    """The safetensors file of ``path``: a GRPO checkpoint directory (``.../ckpt/step-N``,
    its ``weights.safetensors``), a guidance checkpoint directory (``.../ckpt/iteration-N``,
    its ``agent.safetensors``) or either file itself.

    Raises:
        trainers.config.ConfigError: ``--agent-init: expected ...``, naming what is missing
            (one line on the console)."""
    p = Path(path)
    f = next((p / n for n in FILES if (p / n).is_file()), p / FILES[0]) if p.is_dir() else p
    if not f.is_file():
        raise ConfigError(f"{FLAG}: expected a GRPO checkpoint directory holding "
                          f"{FILES[0]}, a guidance checkpoint directory holding {FILES[1]} "
                          f"(or either file), got {str(path)!r} ({f} does not exist)")
    return f


def sha256(path: Path) -> str:
    """Hex SHA-256 of the file at ``path`` (read in 1 MiB blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(2**20), b""):
            h.update(block)
    return h.hexdigest()


def adapter_names(state: dict[str, Any]) -> dict[str, str]:
    """``{peft name without the adapter name: name in the file}`` of the LoRA tensors of a
    GRPO ``weights.safetensors`` state (``...lora_A.default.weight``) or of a guidance
    ``agent.safetensors`` state (``...lora_A.weight``, kept as they are); names without
    ``lora_A``/``lora_B`` are skipped."""
    names = {_ADAPTER_NAME.sub(r".\1.weight", k): k for k in state if _ADAPTER_NAME.search(k)}
    names.update({k: k for k in state if _PLAIN_NAME.search(k)})
    return names


def check_run_config(file: Path, cfg: Any) -> dict[str, Any]:
    """The source run's ``config.json`` (two directories above ``ckpt/step-N`` or
    ``ckpt/iteration-N``), when there is one, checked against ``cfg``: the LoRA scale
    ``alpha / rank`` and the base model are not in the weights, so they must match here.
    Returns the compared settings ({} without it).

    Raises:
        trainers.config.ConfigError: (a ValueError) ``--agent-init: expected --lora-alpha
            ..., got ...`` (or --lora-rank, --model) for a setting that differs."""
    path = file.parent.parent.parent / "config.json"
    if not path.is_file():
        return {}
    from rlbuffers.safe_load import load_json

    saved = load_json(path, dict)
    seen = {}
    for name in ("model", "lora_rank", "lora_alpha"):
        if name in saved:
            seen[name] = saved[name]
            if saved[name] != getattr(cfg, name):
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{FLAG}: expected {flag} {getattr(cfg, name)!r} (this run's), "
                                 f"got {saved[name]!r} in {path}: pass {flag} {saved[name]!r}")
    return seen


def load_agent_init(policies: Any, path: str | Path, cfg: Any) -> dict[str, Any]:
    """Load the LoRA adapter of the GRPO checkpoint at ``path`` (or the agent adapter of the
    guidance checkpoint there) into ``policies``' agent adapter (exact copies, converted to
    the adapter's dtype; the guidance adapter is not touched). ``cfg`` gives ``model``,
    ``lora_rank`` and ``lora_alpha`` to compare with the source run's ``config.json`` when it
    is there.

    Returns:
        ``{"path", "sha256", "tensors", "grpo_config"}``: the file loaded, its SHA-256, the
        number of tensors and the source run's settings compared (the key keeps its first
        name for the eval.json files written before guidance checkpoints were accepted).

    Raises:
        trainers.config.ConfigError: (a ValueError) ``--agent-init: expected ..., got ...``
            for no such checkpoint file, a full-weights checkpoint (no LoRA tensors), names
            that do not match the agent adapter's, a shape (rank) that differs, or a GRPO
            setting that differs.
    """
    from rlbuffers.safe_load import load_safetensors

    file = checkpoint_file(path)
    grpo = check_run_config(file, cfg)
    state = load_safetensors(file)
    names = adapter_names(state)
    if not names:
        raise ConfigError(f"{FLAG}: expected a LoRA checkpoint (lora_A/lora_B tensors), got "
                         f"{len(state)} tensors without any in {file} (a full-weights "
                         f"checkpoint, e.g. {sorted(state)[:2]}?)")
    want = policies.adapter_state("agent")
    missing, extra = sorted(set(want) - set(names)), sorted(set(names) - set(want))
    if missing or extra:
        raise ConfigError(f"{FLAG}: expected the agent adapter's {len(want)} LoRA tensors, got "
                         f"{len(names)} in {file}; missing {missing[:3]}, unexpected "
                         f"{extra[:3]}")
    for k, v in want.items():
        got = tuple(state[names[k]].shape)
        if got != v.shape:
            raise ConfigError(f"{FLAG}: expected {k} of shape {v.shape} (--lora-rank "
                             f"{cfg.lora_rank}), got {got} in {file}")
    policies.load_adapter_state("agent", {
        k: state[names[k]].float().numpy().astype(v.dtype, copy=False) for k, v in want.items()})
    info = {"path": str(file.resolve()), "sha256": sha256(file), "tensors": len(want),
            "grpo_config": grpo}
    log.info("agent adapter initialised from %s (%d tensors, sha256 %s)", info["path"],
             info["tensors"], info["sha256"])
    return info
