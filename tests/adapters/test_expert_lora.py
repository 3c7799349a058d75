"""LoRA on an MoE base's parameters (PEFT's target_parameters: the fused experts and the router):
what the loader returns gives exactly PEFT's own delta weights (ParamWrapper.get_delta_weight,
after PeftModel.from_pretrained), and malformed adapters are refused naming what is wrong."""

import json

import pytest
import safetensors.torch
import torch

from loragw.adapters.errors import AdapterError
from loragw.adapters.format import BaseModelSpec, parse_adapter, read_adapter
from loragw.adapters.lora_config import parse_adapter_config
from loragw.engine.models import adapter_spec

# hidden 32 != moe intermediate 48, so every factor's shape says which parameter it is for
MIXTRAL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, num_local_experts=3,
               num_experts_per_tok=2)  # fmt: skip
MIXTRAL_BASE = {"architectures": ["MixtralForCausalLM"], **MIXTRAL}  # its config.json
DENSE = {"architectures": ["LlamaForCausalLM"],  # the same base without experts
         **{k: v for k, v in MIXTRAL.items() if k != "num_local_experts"}}
E, H, INTER = 3, 32, 48
ALL = ["experts.gate_up_proj", "experts.down_proj", "gate.weight"]
VARIANTS = {
    "all": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], target_parameters=ALL,
                rank_pattern={"experts.down_proj": 2}, alpha_pattern={"gate.weight": 3}),
    "rslora": dict(r=8, lora_alpha=4, use_rslora=True, target_modules=["o_proj"],
                   target_parameters=["experts.gate_up_proj", "experts.down_proj"]),
    "down-only": dict(r=2, lora_alpha=2, target_parameters=["experts.down_proj"]),
    # PEFT converts Mixtral's old per-expert names: target_parameters "gate_up_proj" and
    # "down_proj", rank_pattern / alpha_pattern {".*\\.gate_up_proj": 2r / 2 alpha}
    "converted": dict(r=2, lora_alpha=4, target_modules=["q_proj", "w1", "w3", "w2"]),
}  # fmt: skip


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """name -> (folder, spec, {(layer, target): PEFT's delta weight}) for each VARIANT, the
    deltas read from PeftModel.from_pretrained on a fresh base."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import MixtralConfig, MixtralForCausalLM

    root = tmp_path_factory.mktemp("expert-lora")
    torch.manual_seed(0)
    MixtralForCausalLM(MixtralConfig(**MIXTRAL)).save_pretrained(root / "base")
    base_config = json.loads((root / "base" / "config.json").read_text())
    spec = adapter_spec(base_config, max_lora_rank=16)
    out = {}
    for name, kwargs in VARIANTS.items():
        model = get_peft_model(MixtralForCausalLM.from_pretrained(root / "base"),
                               LoraConfig(**kwargs, init_lora_weights=False))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.normal_(0, 0.3)
        model.save_pretrained(root / name)
        fresh = MixtralForCausalLM.from_pretrained(root / "base")
        reloaded = PeftModel.from_pretrained(fresh, root / name)
        out[name] = (root / name, spec, peft_deltas(reloaded))
    return out


def peft_deltas(model) -> dict[tuple[int, str], torch.Tensor]:
    """(layer, target) -> PEFT's delta weight: [E, out, in] for the experts, [out, in] else."""
    from peft.tuners.lora.layer import ParamWrapper

    deltas = {}
    for name, module in model.base_model.model.named_modules():
        if not hasattr(module, "lora_A") or "default" not in module.lora_A:
            continue
        layer = int(name.split(".")[2])
        if isinstance(module, ParamWrapper):
            holder = name.replace(".base_layer", "").rsplit(".", 1)[-1]
            target = "gate" if holder == "gate" else f"experts.{module.parameter_name}"
        else:
            target = name.rsplit(".", 1)[-1]
        deltas[(layer, target)] = module.get_delta_weight("default").detach()
    return deltas


def our_delta(m) -> torch.Tensor:
    return m.scaling * (m.lora_b @ m.lora_a)  # [E, out, r] @ [E, r, in], or 2D


@pytest.mark.parametrize("name", list(VARIANTS))
def test_deltas_match_peft(made, name):
    path, spec, expected = made[name]
    adapter = read_adapter(path, spec)
    assert sorted(adapter.modules) == sorted(expected)
    for key, want in expected.items():
        m = adapter.modules[key]
        if key[1].startswith("experts."):
            assert m.lora_a.shape[0] == m.lora_b.shape[0] == E
        torch.testing.assert_close(our_delta(m), want, rtol=1e-6, atol=1e-6)
    ranks = {t: m.rank for (_, t), m in adapter.modules.items()}
    if name == "all":
        assert ranks == {"q_proj": 4, "v_proj": 4, "gate": 4, "experts.gate_up_proj": 4,
                         "experts.down_proj": 2}
    if name == "converted":
        assert ranks == {"q_proj": 2, "experts.gate_up_proj": 4, "experts.down_proj": 2}
        assert set(adapter.config.target_parameters) == {"gate_up_proj", "down_proj"}


def test_spec_of_moe_bases():
    spec = adapter_spec(MIXTRAL_BASE, max_lora_rank=8)
    assert spec.num_experts == E
    shapes = spec.module_shapes
    assert (shapes["gate"], shapes["experts.gate_up_proj"], shapes["experts.down_proj"]) == (
        (E, H), (2 * INTER, H), (H, INTER))
    assert spec.moe_layers == (0, 1)
    qwen = MIXTRAL_BASE | dict(num_local_experts=None, num_experts=5, moe_intermediate_size=24,
                               num_hidden_layers=5, decoder_sparse_step=2, mlp_only_layers=[3],
                               architectures=["Qwen2MoeForCausalLM"])
    spec = adapter_spec(qwen, max_lora_rank=8)
    shapes = spec.module_shapes
    assert (shapes["gate"], shapes["experts.down_proj"]) == ((5, H), (H, 24))
    assert shapes["down_proj"] == (H, INTER) and spec.moe_layers == (1,)  # 0, 2, 4 dense
    assert adapter_spec(DENSE, max_lora_rank=8).num_experts == 0


def _files(made, name):
    path = made[name][0]
    return ((path / "adapter_config.json").read_bytes(),
            safetensors.torch.load((path / "adapter_model.safetensors").read_bytes()))


def _load(config: bytes, tensors: dict, spec: BaseModelSpec):
    return parse_adapter(config, safetensors.torch.save(tensors), spec)


def test_unsupported_target_parameter_refused():
    for bad in ("experts.w1", "self_attn.q_proj.weight", "experts", "weight"):
        raw = {"peft_type": "LORA", "r": 2, "lora_alpha": 2, "target_modules": ["q_proj"],
               "target_parameters": [bad]}
        with pytest.raises(AdapterError, match=rf"target_parameters names '{bad}'"):
            parse_adapter_config(raw)
    ok = parse_adapter_config({"peft_type": "LORA", "r": 2, "lora_alpha": 2,
                               "target_modules": None, "target_parameters": ALL})
    assert ok.target_modules == () and ok.target_parameters == tuple(ALL)
    assert ok.targets_parameter("model.layers.1.mlp.experts.down_proj")
    assert not ok.targets_parameter("model.layers.1.mlp.shared_expert.down_proj")
    # what PEFT writes when it converts target_modules=["down_proj"] for a fused-expert base
    bare = parse_adapter_config({"peft_type": "LORA", "r": 2, "lora_alpha": 2,
                                 "target_modules": ["v_proj"], "target_parameters": ["down_proj"]})
    assert bare.targets_parameter("model.layers.1.mlp.experts.down_proj")


def test_wrong_shapes_refused(made):
    config, tensors = _files(made, "all")
    spec = made["all"][1]
    key = "base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight"
    bad = dict(tensors, **{key: tensors[key][:, :-1].contiguous()})  # [E*r, H-1]
    with pytest.raises(AdapterError, match=r"layers\.1\.mlp\.experts\.gate_up_proj.*lora_A"
                                           r" \[3\*r, 32\] and lora_B \[96, 3\*r\]"):
        _load(config, bad, spec)
    key = "base_model.model.model.layers.0.mlp.gate.lora_B.weight"
    bad = dict(tensors, **{key: tensors[key][:-1].contiguous()})
    with pytest.raises(AdapterError, match=r"layers\.0\.mlp\.gate\.weight.*lora_B \[3, r\]"):
        _load(config, bad, spec)
    # the two expert parameters swapped: the nesting says which is which, the shapes disagree
    outer, inner = "base_model.model.model.layers.0.mlp.experts.", (
        "base_model.model.model.layers.0.mlp.experts.base_layer.")
    swapped = dict(tensors)
    for ab in ("A", "B"):
        k1, k2 = f"{outer}lora_{ab}.weight", f"{inner}lora_{ab}.weight"
        swapped[k1], swapped[k2] = tensors[k2], tensors[k1]
    with pytest.raises(AdapterError, match=r"experts\.down_proj. has lora_A \[12, 32\]"):
        _load(config, swapped, spec)
    bad = dict(tensors)
    del bad[f"{outer}lora_B.weight"]
    with pytest.raises(AdapterError, match=r"experts\.down_proj' has no lora_B"):
        _load(config, bad, spec)


def test_untargeted_parameter_refused(made):
    config, tensors = _files(made, "down-only")  # targets experts.down_proj only
    nested = {k.replace(".experts.", ".experts.base_layer."): v.clone() for k, v in tensors.items()}
    with pytest.raises(AdapterError, match=r"parameter of 'model\.layers\.\d\.mlp\.experts'"
                                           r" that adapter_config.json does not target"):
        _load(config, tensors | nested, made["down-only"][1])


def test_rank_over_max_refused(made):
    path, spec, _ = made["rslora"]  # rank 8
    small = adapter_spec(MIXTRAL_BASE, max_lora_rank=4)
    with pytest.raises(AdapterError, match=r"rank 8 > --max-lora-rank 4"):
        read_adapter(path, small)
    assert read_adapter(path, spec).max_rank == 8


def test_dense_base_refused(made):
    config, tensors = _files(made, "all")
    # trained on a Mixtral (auto_mapping), whose class check would refuse it first on a Llama
    config = json.dumps(json.loads(config) | {"auto_mapping": None}).encode()
    spec = adapter_spec(DENSE, max_lora_rank=16)
    with pytest.raises(AdapterError, match=r"sets target_parameters .*experts.gate_up_proj.*"
                                           r"not a mixture of experts"):
        _load(config, tensors, spec)


def test_dense_mlp_target_on_moe_base_refused(made):
    config, tensors = _files(made, "all")
    a = "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"
    raw = json.loads(config) | {"target_modules": ["q_proj", "v_proj", "down_proj"]}
    bad = tensors | {a: torch.zeros(4, INTER), a.replace("lora_A", "lora_B"): torch.zeros(H, 4)}
    with pytest.raises(AdapterError, match=r"down_proj, which layer 0 of this mixture-of"):
        _load(json.dumps(raw).encode(), bad, made["all"][1])
