"""Quantized bases on a GPU: the Triton GEMM serves every scheme the tools write (FP8 from sm_89;
dequantize-then-GEMM before it), in float32 token for token with the checkpoint's forward +
PEFT (the CPU oracle of test_quant_parity: W8A8 / FP8 inputs quantized as declared, in torch
before the kernel), eager and in CUDA graphs, and in bfloat16 within a few tokens of it.

The quantized world is built by `make quant-tools`' venv, which a GPU machine may lack: point
LORAGW_QUANT_WORLD at a world built elsewhere (benchmarks/gpu_session.sh documents how).
"""

from __future__ import annotations

import os

import pytest
import torch
from quant_checkpoints import ALL_SCHEMES, QuantWorld, build_world

from loragw.engine import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> QuantWorld:
    root = os.environ.get("LORAGW_QUANT_WORLD") or str(tmp_path_factory.mktemp("quant-gpu"))
    return build_world(root, "llama", ALL_SCHEMES)


def serve(world: QuantWorld, scheme: str, **options) -> LLM:
    llm = LLM(world.checkpoints[scheme].dir, **(dict(
        device="cuda", dtype="float32", max_loras=len(world.adapters), max_lora_rank=16)
        | options))
    for name, path in world.adapters.items():
        llm.add_adapter(name, path)
    return llm


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "cuda-graphs"])
@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_float32_on_the_gpu_matches_the_decompressed_model(world, scheme, eager):
    with serve(world, scheme, enforce_eager=eager) as llm:
        expected = "torch" if scheme.startswith(("fp8", "hf-fp8")) and (
            torch.cuda.get_device_capability() < (8, 9)) else "triton"
        assert llm.engine.model_runner.backends.quant == expected
        outputs = llm.generate(world.prompts, GREEDY, adapters=world.request_adapters)
        world.check(outputs, scheme)


@pytest.mark.parametrize("scheme", ["w4a16-g128", "w8a16-channel", "fp8-block", "gptq-desc-act",
                                    "w8a8", "fp8-static-split"])
def test_bfloat16_stays_close_to_the_float32_oracle(world, scheme):
    """bf16 rounds every activation: tokens may part at a near-tie, but not wholesale."""
    with serve(world, scheme, dtype="bfloat16") as llm:
        outputs = llm.generate(world.prompts, GREEDY, adapters=world.request_adapters)
    expected = world.checkpoints[scheme].expected
    first_tokens = sum(o.token_ids[0] == e[0] for o, e in zip(outputs, expected, strict=True))
    assert first_tokens >= len(expected) - 1, (scheme, first_tokens, len(expected))
