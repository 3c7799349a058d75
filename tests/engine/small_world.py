"""A small Llama (2 layers, hidden 64, vocabulary 256) with five adapters of ranks 1-16 on
q, v and down_proj, written without PEFT: the world of the engine's scheduling tests."""

import json
import os

import pytest
import safetensors.torch
import torch

from loragw.engine import LLM
from loragw.engine.config import Config
from loragw.engine.llm_engine import LLMEngine

TARGETS = ("q_proj", "v_proj", "down_proj")
SHAPES = {"q_proj": (64, 64), "v_proj": (64, 32), "down_proj": (128, 64)}  # (in, out)
NUM_ADAPTERS = 5
def write_adapter(path: str, rank: int, seed: int) -> str:
    """A PEFT-format adapter on TARGETS of every layer, written without PEFT."""
    os.makedirs(path)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": list(TARGETS)}, f)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        for target in TARGETS:
            block = "mlp" if target == "down_proj" else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{target}"
            fan_in, fan_out = SHAPES[target]
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.3
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.3
    safetensors.torch.save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[str, dict[str, str]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("lora-scheduling")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
    model.save_pretrained(root / "base")
    adapters = {f"ad{k}": write_adapter(str(root / f"ad{k}"), rank=(1, 4, 8, 16, 2)[k], seed=k)
                for k in range(NUM_ADAPTERS)}
    return str(root / "base"), adapters


def make_llm(checkpoint, **kwargs) -> LLM:
    base, adapters = checkpoint
    llm = LLM(base, device="cpu", dtype="float32", lora_backend="torch", **kwargs)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    return llm


def make_engine(checkpoint, **config) -> LLMEngine:
    """An engine built from a Config directly, for fields that LLM() does not take."""
    base, adapters = checkpoint
    engine = LLMEngine(Config(base, device="cpu", dtype="float32", lora_backend="torch", **config))
    for name, path in adapters.items():
        engine.add_adapter(name, path)
    return engine


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(torch.randint(2, 20, (1,), generator=g)),), generator=g)
            .tolist() for _ in range(n)]
