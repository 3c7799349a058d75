"""Quantized bases, served quantized, give exactly the greedy tokens of the checkpoint's own
forward in transformers with the same PEFT adapters (float32, CPU), in mixed-adapter batches:
every scheme the real tools write (llm-compressor's compressed-tensors, AutoRound's GPTQ / AWQ,
GPTQ desc_act, Hugging Face fp8), Llama and Qwen2 (biases), under chunked prefill and
preemption and tensor parallelism; weights stay quantized; a checkpoint that cannot be served
is refused, named.

The checkpoints and their oracle come from tests/quant_checkpoints.py (llm-compressor's own venv,
`make quant-tools`). W8A8 and FP8 schemes quantize each projection's input as the checkpoint
declares (dynamic per token or group, static per tensor and per merged slice, int8 or fp8,
symmetric or not), as compressed-tensors' forward does: their oracle is that forward, and its
weight-only answers (`expected_weight_only`) are what the engine must not give.
"""

from __future__ import annotations

import pytest
from quant_checkpoints import (
    ALL_SCHEMES,
    QuantWorld,
    build_world,
    corrupt,
    with_group_size,
    with_unknown_method,
)

from loragw.engine import LLM, SamplingParams
from loragw.engine.forward import backends
from loragw.engine.quant.scheme import SUPPORTED
from loragw.engine.snapshot import engine_info

pytestmark = pytest.mark.slow  # quantized checkpoints and their oracle, in another venv

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
QWEN2_SCHEMES = ("w4a16-asym-g32", "w8a16-channel", "fp8-block", "gptq-desc-act", "awq-g32",
                 "w8a8-asym", "fp8-static-split")
STRESS = dict(max_loras=2, max_num_batched_tokens=8, num_kv_blocks=16, block_size=4)


@pytest.fixture(scope="module")
def llama(quant_llama) -> QuantWorld:
    return quant_llama


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> QuantWorld:
    return build_world(str(tmp_path_factory.mktemp("quant-qwen2")), "qwen2", QWEN2_SCHEMES)


def serve(world: QuantWorld, scheme: str, **options) -> LLM:
    llm = LLM(world.checkpoints[scheme].dir, **(dict(
        device="cpu", dtype="float32", max_loras=len(world.adapters), max_lora_rank=16) | options))
    for name, path in world.adapters.items():
        llm.add_adapter(name, path)
    return llm


def generate(llm: LLM, world: QuantWorld):
    return llm.generate(world.prompts, GREEDY, adapters=world.request_adapters)


def check(world: QuantWorld, scheme: str, outputs) -> None:
    """The oracle's tokens; and where the scheme quantizes activations, not the weight-only
    forward's (the engine really quantizes them)."""
    world.check(outputs, scheme)
    checkpoint = world.checkpoints[scheme]
    if checkpoint.activations:
        assert [out.token_ids for out in outputs] != checkpoint.expected_weight_only


@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_llama_mixed_adapters_match_the_checkpoints_forward(llama, scheme):
    with serve(llama, scheme) as llm:
        check(llama, scheme, generate(llm, llama))
        assert llm.config.quant is not None


@pytest.mark.parametrize("scheme", QWEN2_SCHEMES)
def test_qwen2_with_biases_matches_under_chunked_prefill_and_preemption(qwen2, scheme):
    with serve(qwen2, scheme, **STRESS) as llm:
        check(qwen2, scheme, generate(llm, qwen2))
        assert llm.engine.scheduler.num_preemptions > 0, "the schedule did not preempt"


@pytest.mark.parametrize("scheme", ["w4a16-asym-g32", "gptq-desc-act", "fp8-block", "awq-g32",
                                    "fp8-dynamic", "w8a8-static-asym"])
def test_tensor_parallel_quantized_weights_split_along_the_shard(llama, scheme):
    """Column-parallel rows and row-parallel columns of packed int4 with zero points, act
    order (every rank keeps every group's scales), FP8 blocks; per-token activation scales
    maxed over the ranks' halves of each row (fp8-dynamic, and fp8-block's o_proj, whose one
    128-column group both ranks share); chunked and preempted."""
    with serve(llama, scheme, tensor_parallel_size=2, **STRESS) as llm:
        check(llama, scheme, generate(llm, llama))


def vocabulary_adapter(base: str, out: str) -> str:
    """A PEFT LoRA on embed_tokens, lm_head and q_proj of `base`, saved by PEFT."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=[
        "embed_tokens", "lm_head", "q_proj"], init_lora_weights=False))
    peft.save_pretrained(out)
    return out


def test_vocabulary_loras_and_logprobs_equal_the_decompressed_twin(llama, tmp_path, monkeypatch):
    """Everything beside the projections works on a quantized base as on its float32 twin
    (the same weights, dequantized once): embed_tokens / lm_head LoRA, logprobs with
    alternatives, bit for bit."""
    scheme = "w4a16-asym-g32"
    twin = llama.checkpoints[scheme].dequantized
    vocab = vocabulary_adapter(twin, str(tmp_path / "vocab"))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    adapters = ["vocab", None, "all-r16", "vocab"]
    runs = []
    monkeypatch.setattr(backends, "resolve_quant_backend",
                        lambda kind, device: None if kind is None else "torch")
    for path in (llama.checkpoints[scheme].dir, twin):
        # bit for bit needs one GEMM for every projection: the quantized base's are
        # dequantize-then-F.linear (not the CPU's C kernel, which sums in another order), so
        # the twin's (and both lm_heads) are F.linear too
        with LLM(path, device="cpu", max_loras=4, max_lora_rank=16,
                 linear_backend="torch") as llm:
            llm.add_adapter("vocab", vocab)
            llm.add_adapter("all-r16", llama.adapters["all-r16"])
            runs.append(llm.generate(llama.prompts[:4], params, adapters=adapters))
    for quantized, dense in zip(*runs, strict=True):
        assert quantized.token_ids == dense.token_ids
        assert [(lp.token_id, lp.logprob, lp.top) for lp in quantized.logprobs] == [
            (lp.token_id, lp.logprob, lp.top) for lp in dense.logprobs]


def test_weights_stay_quantized_and_are_reported(llama):
    sizes = {}
    for scheme in ("w4a16-g128", "w8a16-channel", "fp8-dynamic"):
        with serve(llama, scheme, num_kv_blocks=8) as llm:
            info = engine_info(llm.engine)
            sizes[scheme] = info.weight_bytes
            assert info.quantization.startswith("compressed-tensors ("), info.quantization
            kinds = {linear.qweight.dtype for _, linear in llm.engine.runner.model.lora_linears()}
            assert len(kinds) == 1 and not kinds.pop().is_floating_point
    with LLM(llama.base, device="cpu", num_kv_blocks=8) as llm:
        full = engine_info(llm.engine).weight_bytes
        assert engine_info(llm.engine).quantization == "none"
    # the tiny base: 295k projection parameters, 98k in embed_tokens + lm_head (float32)
    float_rest = full - 295_000 * 4
    for scheme, bits in (("w4a16-g128", 4), ("w8a16-channel", 8), ("fp8-dynamic", 8)):
        projections = sizes[scheme] - float_rest
        assert projections < 295_000 * bits / 8 * 1.1, (scheme, sizes[scheme], full)


def test_a_corrupt_scale_is_refused_at_start_naming_the_tensor(llama, tmp_path):
    src = llama.checkpoints["w4a16-asym-g32"].dir
    scale = "model.layers.1.mlp.down_proj.weight_scale"
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj's scale holds NaN"):
        LLM(corrupt(src, str(tmp_path / "nan"), scale, "nan"), device="cpu")
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj.weight_scale has shape"):
        LLM(corrupt(src, str(tmp_path / "shape"), scale, "shape"), device="cpu")
    static = llama.checkpoints["w8a8-static-asym"].dir
    with pytest.raises(ValueError, match="down_proj'.*an input_scale is not a positive finite"):
        LLM(corrupt(static, str(tmp_path / "input"), "model.layers.1.mlp.down_proj.input_scale",
                    "nan"), device="cpu")
    gptq = llama.checkpoints["gptq-g32"].dir
    with pytest.raises(ValueError, match="model.layers.0.self_attn.k_proj"):
        LLM(corrupt(gptq, str(tmp_path / "gptq"), "model.layers.0.self_attn.k_proj.scales",
                    "shape"), device="cpu")


def test_an_act_order_map_past_its_groups_is_refused_before_any_kernel_reads_it(llama, tmp_path):
    """A g_idx naming a group that has no scale would read out of bounds in the GPU kernel."""
    import os
    import shutil

    import safetensors.torch

    src = llama.checkpoints["gptq-desc-act"].dir
    dst = shutil.copytree(src, tmp_path / "gidx")
    path = os.path.join(dst, "model.safetensors")
    tensors = safetensors.torch.load_file(path)
    tensors["model.layers.1.self_attn.o_proj.g_idx"][5] = 1000
    safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.1.self_attn.o_proj.*g_idx names groups"):
        LLM(str(dst), device="cpu")


def test_an_unknown_method_and_a_group_that_does_not_divide_are_refused_by_the_config(
        llama, tmp_path):
    from loragw.engine.config import Config

    src = llama.checkpoints["w4a16-g32"].dir
    with pytest.raises(ValueError) as refused:
        Config(with_unknown_method(src, str(tmp_path / "unknown")), device="cpu")
    assert "'mystery-int3' is not served" in str(refused.value)
    assert SUPPORTED in str(refused.value)
    for scheme in ("w4a16-g32", "gptq-g32"):
        with pytest.raises(ValueError, match="group_size 48 does not divide"):
            Config(with_group_size(llama.checkpoints[scheme].dir, str(tmp_path / scheme), 48),
                   device="cpu")
