"""What a quantized checkpoint's config.json asks for is read once, with the Config: a method,
format, scheme or group size the engine cannot serve is refused there (before any process is
started or any weight read), naming it and the supported list; `--quantization` must match the
checkpoint (engine/quant/scheme.py)."""

import json
import os
import shutil

import pytest

from loragw.engine.config import Config
from loragw.engine.quant.scheme import SUPPORTED, ActScheme, read_quantization

W4_GROUP = {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
                "group_size": 32}}}, "ignore": ["lm_head"]}


def with_quant(src: str, dst: str, quantization_config: dict | None) -> str:
    """A copy of checkpoint `src` whose config.json says `quantization_config` (no weights are
    read by a Config, so the float weights stay)."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    with open(path, "w") as f:
        json.dump(config, f)
    return dst


@pytest.fixture
def configured(tiny_checkpoint, tmp_path):
    def make(quantization_config: dict | None, arch: str = "llama") -> str:
        return with_quant(tiny_checkpoint(arch), str(tmp_path / "q"), quantization_config)
    return make


def group(**weights) -> dict:
    config = json.loads(json.dumps(W4_GROUP))
    config["config_groups"]["group_0"]["weights"].update(weights)
    return config


def w8a8(**activations) -> dict:
    """llm-compressor's W8A8 config (int8 channel weights, int8 dynamic per-token inputs), its
    input_activations changed by `activations`."""
    inputs = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True,
              "symmetric": True, "group_size": None, "scale_dtype": None, "zp_dtype": None,
              "observer": None} | activations
    return {"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": inputs,
                                          "weights": {"num_bits": 8, "type": "int",
                                                      "strategy": "channel"}}}}


@pytest.mark.parametrize("config, named", [
    ({"quant_method": "bitsandbytes"}, "'bitsandbytes' is not served"),
    ({"quant_method": "hqq"}, "'hqq' is not served"),
    (dict(W4_GROUP, sparsity_config={"format": "sparse-24-bitmask"}), "sparse-24-bitmask"),
    (dict(W4_GROUP, format="nvfp4-pack-quantized"), "'nvfp4-pack-quantized' is not served"),
    (group(num_bits=4, type="float"), "4-bit float weights (e.g. NVFP4/MXFP4)"),
    (group(num_bits=2), "2-bit int weights"),
    (group(strategy="tensor_group"), "'tensor_group' is not served"),
    (group(group_size=0), "positive group_size, got 0"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "gptq bits 3"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "'gemv'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size [128]"),
    (w8a8(num_bits=4), "4-bit int input activations (e.g. W4A4, NVFP4)"),
    (w8a8(num_bits=4, type="float"), "4-bit float input activations"),
    (w8a8(strategy="tensor"), "dynamic per-tensor input activations are not served"),
    (w8a8(strategy="group", group_size=32, dynamic=False),
     "static per-group input activations are not served"),
    (w8a8(dynamic="local", strategy="tensor_group", group_size=16), "per-tensor_group"),
    (w8a8(type="float", strategy="group", group_size=32, scale_dtype="torch.uint8"),
     "scales stored as torch.uint8 (e.g. MXFP8)"),
    (w8a8(strategy="group", group_size=48), "activation group_size 48 does not divide"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme 'static'"),
])
def test_what_is_not_served_is_named_with_the_supported_list(configured, config, named):
    with pytest.raises(ValueError) as refused:
        Config(configured(config), device="cpu")
    assert named in str(refused.value) and SUPPORTED in str(refused.value), refused.value


def test_a_group_that_does_not_divide_the_input_is_refused_naming_the_projection(configured):
    # the tiny llama's hidden size is 64: groups of 48 columns cut it
    with pytest.raises(ValueError, match="group_size 48 does not divide q_proj's 64 input"):
        Config(configured(group(group_size=48)), device="cpu")


def test_a_group_wider_than_the_input_is_one_group(configured):
    assert Config(configured(group(group_size=128)), device="cpu").quant.method == (
        "compressed-tensors")


@pytest.mark.parametrize("requested, quantization_config, message", [
    ("gptq", None, "needs a quantized checkpoint"),
    ("none", W4_GROUP, "serve it with --quantization auto or compressed-tensors"),
    ("awq", W4_GROUP, "does not match the checkpoint, which is quantized with compressed-tensors"),
])
def test_the_flag_must_match_the_checkpoint(configured, requested, quantization_config, message):
    with pytest.raises(ValueError, match=message):
        Config(configured(quantization_config), device="cpu", quantization=requested)


def test_the_flag_confirms_and_auto_detects(configured):
    path = configured(W4_GROUP)
    for requested in ("auto", "compressed-tensors"):
        quant = Config(path, device="cpu", quantization=requested).quant
        assert quant.describe() == "compressed-tensors (pack-quantized: int4 group 32 asym)"
    assert Config(configured(None), device="cpu", quantization="none").quant is None


def test_a_quantized_lm_head_and_a_quantized_moe_base_are_refused(configured, tiny_checkpoint,
                                                                  tmp_path):
    with pytest.raises(ValueError, match="lm_head is quantized"):
        Config(configured(dict(W4_GROUP, ignore=[])), device="cpu")
    moe = with_quant(tiny_checkpoint("qwen2_moe"), str(tmp_path / "moe"), W4_GROUP)
    with pytest.raises(ValueError, match="quantized Mixture-of-Experts bases"):
        Config(moe, device="cpu")


def test_schemes_by_target_and_ignore():
    quant = read_quantization({
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "ignore": ["lm_head", "re:.*layers\\.1\\.mlp\\..*"],
        "config_groups": {
            "attn": {"targets": ["re:.*self_attn\\..*"], "weights": {
                "num_bits": 8, "type": "int", "strategy": "channel"}},
            "rest": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}}}},
        "auto")
    assert quant.scheme("model.layers.0.self_attn.q_proj").kind == "int8"
    assert quant.scheme("model.layers.0.mlp.up_proj").kind == "int4"
    assert quant.scheme("model.layers.1.mlp.up_proj") is None
    assert quant.scheme("lm_head") is None


def test_gptq_awq_and_fp8_configs():
    gptq = read_quantization({
        "quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True},
        "auto")
    assert gptq.describe() == "gptq (gptq: int4 group 128 act-order)" and gptq.zero_minus_one
    v2 = read_quantization({
        "quant_method": "gptq", "bits": 8, "group_size": -1, "checkpoint_format": "gptq_v2"},
        "gptq")
    assert v2.describe() == "gptq (gptq_v2: int8 per channel)" and not v2.zero_minus_one
    awq = read_quantization({
        "quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
        "version": "gemm"}, "auto")
    assert awq.describe() == "awq (gemm: int4 group 64 asym)"
    fp8 = read_quantization({
        "quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"},
        "fp8")
    assert fp8.describe() == (
        "fp8 (fp8: fp8 block [128, 128], activations fp8 dynamic per token group 128)")
    per_tensor = read_quantization({"quant_method": "fp8"}, "fp8").scheme("model.layers.0.mlp")
    assert per_tensor.activations == ActScheme("fp8", dynamic=True)


@pytest.mark.parametrize("activations, scheme, described", [
    ({}, ActScheme("int8", True), "int8 dynamic per token"),
    ({"symmetric": False, "zp_dtype": "torch.int8"}, ActScheme("int8", True, symmetric=False),
     "int8 dynamic per token asym"),
    ({"type": "float", "strategy": "group", "group_size": 128},
     ActScheme("fp8", True, 128), "fp8 dynamic per token group 128"),
    ({"type": "float", "strategy": "tensor", "dynamic": False, "observer": "static_minmax"},
     ActScheme("fp8", False), "fp8 static per tensor"),
    ({"strategy": "tensor", "dynamic": False, "symmetric": False, "zp_dtype": "torch.int8"},
     ActScheme("int8", False, symmetric=False), "int8 static per tensor asym"),
])
def test_input_activations_as_llm_compressor_writes_them(activations, scheme, described):
    quant = read_quantization(w8a8(**activations), "auto")
    got = quant.scheme("model.layers.0.self_attn.q_proj")
    assert got.activations == scheme
    assert quant.describe() == (
        f"compressed-tensors (int-quantized: int8 per channel, activations {described})")
    assert read_quantization(W4_GROUP, "auto").scheme("x.q_proj").activations is None


def test_output_activations_are_refused():
    config = w8a8()
    config["config_groups"]["group_0"]["output_activations"] = {"num_bits": 8, "type": "int"}
    with pytest.raises(ValueError, match="output activation quantization is not served"):
        read_quantization(config, "auto")
