"""adapters/wire.py: a parsed adapter packed on one side of the engine process boundary comes
back on the other as the same adapter (every field, every tensor bit for bit, a saved pair
that is one tensor still one tensor), without being parsed or validated again."""

from __future__ import annotations

import json

import pytest
import torch

from loragw.adapters.format import LoraAdapter, LoraModuleWeights
from loragw.adapters.lora_config import parse_adapter_config
from loragw.adapters.wire import pack, unpack


@pytest.fixture
def adapter() -> LoraAdapter:
    g = torch.Generator().manual_seed(0)
    config = parse_adapter_config(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8,
        "target_modules": ["qkv_proj", "embed_tokens"], "rank_pattern": {"qkv_proj": 4},
        "modules_to_save": ["lm_head", "embed_tokens"], "layers_to_transform": [0, 1]}).encode())
    modules = {
        (0, "qkv_proj"): LoraModuleWeights(0, "qkv_proj", torch.randn(4, 16, generator=g),
                                           torch.randn(32, 4, generator=g), 2.0,
                                           (("q_proj", 16), ("k_proj", 8), ("v_proj", 8))),
        (1, "experts.down_proj"): LoraModuleWeights(
            1, "experts.down_proj", torch.randn(3, 4, 24, generator=g),
            torch.randn(3, 16, 4, generator=g), 0.5),
        (None, "embed_tokens"): LoraModuleWeights(None, "embed_tokens",
                                                  torch.randn(4, 50, generator=g),
                                                  torch.randn(16, 4, generator=g), 1.0),
    }
    tied = torch.randn(50, 16, generator=g).bfloat16()  # saved as bf16, one tensor for both ends
    return LoraAdapter(config, modules, "ab" * 32, 1234, {"embed_tokens": tied, "lm_head": tied},
                       ("trained on another base",))


def test_an_adapter_crosses_as_it_was(adapter):
    back = unpack(pack(adapter))
    assert back.config == adapter.config
    assert (back.sha256, back.num_bytes, back.warnings) == (adapter.sha256, adapter.num_bytes,
                                                            adapter.warnings)
    assert list(back.modules) == list(adapter.modules)
    for key, want in adapter.modules.items():
        got = back.modules[key]
        assert (got.layer, got.target, got.scaling, got.slices) == (
            want.layer, want.target, want.scaling, want.slices)
        for a, b in ((got.lora_a, want.lora_a), (got.lora_b, want.lora_b)):
            assert a.dtype == b.dtype and torch.equal(a, b)
    assert set(back.saved_modules) == {"embed_tokens", "lm_head"}
    assert back.saved_modules["lm_head"] is back.saved_modules["embed_tokens"]
    assert back.saved_modules["lm_head"].dtype == torch.bfloat16
    assert torch.equal(back.saved_modules["lm_head"], adapter.saved_modules["lm_head"])
    assert back.by_slice().keys() == adapter.by_slice().keys()


def test_untied_saved_modules_stay_two_tensors(adapter):
    saved = {"embed_tokens": torch.zeros(50, 16), "lm_head": torch.ones(50, 16)}
    back = unpack(pack(LoraAdapter(adapter.config, adapter.modules, adapter.sha256,
                                   adapter.num_bytes, saved)))
    assert back.saved_modules["lm_head"] is not back.saved_modules["embed_tokens"]
    assert torch.equal(back.saved_modules["lm_head"], saved["lm_head"])
