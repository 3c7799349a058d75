"""Shared helpers for the CPU benchmarks: a random Llama checkpoint and a timer."""

from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
import time

import torch


def build_random_llama(out_dir: str, hidden: int = 512, layers: int = 8, heads: int = 8,
                       kv_heads: int = 8, intermediate: int = 1376, vocab: int = 8192,
                       seed: int = 0) -> str:
    """A random ~25M-parameter Llama in Hugging Face format (built once, reused)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=2048,
                         tie_word_embeddings=False)
    return save_random(out_dir, seed, lambda: LlamaForCausalLM(config))


def layer_of(key: str) -> int:
    """The decoder layer a checkpoint or adapter tensor name belongs to (-1 for none)."""
    parts = key.split(".")
    return int(parts[parts.index("layers") + 1]) if "layers" in parts else -1


def save_random(out_dir: str, seed: int, make) -> str:
    """The Hugging Face model `make()` builds, its matrices redrawn from N(0, 0.05), saved into
    out_dir once (reused when there)."""
    if os.path.isfile(os.path.join(out_dir, "config.json")):
        return out_dir
    torch.manual_seed(seed)
    model = make()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.05)
    model.save_pretrained(out_dir)
    return out_dir


def demo_model(model: str | None) -> str:
    """`model`, or the demo model (built once under the temp dir) when it is None."""
    if model is not None:
        return model
    from loragw.demo.model import build_demo_model

    return build_demo_model(os.path.join(tempfile.gettempdir(), "lora-gateway-bench"))


def build_llama25m_with_tokenizer(root: str | None = None) -> str:
    """The random ~25M Llama with the demo model's tokenizer, vocabulary and chat template:
    text prompts, detokenized outputs, a step closer to a real model's than the demo's."""
    from loragw.demo.model import build_demo_model

    root = root or tempfile.gettempdir()
    demo = build_demo_model(os.path.join(root, "loragw-bench-demo"))
    with open(os.path.join(demo, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    path = build_random_llama(os.path.join(root, f"loragw-bench-llama25m-v{vocab}"), vocab=vocab)
    for name in os.listdir(demo):  # the tokenizer, its config and chat template
        if name.startswith(("tokenizer", "generation_config")) or name.endswith(".jinja"):
            shutil.copy(os.path.join(demo, name), path)
    return path


def write_adapters(root: str, hf_config, targets: tuple[str, ...], count: int, seed: int,
                   rank: int = 16) -> list[str]:
    """`count` PEFT adapter dirs of rank `rank` on `targets`, random weights (built once)."""
    import safetensors.torch
    from peft import LoraConfig

    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
    head_dim = hidden // hf_config.num_attention_heads
    kv = hf_config.num_key_value_heads * head_dim
    shapes = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
              "o_proj": (hidden, hidden), "gate_proj": (hidden, inter),
              "up_proj": (hidden, inter), "down_proj": (inter, hidden)}  # (in, out)
    dirs = []
    for k in range(count):
        path = os.path.join(root, f"adapter{k:02d}")
        dirs.append(path)
        if os.path.isfile(os.path.join(path, "adapter_model.safetensors")):
            continue
        g = torch.Generator().manual_seed(seed * 1000 + k)
        LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets),
                   task_type="CAUSAL_LM").save_pretrained(path)
        tensors = {}
        for layer in range(hf_config.num_hidden_layers):
            for target in targets:
                block = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                prefix = f"base_model.model.model.layers.{layer}.{block}.{target}"
                fan_in, fan_out = shapes[target]
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
        safetensors.torch.save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    return dirs


def machine() -> str:
    return (f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads")


def timed(totals: dict[str, float], part: str, fn):
    """fn, adding the seconds of each call to totals[part] (a defaultdict(float))."""
    def call(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[part] += time.perf_counter() - start
    return call


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
