"""The one engine Config. Components copy out the fields they need."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LORA_BACKENDS = ("auto", "torch", "triton")


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, hf_config: dict) -> torch.dtype:
    """`auto`: the checkpoint's dtype on CUDA; float32 on CPU (bf16 matmuls there are ~100x slower)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        return DTYPES.get(str(hf_config.get("torch_dtype") or hf_config.get("dtype")), torch.bfloat16)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


@dataclass(frozen=True)
class Config:
    model: str
    device: str = "auto"
    dtype: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    # Reuse the KV blocks of earlier requests with the same leading tokens and adapter version
    # (vLLM V1's default). Off: every prompt is prefilled in full.
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None
    max_model_len: int | None = None
    # Fraction of free memory the KV cache may take when num_kv_blocks is not given.
    kv_cache_memory_fraction: float = 0.5
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # host-memory LRU of parsed adapters; None = max(max_loras, 16)
    lora_backend: str = "auto"
    # Aging for adapter slots: once a request has been refused a slot for this many scheduling
    # steps, one resident adapter stops admitting new requests until its slot drains and
    # passes to it. Counted in steps, not seconds, so it bounds the wait in forward passes
    # whatever the hardware and is deterministic in tests. None turns aging off.
    lora_starvation_steps: int | None = 32
    # Adapters with PEFT modules_to_save (their own full embed_tokens and/or lm_head, a
    # [vocab, hidden] matrix each: about 1 GB per module on an 8B model in bf16) that may be on
    # the device at once. Each also holds one of the max_loras slots; its copies are allocated
    # when it is loaded and freed when it leaves. 0 (the default) refuses such adapters.
    max_full_module_slots: int = 0
    seed: int = 0
    hf_config: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not os.path.isdir(self.model):
            raise ValueError(f"model path {self.model!r} is not a directory")
        config_path = os.path.join(self.model, "config.json")
        if not os.path.isfile(config_path):
            raise ValueError(f"{self.model!r} has no config.json; expected a Hugging Face checkpoint")
        with open(config_path) as f:
            object.__setattr__(self, "hf_config", json.load(f))
        positive = ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_loras",
                    "max_lora_rank")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.lora_starvation_steps is not None and self.lora_starvation_steps < 1:
            raise ValueError(f"lora_starvation_steps must be at least 1 (or None to disable "
                             f"aging), got {self.lora_starvation_steps}")
        if not 0 <= self.max_full_module_slots <= self.max_loras:
            raise ValueError(f"max_full_module_slots must be in [0, max_loras={self.max_loras}] "
                             "(each adapter with saved modules also holds a LoRA slot), got "
                             f"{self.max_full_module_slots}")
        if self.lora_backend not in LORA_BACKENDS:
            raise ValueError(f"lora_backend must be one of {LORA_BACKENDS}, got {self.lora_backend!r}")
        context = self.hf_config.get("max_position_embeddings", 4096)
        if self.max_model_len is None:
            object.__setattr__(self, "max_model_len", context)
        elif self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}")

    @property
    def torch_device(self) -> torch.device:
        return resolve_device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype, self.torch_device, self.hf_config)
