"""transformers + PEFT as the oracle: a checkpoint loaded in float32 the way transformers itself
reads it, every adapter loaded into one PeftModel, and greedy tokens per request.

How each family is read (`load`):
    compressed-tensors  from_pretrained(dir, quantization_config=CompressedTensorsConfig(
                        dequantize=True)): float32 Linears holding the decompressed weights.
                        Their forward still runs compressed-tensors' wrapper, which for schemes
                        with input_activations (W8A8, FP8_DYNAMIC, FP8_BLOCK, FP8) quantizes and
                        dequantizes each Linear's input on the fly (dynamic: per token, or per
                        token and 128 columns for FP8_BLOCK; static: the module's own
                        input_scale / input_zero_point); `weight_only` turns that off
                        (module.quantization_enabled = False), leaving plain float32 Linears.
    fp8                 from_pretrained(dir, quantization_config=FineGrainedFP8Config(
                        dequantize=True)): plain float32 Linears. transformers quantizes fp8
                        activations only in its GPU kernel (finegrained-fp8: per token and
                        weight-block column, s = max|x| / 448, in float32), and drops them on
                        the CPU; so each Linear's input gets compressed-tensors' own dynamic
                        group quantization of the same rule (a forward pre-hook), which in
                        float32 is that kernel's up to its GEMM's rounding. `weight_only` turns
                        it off the same way.
    gptq, awq           transformers reads these only through gptqmodel (CUDA or a torch newer
                        than llm-compressor allows), so the float32 checkpoint dequantize.py
                        wrote (float64 (q - z) * s, rounded once) is loaded as a plain model.
Requests run one at a time (no padding), the adapter set with set_adapter, the base model's
requests under disable_adapter; generation_config's EOS is cleared, so every request gets
max_tokens tokens.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager

import torch


def load(family: str, path: str):
    """The checkpoint at `path` in float32 as transformers reads it (module docstring); for
    gptq / awq pass the dequantized twin's path."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig, FineGrainedFP8Config

    quantization = {"compressed-tensors": CompressedTensorsConfig(dequantize=True),
                    "fp8": FineGrainedFP8Config(dequantize=True)}.get(family)
    kwargs = {"quantization_config": quantization} if quantization else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
    model.generation_config.eos_token_id = None  # every token counts
    if family == "fp8":
        with open(os.path.join(path, "config.json")) as f:
            fp8 = json.load(f)["quantization_config"]
        if fp8.get("activation_scheme", "dynamic") == "dynamic":
            _quantize_fp8_inputs(model, (fp8.get("weight_block_size") or [None, None])[1])
    return model.eval()


def _quantize_fp8_inputs(model, group_size: int | None) -> None:
    """Every quantized Linear's input through compressed-tensors' dynamic fp8 quantization, per
    token and `group_size` columns (None: the whole row)."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    args = QuantizationArgs(num_bits=8, type="float", symmetric=True, dynamic=True,
                            strategy="group" if group_size else "token", group_size=group_size)

    def quantize_input(module, inputs):
        if not getattr(module, "quantization_enabled", True):
            return None
        scale, zero = compute_dynamic_scales_and_zp(value=inputs[0], args=args, module=module)
        return (fake_quantize(inputs[0], scale, zero, args),)

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            module.register_forward_pre_hook(quantize_input)


def weight_only(model) -> None:
    """Turn off the on-the-fly activation quantization (compressed-tensors' wrapper, or the fp8
    pre-hooks): plain float32 Linears on the decompressed weights."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.quantization_enabled = False


def with_adapters(model, dirs: dict[str, str]):
    """A PeftModel on `model` holding every adapter of `dirs` (name -> dir)."""
    from peft import PeftModel

    names = list(dirs)
    peft_model = PeftModel.from_pretrained(model, dirs[names[0]], adapter_name=names[0])
    for name in names[1:]:
        peft_model.load_adapter(dirs[name], adapter_name=name)
    return peft_model.eval()


@contextmanager
def _active(model, adapter: str | None):
    if adapter is None:
        with model.disable_adapter():
            yield
    else:
        model.set_adapter(adapter)
        yield


def greedy(model, requests: list[tuple[list[int], str | None]],
           max_tokens: int) -> list[list[int]]:
    """PEFT's greedy tokens for each (prompt token ids, adapter or None) request."""
    return greedy_with_margins(model, requests, max_tokens)[0]


def greedy_with_margins(model, requests: list[tuple[list[int], str | None]], max_tokens: int
                        ) -> tuple[list[list[int]], list[list[list[float]]]]:
    """greedy's tokens, and per token [its log-probability lead over the runner-up (nats), the
    runner-up's id]: how near a tie each choice was."""
    outputs, margins = [], []
    with torch.inference_mode():
        for prompt, adapter in requests:
            ids = torch.tensor([prompt])
            with _active(model, adapter):
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                     max_new_tokens=max_tokens, do_sample=False,
                                     pad_token_id=0, output_scores=True,
                                     return_dict_in_generate=True)
            tokens = out.sequences[0, len(prompt):].tolist()
            assert len(tokens) == max_tokens, f"generation stopped early: {tokens}"
            outputs.append(tokens)
            row = []
            for scores in out.scores:
                top = torch.log_softmax(scores[0].double(), -1).topk(2)
                row.append([round((top.values[0] - top.values[1]).item(), 6),
                            int(top.indices[1])])
            margins.append(row)
    return outputs, margins
