"""The gateway tests' adapters: random PEFT LoRAs large enough to change greedy output, and
the names the directory's live gateway serves them under (conftest.py builds it)."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from loragw.adapters.types import BLOCK_OF
from loragw.engine.models import adapter_spec

NUM_ADAPTERS = 8
MAX_LORAS = 4
MAX_MODEL_LEN = 512
ADAPTERS = [f"lora-{i}" for i in range(NUM_ADAPTERS)]
BASE = "demo-base"


def write_random_adapter(out_dir: str, hf_config: dict, seed: int, rank: int = 8,
                         scale: float = 0.1, targets: tuple[str, ...] = ("q_proj", "v_proj")
                         ) -> str:
    """A PEFT LoRA on `targets` with random A and B (B nonzero, unlike PEFT's init) large
    enough that greedy outputs differ from the base model's."""
    shapes = adapter_spec(hf_config, max_lora_rank=rank).module_shapes
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(hf_config["num_hidden_layers"]):
        for proj in targets:
            out_features, in_features = shapes[proj]
            key = f"base_model.model.model.layers.{layer}.{BLOCK_OF[proj]}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=g) * scale
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=g) * scale
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
              "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none"}
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return out_dir
