"""How kernels/paged_attention.py's decode launch is tiled and split: DecodeConfig and the
rule that picks it (`decode_config`), apart from the kernel so kernels/compile_targets.py and
the tests can enumerate configs without reading the kernel. Imports no Triton.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # as kernels/paged_attention.py reads it
# Split each context until the grid has about PROGRAMS_PER_SM programs per SM of the device
# (DECODE_TARGET_PROGRAMS when the device is unknown), at most MAX_SPLITS ways. With 8 kv heads
# on a 132-SM H100/H200 (target 1056): B=64 -> 4 splits, B=256 -> 1, B=1 -> 32.
PROGRAMS_PER_SM = 8
DECODE_TARGET_PROGRAMS = 1024
MAX_SPLITS = 32


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    block_n: int      # context tokens per loop step (a power of 2 >= 16)
    num_splits: int   # programs sharing one (sequence, kv head)'s context; > 1 adds the reduce
    num_warps: int = 4
    num_stages: int = 2


def num_splits_for(batch: int, num_kv_heads: int, target_programs: int = DECODE_TARGET_PROGRAMS,
                   max_splits: int = MAX_SPLITS) -> int:
    """Smallest power of 2 that brings B * n_kv_heads * splits to target_programs (capped)."""
    splits = 1
    while batch * num_kv_heads * splits < target_programs and splits < max_splits:
        splits *= 2
    return splits


@cache
def _target_programs(device_index: int) -> int:
    return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_config(batch: int, num_kv_heads: int, head_dim: int, device: torch.device | None = None,
                  interpret: bool = INTERPRET) -> DecodeConfig:
    """64-token tiles (32 past head_dim 128, to bound registers) and num_splits_for(...) on a GPU;
    one split of 128-token tiles under the interpreter (one program at a time)."""
    if interpret:
        return DecodeConfig(block_n=128, num_splits=1)
    target = DECODE_TARGET_PROGRAMS
    if device is not None and device.type == "cuda":
        target = _target_programs(device.index if device.index is not None else torch.cuda.current_device())
    return DecodeConfig(block_n=64 if head_dim <= 128 else 32,
                        num_splits=num_splits_for(batch, num_kv_heads, target),
                        num_warps=4 if head_dim <= 128 else 8)


def decode_grid(batch: int, num_kv_heads: int, cfg: DecodeConfig) -> tuple[int, int, int]:
    return (batch, num_kv_heads, cfg.num_splits)
