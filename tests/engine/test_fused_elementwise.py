"""An engine whose norms, rotary and SiLU-and-mul run through the Triton fused kernels
(kernels/fused_triton.py, under the interpreter here; CUDA's default) gives PEFT's greedy
tokens with many adapters in one batch."""

from __future__ import annotations

from peft_reference import MAX_TOKENS

from loragw.engine import SamplingParams
from loragw.kernels import fused_triton as ft


def test_peft_greedy_tokens_through_the_fused_kernels(lora_world, monkeypatch):
    calls = {"add_rms_norm": 0, "rotary": 0, "silu_and_mul": 0}
    for name in calls:
        real = getattr(ft, name)

        def counted(*args, _real=real, _name=name):
            calls[_name] += 1
            return _real(*args)
        monkeypatch.setattr(ft, name, counted)
    llm = lora_world.llm(elementwise_backend="triton")
    outputs = llm.generate(lora_world.prompts, SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True), adapters=lora_world.requests)
    for i, (out, want) in enumerate(zip(outputs, lora_world.expected, strict=True)):
        assert out.token_ids == want, f"request {i}"
    assert min(calls.values()) > 0, calls
