#!/usr/bin/env bash
# The CUDA checks, for a machine with a GPU: every test whose name says cuda (the trainers'
# one-step smokes with resume, CUDA peaks in the monitor, placement, out-of-memory handling),
# with INFO logs shown so each trainer's memory plan and per-phase CUDA peaks appear.
# Optional wheels for a machine without network: put them in .whl/ (see docs/internals.md).
# Usage: tools/gpu_smoke.sh [OUTDIR]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/gpu_smoke}}
mkdir -p "$out"
# shellcheck source=tools/gpu_env.sh
source tools/gpu_env.sh
export PYTHONUNBUFFERED=1 RLBUFFERS_REQUIRE_ALL=1  # a missing package fails, never skips
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'peft', peft.__version__, 'cuda', torch.cuda.is_available())" \
    | tee -a "$out/gpu.txt"
python3 -m pytest -q -p no:cacheprovider -rA -k cuda -o log_cli=true --log-cli-level=INFO \
    -W "ignore::DeprecationWarning" -W "ignore::FutureWarning" -W "ignore::SyntaxWarning" \
    tests/test_grpo_device.py tests/test_crsp.py tests/test_guidance.py \
    tests/test_memory_budget.py tests/test_memory_micro_batch.py tests/test_memory_monitor.py \
    tests/test_memory_placement.py tests/test_memory_polyak.py 2>&1 | tee "$out/cuda_tests.log"
