#!/usr/bin/env bash
# Issue 35's checks on a CUDA machine: the GRPO CUDA smoke (resume on the GPU) and the resume /
# interrupt / TensorBoard test with --device auto (CUDA there). Usage: tools/gpu_newcomer.sh
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=tools/gpu_env.sh
source tools/gpu_env.sh
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/gpu_newcomer}
mkdir -p "$out"
python3 -c "import torch, transformers, peft, reasoning_gym; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" 2>&1 | tee "$out/env.txt"
python3 -c "import tensorboard; print('tensorboard', tensorboard.__version__)" 2>&1 | tee -a "$out/env.txt"
python3 -m pytest -q -p no:cacheprovider -rA -x -W "ignore::DeprecationWarning" \
    -W "ignore::FutureWarning" tests/test_grpo_device.py -k cuda 2>&1 | tail -15 | tee "$out/cuda.log"
python3 -m pytest -q -p no:cacheprovider -rA -x -W "ignore::DeprecationWarning" \
    -W "ignore::FutureWarning" tests/test_newcomer_resume.py -k grpo 2>&1 | tail -15 | tee "$out/newcomer.log"
