#!/usr/bin/env bash
# One device-machine call: every GPU-marked test, then the GPU kernel benchmarks; everything
# lands under $OUT (the device tool brings that folder back). Runs with the machine image's own
# python3 (torch, triton, transformers, peft, safetensors are there; litestar/xgrammar/redis are
# not, and the kernel tests and engine do not need them). From the repository root:
#
#     bash benchmarks/gpu_session.sh            (device tool: timeout_s 540)
#
# Order matters: correctness first (CUDA decode attention and LoRA default to the Triton
# kernels), so a broken kernel is known even if the benchmarks run out of time.
set -uo pipefail
OUT=${OUT:-/tmp/loragw-gpu}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
} 2>&1 | tee "$OUT/machine.txt"

# Every test marked gpu: compiled Triton kernels, CUDA graphs, bf16.
timeout 240 $PY -m pytest tests/kernels -m gpu -q -p no:cacheprovider \
  --junitxml="$OUT/gpu_tests.xml" 2>&1 | tail -40 | tee "$OUT/gpu_tests.txt"

# LoRA shrink/expand and decode attention tables (markdown), ~3 minutes on an H200.
timeout 240 $PY -m benchmarks.bench_kernels_gpu --out "$OUT/bench_kernels.md" \
  --kernels lora,attention 2>&1 | tail -60 | tee "$OUT/bench_kernels.txt"
echo "done: $(ls "$OUT")"
