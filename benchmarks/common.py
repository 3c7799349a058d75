"""Shared helpers for the CPU benchmarks: a random Llama checkpoint and a timer."""

from __future__ import annotations

import json
import os
import platform
import time

import torch


def build_random_llama(out_dir: str, hidden: int = 512, layers: int = 8, heads: int = 8,
                       kv_heads: int = 8, intermediate: int = 1376, vocab: int = 8192,
                       seed: int = 0) -> str:
    """A random ~25M-parameter Llama in Hugging Face format (built once, reused)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    marker = os.path.join(out_dir, "config.json")
    if os.path.isfile(marker):
        return out_dir
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=2048,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.05)
    model.save_pretrained(out_dir)
    return out_dir


def machine() -> str:
    return (f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads")


class Timer:
    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start


def write_json(path: str | None, data: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=2)
