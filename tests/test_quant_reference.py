"""The quantized-checkpoint fixtures (tests/quant_checkpoints.py, tests/quant_reference/) keep
their promises: each checkpoint is laid out as its tool writes it, quantizing changed the
oracle's tokens, the float32 twins are plain checkpoints near the float base, a second build
reads the cache, and the broken copies are broken as asked."""

from __future__ import annotations

import json
import os

import pytest
import quant_checkpoints as qc
import torch

pytestmark = pytest.mark.slow  # one subprocess in the quant venv: ~30 s

SCHEMES = ["w4a16-asym-g32", "w8a8", "w8a8-static-asym", "gptq-desc-act", "awq-g32",
           "hf-fp8-block"]
# Layer 0's q_proj (128 x 128) as each scheme writes it: tensor suffix -> (dtype, shape).
Q_PROJ = {
    "w4a16-asym-g32": {"weight_packed": ("int32", [128, 16]), "weight_scale": ("float32", [128, 4]),
                       "weight_zero_point": ("int32", [16, 4]), "weight_shape": ("int64", [2])},
    "w8a8": {"weight": ("int8", [128, 128]), "weight_scale": ("float32", [128, 1])},
    "w8a8-static-asym": {"weight": ("int8", [128, 128]), "weight_scale": ("float32", [128, 1]),
                         "input_scale": ("float32", [1]), "input_zero_point": ("int8", [1])},
    "gptq-desc-act": {"qweight": ("int32", [16, 128]), "qzeros": ("int32", [4, 16]),
                      "scales": ("float16", [4, 128]), "g_idx": ("int32", [128])},
    "awq-g32": {"qweight": ("int32", [128, 16]), "qzeros": ("int32", [4, 16]),
                "scales": ("float16", [4, 128])},
    "hf-fp8-block": {"weight": ("float8_e4m3fn", [128, 128]),
                     "weight_scale_inv": ("float32", [1, 1])},
}
# What each quantization_config holds (a subset of it).
QUANT_CONFIG = {
    "w4a16-asym-g32": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                       "config_groups": {"group_0": {"weights": {
                           "num_bits": 4, "group_size": 32, "symmetric": False,
                           "strategy": "group"}, "input_activations": None}}},
    "w8a8": {"quant_method": "compressed-tensors", "format": "int-quantized",
             "config_groups": {"group_0": {"weights": {"num_bits": 8, "strategy": "channel"},
                                           "input_activations": {"dynamic": True,
                                                                 "strategy": "token"}}}},
    "w8a8-static-asym": {"quant_method": "compressed-tensors", "format": "int-quantized",
                         "config_groups": {"group_0": {"input_activations": {
                             "dynamic": False, "strategy": "tensor", "symmetric": False}}}},
    "gptq-desc-act": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True,
                      "sym": True, "checkpoint_format": "gptq"},
    "awq-g32": {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                "version": "gemm"},
    "hf-fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic",
                     "weight_block_size": [128, 128]},
}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> qc.QuantWorld:
    return qc.build_world(str(tmp_path_factory.mktemp("quant-world")), "llama", SCHEMES)


def _tensors(path: str) -> dict[str, torch.Tensor]:
    import safetensors.torch

    return safetensors.torch.load_file(os.path.join(path, "model.safetensors"))


def _config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def _holds(actual, expected) -> bool:
    if isinstance(expected, dict):
        return isinstance(actual, dict) and all(
            key in actual and _holds(actual[key], value) for key, value in expected.items())
    return actual == expected


@pytest.mark.parametrize("scheme", SCHEMES)
def test_checkpoint_is_laid_out_as_its_tool_writes_it(world, scheme):
    checkpoint = world.checkpoints[scheme]
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert os.path.exists(os.path.join(checkpoint.dir, name)), name
    tensors = _tensors(checkpoint.dir)
    prefix = "model.layers.0.self_attn.q_proj."
    got = {name[len(prefix):]: (str(t.dtype).removeprefix("torch."), list(t.shape))
           for name, t in tensors.items() if name.startswith(prefix)}
    assert got == Q_PROJ[scheme]
    quant = _config(checkpoint.dir)["quantization_config"]
    assert _holds(quant, QUANT_CONFIG[scheme]), json.dumps(quant, indent=1)
    assert tensors["lm_head.weight"].dtype.is_floating_point  # lm_head is never quantized


def test_quantizing_changed_the_oracles_tokens(world):
    assert len(world.expected_float) == len(world.requests)
    assert {adapter for _, adapter in world.requests} == {*world.adapters, None}
    for scheme, checkpoint in world.checkpoints.items():
        for tokens in (checkpoint.expected, checkpoint.expected_weight_only):
            assert len(tokens) == len(world.requests), scheme
            assert all(len(row) == world.max_tokens for row in tokens), scheme
            assert tokens != world.expected_float, scheme
        # W8A8 and fp8 quantize activations in the checkpoint's forward, and it shows
        assert checkpoint.activations == (scheme in ("w8a8", "w8a8-static-asym", "hf-fp8-block"))
        assert (checkpoint.expected != checkpoint.expected_weight_only) == checkpoint.activations
        assert len(checkpoint.margins) == len(world.requests), scheme
        assert all(lead >= 0 for row in checkpoint.margins for lead, _ in row), scheme


def test_dequantized_twin_is_a_plain_float_checkpoint_near_the_base(world):
    base = _tensors(world.base)
    for scheme, checkpoint in world.checkpoints.items():
        assert "quantization_config" not in _config(checkpoint.dequantized)
        twin = _tensors(checkpoint.dequantized)
        assert twin.keys() == base.keys(), scheme
        assert all(t.dtype == torch.float32 for t in twin.values()), scheme
        q = twin["model.layers.0.self_attn.q_proj.weight"]
        w = base["model.layers.0.self_attn.q_proj.weight"]
        assert 0 < (q - w).norm() / w.norm() <= checkpoint.max_weight_error < 0.15, scheme


def test_adapters_are_peft_folders(world):
    for path in world.adapters.values():
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(path))


def test_a_second_build_reads_the_cache(world, monkeypatch):
    monkeypatch.setattr(qc, "QUANT_PYTHON", qc.Path("/nonexistent/python"))  # no subprocess
    again = qc.build_world(world.root, "llama", SCHEMES)
    assert again == world


def test_a_missing_quant_venv_says_how_to_make_it(tmp_path, monkeypatch):
    monkeypatch.setattr(qc, "QUANT_PYTHON", tmp_path / "no-venv" / "bin" / "python")
    with pytest.raises(qc.QuantToolsMissing, match="make quant-tools"):
        qc.build_world(str(tmp_path / "world"), "llama", ["w4a16-g128"])


def test_unknown_schemes_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown schemes"):
        qc.build_world(str(tmp_path), "llama", ["w3a16"])


def test_broken_copies_are_broken_as_asked(world, tmp_path):
    src = world.checkpoints["gptq-desc-act"].dir
    name = "model.layers.1.mlp.down_proj.scales"
    nan = _tensors(qc.corrupt(src, str(tmp_path / "nan"), name, "nan"))
    assert torch.isnan(nan[name]).all()
    shaped = _tensors(qc.corrupt(src, str(tmp_path / "shape"), name, "shape"))
    assert list(shaped[name].shape) == [9, 128]
    fp8 = world.checkpoints["hf-fp8-block"].dir
    weight = "model.layers.0.self_attn.k_proj.weight"
    assert list(_tensors(qc.corrupt(fp8, str(tmp_path / "fp8"), weight, "shape"))[weight].shape) \
        == [65, 128]
    with pytest.raises(KeyError, match="has no tensor"):
        qc.corrupt(src, str(tmp_path / "missing"), "model.layers.0.scales", "nan")

    awq = qc.with_group_size(world.checkpoints["awq-g32"].dir, str(tmp_path / "g48"), 48)
    assert _config(awq)["quantization_config"]["group_size"] == 48
    with open(os.path.join(awq, "quantization_config.json")) as f:
        assert json.load(f)["group_size"] == 48  # AutoRound's copy beside config.json
    ct = qc.with_group_size(world.checkpoints["w4a16-asym-g32"].dir, str(tmp_path / "ct48"))
    group = _config(ct)["quantization_config"]["config_groups"]["group_0"]
    assert group["weights"]["group_size"] == 48
    odd = qc.with_unknown_method(src, str(tmp_path / "odd"))
    assert _config(odd)["quantization_config"]["quant_method"] == "mystery-int3"


def test_qwen2_checkpoints_keep_their_biases(tmp_path):
    qwen = qc.build_world(str(tmp_path), "qwen2", ["w4a16-g128", "gptq-g32"])
    base = _tensors(qwen.base)
    for scheme, dtype in (("w4a16-g128", torch.float32), ("gptq-g32", torch.float16)):
        for name in ("q_proj", "k_proj", "v_proj"):
            bias = f"model.layers.1.self_attn.{name}.bias"
            written = _tensors(qwen.checkpoints[scheme].dir)[bias]
            assert written.dtype == dtype  # GPTQ tools store biases in float16
            # AutoRound rounds the whole model through bfloat16 first
            torch.testing.assert_close(written.float(), base[bias], rtol=2 ** -7, atol=0)
            assert torch.equal(_tensors(qwen.checkpoints[scheme].dequantized)[bias],
                               written.float())
