#!/usr/bin/env bash
# The CUDA checks, for a machine with a GPU (docs/cuda.md): every test whose name says cuda or
# gpu (the trainers' one-step smokes with resume, CUDA peaks in the monitor, placement,
# out-of-memory handling), with INFO logs shown so each trainer's memory plan and per-phase
# CUDA peaks appear; then, given LM_DIR and ENCODER_DIR (config + tokenizer directories of the
# default models), each LLM trainer for a few steps at its defaults on real-size random models
# (tools/gpu_random_models.py); with T3 > 0, the LLM test files with CUDA visible (their
# --device auto picks it; needs pytest-xdist).
# Warnings stay errors, as in CI: ignoring DeprecationWarning here once hid that every trainer
# flag parser broke on Python 3.12 (BooleanOptionalAction with a type).
# Optional wheels for a machine without network: put them in .whl/ (tools/gpu_env.sh).
# Usage: tools/gpu_smoke.sh [OUTDIR] [LM_DIR ENCODER_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/gpu_smoke}}
mkdir -p "$out"
# shellcheck source=tools/gpu_env.sh
source tools/gpu_env.sh
export PYTHONUNBUFFERED=1 RLBUFFERS_REQUIRE_ALL=1  # a missing package fails, never skips
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import sys, torch, transformers, peft; print('python', sys.version.split()[0],
'torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__,
'cuda', torch.cuda.is_available())" | tee -a "$out/gpu.txt"
timeout "${T1:-300}" python3 -m pytest -q -p no:cacheprovider -rA -k "cuda or gpu" \
    -o log_cli=true --log-cli-level=INFO \
    tests/test_grpo_device.py tests/test_crsp.py tests/test_guidance.py \
    tests/test_memory_budget.py tests/test_memory_micro_batch.py tests/test_memory_monitor.py \
    tests/test_memory_placement.py tests/test_memory_polyak.py > "$out/cuda_tests.log" 2>&1
echo "cuda tests rc $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$out/cuda_tests.log"
if [ $# -ge 3 ]; then
    models=$(mktemp -d)
    python3 tools/gpu_random_models.py "$models" "$2" "$3" || exit 1
    tv=""; [ -x /usr/bin/time ] && tv="/usr/bin/time -v"
    trainer() {
        name=$1; shift; echo "== $name $(date +%T)"
        $tv timeout "${T2:-240}" python3 -m "trainers.$name" --device cuda \
            --run-dir "$models/runs/$name" "$@" > "$out/$name.log" 2>&1
        echo "$name rc $?"
        grep -E "step [0-9]+:|iteration [0-9]+:|peak RSS|Maximum resident|Elapsed" \
            "$out/$name.log" | sed 's/.*INFO/INFO/'
    }
    trainer grpo --model "$models/smollm2" --steps 3 --no-evaluate
    trainer crsp --model "$models/smollm2" --steps 2
    trainer guidance --model "$models/smollm2" --critic-model "$models/minilm" \
        --iterations 1 --eval-size 4
fi
if [ "${T3:-0}" != 0 ]; then
    timeout "$T3" python3 -m pytest -q -p no:cacheprovider -p no:benchmark -n "${WORKERS:-8}" \
        tests/test_grpo.py tests/test_crsp.py tests/test_crsp_selfplay.py \
        tests/test_crsp_verdict.py tests/test_crsp_critic_reward.py tests/test_guidance.py \
        tests/test_memory_activations.py tests/test_memory_logprobs.py \
        tests/test_memory_reference.py tests/test_memory_prefix_attention.py \
        tests/test_llm_evaluation.py > "$out/files_cuda_visible.log" 2>&1
    echo "test files with CUDA visible rc $?"
    grep -E "^(FAILED|ERROR)|passed|failed" "$out/files_cuda_visible.log"
fi
