"""transformers + PEFT as the oracle: a checkpoint loaded in float32 the way transformers itself
reads it, every adapter loaded into one PeftModel, and greedy tokens per request.

How each family is read (`load`):
    compressed-tensors  from_pretrained(dir, quantization_config=CompressedTensorsConfig(
                        dequantize=True)): float32 Linears holding the decompressed weights.
                        Their forward still runs compressed-tensors' wrapper, which for schemes
                        with input_activations (W8A8, FP8_DYNAMIC, FP8_BLOCK) quantizes and
                        dequantizes each Linear's input on the fly (dynamic: per token, or per
                        token and 128 columns for FP8_BLOCK); `weight_only` turns that off
                        (module.quantization_enabled = False), leaving plain float32 Linears.
    fp8                 from_pretrained(dir, quantization_config=FineGrainedFP8Config(
                        dequantize=True)): plain float32 Linears, no activation quantization.
    gptq, awq           transformers reads these only through gptqmodel (CUDA or a torch newer
                        than llm-compressor allows), so the float32 checkpoint dequantize.py
                        wrote (float64 (q - z) * s, rounded once) is loaded as a plain model.
Requests run one at a time (no padding), the adapter set with set_adapter, the base model's
requests under disable_adapter; generation_config's EOS is cleared, so every request gets
max_tokens tokens.
"""

from __future__ import annotations

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
    return model.eval()


def weight_only(model) -> None:
    """Turn off compressed-tensors' on-the-fly activation quantization: plain float32 Linears
    on the decompressed weights."""
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is not None:
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
    outputs = []
    with torch.inference_mode():
        for prompt, adapter in requests:
            ids = torch.tensor([prompt])
            with _active(model, adapter):
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                     max_new_tokens=max_tokens, do_sample=False,
                                     pad_token_id=0)
            tokens = out[0, len(prompt):].tolist()
            assert len(tokens) == max_tokens, f"generation stopped early: {tokens}"
            outputs.append(tokens)
    return outputs
