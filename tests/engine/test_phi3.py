"""Phi-3 bases (fused qkv_proj / gate_up_proj in the checkpoint and in adapters): greedy output
equals transformers' token for token under batching, chunked prefill and preemption, with
default rope, longrope (Phi-3-128k / Phi-3.5) and partial rotary with longrope and tied
embeddings (Phi-4-mini); PEFT's Phi-3 adapters on the fused modules match PEFT in one mixed
batch with base rows, on one rank and on two (gloo)."""

import shutil

import pytest
import safetensors.torch
import torch
from checkpoints import make_tiny_checkpoint
from peft_reference import MAX_TOKENS, World, hf_greedy

from loragw.engine import LLM, SamplingParams

TOKENS = 20
ORIGINAL = 64  # longrope's original_max_position_embeddings: every test sequence fits in it


def longrope(rotary_dims: int) -> dict:
    return {"rope_type": "longrope",
            "short_factor": [1.0 + 0.25 * i for i in range(rotary_dims // 2)],
            "long_factor": [4.0 + i for i in range(rotary_dims // 2)]}


VARIANTS = {
    "phi3": {},
    "phi3-longrope": {"rope_scaling": longrope(16), "original_max_position_embeddings": ORIGINAL},
    "phi4-mini-like": {"rope_scaling": longrope(12), "partial_rotary_factor": 0.75,
                       "original_max_position_embeddings": ORIGINAL, "tie_word_embeddings": True},
}
SCHEDULES = {
    "batched": {},
    "chunked-prefill": {"max_num_batched_tokens": 8},
    "preempted": {"num_kv_blocks": 24, "block_size": 4},
}
ADAPTERS = {  # fused targets, ranks 2-16, rslora, patterns keyed by the fused name, all-linear
    "qkv-r8": dict(r=8, lora_alpha=16, target_modules=["qkv_proj"]),
    "gate-up-r2-rslora": dict(r=2, lora_alpha=4, use_rslora=True, target_modules=["gate_up_proj"]),
    "all-linear-patterns": dict(r=4, lora_alpha=8, target_modules="all-linear",
                                rank_pattern={"qkv_proj": 16}, alpha_pattern={"down_proj": 2}),
    "qkv-o-layer1": dict(r=4, lora_alpha=4, target_modules=["qkv_proj", "o_proj"],
                         layers_to_transform=[1]),
}
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in (1, 5, 17, 40, 3, 29)]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_transformers(tiny_checkpoint, variant):
    path = tiny_checkpoint("phi3", **VARIANTS[variant])
    asks = prompts()
    expected = hf_greedy(path, asks, TOKENS)
    assert len({tuple(e) for e in expected}) > 1, "degenerate checkpoint: every output is equal"
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    for name, schedule in SCHEDULES.items():
        llm = LLM(path, device="cpu", dtype="float32", max_model_len=ORIGINAL, **schedule)
        for prompt, out, want in zip(asks, llm.generate(asks, params), expected, strict=True):
            assert out.token_ids == want, f"{variant}/{name}: prompt of {len(prompt)} tokens"
        if name == "preempted":
            assert llm.engine.scheduler.num_preemptions > 0, "the schedule did not preempt"


def test_longrope_serves_up_to_the_original_length_and_refuses_past_it(tiny_checkpoint):
    """Past original_max_position_embeddings transformers switches the whole sequence to the
    long factors; the engine does not, so it keeps contexts short of that."""
    path = tiny_checkpoint("phi3", **VARIANTS["phi3-longrope"])  # max_position_embeddings 512
    assert LLM(path, device="cpu", dtype="float32").engine.config.max_model_len == ORIGINAL
    with pytest.raises(ValueError, match=f"restart with --max-model-len {ORIGINAL} or less"):
        LLM(path, device="cpu", dtype="float32", max_model_len=ORIGINAL + 1)


def test_phi3s_default_original_length_is_the_one_the_context_defaults_to(tiny_checkpoint,
                                                                       tmp_path):
    """A longrope config.json without original_max_position_embeddings: Phi3Config's 4096 is
    both the rotary table's exact length and the default context (they were two readings of
    the dict, and the context missed the default, so the engine refused its own default)."""
    import json

    from loragw.engine.config import Config

    path = tmp_path / "phi3"
    shutil.copytree(tiny_checkpoint("phi3", rope_scaling=longrope(16),
                                    max_position_embeddings=8192), path)
    config = json.loads((path / "config.json").read_text())
    config.pop("original_max_position_embeddings", None)
    (path / "config.json").write_text(json.dumps(config))
    engine_config = Config(str(path), device="cpu", dtype="float32")
    assert engine_config.max_model_len == engine_config.args.rope.exact_context == 4096
    assert LLM(str(path), device="cpu", dtype="float32").engine.config.max_model_len == 4096


@pytest.fixture(scope="module")
def phi3_world(tmp_path_factory) -> World:
    root = tmp_path_factory.mktemp("phi3-lora")
    base = make_tiny_checkpoint(str(root / "base"), "phi3")
    return World(str(root), ADAPTERS, base=base)


@pytest.mark.parametrize("options", [{}, {"max_loras": 2, "max_num_batched_tokens": 8}],
                         ids=["batched", "2-slots-chunked"])
def test_fused_adapters_match_peft_in_a_mixed_batch(phi3_world, options):
    llm = phi3_world.llm(**options)
    phi3_world.check(llm.generate(phi3_world.prompts, GREEDY, adapters=phi3_world.requests),
                     f"phi3 {options}")


def test_fused_adapters_match_peft_under_tensor_parallelism(phi3_world):
    """Two ranks: each loads its part of every q/k/v and gate/up slice of the fused tensors,
    and of every fused LoRA's B rows; chunked prefill and preemption on top."""
    llm = phi3_world.llm(tensor_parallel_size=2, max_num_batched_tokens=24, num_kv_blocks=12)
    phi3_world.check(llm.generate(phi3_world.prompts, GREEDY, adapters=phi3_world.requests),
                     "phi3 tp=2")
    assert llm.engine.scheduler.num_preemptions > 0


def test_fused_checkpoint_tensor_of_the_wrong_height_is_refused(tiny_checkpoint, tmp_path):
    path = shutil.copytree(tiny_checkpoint("phi3"), tmp_path / "short-qkv")
    weights = safetensors.torch.load_file(path / "model.safetensors")
    name = "model.layers.1.self_attn.qkv_proj.weight"
    weights[name] = weights[name][:-8]  # [q + 2 kv - 8, H]
    safetensors.torch.save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{name}.*\(120, 64\).*128 rows \(q_proj, k_proj"):
        LLM(str(path), device="cpu", dtype="float32")
