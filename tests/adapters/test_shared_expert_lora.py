"""LoRA on Qwen2-MoE's shared expert (``mlp.shared_expert.gate_proj`` ...) and its gate
(``mlp.shared_expert_gate`` [1, H]): served on a sparse layer with the shared expert's shapes,
beside a dense layer's plain ``mlp.gate_proj``; refused, naming the module, where the layer or
the base has no such module. Adapter files are written here in PEFT's key layout, which
tests/engine/test_moe.py checks against PEFT itself."""

import json

import pytest
import safetensors.torch
import torch

from loragw.adapters.errors import AdapterError
from loragw.adapters.format import BaseModelSpec, parse_adapter
from loragw.engine.models import adapter_spec

H, INTER, SHARED, MOE_INTER = 32, 128, 80, 48  # hidden, dense MLP, shared expert, one expert
QWEN2_MOE = dict(architectures=["Qwen2MoeForCausalLM"], hidden_size=H, intermediate_size=INTER,
                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                 num_experts=3, num_experts_per_tok=2, vocab_size=64,
                 moe_intermediate_size=MOE_INTER,
                 shared_expert_intermediate_size=SHARED, mlp_only_layers=[1])  # fmt: skip
# Qwen3-MoE has no shared expert; every layer sparse
QWEN3_MOE = {k: v for k, v in QWEN2_MOE.items() if k not in (
    "shared_expert_intermediate_size", "mlp_only_layers")} | {"architectures": ["Qwen3MoeForCausalLM"]}
MLP = ("gate_proj", "up_proj", "down_proj")
PREFIX = "base_model.model.model.layers"


def spec_of(hf_config: dict) -> BaseModelSpec:
    return adapter_spec(hf_config, max_lora_rank=8)


def files(modules: dict[str, tuple[int, int]], r: int = 4, **config) -> tuple[bytes, bytes]:
    """adapter_config.json and adapter_model.safetensors with a rank-r LoRA on every module
    (its path under model.layers, e.g. '0.mlp.shared_expert.gate_proj': (out, in))."""
    tensors = {}
    for path, (out_f, in_f) in modules.items():
        tensors[f"{PREFIX}.{path}.lora_A.weight"] = torch.randn(r, in_f)
        tensors[f"{PREFIX}.{path}.lora_B.weight"] = torch.randn(out_f, r)
    raw = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r,
           "target_modules": [*MLP, "shared_expert_gate"]} | config
    return json.dumps(raw).encode(), safetensors.torch.save(tensors)


SHARED_SHAPES = {"gate_proj": (SHARED, H), "up_proj": (SHARED, H), "down_proj": (H, SHARED)}
DENSE_SHAPES = {"gate_proj": (INTER, H), "up_proj": (INTER, H), "down_proj": (H, INTER)}
ALL = ({f"{i}.mlp.shared_expert.{t}": s for i in (0, 2) for t, s in SHARED_SHAPES.items()}
       | {f"{i}.mlp.shared_expert_gate": (1, H) for i in (0, 2)}
       | {f"1.mlp.{t}": s for t, s in DENSE_SHAPES.items()})


def test_spec_offers_the_shared_expert_and_its_gate():
    shapes = spec_of(QWEN2_MOE).module_shapes
    assert {t: shapes[f"shared_expert.{t}"] for t in MLP} == SHARED_SHAPES
    assert shapes["shared_expert_gate"] == (1, H)
    assert {t: shapes[t] for t in MLP} == DENSE_SHAPES  # the dense layers' MLP
    assert not any(t.startswith("shared_expert") for t in spec_of(QWEN3_MOE).module_shapes)


def test_shared_expert_and_dense_mlp_load_each_with_its_shape():
    adapter = parse_adapter(*files(ALL), spec_of(QWEN2_MOE))
    got = {key: tuple(w.lora_b.shape[:1]) + tuple(w.lora_a.shape[1:])
           for key, w in adapter.modules.items()}
    assert got[(0, "shared_expert.gate_proj")] == (SHARED, H)
    assert got[(2, "shared_expert.down_proj")] == (H, SHARED)
    assert got[(2, "shared_expert_gate")] == (1, H)
    assert got[(1, "gate_proj")] == (INTER, H)
    assert len(got) == len(ALL)


def test_dense_mlp_key_on_a_sparse_layer_refused():
    bad = ALL | {"0.mlp.up_proj": DENSE_SHAPES["up_proj"]}
    with pytest.raises(AdapterError, match=r"layers\.0\.mlp\.up_proj\.lora_A.*is for mlp\.up_proj,"
                                           r" which layer 0 .* experts .* and a shared expert"):
        parse_adapter(*files(bad), spec_of(QWEN2_MOE))


def test_shared_expert_key_on_a_dense_layer_refused():
    bad = ALL | {"1.mlp.shared_expert_gate": (1, H)}
    with pytest.raises(AdapterError, match=r"is for mlp\.shared_expert_gate, which layer 1 .*"
                                           r" a dense MLP \(mlp\.gate_proj"):
        parse_adapter(*files(bad), spec_of(QWEN2_MOE))


@pytest.mark.parametrize("module", ["shared_expert.down_proj", "shared_expert_gate"])
def test_shared_expert_key_on_a_base_without_one_refused(module):
    shapes = SHARED_SHAPES | {"shared_expert_gate": (1, H)}
    one = {f"0.mlp.{module}": shapes[module.removeprefix("shared_expert.")]}
    with pytest.raises(AdapterError, match=rf"targets module '{module}'.*Qwen3MoeForCausalLM.*"
                                           r"no shared expert"):
        parse_adapter(*files(one), spec_of(QWEN3_MOE))


def test_dense_shapes_on_the_shared_expert_refused():
    bad = ALL | {"0.mlp.shared_expert.gate_proj": DENSE_SHAPES["gate_proj"]}
    with pytest.raises(AdapterError, match=r"layers\.0\.mlp\.shared_expert\.gate_proj' has"
                                           rf" lora_A \[4, {H}\] and lora_B \[{INTER}, 4\]"):
        parse_adapter(*files(bad), spec_of(QWEN2_MOE))


def test_untargeted_shared_expert_gate_refused():
    with pytest.raises(AdapterError, match=r"module 'model\.layers\.0\.mlp\.shared_expert_gate',"
                                           r" which adapter_config.json does not target"):
        parse_adapter(*files(ALL, target_modules=list(MLP)), spec_of(QWEN2_MOE))


def test_all_linear_targets_the_shared_expert_and_its_gate():
    adapter = parse_adapter(*files(ALL, target_modules="all-linear"), spec_of(QWEN2_MOE))
    assert (0, "shared_expert_gate") in adapter.modules
