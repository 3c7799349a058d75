"""adapters.format and adapters.lora_config against adapters made by real PEFT, and against
hostile files."""

import hashlib
import json
import math
import pickle
import shutil
import struct

import pytest
import safetensors.torch
import torch

from loragw.adapters.errors import AdapterError, AdapterNotFound
from loragw.adapters.format import parse_adapter, read_adapter
from loragw.adapters.lora_config import parse_adapter_config
from loragw.adapters.types import TARGET_MODULES, pattern_key
from loragw.engine.models import adapter_spec

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=128)  # fmt: skip
LLAMA = {"architectures": ["LlamaForCausalLM"], **TINY}  # the base the engine serves
PREFIX = "base_model.model.model.layers"

# name -> (base model overrides, peft LoraConfig kwargs)
VARIANTS = {
    "basic": ({}, dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])),
    "all_linear_rslora": ({}, dict(r=4, lora_alpha=8, target_modules="all-linear",
                                   use_rslora=True)),
    "regex": ({}, dict(r=6, lora_alpha=12, target_modules=r".*\.(k_proj|down_proj)")),
    "patterns": ({}, dict(
        r=8, lora_alpha=16, target_modules=list(TARGET_MODULES),
        rank_pattern={"q_proj": 4, r"layers\.1\.mlp\.down_proj": 12},
        alpha_pattern={"o_proj": 3, r"model\.layers\.0\..*": 5},  # first match wins
    )),
    "layers_rslora_patterns": ({}, dict(
        r=16, lora_alpha=32, target_modules=["o_proj", "gate_proj", "up_proj"],
        layers_to_transform=[1], use_rslora=True, rank_pattern={"up_proj": 2},
    )),
    "bigger_model": ({"hidden_size": 96}, dict(r=8, lora_alpha=8, target_modules=["q_proj"])),
    "qwen2": ({"arch": "qwen2"}, dict(r=4, lora_alpha=4, target_modules=["k_proj", "up_proj"])),
}  # fmt: skip


def _lora_modules(model):
    for module_name, module in model.base_model.model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            yield module_name, module


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Save each VARIANT with real PEFT, then reload it with PeftModel.from_pretrained (the
    reference a served adapter must match) and record its A, B and scaling per module."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from peft.utils.other import get_pattern_key
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    archs = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}

    out = {"get_pattern_key": get_pattern_key, "training_scaling": {}}
    g = torch.Generator().manual_seed(0)
    for name, (model_overrides, lora_kwargs) in VARIANTS.items():
        overrides = dict(model_overrides)
        config_cls, model_cls = archs[overrides.pop("arch", "llama")]
        base_config = config_cls(**{**TINY, **overrides})
        peft_model = get_peft_model(model_cls(base_config), LoraConfig(**lora_kwargs))
        for module_name, module in _lora_modules(peft_model):
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            with torch.no_grad():  # PEFT starts B at zero; make both sides informative
                a.copy_(torch.randn(a.shape, generator=g))
                b.copy_(torch.randn(b.shape, generator=g))
            out["training_scaling"][name, module_name] = module.scaling["default"]
        path = tmp_path_factory.mktemp(name)
        peft_model.save_pretrained(path)
        reloaded = PeftModel.from_pretrained(model_cls(base_config), path)
        expected = {
            module_name: (module.lora_A["default"].weight.detach().clone(),
                          module.lora_B["default"].weight.detach().clone(),
                          module.scaling["default"])
            for module_name, module in _lora_modules(reloaded)
        }  # fmt: skip
        out[name] = (path, expected)
        # as save_pretrained writes it: the class it was saved from
        out[name, "hf_config"] = base_config.to_dict() | {"architectures": [model_cls.__name__]}
    return out


@pytest.fixture
def spec():
    return adapter_spec(LLAMA, max_lora_rank=16)


def files(made, name="basic"):
    path = made[name][0]
    return (path / "adapter_config.json").read_bytes(), (
        path / "adapter_model.safetensors"
    ).read_bytes()


def tensors_of(weights: bytes) -> dict[str, torch.Tensor]:
    return dict(safetensors.torch.load(weights))


def with_config(config: bytes, **changes) -> bytes:
    return json.dumps({**json.loads(config), **changes}).encode()


def raw_safetensors(header, data: bytes = b"") -> bytes:
    text = header if isinstance(header, str) else json.dumps(header)
    return struct.pack("<Q", len(text.encode())) + text.encode() + data


# --- what PEFT saved comes back exactly ---------------------------------------------------------


@pytest.mark.parametrize("name", [n for n in VARIANTS if n != "bigger_model"])
def test_load_matches_peft_weights_and_scaling(made, name):
    path, expected = made[name]
    spec = adapter_spec(made[name, "hf_config"], max_lora_rank=16)  # the class it was saved on
    adapter = read_adapter(path, spec)
    assert len(adapter.modules) == len(expected) > 0
    for module_name, (a, b, scaling) in expected.items():
        layer, target = int(module_name.split(".")[2]), module_name.rsplit(".", 1)[-1]
        m = adapter.modules[(layer, target)]
        assert (m.layer, m.target) == (layer, target)
        assert m.lora_a.dtype == m.lora_b.dtype == torch.float32
        torch.testing.assert_close(m.lora_a, a, rtol=0, atol=0)
        torch.testing.assert_close(m.lora_b, b, rtol=0, atol=0)
        assert m.rank == a.shape[0]
        assert m.scaling == pytest.approx(scaling, rel=1e-12)
        assert adapter.config.scaling(module_name) == pytest.approx(scaling, rel=1e-12)
    assert adapter.max_rank == max(a.shape[0] for a, _, _ in expected.values())
    assert adapter.targets == tuple(sorted({n.rsplit(".", 1)[-1] for n in expected}))
    weights = (path / "adapter_model.safetensors").read_bytes()
    assert adapter.num_bytes == len(weights)
    assert adapter.sha256 == hashlib.sha256(weights).hexdigest()


def test_spec_from_real_hf_configs_accepts_their_adapters(made):
    for name in ("basic", "qwen2"):
        hf_config = made[name, "hf_config"]
        spec = adapter_spec(hf_config, max_lora_rank=8)
        assert spec == adapter_spec({**TINY, "architectures": hf_config["architectures"]}, 8)
        assert read_adapter(made[name][0], spec).modules


def test_variants_cover_what_they_claim(made, spec):
    assert read_adapter(made["all_linear_rslora"][0], spec).targets == tuple(sorted(TARGET_MODULES))
    assert read_adapter(made["regex"][0], spec).targets == ("down_proj", "k_proj")
    layered = read_adapter(made["layers_rslora_patterns"][0], spec)
    assert {layer for layer, _ in layered.modules} == {1}
    assert layered.modules[(1, "up_proj")].rank == 2
    patterns = read_adapter(made["patterns"][0], spec)
    assert patterns.modules[(0, "q_proj")].scaling == 5 / 4
    assert patterns.modules[(1, "o_proj")].scaling == 3 / 8
    assert patterns.modules[(1, "down_proj")].scaling == 16 / 12


def test_overlapping_patterns_resolve_in_file_order_like_peft_from_pretrained(made, spec):
    """Where alpha_pattern keys overlap, the first match in the *file* wins: what
    PeftModel.from_pretrained serves. PEFT before 0.22 wrote the file with sort_keys=True, so
    its reload could differ from the training run ("o_proj" first: 3 for layer 0's o_proj);
    0.22 keeps the patterns in the order they were given. Either way the file decides."""
    path, expected = made["patterns"]
    in_file = list(json.loads((path / "adapter_config.json").read_text())["alpha_pattern"])
    patterns = read_adapter(path, spec)
    assert list(patterns.config.alpha_pattern) == in_file
    first = {"o_proj": 3, r"model\.layers\.0\..*": 5}[in_file[0]]
    served = patterns.modules[(0, "o_proj")].scaling
    assert served == expected["model.layers.0.self_attn.o_proj"][2] == first / 8
    assert made["training_scaling"]["patterns", "model.layers.0.self_attn.o_proj"] == 3 / 8
    config = json.loads(files(made, "patterns")[0])
    for alphas, want in (({"o_proj": 3, r"model\.layers\.0\..*": 5}, 3),  # hand-written orders
                         ({r"model\.layers\.0\..*": 5, "o_proj": 3}, 5)):
        config["alpha_pattern"] = alphas
        assert parse_adapter_config(config).scaling("model.layers.0.self_attn.o_proj") == want / 8


def test_pattern_key_mirrors_peft(made):
    peft_get_pattern_key = made["get_pattern_key"]
    keys = ["q_proj", r"layers\.1\.mlp\.down_proj", r"model\.layers\.0\..*", "proj", "_proj",
            r".*\.k_proj", "layers.1.self_attn.v_proj", "self_attn"]  # fmt: skip
    for layer in range(2):
        for target in TARGET_MODULES:
            block = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            for name in (
                f"model.layers.{layer}.{block}.{target}",
                f"layers.{layer}.{block}.{target}",
            ):
                for order in (keys, keys[::-1]):
                    assert pattern_key(order, name) == peft_get_pattern_key(order, name)


def test_half_precision_weights_become_float32(made, spec):
    config, weights = files(made)
    halves = {k: v.to(torch.bfloat16) for k, v in tensors_of(weights).items()}
    adapter = parse_adapter(config, safetensors.torch.save(halves), spec)
    for (layer, target), m in adapter.modules.items():
        key = f"{PREFIX}.{layer}.self_attn.{target}.lora_A.weight"
        assert m.lora_a.dtype == torch.float32
        assert torch.equal(m.lora_a, halves[key].float())


def test_default_adapter_name_and_bare_model_prefix_are_accepted(made, spec):
    config, weights = files(made)
    t = tensors_of(weights)
    renamed = {k.replace(".lora_A.", ".lora_A.default.").replace("model.model.", "model."): v
               for k, v in t.items()}  # fmt: skip
    adapter = parse_adapter(config, safetensors.torch.save(renamed), spec)
    assert sorted(adapter.modules) == sorted(parse_adapter(config, weights, spec).modules)


def test_spec_from_hf_config_shapes():
    spec = adapter_spec(LLAMA, max_lora_rank=8)
    assert spec.num_layers == 2
    assert spec.module_shapes == {
        "q_proj": (64, 64), "k_proj": (32, 64), "v_proj": (32, 64), "o_proj": (64, 64),
        "gate_proj": (128, 64), "up_proj": (128, 64), "down_proj": (64, 128),
        "embed_tokens": (64, 128), "lm_head": (128, 64),
    }  # fmt: skip
    assert not spec.tie_word_embeddings
    assert adapter_spec(dict(LLAMA, tie_word_embeddings=True), 8).tie_word_embeddings
    qwen3 = dict(TINY, head_dim=32, architectures=["Qwen3ForCausalLM"])  # != hidden / heads
    shapes = adapter_spec(qwen3, max_lora_rank=8).module_shapes
    assert shapes["q_proj"] == (128, 64) and shapes["o_proj"] == (64, 128)
    assert shapes["k_proj"] == (64, 64)
    with pytest.raises(ValueError, match="hidden_size 64 % heads 5"):
        adapter_spec(dict(LLAMA, num_attention_heads=5), 8)
    with pytest.raises(ValueError, match="intermediate_size"):
        adapter_spec({k: v for k, v in LLAMA.items() if k != "intermediate_size"}, 8)
    # the engine builds embed_tokens and lm_head from vocab_size, so it must be there (a spec
    # without vocabulary shapes is built directly: test_vocab_targets.py, test_saved_modules.py)
    with pytest.raises(ValueError, match="vocab_size"):
        adapter_spec({k: v for k, v in LLAMA.items() if k != "vocab_size"}, 8)


# --- pickles are refused and never opened ---------------------------------------------------------


@pytest.fixture
def no_unpickling(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("something tried to unpickle adapter weights")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)


@pytest.mark.parametrize("filename", ["adapter_model.bin", "weights.pt", "w.pth", "w.pkl"])
def test_pickled_weights_are_refused_without_unpickling(
    made, spec, tmp_path, no_unpickling, filename
):
    shutil.copy(made["basic"][0] / "adapter_config.json", tmp_path)
    (tmp_path / filename).write_bytes(pickle.dumps({"boom": 1}))
    with pytest.raises(
        AdapterError, match="pickled weights .* convert them to adapter_model.safetensors"
    ):
        read_adapter(tmp_path, spec)


def test_safetensors_wins_over_a_pickle_beside_it(made, spec, tmp_path, no_unpickling):
    shutil.copytree(made["basic"][0], tmp_path, dirs_exist_ok=True)
    (tmp_path / "adapter_model.bin").write_bytes(pickle.dumps({"boom": 1}))
    assert read_adapter(tmp_path, spec).targets == ("q_proj", "v_proj")


# --- missing files and bad configs ----------------------------------------------------------------


def test_missing_directory_is_not_found(spec, tmp_path):
    with pytest.raises(AdapterNotFound) as info:
        read_adapter(tmp_path / "nope", spec)
    assert info.value.status == 404


@pytest.mark.parametrize("missing", ["adapter_config.json", "adapter_model.safetensors"])
def test_missing_file_is_named(made, spec, tmp_path, missing):
    shutil.copytree(made["basic"][0], tmp_path, dirs_exist_ok=True)
    (tmp_path / missing).unlink()
    with pytest.raises(AdapterError, match=f"has no {missing}") as info:
        read_adapter(tmp_path, spec)
    assert info.value.status == 422


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"use_dora": True}, "use_dora is set; DoRA"),
        ({"bias": "all"}, "bias is 'all'"),
        ({"bias": "lora_only"}, "bias is 'lora_only'"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out"),
        ({"peft_type": "IA3"}, "only LORA"),
        ({"peft_type": None}, "only LORA"),
        ({"r": 0}, "r must be a positive integer"),
        ({"r": -4}, "r must be a positive integer"),
        ({"r": True}, "r must be a positive integer"),
        ({"r": 8.0}, "r must be a positive integer"),
        ({"lora_alpha": "16"}, "lora_alpha must be a finite number"),
        ({"lora_bias": True}, "lora_bias is set"),
        ({"layer_replication": [[0, 2]]}, "layer_replication"),
        ({"trainable_token_indices": [1, 2]}, "trainable_token_indices"),
        ({"target_modules": ["q_proj", "wte"]}, "'wte'; lora-gateway supports only q_proj"),
        ({"modules_to_save": ["embed_tokens"]}, "only when started with --max-full-module-slots"),
        ({"modules_to_save": ["score"]}, "saved copies of embed_tokens and lm_head only"),
        ({"ensure_weight_tying": "yes"}, "ensure_weight_tying must be true or false"),
        ({"target_modules": []}, "target_modules must be a non-empty list or a regex"),
        ({"target_modules": None}, "target_modules must be a non-empty list or a regex"),
        ({"target_modules": "(q_proj"}, "not a valid regex"),
        ({"target_modules": r"(\w+\.)*q_proj"}, "repeats a group"),
        ({"target_modules": "(a+)+$"}, "repeats a group"),
        ({"target_modules": ".*.*.*.*x"}, "more than 3 repeats"),
        ({"rank_pattern": {"(.*)*q": 4}}, "repeats a group"),
        ({"rank_pattern": {"q_proj": 0}}, "must be a positive integer"),
        ({"alpha_pattern": {"q_proj": "x"}}, "must be a finite number"),
        ({"layers_to_transform": [0, -1]}, "layers_to_transform"),
        ({"layers_pattern": "h"}, "layers_pattern"),
        ({"layers_pattern": 5}, "layers_pattern"),
        ({"use_rslora": "yes"}, "use_rslora must be true or false"),
        ({"base_model_name_or_path": ["x"]}, "base_model_name_or_path must be a string"),
        ({"exclude_modules": "(a|b)*"}, "repeats a group"),
    ],
)
def test_bad_config_is_refused_naming_the_field(made, spec, changes, message):
    config, weights = files(made)
    with pytest.raises(AdapterError, match=message):
        parse_adapter(with_config(config, **changes), weights, spec)


@pytest.mark.parametrize("field", ["r", "lora_alpha"])
def test_missing_rank_or_alpha_is_refused(made, field):
    config = json.loads(files(made)[0])
    del config[field]
    with pytest.raises(AdapterError, match=f"{field} is missing"):
        parse_adapter_config(config)


MINIMAL_CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}


@pytest.mark.parametrize("task_type", ["SEQ_CLS", "SEQ_2_SEQ_LM", "TOKEN_CLS", "causal_lm", 3])
def test_a_task_type_other_than_causal_lm_is_refused_naming_it(task_type):
    with pytest.raises(AdapterError) as refused:
        parse_adapter_config({**MINIMAL_CONFIG, "task_type": task_type})
    message = str(refused.value)
    assert refused.value.status == 422
    assert f"task_type is {task_type!r}" in message and "CAUSAL_LM" in message, message


@pytest.mark.parametrize("task_type", ["CAUSAL_LM", None, "absent"])
def test_a_causal_lm_or_missing_task_type_is_served(task_type):
    config = dict(MINIMAL_CONFIG) if task_type == "absent" else {**MINIMAL_CONFIG,
                                                                 "task_type": task_type}
    assert parse_adapter_config(config).r == 2


BAD_JSON = [b"{not json", b"", b"[1, 2]", b'{"peft_type": "LORA", "r": 8, "lora_alpha": NaN}',
            b"[" * 100_000]  # fmt: skip


@pytest.mark.parametrize("raw", BAD_JSON)
def test_malformed_config_json_is_refused(raw):
    with pytest.raises(AdapterError, match="adapter_config.json"):
        parse_adapter_config(raw)


def test_config_parses_peft_fields(made):
    config = parse_adapter_config(files(made, "layers_rslora_patterns")[0])
    assert (config.r, config.lora_alpha, config.use_rslora) == (16, 32.0, True)
    assert sorted(config.target_modules) == ["gate_proj", "o_proj", "up_proj"]
    assert config.layers_to_transform == (1,)
    assert config.rank_pattern == {"up_proj": 2} and config.alpha_pattern == {}
    assert config.scaling("model.layers.1.mlp.up_proj") == 32 / math.sqrt(2)
    minimal = MINIMAL_CONFIG
    assert parse_adapter_config({**minimal, "layers_to_transform": 1}).layers_to_transform == (1,)
    all_linear = parse_adapter_config({**minimal, "target_modules": "ALL-LINEAR"})
    assert all(all_linear.targets_module(f"model.layers.0.x.{t}", 0) for t in TARGET_MODULES)
    with pytest.raises(AdapterError, match="layers_to_transform cannot be used"):  # as PEFT
        parse_adapter_config({**minimal, "target_modules": ".*q_proj", "layers_to_transform": 1})


# --- hostile or mismatched safetensors ------------------------------------------------------------


def _header_of(weights: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", weights[:8])[0]
    return json.loads(weights[8 : 8 + n]), weights[8 + n :]


def _first(header: dict) -> str:
    return next(k for k in header if k != "__metadata__")


def _lie(weights: bytes, how: str) -> bytes:
    header, data = _header_of(weights)
    key = _first(header)
    entry = header[key]
    if how == "offsets_beyond_file":
        entry["data_offsets"][1] += 4096
    elif how == "wrong_size":
        entry["shape"][0] += 1
    elif how == "overlap":
        others = [k for k in header if k not in ("__metadata__", key)]
        header[others[0]]["data_offsets"] = list(entry["data_offsets"])
        header[others[0]]["shape"], header[others[0]]["dtype"] = entry["shape"], entry["dtype"]
    elif how == "unknown_dtype":
        entry["dtype"] = "F128"
    elif how == "negative_shape":
        entry["shape"][0] = -entry["shape"][0]
    elif how == "trailing_bytes":
        data += b"\0" * 4
    elif how == "duplicate_key":
        text = json.dumps(header)
        return raw_safetensors(text[:-1] + f", {json.dumps(key)}: {json.dumps(entry)}}}", data)
    return raw_safetensors(header, data)


@pytest.mark.parametrize(
    "how",
    ["offsets_beyond_file", "wrong_size", "overlap", "unknown_dtype", "negative_shape",
     "trailing_bytes", "duplicate_key"],
)  # fmt: skip
def test_lying_header_is_refused_before_deserializing(made, spec, monkeypatch, how):
    config, weights = files(made)
    monkeypatch.setattr(safetensors.torch, "load", lambda *a: pytest.fail("deserialized"))
    with pytest.raises(AdapterError, match="truncated or corrupt safetensors"):
        parse_adapter(config, _lie(weights, how), spec)


@pytest.mark.parametrize(
    "weights",
    [b"", b"\x01\x02\x03", struct.pack("<Q", 10**9) + b"{}", struct.pack("<Q", 50) + b"{}",
     raw_safetensors("not json"), raw_safetensors("[]"), struct.pack("<Q", 2) + b"\xff\xfe"],
)  # fmt: skip
def test_garbage_safetensors_is_refused(made, spec, weights):
    with pytest.raises(AdapterError, match="truncated or corrupt safetensors"):
        parse_adapter(files(made)[0], weights, spec)


@pytest.mark.parametrize("cut", [1, 100, 1000])
def test_truncated_safetensors_is_refused(made, spec, tmp_path, cut):
    shutil.copytree(made["basic"][0], tmp_path, dirs_exist_ok=True)
    weights = tmp_path / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-cut])
    with pytest.raises(AdapterError, match="truncated or corrupt safetensors"):
        read_adapter(tmp_path, spec)


def test_adapter_for_a_bigger_model_is_refused(made, spec):
    with pytest.raises(AdapterError, match=r"needs lora_A \[r, 64\] .* different base model"):
        read_adapter(made["bigger_model"][0], spec)


def test_rank_above_max_lora_rank_says_what_to_do(made):
    small = adapter_spec(LLAMA, max_lora_rank=8)
    message = ("adapter has rank 16 > --max-lora-rank 8; restart with --max-lora-rank 16"
               " or use a smaller adapter")  # fmt: skip
    with pytest.raises(AdapterError, match=message):
        read_adapter(made["layers_rslora_patterns"][0], small)


def _edit(made, spec, edit, config_changes=None):
    config, weights = files(made)
    t = tensors_of(weights)
    edit(t)
    if config_changes:
        config = with_config(config, **config_changes)
    return parse_adapter(config, safetensors.torch.save(t), spec)


A0, B0 = f"{PREFIX}.0.self_attn.q_proj.lora_A.weight", f"{PREFIX}.0.self_attn.q_proj.lora_B.weight"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)}),
            "is for module 'lm_head', which adapter_config.json does not target",
        ),
        (
            lambda t: t.update(
                {"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(8, 128)}
            ),
            "is for module 'model.embed_tokens', which adapter_config.json does not target",
        ),
        (
            lambda t: t.update(
                {f"{PREFIX}.0.self_attn.q_proj.lora_magnitude_vector": torch.zeros(64)}
            ),
            "DoRA",
        ),
        (
            lambda t: t.update(
                {"base_model.model.model.embed_tokens.weight": torch.zeros(128, 64)}
            ),
            "tensor 'base_model.model.model.embed_tokens.weight' is a full copy of embed_tokens,"
            " which adapter_config.json does not list in modules_to_save",
        ),
        (
            lambda t: t.update({f"{PREFIX}.0.self_attn.rotary.lora_A.weight": torch.zeros(8, 64)}),
            "targets module 'rotary'",
        ),
        (
            lambda t: t.update({f"{PREFIX}.0.self_attn.k_proj.lora_A.weight": torch.zeros(8, 64)}),
            "does not target",
        ),
        (
            lambda t: t.update({f"{PREFIX}.0.mlp.q_proj.lora_A.weight": torch.zeros(8, 64)}),
            "puts q_proj under mlp",
        ),
        (
            lambda t: t.update({A0.replace(".0.", ".5."): t[A0].clone()}),
            "layer 5 but the base model has 2",
        ),
        (lambda t: t.update({A0.replace(".0.", ".00."): t[A0].clone()}), "unexpected path"),
        (
            lambda t: t.update({A0.replace("lora_A.", "lora_A.default."): t[A0].clone()}),
            "duplicates the lora_A of layer 0 q_proj",
        ),
        (lambda t: t.pop(B0), "has no lora_B"),
        (lambda t: t.update({A0: t[A0][:4]}), r"lora_A \[4, 64\] and lora_B \[64, 8\]"),
        (lambda t: t.update({A0: t[A0].to(torch.int32)}), "dtype I32"),
        (lambda t: t.update({A0: t[A0].double()}), "dtype F64"),
        (lambda t: t[A0].__setitem__((0, 0), float("nan")), "NaN or infinite"),
        (lambda t: t.clear(), "holds no LoRA tensors"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_bad_tensors_are_refused_naming_the_key(made, spec, edit, message):
    with pytest.raises(AdapterError, match=message):
        _edit(made, spec, edit)


def test_huge_untrusted_names_are_cut_short_in_errors(made, spec):
    config, weights = files(made)
    t = tensors_of(weights)
    t["x" * 100_000] = torch.zeros(1)
    with pytest.raises(AdapterError, match=r"unexpected tensor 'x+\.\.\.\(100002 chars\)") as info:
        parse_adapter(config, safetensors.torch.save(t), spec)
    assert len(str(info.value)) < 400


def test_exclude_modules_is_honoured(made, spec):
    with pytest.raises(AdapterError, match="does not target"):
        _edit(made, spec, lambda t: None, {"exclude_modules": ["model.layers.1.self_attn.v_proj"]})
    with pytest.raises(AdapterError, match="does not target"):
        _edit(made, spec, lambda t: None, {"exclude_modules": r".*\.0\.self_attn\.q_proj"})


def test_rank_must_match_config(made, spec):
    with pytest.raises(AdapterError, match="has rank 8 but adapter_config.json says 4"):
        _edit(made, spec, lambda t: None, {"r": 4})
    with pytest.raises(AdapterError, match="has rank 8 but adapter_config.json says 2"):
        _edit(made, spec, lambda t: None, {"rank_pattern": {r"layers\.1\..*v_proj": 2}})


def test_layers_outside_layers_to_transform_are_refused(made, spec):
    with pytest.raises(AdapterError, match="does not target .* layers_to_transform=\\(1,\\)"):
        _edit(made, spec, lambda t: None, {"layers_to_transform": [1]})


def test_weights_past_the_served_dtype_are_refused(made, spec):
    """Under --dtype float16 a LoRA weight past 65504 would be served as inf: refused, naming
    the tensor and the dtypes that hold it; the same file loads for a bfloat16 server."""
    import dataclasses

    config, weights = files(made)
    t = tensors_of(weights)
    key = next(k for k in t if k.endswith("lora_B.weight"))
    t[key][0, 0] = 1e5
    big = safetensors.torch.save(t)
    half = dataclasses.replace(spec, dtype="float16")
    with pytest.raises(AdapterError, match=r"values up to 1e\+05 in magnitude, past float16's "
                                           r"largest \(65504\).*--dtype bfloat16 or --dtype float32"):
        parse_adapter(config, big, half)
    adapter = parse_adapter(config, big, dataclasses.replace(spec, dtype="bfloat16"))
    assert max(m.lora_b.abs().max().item() for m in adapter.modules.values()) == 1e5
