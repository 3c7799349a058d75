"""Adapters saved by real PEFT, for tests that check the loader against PEFT itself: a tiny
Llama, a PEFT LoraConfig (LoRA and/or modules_to_save), random weights, ``save_pretrained``,
then ``PeftModel.from_pretrained`` on a fresh base, whose weights are what the loader must match.

Used by test_saved_modules.py (modules_to_save) and test_vocab_targets.py (LoRA on
embed_tokens / lm_head). peft and transformers are imported only when adapters are saved.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch

from loragw.adapters.format import BaseModelSpec, LoraAdapter, parse_adapter
from loragw.adapters.types import MODEL_TARGETS

TINY = dict(architectures=["LlamaForCausalLM"], hidden_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=128)  # fmt: skip
EMBED = "base_model.model.model.embed_tokens"  # the PEFT key prefixes of the vocabulary ends
HEAD = "base_model.model.lm_head"


@dataclass(frozen=True)
class SavedByPeft:
    path: Path  # the folder save_pretrained wrote
    base_config: dict  # the tiny base's config.json, as a dict
    reloaded: torch.nn.Module  # PeftModel.from_pretrained(fresh base, path)


def module_key(module_name: str) -> tuple[int | None, str]:
    """'model.layers.1.self_attn.q_proj' -> (1, 'q_proj'); 'lm_head' -> (None, 'lm_head')."""
    target = module_name.rsplit(".", 1)[-1]
    return (None, target) if target in MODEL_TARGETS else (
        int(module_name.split(".")[2]), target)


def lora_weights(model) -> Iterator[tuple[str, torch.Tensor, torch.Tensor, torch.nn.Module]]:
    """(module name, A, B, module) of adapter 'default', embeddings included."""
    for name, module in model.base_model.model.named_modules():
        if hasattr(module, "lora_embedding_A") and "default" in module.lora_embedding_A:
            yield name, module.lora_embedding_A["default"], module.lora_embedding_B["default"], module
        elif hasattr(module, "lora_A") and "default" in module.lora_A:
            yield name, module.lora_A["default"].weight, module.lora_B["default"].weight, module


def saved_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """target -> the adapter's own copy, as PEFT's ModulesToSaveWrapper holds it."""
    for name, module in model.base_model.model.named_modules():
        if hasattr(module, "modules_to_save") and "default" in module.modules_to_save:
            yield name.rsplit(".", 1)[-1], module.modules_to_save["default"].weight


def save_with_peft(variants: dict[str, tuple[bool, dict]], tmp_path_factory) -> dict[str, SavedByPeft]:
    """Each variant, name -> (tie_word_embeddings, peft LoraConfig kwargs), saved by PEFT with
    random LoRA weights and trained-looking saved copies, and reloaded by PEFT."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    out, g = {}, torch.Generator().manual_seed(0)
    for name, (tied, lora_kwargs) in variants.items():
        config = LlamaConfig(**TINY, tie_word_embeddings=tied)
        model = get_peft_model(LlamaForCausalLM(config), LoraConfig(**lora_kwargs))
        with torch.no_grad():
            for _, a, b, _ in lora_weights(model):  # PEFT starts one side at zero
                a.copy_(torch.randn(a.shape, generator=g))
                b.copy_(torch.randn(b.shape, generator=g))
            for _, w in saved_weights(model):  # a trained copy, off the base weights
                w.add_(torch.randn(w.shape, generator=g))
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        reloaded = PeftModel.from_pretrained(LlamaForCausalLM(config), path)
        out[name] = SavedByPeft(path, config.to_dict(), reloaded)
    return out


def saved_files(path: Path) -> tuple[bytes, dict[str, torch.Tensor]]:
    """(adapter_config.json bytes, the tensors of adapter_model.safetensors) of a saved folder."""
    weights = safetensors.torch.load((path / "adapter_model.safetensors").read_bytes())
    return (path / "adapter_config.json").read_bytes(), dict(weights)


def load_edited(path: Path, spec: BaseModelSpec,
                edit: Callable[[dict[str, torch.Tensor]], object] | None = None,
                config_changes: dict | None = None) -> LoraAdapter:
    """Load a saved adapter after editing its tensors in place and/or its config's fields."""
    config, tensors = saved_files(path)
    if edit is not None:
        edit(tensors)
    if config_changes:
        config = json.dumps({**json.loads(config), **config_changes}).encode()
    return parse_adapter(config, safetensors.torch.save(tensors), spec)


def without_vocabulary(spec: BaseModelSpec) -> BaseModelSpec:
    """`spec` with no embed_tokens / lm_head shapes (the engine's always have them): a base
    whose vocabulary adapters/ cannot check against."""
    return dataclasses.replace(spec, module_shapes={
        target: shape for target, shape in spec.module_shapes.items()
        if target not in MODEL_TARGETS})
