"""Quantized checkpoints of a float base, one writer per tool, and SCHEMES, the names tests use.

    compressed-tensors  llm-compressor's oneshot(QuantizationModifier(targets="Linear",
                        scheme or config_groups, ignore=["lm_head"])), then
                        save_pretrained(save_compressed=True); no calibration data, except for
                        static activation scales (FP8, W8A8 static): CALIBRATION's random
                        token sequences as a datasets.Dataset
    static, split       fp8-static with k_proj's and up_proj's input_scale times 1.5, as
                        another calibration could leave them: the slices of one merged
                        projection then quantize the same x with different scales
    gptq, awq           AutoRound in its round-to-nearest mode (iters=0, disable_opt_rtn) with
                        quantize_and_save(format="auto_gptq" / "auto_awq"): its own packers
                        (auto_round_extension/torch/qlinear_torch_zp.py, auto_round/export/
                        export_to_awq/utils.py) and its config, which names no checkpoint_format;
                        it rounds the model through bfloat16 first and saves the unquantized
                        tensors in bfloat16, biases and scales in float16, config dtype float16
    gptq desc_act       no installed tool writes it (AutoRound's GPTQ export sets desc_act false;
                        compressed-tensors 0.19 removed actorder="group" and g_idx): input columns
                        ordered by calibration activation size as GPTQ orders them, symmetric
                        round-to-nearest per group, packed by formats.quantize_desc_act, config
                        as GPTQModel writes it (checkpoint_format "gptq")
    fp8 (Hugging Face)  llm-compressor's FP8_BLOCK weights and scales, renamed weight_scale ->
                        weight_scale_inv, config {"quant_method": "fp8", ...} as Qwen3-FP8 has it
Every checkpoint also gets the base's tokenizer and generation_config.json.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

EXTRA_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
CALIBRATION = dict(sequences=8, length=32, seed=3)  # desc_act's order, static input scales


@dataclass(frozen=True)
class Scheme:
    family: str  # "compressed-tensors", "gptq", "awq" or "fp8": how it is read back
    write: Callable[[str, str], None] = field(repr=False)  # (float base dir, out dir)


def write_llmcompressor(base: str, out: str, preset: str, weights: dict | None = None,
                        activations: dict | None = None) -> None:
    """llm-compressor's oneshot with compressed-tensors' `preset` scheme; `weights` and
    `activations` override fields of its weights and input_activations arguments (group_size,
    strategy, dynamic, symmetric) through config_groups. Static activations are calibrated."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    args = dict(PRESET_SCHEMES[preset])
    for key, changes in (("weights", weights), ("input_activations", activations)):
        if changes:
            args[key] = QuantizationArgs(**{**args[key].model_dump(), **changes})
    if weights or activations:
        groups = {"group_0": QuantizationScheme(targets=["Linear"], **args)}
        recipe = QuantizationModifier(config_groups=groups, ignore=["lm_head"])
    else:
        recipe = QuantizationModifier(targets="Linear", scheme=preset, ignore=["lm_head"])
    static = args.get("input_activations") is not None and not args["input_activations"].dynamic
    if static:
        oneshot(model=model, dataset=_calibration_set(model.config.vocab_size), recipe=recipe,
                num_calibration_samples=CALIBRATION["sequences"],
                max_seq_length=CALIBRATION["length"])
    else:
        oneshot(model=model, processor=None, recipe=recipe)
    model.save_pretrained(out, save_compressed=True)
    _copy_extras(base, out)


def write_split_input_scales(base: str, out: str) -> None:
    """fp8-static with k_proj's and up_proj's input_scale times 1.5 (module docstring)."""
    import safetensors.torch

    write_llmcompressor(base, out, "FP8")
    path = os.path.join(out, "model.safetensors")
    tensors = safetensors.torch.load_file(path)
    for name in tensors:
        if name.endswith(("k_proj.input_scale", "up_proj.input_scale")):
            tensors[name] = tensors[name] * 1.5
    safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})


def _calibration_set(vocab: int):
    """CALIBRATION's random token sequences, as llm-compressor's oneshot takes a dataset."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(CALIBRATION["seed"])
    ids = torch.randint(0, vocab, (CALIBRATION["sequences"], CALIBRATION["length"]),
                        generator=g)
    return Dataset.from_dict({"input_ids": ids.tolist(),
                              "attention_mask": torch.ones_like(ids).tolist()})


def write_autoround(base: str, out: str, fmt: str, group_size: int, sym: bool) -> None:
    """AutoRound's round-to-nearest 4-bit quantization saved in `fmt` ("auto_gptq",
    "auto_awq")."""
    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    rounder = AutoRound(model, tokenizer=AutoTokenizer.from_pretrained(base), bits=4,
                        group_size=group_size, sym=sym, iters=0, disable_opt_rtn=True,
                        device_map="cpu")
    staging = out + ".staging"
    shutil.rmtree(staging, ignore_errors=True)
    rounder.quantize_and_save(output_dir=staging, format=fmt)
    # AutoRound saves into a folder of its own naming under output_dir
    written = [root for root, _, files in os.walk(staging) if "config.json" in files]
    assert len(written) == 1, f"AutoRound wrote {written}"
    shutil.move(written[0], out)
    shutil.rmtree(staging)
    _copy_extras(base, out)


def write_gptq_desc_act(base: str, out: str, group_size: int) -> None:
    """A GPTQ desc_act checkpoint (module docstring): fp16 scales, biases and unquantized
    tensors, as GPTQ tools save them."""
    import safetensors.torch
    from formats import quantize_desc_act
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    order = _activation_order(model)
    tensors = {}
    for name, param in model.state_dict().items():
        module = name.rpartition(".")[0]
        if module in order and name.endswith(".weight"):
            packed = quantize_desc_act(param, order[module], group_size, bits=4)
            tensors |= {f"{module}.{key}": value for key, value in packed.items()}
        else:
            tensors[name] = param.to(torch.float16)
    config = _read_json(os.path.join(base, "config.json"))
    quant = {"bits": 4, "group_size": group_size, "desc_act": True, "sym": True,
             "lm_head": False, "quant_method": "gptq", "checkpoint_format": "gptq",
             "static_groups": False, "true_sequential": True, "damp_percent": 0.01,
             "pack_dtype": "int32"}
    os.makedirs(out, exist_ok=True)
    safetensors.torch.save_file(tensors, os.path.join(out, "model.safetensors"),
                                metadata={"format": "pt"})
    _write_json(os.path.join(out, "config.json"),
                config | {"dtype": "float16", "quantization_config": quant})
    _write_json(os.path.join(out, "quantize_config.json"), quant)
    _copy_extras(base, out)


def write_hf_fp8(base: str, out: str) -> None:
    """Hugging Face fp8 with [128, 128] blocks, from llm-compressor's FP8_BLOCK (the same
    weights and scales: w = weight * weight_scale_inv per block)."""
    import safetensors.torch

    write_llmcompressor(base, out, "FP8_BLOCK")
    path = os.path.join(out, "model.safetensors")
    tensors = safetensors.torch.load_file(path)
    renamed = {(name + "_inv" if name.endswith(".weight_scale") else name): value
               for name, value in tensors.items()}
    safetensors.torch.save_file(renamed, path, metadata={"format": "pt"})
    config = _read_json(os.path.join(out, "config.json"))
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "fmt": "e4m3", "weight_block_size": [128, 128]}
    _write_json(os.path.join(out, "config.json"), config)
    os.remove(os.path.join(out, "recipe.yaml"))


SCHEMES: dict[str, Scheme] = {
    "w4a16-g128": Scheme("compressed-tensors", partial(write_llmcompressor, preset="W4A16")),
    "w4a16-g32": Scheme("compressed-tensors", partial(write_llmcompressor, preset="W4A16",
                                                      weights={"group_size": 32})),
    "w4a16-asym-g128": Scheme("compressed-tensors",
                              partial(write_llmcompressor, preset="W4A16_ASYM")),
    "w4a16-asym-g32": Scheme("compressed-tensors", partial(
        write_llmcompressor, preset="W4A16_ASYM", weights={"group_size": 32})),
    # compressed-tensors 0.19's W8A16 preset is group 128; "w8a16-channel" is the older layout
    "w8a16": Scheme("compressed-tensors", partial(write_llmcompressor, preset="W8A16")),
    "w8a16-channel": Scheme("compressed-tensors", partial(
        write_llmcompressor, preset="W8A16", weights={"strategy": "channel",
                                                      "group_size": None})),
    "w8a16-asym-g32": Scheme("compressed-tensors", partial(
        write_llmcompressor, preset="W8A16", weights={"symmetric": False, "group_size": 32})),
    "w8a8": Scheme("compressed-tensors", partial(write_llmcompressor, preset="W8A8")),
    "w8a8-asym": Scheme("compressed-tensors", partial(
        write_llmcompressor, preset="W8A8", activations={"symmetric": False})),
    "w8a8-static-asym": Scheme("compressed-tensors", partial(
        write_llmcompressor, preset="W8A8", activations={
            "strategy": "tensor", "dynamic": False, "symmetric": False})),
    "fp8-static": Scheme("compressed-tensors", partial(write_llmcompressor, preset="FP8")),
    "fp8-static-split": Scheme("compressed-tensors", write_split_input_scales),
    "fp8-dynamic": Scheme("compressed-tensors",
                          partial(write_llmcompressor, preset="FP8_DYNAMIC")),
    "fp8-block": Scheme("compressed-tensors", partial(write_llmcompressor, preset="FP8_BLOCK")),
    "gptq-g32": Scheme("gptq", partial(write_autoround, fmt="auto_gptq", group_size=32,
                                       sym=False)),
    "gptq-desc-act": Scheme("gptq", partial(write_gptq_desc_act, group_size=32)),
    "awq-g32": Scheme("awq", partial(write_autoround, fmt="auto_awq", group_size=32, sym=False)),
    "hf-fp8-block": Scheme("fp8", write_hf_fp8),
}


def quantized_linears(model) -> list[str]:
    """The Linear modules every scheme quantizes: all but lm_head."""
    return [name for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and name != "lm_head"]


def _activation_order(model) -> dict[str, torch.Tensor]:
    """Each quantized Linear's input columns, largest summed squared activation (the GPTQ
    Hessian's diagonal) first, over CALIBRATION's random token sequences."""
    sums: dict[str, torch.Tensor] = {}
    hooks = []
    for name in quantized_linears(model):
        def record(module, args, _out, name=name):
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            sums[name] = sums.get(name, 0) + (x * x).sum(0)
        hooks.append(model.get_submodule(name).register_forward_hook(record))
    g = torch.Generator().manual_seed(CALIBRATION["seed"])
    ids = torch.randint(0, model.config.vocab_size,
                        (CALIBRATION["sequences"], CALIBRATION["length"]), generator=g)
    with torch.no_grad():
        model(input_ids=ids)
    for hook in hooks:
        hook.remove()
    return {name: torch.argsort(total, descending=True) for name, total in sums.items()}


def _copy_extras(base: str, out: str) -> None:
    for name in EXTRA_FILES:
        shutil.copy(os.path.join(base, name), os.path.join(out, name))


def _read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
