#!/usr/bin/env bash
# Every GPU-marked test, then the GPU benchmarks, in one run on a CUDA machine; each result file
# is written to OUT_DIR. Needs a CUDA GPU, nvidia-smi, and a python3 with torch, triton,
# transformers, peft and safetensors (litestar, xgrammar and redis are not needed: the kernel
# tests and the engine run without them). From the repository root:
#
#     bash benchmarks/gpu_session.sh [OUT_DIR]      (default $OUT, else /tmp/loragw-gpu; PY=python3)
#
# Each step has a timeout of its own; together they come to 590 s. The quantized-base tests need
# a quantized world built where llm-compressor installs (`make quant-world` on the CPU machine,
# then carry .quant-world to the GPU one; LORAGW_QUANT_WORLD points there). Order matters: correctness
# first (CUDA decode attention and LoRA default to the Triton kernels), so a broken kernel is
# known even if the benchmarks run out of time.
set -uo pipefail
OUT_DIR=${1:-${OUT:-/tmp/loragw-gpu}}
PY=${PY:-python3}
mkdir -p "$OUT_DIR"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
} 2>&1 | tee "$OUT_DIR/machine.txt"

# The engine on the GPU first: CUDA-graph replay vs eager token for token, graphs vs PEFT in
# float32, bf16/fp16 vs PEFT on the same GPU (tests/engine: test_cuda_graphs, test_dtype_parity).
timeout 145 $PY -P -m pytest tests/engine/test_cuda_graphs.py tests/engine/test_dtype_parity.py \
  -m gpu -q -p no:cacheprovider -o log_cli=true --log-cli-level=INFO \
  --junitxml="$OUT_DIR/gpu_engine_tests.xml" 2>&1 | tail -60 | tee "$OUT_DIR/gpu_engine_tests.txt"

# The fused norm / rotary / SiLU kernels and the quantized bases' Triton GEMM against their
# float64 oracles on the GPU, then the engine on
# every scheme the tools write, float32 token for token with the CPU oracle, eager and graphs.
timeout 60 $PY -P -m pytest tests/kernels/test_quant_triton.py tests/kernels/test_fused_triton.py \
  -q -p no:cacheprovider \
  --junitxml="$OUT_DIR/gpu_quant_kernels.xml" 2>&1 | tail -20 | tee "$OUT_DIR/gpu_quant_kernels.txt"
LORAGW_QUANT_WORLD=${LORAGW_QUANT_WORLD:-$PWD/.quant-world/llama} timeout 90 $PY -P -m pytest \
  tests/engine/test_quant_gpu.py -m gpu -q -p no:cacheprovider \
  --junitxml="$OUT_DIR/gpu_quant_engine.xml" 2>&1 | tail -30 | tee "$OUT_DIR/gpu_quant_engine.txt"

# Then every kernel test marked gpu: compiled Triton kernels at Llama-3-8B shapes.
timeout 75 $PY -P -m pytest tests/kernels -m gpu -q -p no:cacheprovider \
  --junitxml="$OUT_DIR/gpu_tests.xml" 2>&1 | tail -40 | tee "$OUT_DIR/gpu_tests.txt"

# Host overhead per decode step on the GPU: eager, with CUDA graphs, and with graphs and async
# scheduling (the host's work of a step overlapping the device's).
timeout 60 $PY benchmarks/bench_step_overhead.py --device cuda --out "$OUT_DIR/step_overhead.md" \
  2>&1 | tail -30 | tee "$OUT_DIR/step_overhead.txt"

# LoRA shrink/expand and decode attention tables (markdown), ~3 minutes on an H200.
timeout 100 $PY benchmarks/bench_kernels_gpu.py --out "$OUT_DIR/bench_kernels.md" \
  --kernels lora,attention 2>&1 | tail -60 | tee "$OUT_DIR/bench_kernels.txt"
# The W4A16 / W8A16 / FP8 decode GEMM table at Llama-3-8B's projections.
timeout 60 $PY benchmarks/bench_quant_gpu.py --out "$OUT_DIR/bench_quant_gpu.md" 2>&1 | tail -60 \
  | tee "$OUT_DIR/bench_quant_gpu.txt"
echo "done: $(ls "$OUT_DIR")"
