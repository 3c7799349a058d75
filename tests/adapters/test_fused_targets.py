"""Adapters on fused projections (Phi-3's qkv_proj and gate_up_proj): served on a Phi-3 base,
with one A and B's rows per slice; refused, naming the module and what the base offers, where
the base's projections are the other kind. Adapter files are written here (no model needed):
PEFT's key layout, as tests/engine/test_phi3.py checks against PEFT itself."""

import json

import pytest
import safetensors.torch
import torch

from loragw.adapters.errors import AdapterError
from loragw.adapters.format import BaseModelSpec, parse_adapter
from loragw.engine.models import adapter_spec

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=512)
PHI3 = {"architectures": ["Phi3ForCausalLM"], **TINY}
LLAMA = {"architectures": ["LlamaForCausalLM"], **TINY}
Q, KV, INTER, H = 64, 32, 128, 64  # q rows, k (and v) rows, intermediate, hidden
SHAPES = {"qkv_proj": (Q + 2 * KV, H), "o_proj": (H, Q), "gate_up_proj": (2 * INTER, H),
          "down_proj": (H, INTER), "q_proj": (Q, H), "v_proj": (KV, H)}
BLOCK = {"qkv_proj": "self_attn", "o_proj": "self_attn", "q_proj": "self_attn",
         "v_proj": "self_attn", "gate_up_proj": "mlp", "down_proj": "mlp"}


def spec_of(hf_config: dict) -> BaseModelSpec:
    return adapter_spec(hf_config, max_lora_rank=16)


def adapter_files(targets: list[str], r: int = 4, **config) -> tuple[bytes, bytes]:
    """adapter_config.json and adapter_model.safetensors for `targets` in both layers, each
    module's rank from config's rank_pattern (keyed by the module's name) or r."""
    pattern = config.get("rank_pattern", {})
    tensors = {}
    g = torch.Generator().manual_seed(0)
    for layer in range(2):
        for target in targets:
            rank = pattern.get(target, r)
            out_f, in_f = SHAPES[target]
            key = f"base_model.model.model.layers.{layer}.{BLOCK[target]}.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=g)
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=g)
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": 8, "target_modules": targets, **config}
    return json.dumps(cfg).encode(), safetensors.torch.save(tensors)


def test_phi3_base_offers_the_fused_projections():
    spec = spec_of(PHI3)
    projections = {t: s for t, s in spec.module_shapes.items() if t.endswith("_proj")}
    assert projections == {t: SHAPES[t] for t in ("qkv_proj", "o_proj", "gate_up_proj",
                                                   "down_proj")}
    assert spec.fused == {"qkv_proj": (("q_proj", Q), ("k_proj", KV), ("v_proj", KV)),
                          "gate_up_proj": (("gate_proj", INTER), ("up_proj", INTER))}
    assert spec_of(LLAMA).fused == {} and "qkv_proj" not in spec_of(LLAMA).module_shapes


def test_fused_lora_is_one_a_and_b_rows_per_slice_with_patterns_keyed_by_the_fused_name():
    config, weights = adapter_files(["qkv_proj", "gate_up_proj", "o_proj"], r=4,
                                    rank_pattern={"qkv_proj": 8},
                                    alpha_pattern={"gate_up_proj": 2})
    adapter = parse_adapter(config, weights, spec_of(PHI3))
    assert adapter.targets == ("gate_up_proj", "o_proj", "qkv_proj")
    qkv, gate_up = adapter.modules[(1, "qkv_proj")], adapter.modules[(1, "gate_up_proj")]
    assert (qkv.rank, qkv.scaling) == (8, 1.0) and (gate_up.rank, gate_up.scaling) == (4, 0.5)
    slices = adapter.by_slice()
    assert {t for _, t in slices} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                      "up_proj"}
    x = torch.randn(3, H)
    for fused, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")),
                         ("gate_up_proj", ("gate_proj", "up_proj"))):
        whole = adapter.modules[(1, fused)]
        delta = whole.scaling * (x @ whole.lora_a.T) @ whole.lora_b.T  # PEFT's, [3, out]
        per_slice = [slices[(1, p)] for p in parts]
        assert all(s.lora_a is whole.lora_a and s.scaling == whole.scaling for s in per_slice)
        stacked = torch.cat([s.scaling * (x @ s.lora_a.T) @ s.lora_b.T for s in per_slice], -1)
        torch.testing.assert_close(stacked, delta, rtol=0, atol=0)


def test_all_linear_on_phi3_means_the_four_fused_and_plain_projections():
    config, weights = adapter_files(["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    config = json.dumps({**json.loads(config), "target_modules": "all-linear"}).encode()
    adapter = parse_adapter(config, weights, spec_of(PHI3))
    assert adapter.targets == ("down_proj", "gate_up_proj", "o_proj", "qkv_proj")


def test_q_proj_adapter_on_a_phi3_base_is_refused_naming_what_the_base_offers():
    with pytest.raises(AdapterError) as refused:
        parse_adapter(*adapter_files(["q_proj", "v_proj"]), spec_of(PHI3))
    message = str(refused.value)
    assert "'q_proj'" in message and "Phi3ForCausalLM" in message, message
    assert "fuses q_proj into qkv_proj" in message, message
    assert "qkv_proj, o_proj, gate_up_proj, down_proj" in message, message


def test_qkv_proj_adapter_on_a_llama_base_is_refused_naming_what_the_base_offers():
    with pytest.raises(AdapterError) as refused:
        parse_adapter(*adapter_files(["qkv_proj"]), spec_of(LLAMA))
    message = str(refused.value)
    assert "'qkv_proj'" in message and "has no qkv_proj" in message, message
    assert "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj" in message, message


def test_fused_lora_b_of_the_wrong_height_is_refused():
    config, weights = adapter_files(["qkv_proj"])
    tensors = safetensors.torch.load(weights)
    key = "base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight"
    tensors[key] = torch.randn(Q, 4)  # q rows only
    with pytest.raises(AdapterError, match=r"lora_B \[64, 4\]; the base model needs .* \[128, r\]"):
        parse_adapter(config, safetensors.torch.save(tensors), spec_of(PHI3))
