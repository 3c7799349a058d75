"""The served models' contract (engine/models/base.py, engine/layers/parts.py) and the one
description of the base: for every family, what adapters are checked against
(engine.models.adapter_spec) is the model the engine builds from the same config.json, and the
parts answer the loader and the slot pool through their declared interface."""

import json
import os

import pytest
import torch
from checkpoints import ARCHS
from torch import nn

from loragw.adapters.types import EMBED_TOKENS, EXPERT_TARGETS, LM_HEAD, ROUTER
from loragw.engine.layers.norm import RMSNorm
from loragw.engine.layers.parts import Block, Loadable
from loragw.engine.models import adapter_spec, model_args, model_class

MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def built(path: str):
    """(config.json as a dict, the model built from it on the meta device)."""
    with open(os.path.join(path, "config.json")) as f:
        hf_config = json.load(f)
    with torch.device("meta"):
        return hf_config, model_class(hf_config)(model_args(hf_config))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_the_spec_is_the_model_the_engine_builds(tiny_checkpoint, arch):
    hf_config, model = built(tiny_checkpoint(arch))
    spec = adapter_spec(hf_config, max_lora_rank=8)
    hidden = model.args.hidden_size
    assert spec.num_layers == len(model.model.layers)
    assert spec.tie_word_embeddings == model.lm_head.tied
    assert spec.module_shapes[LM_HEAD] == (model.lm_head.vocab_size, hidden)
    assert spec.module_shapes[EMBED_TOKENS] == (hidden, model.model.embed_tokens.vocab_size)
    assert spec.fused == model.fused_projections
    fused_into = {part: (module, rows) for module, slices in spec.fused.items()
                  for part, rows in slices}
    layers_of: dict[str, set[int]] = {}
    for layer, linear in model.lora_linears():
        for name, target in zip(linear.slice_names, linear.lora_names, strict=True):
            rows = linear.slice_rows(name)
            if target in fused_into:  # Phi-3: the adapter's target is the fused module
                module, want = fused_into[target]
                assert rows.stop - rows.start == want
                assert spec.module_shapes[module][1] == linear.in_features
                target = module
            else:
                assert spec.module_shapes[target] == (rows.stop - rows.start, linear.in_features)
            layers_of.setdefault(target, set()).add(layer)
    experts = dict(model.expert_modules())
    assert spec.moe_layers == tuple(experts)
    assert spec.num_experts == (spec.module_shapes[ROUTER][0] if experts else 0)
    for module in experts.values():
        assert spec.num_experts == module.num_experts
        for target, param in zip(EXPERT_TARGETS, ("gate_up_proj", "down_proj"), strict=True):
            assert spec.module_shapes[target] == tuple(getattr(module, param).shape[1:])
    # the MLP's projections an adapter may target exist exactly on the layers that are dense
    dense = set(range(spec.num_layers)) - set(spec.moe_layers)
    assert layers_of.get("down_proj", set()) == dense
    assert (arch in MOE) == bool(experts)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_part_answers_through_its_interface(tiny_checkpoint, arch):
    _, model = built(tiny_checkpoint(arch))
    owners = {model.get_submodule(name.rpartition(".")[0]) for name, _ in model.named_parameters()}
    assert all(isinstance(owner, Loadable) for owner in owners)
    for layer in model.model.layers:
        assert isinstance(layer, Block) and isinstance(layer.self_attn, Block)
        attention = layer.self_attn
        norms = (attention.q_norm, attention.k_norm)
        if model.args.qk_norm is None:
            assert all(isinstance(n, nn.Identity) for n in norms)
        else:
            assert all(isinstance(n, RMSNorm) for n in norms)
            whole = model.args.qk_norm == "whole"  # OLMoE: over all heads at once
            width = attention.num_heads * attention.head_dim if whole else attention.head_dim
            assert attention.q_norm.weight.shape == (width,)
    assert (model.args.qk_norm is not None) == (arch in ("qwen3", "qwen3_moe", "olmoe", "gemma3"))


def test_a_dense_model_has_no_experts(tiny_checkpoint):
    _, model = built(tiny_checkpoint("llama"))
    assert list(model.expert_modules()) == []
    total, active = model.parameter_counts()
    assert total == active == sum(p.numel() for p in model.parameters())
