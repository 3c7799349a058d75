"""A quantized checkpoint's float32 twin, computed by formats.py alone, and the checks that tie it
to the tools: their own unpacking reads the same integers, their own dequantization the same
weights, and the weights sit near the float base's (quantization error small, never zero).

`dequantize(src, family, out)` writes out/ as a plain float32 checkpoint (config.json without
quantization_config, every other tensor upcast) and returns its tensors.
"""

from __future__ import annotations

import json
import os
import shutil

import formats
import safetensors.torch
import torch

# The tensors that make up one quantized Linear, by family; the first names the Linear.
PARTS = {
    "compressed-tensors": ("weight_scale", "weight_packed", "weight_shape", "weight_zero_point",
                           "weight", "input_scale", "input_zero_point"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "fp8": ("weight_scale_inv", "weight"),
}
# The largest relative RMS error of a dequantized Linear against the float base, by bits.
MAX_ERROR = {4: 0.15, 8: 0.05}


def read_checkpoint(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    return config, safetensors.torch.load_file(os.path.join(path, "model.safetensors"))


def linear_prefixes(tensors: dict[str, torch.Tensor], family: str) -> list[str]:
    """The quantized Linears' name prefixes ("model.layers.0.self_attn.q_proj.")."""
    marker = "." + PARTS[family][0]
    return sorted(name[:-len(marker) + 1] for name in tensors if name.endswith(marker))


def weight_bits(config: dict, family: str) -> int:
    quant = config["quantization_config"]
    if family == "compressed-tensors":
        (group,) = quant["config_groups"].values()
        return group["weights"]["num_bits"]
    return 8 if family == "fp8" else quant["bits"]


def dequantize(src: str, family: str, out: str) -> dict[str, torch.Tensor]:
    config, tensors = read_checkpoint(src)
    quant = config.pop("quantization_config")
    weights = {}
    for prefix in linear_prefixes(tensors, family):
        if family == "compressed-tensors":
            (group,) = quant["config_groups"].values()
            w = formats.dequant_compressed_tensors(tensors, prefix, group["weights"],
                                                   quant["format"])
        elif family == "gptq":
            w = formats.dequant_gptq(tensors, prefix, quant)
        elif family == "awq":
            w = formats.dequant_awq(tensors, prefix, quant)
        else:
            w = formats.dequant_hf_fp8(tensors, prefix, quant)
        for part in PARTS[family]:
            tensors.pop(prefix + part, None)
        weights[prefix + "weight"] = w
    weights |= {name: t.to(torch.float32) for name, t in tensors.items()}
    os.makedirs(out, exist_ok=True)
    safetensors.torch.save_file(weights, os.path.join(out, "model.safetensors"),
                                metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config | {"dtype": "float32"}, f, indent=2, sort_keys=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(src, name), os.path.join(out, name))
    return weights


def max_error(weights: dict[str, torch.Tensor], float_base: str, bits: int) -> float:
    """The largest relative RMS error of a quantized Linear against the float base's; asserts
    it is above zero (something was quantized) and under MAX_ERROR[bits]."""
    _, base = read_checkpoint(float_base)
    errors = {}
    for name, w in weights.items():
        if name.endswith("_proj.weight"):
            ref = base[name].double()
            errors[name] = ((w.double() - ref).norm() / ref.norm()).item()
    assert errors and all(0 < e < MAX_ERROR[bits] for e in errors.values()), errors
    return max(errors.values())


def check_loaded(model, weights: dict[str, torch.Tensor]) -> None:
    """transformers' own dequantization (a model loaded from the quantized checkpoint) holds
    exactly the weights formats.py computed."""
    params = dict(model.named_parameters())
    for name, w in weights.items():
        assert torch.equal(params[name].detach(), w), (
            f"{name}: transformers' weights differ from formats.py's by "
            f"{(params[name].detach() - w).abs().max().item()}")


def check_gptq_tool(src: str, weights: dict[str, torch.Tensor]) -> None:
    """auto_round_extension's CPU QuantLinear (the GPTQ v1 layout, g_idx honoured) reads the
    same integers (scales set to 1) and, dequantizing in float16, the same weights up to one
    float16 rounding. Its g_idx path slices the scales by input width, right only while
    out <= in, so wider Linears are read in column slices of at most `in` outputs (GPTQ's
    tensors split cleanly by output column)."""
    from auto_round_extension.torch.qlinear_torch_zp import QuantLinear

    config, tensors = read_checkpoint(src)
    quant = config["quantization_config"]
    bits, per_word = quant["bits"], 32 // quant["bits"]
    for prefix in linear_prefixes(tensors, "gptq"):
        g_idx, scales = tensors[prefix + "g_idx"], tensors[prefix + "scales"]
        inp, out = g_idx.shape[0], scales.shape[1]
        q, z = formats.gptq_integers(tensors, prefix, bits, v1_zeros=True)
        integers = (q - z[g_idx.long()]).float()  # [in, out]
        eye = torch.eye(inp)
        for start in range(0, out, inp):
            cols = slice(start, min(out, start + inp))
            width = cols.stop - cols.start
            layer = QuantLinear(bits, quant["group_size"], inp, width, bias=False, g_idx=True)
            layer.qweight = tensors[prefix + "qweight"][:, cols]
            layer.qzeros = tensors[prefix + "qzeros"][:, start // per_word:cols.stop // per_word]
            layer.g_idx = g_idx
            layer.scales = scales[:, cols]
            deq = layer(eye).t()  # [width, in], dequantized in float16 by the tool
            _assert_fp16_close(deq, weights[prefix + "weight"][cols], prefix)
            layer.scales = torch.ones_like(scales[:, cols])
            assert torch.equal(layer(eye), integers[:, cols]), f"{prefix}: integers differ"


def check_awq_tool(src: str, weights: dict[str, torch.Tensor]) -> None:
    """auto_round's AWQ unpacking (unpack_awq, reverse_awq_order) reads the same integers, and
    its float16 dequantize_gemm the same weights up to one float16 rounding."""
    from auto_round.export.export_to_awq.utils import dequantize_gemm, reverse_awq_order, unpack_awq

    config, tensors = read_checkpoint(src)
    quant = config["quantization_config"]
    bits, group = quant["bits"], quant["group_size"]
    for prefix in linear_prefixes(tensors, "awq"):
        qweight, qzeros = tensors[prefix + "qweight"], tensors[prefix + "qzeros"]
        tool_q, tool_z = reverse_awq_order(*unpack_awq(qweight, qzeros, bits), bits)
        q, z = formats.awq_integers(tensors, prefix, bits)
        mask = (1 << bits) - 1
        assert torch.equal(tool_q.long() & mask, q) and torch.equal(tool_z.long() & mask, z), (
            f"{prefix}: integers differ")
        deq = dequantize_gemm(qweight, qzeros, tensors[prefix + "scales"], bits, group).t()
        _assert_fp16_close(deq, weights[prefix + "weight"], prefix)


def _assert_fp16_close(tool: torch.Tensor, ours: torch.Tensor, prefix: str) -> None:
    """Equal up to one float16 rounding of the tool's product."""
    gap = (tool.float() - ours).abs()
    ulp = ours.abs().clamp(min=2.0 ** -14) * 2.0 ** -10
    assert bool((gap <= ulp).all()), f"{prefix}: the tool's weights differ by {gap.max().item()}"
