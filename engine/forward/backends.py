"""Which kernels a step runs on, decided once per engine (by the model runner, at start-up)
and read by every layer from the forward context, as the callables themselves.

    lora       kernels.LoRAKernels (apply, embedding): "torch" (kernels/reference.py, the CPU
               production path) or "triton" (kernels/lora_triton.py).
    attention  decode rows of engine/layers/attention.py: "torch" (gather whole blocks, then
               SDPA), "triton" (kernels/paged_attention.py reads K/V in place) or "cpu"
               (kernels/cpu_attention.py, a C kernel that reads K/V in place, float32 or bf16).
    linear     dense projections (and lm_head): "torch" (F.linear) or "onednn" (kernels/
               cpu_linear.py: weights packed once at load; the CPU's auto once it passes its
               start-up check).
    elementwise  residual add + RMSNorm, rotary and SiLU-and-mul (engine/layers/norm.py,
               rotary.py, models/llama.py): "torch" (its ops), "cpu" (kernels/cpu_fused.py, C,
               float32 or bf16: the CPU's auto once it passes its start-up check; SiLU stays
               torch's) or "triton" (kernels/fused_triton.py: CUDA's auto once it passes its
               check).
    quant      a quantized base's projections: "torch" (kernels/quant.py, dequantize then GEMM:
               CUDA's for FP8 before sm_89, and the CPU's when its C kernel fails its check),
               "cpu" (kernels/cpu_quant.py, a C kernel dequantizing in registers: the CPU's once
               it passes its start-up check) or "triton" (kernels/quant_triton.py, dequantizing
               in the GEMM's tiles: CUDA). None: the base is not quantized.

`auto` is triton on CUDA and torch elsewhere, except that auto decode attention takes the
Triton kernel on CUDA, and the C kernel on a float32 or bfloat16 CPU engine, only after it
matched the float64 reference on a small random cache of the model's shapes in the engine's
dtype (each module's self_check); otherwise it warns and keeps torch, so a kernel that fails to
compile or is wrong on some machine never serves. (The CPU's "torch" LoRA path runs its decode
bags through kernels/cpu_lora.py's C kernel the same way, checked per dtype at first use.) A
forced backend is used as it is. A model with sliding-window or soft-capped layers (Mistral, Gemma) has the self-check
run with its window and cap too (AttentionShape). Triton on CPU runs under its interpreter
only: TRITON_INTERPRET=1 must be set before the kernels are first imported (tests do this).
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from loragw.engine.forward.elementwise import TORCH, Elementwise, FusedElementwise
from loragw.kernels import (
    LoRAKernels,
    cpu_attention,
    cpu_fused,
    cpu_linear,
    cpu_quant,
    lora_kernels,
)
from loragw.kernels.quant import dequant_linear

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Backends:
    lora: str = "torch"
    attention: str = "torch"
    quant: str | None = None
    linear: str = "torch"
    elementwise: str = "torch"
    # what the layers call, resolved here once from the names: the LoRA kernels, the decode
    # attention kernel (None: the torch path of engine/layers/attention.py) and a quantized
    # projection's GEMM: quant_linear(x [T, I], QuantWeight, bias) -> [T, O]
    lora_kernels: LoRAKernels = field(init=False, repr=False, compare=False)
    decode_attention: Callable | None = field(init=False, repr=False, compare=False)
    # store_kv(k, v, k_cache, v_cache, slots): the step's new K/V into the cache (None: the
    # attention layer's index_copy_)
    store_kv: Callable | None = field(init=False, repr=False, compare=False)
    quant_linear: Callable = field(init=False, repr=False, compare=False)
    # what the layers call for add_rms_norm / rotary / silu_and_mul (engine/forward/elementwise.py)
    fused: Elementwise = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "lora_kernels", lora_kernels(self.lora))
        quant = dequant_linear
        if self.quant == "triton":
            quant = importlib.import_module("loragw.kernels.quant_triton").quant_matmul
        elif self.quant == "cpu":
            quant = cpu_quant.quant_linear
        object.__setattr__(self, "quant_linear", quant)
        decode = store = None
        if self.attention == "triton":  # triton imported only when it serves
            decode = importlib.import_module("loragw.kernels.paged_attention").paged_attention_decode
        elif self.attention == "cpu":
            decode, store = cpu_attention.paged_attention_decode, cpu_attention.store_kv
        object.__setattr__(self, "decode_attention", decode)
        object.__setattr__(self, "store_kv", store)
        fused = FusedElementwise(cpu_fused, silu=False) if self.elementwise == "cpu" else TORCH
        if self.elementwise == "triton":  # triton imported only when it serves
            fused = FusedElementwise(importlib.import_module("loragw.kernels.fused_triton"),
                                     silu=True)
        object.__setattr__(self, "fused", fused)


@dataclass(frozen=True, slots=True)
class AttentionShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None  # the narrowest window of a sliding layer, if any
    softcap: float | None = None  # the score cap of a capped layer, if any


def attention_shape(layers) -> AttentionShape:
    """What decode attention must serve for these PagedAttention layers (this rank's heads)."""
    windows = [layer.sliding_window for layer in layers if layer.sliding_window is not None]
    caps = [layer.softcap for layer in layers if layer.softcap is not None]
    first = layers[0]
    return AttentionShape(first.num_heads, first.num_kv_heads, first.head_dim,
                          min(windows, default=None), caps[0] if caps else None)


def resolve_lora_backend(name: str, device: torch.device) -> str:
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError('lora_backend="triton" on CPU needs TRITON_INTERPRET=1 set before '
                         'start-up; use lora_backend="torch" on CPU')
    return name


def resolve_attention_backend(name: str, device: torch.device, dtype: torch.dtype,
                              shape: AttentionShape) -> str:
    if device.type == "cpu" and name in ("auto", "cpu"):
        return resolve_cpu_attention(name, dtype, shape)
    if name == "cpu":
        raise ValueError(f'attention_backend="cpu" serves a CPU engine; this one is on {device.type}')
    if name != "auto":
        return name
    if device.type != "cuda":
        return "torch"
    paged = importlib.import_module("loragw.kernels.paged_attention")  # triton only on CUDA
    problem = paged.self_check(device, dtype, shape.num_heads, shape.num_kv_heads,
                               shape.head_dim, shape.sliding_window, shape.softcap)
    if problem is not None:
        logger.warning("Triton paged decode attention is off, torch serves decode: %s (force "
                       "it with attention_backend=triton)", problem)
        return "torch"
    return "triton"


def checked(name: str, kernel: str, problem: str | None, what: str, instead: str) -> str:
    """`kernel` when its self-check found no `problem`; else a forced `name` (== kernel) raises
    and auto warns and keeps torch, so a kernel wrong on this machine never serves."""
    if problem is None:
        return kernel
    if name == kernel:
        raise ValueError(f"{what} fails its check here: {problem}")
    logger.warning("%s is off, %s serves: %s", what, instead, problem)
    return "torch"


def resolve_cpu_attention(name: str, dtype: torch.dtype, shape: AttentionShape) -> str:
    if dtype not in cpu_attention.DTYPES and name == "auto":
        return "torch"  # float16: the C kernel takes float32 and bfloat16
    problem = cpu_attention.self_check(dtype, shape.num_heads, shape.num_kv_heads,
                                       shape.head_dim, shape.sliding_window, shape.softcap)
    return checked(name, "cpu", problem, "the CPU decode attention kernel", "torch")


def quant_kind(model) -> str | None:
    """The kind of the model's quantized weights ("int4", "int8", "fp8"), None if it has none."""
    kinds = {linear.weights.scheme.kind for _, linear in model.lora_linears()
             if linear.weights.scheme}
    return "fp8" if "fp8" in kinds else next(iter(kinds), None)


def resolve_quant_backend(kind: str | None, device: torch.device) -> str | None:
    """Triton's dequantizing GEMM on CUDA (FP8 weights need sm_89's e4m3 conversion; before it
    they are dequantized, then multiplied); on the CPU the C kernel once it matched the float64
    oracle (its weights are dequantize's, bit for bit, so only the order of the sums differs from
    the decompressed model's arithmetic), else dequantize-then-GEMM."""
    if kind is None:
        return None
    if device.type == "cpu":
        return checked("auto", "cpu", cpu_quant.self_check(), "the CPU quantized GEMM kernel",
                       "dequantize-then-GEMM")
    if device.type != "cuda":
        return "torch"
    if kind == "fp8" and torch.cuda.get_device_capability(device) < (8, 9):
        logger.warning("FP8 weights on a GPU before sm_89: dequantized, then multiplied")
        return "torch"
    return "triton"


def resolve_linear_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    if name == "torch":
        return name
    if not cpu_linear.supported(device, dtype):
        if name == "onednn":
            raise ValueError(f'linear_backend="onednn" needs the CPU, float32 (or bfloat16 on a '
                             f"CPU with AVX-512 or AVX-NE-CONVERT) and a torch with oneDNN; "
                             f"this is {device.type} {dtype}")
        return "torch"
    return checked(name, "onednn", cpu_linear.self_check(dtype), "oneDNN's packed GEMM", "F.linear")


def resolve_elementwise_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    if name == "torch":
        return name
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError('elementwise_backend="triton" on CPU needs TRITON_INTERPRET=1 set '
                         'before start-up; use "cpu" or "torch" on CPU')
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        fused = importlib.import_module("loragw.kernels.fused_triton")  # triton only where it serves
        return checked(name, "triton", fused.self_check(device, dtype),
                       "the Triton norm, rotary and SiLU kernels", "torch's ops")
    if device.type != "cpu" or dtype not in cpu_fused.DTYPES:
        if name == "cpu":
            raise ValueError(f'elementwise_backend="cpu" needs a float32 or bfloat16 CPU engine; '
                             f"this is {device.type} {dtype}")
        return "torch"
    return checked(name, "cpu", cpu_fused.self_check(dtype), "the CPU norm and rotary kernels",
                   "torch's ops")


def resolve_backends(lora: str, attention: str, device: torch.device, dtype: torch.dtype,
                     shape: AttentionShape, quant: str | None = None,
                     linear: str = "torch", elementwise: str = "torch") -> Backends:
    """The engine's Backends from Config.lora_backend, attention_backend, linear_backend and
    elementwise_backend, and the kind of a quantized base's weights."""
    return Backends(resolve_lora_backend(lora, device),
                    resolve_attention_backend(attention, device, dtype, shape),
                    resolve_quant_backend(quant, device),
                    resolve_linear_backend(linear, device, dtype),
                    resolve_elementwise_backend(elementwise, device, dtype))
