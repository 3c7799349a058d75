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

# The engine on the GPU first: CUDA-graph replay vs eager token for token, graphs vs PEFT in
# float32, bf16/fp16 vs PEFT on the same GPU (tests/engine: test_cuda_graphs, test_dtype_parity).
timeout 170 $PY -m pytest tests/engine/test_cuda_graphs.py tests/engine/test_dtype_parity.py \
  -m gpu -q -p no:cacheprovider -o log_cli=true --log-cli-level=INFO \
  --junitxml="$OUT/gpu_engine_tests.xml" 2>&1 | tail -60 | tee "$OUT/gpu_engine_tests.txt"

# Then every kernel test marked gpu: compiled Triton kernels at Llama-3-8B shapes.
timeout 120 $PY -m pytest tests/kernels -m gpu -q -p no:cacheprovider \
  --junitxml="$OUT/gpu_tests.xml" 2>&1 | tail -40 | tee "$OUT/gpu_tests.txt"

# Host overhead per decode step on the GPU, eager and with CUDA graphs.
timeout 60 $PY -m benchmarks.bench_step_overhead --device cuda --out "$OUT/step_overhead.md" \
  2>&1 | tail -30 | tee "$OUT/step_overhead.txt"

# LoRA shrink/expand and decode attention tables (markdown), ~3 minutes on an H200.
timeout 150 $PY -m benchmarks.bench_kernels_gpu --out "$OUT/bench_kernels.md" \
  --kernels lora,attention 2>&1 | tail -60 | tee "$OUT/bench_kernels.txt"
echo "done: $(ls "$OUT")"
