"""Run the Triton kernels through the interpreter on machines without CUDA.

This must happen before kernels.lora_triton is imported (@triton.jit reads the variable when
it decorates); kernels imports that module lazily, on the first backend="triton" call. On a
CUDA machine the variable is left alone, so the same tests run the compiled kernels on the GPU.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
