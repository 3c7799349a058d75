"""Gemma 2 and Gemma 3 (text): greedy output equals transformers' token for token, under
batching, chunked prefill and preemption, and mixed-adapter batches equal PEFT's.

The tiny checkpoints (tests/checkpoints.py) have layers [sliding, full] with an 8-token window
and prompts up to 40 tokens, so the window, the per-kind rope (Gemma 3) and the caps (Gemma 2:
scores at 5, logits at 8) all change tokens if got wrong.
"""


import pytest
import torch
from peft_reference import ALL_SEVEN, load_peft, peft_greedy, save_peft_adapters
from window_parity import SCHEDULES, check_schedules, make_prompts

from loragw.engine import LLM, SamplingParams
from loragw.engine.models import adapter_spec, model_args, model_class
from loragw.engine.models.gemma import FULL, SLIDING, GemmaArgs

# The two bases under every schedule; config variants batched only (the file stays fast).
VARIANTS = {
    "gemma2": ("gemma2", {}),
    "gemma2-tied": ("gemma2", {"tie_word_embeddings": True}),
    "gemma3": ("gemma3", {}),
    "gemma3-rope-linear": ("gemma3", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "gemma3-transformers5-config": ("gemma3", {"config_style": "transformers5"}),
    # transformers' Gemma 3 caps logits but ignores attn_logit_softcapping: so must we
    "gemma3-capped": ("gemma3", {"attn_logit_softcapping": 5.0, "final_logit_softcapping": 8.0}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_transformers(tiny_checkpoint, variant):
    arch, overrides = VARIANTS[variant]
    path = tiny_checkpoint(arch, **overrides)
    # a tied random Gemma mostly repeats its input token: parity still holds, diversity not
    check_schedules(path, variant, diverse=variant != "gemma2-tied",
                    schedules=SCHEDULES if variant in ("gemma2", "gemma3") else ("batched",))


def test_config_reading():
    """What config.json leaves out takes transformers' defaults: Gemma 2 alternates from a
    sliding layer 0 and caps at 50 / 30; Gemma 3 makes every 6th layer full, caps nothing."""
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_attention_heads=1,
                num_hidden_layers=6)
    gemma2 = GemmaArgs.from_hf_config({**base, "architectures": ["Gemma2ForCausalLM"]})
    assert gemma2.layer_kinds == (SLIDING, FULL) * 3
    assert (gemma2.attn_softcap, gemma2.final_softcap, gemma2.head_dim) == (50.0, 30.0, 256)
    assert gemma2.layer_windows == (4096, None) * 3 and gemma2.tie_word_embeddings
    gemma3 = GemmaArgs.from_hf_config({**base, "architectures": ["Gemma3ForCausalLM"]})
    assert gemma3.layer_kinds == (SLIDING,) * 5 + (FULL,)
    assert gemma3.attn_softcap is None and gemma3.final_softcap is None and gemma3.qk_norm
    assert model_class({"architectures": ["Gemma3ForCausalLM"]}).__name__ == "GemmaForCausalLM"
    with pytest.raises(ValueError, match="hidden_activation 'relu'"):
        GemmaArgs.from_hf_config({**base, "architectures": ["Gemma2ForCausalLM"],
                                  "hidden_activation": "relu"})


def test_the_adapter_spec_takes_gemmas_defaults_as_the_engine_does():
    """Adapters are checked against the model the engine builds: with config.json silent, lm_head
    is tied to embed_tokens and head_dim is 256 (not hidden / heads) on both sides. (The adapter
    side once read config.json itself, untied and hidden / heads: a Gemma adapter's LoRA shapes
    were then refused, or a tied base's lm_head LoRA checked as an untied one's.)"""
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_attention_heads=2,
                num_key_value_heads=1, num_hidden_layers=2)
    for arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        hf_config = {**base, "architectures": [arch]}
        spec = adapter_spec(hf_config, max_lora_rank=4)
        assert spec.tie_word_embeddings
        shapes = spec.module_shapes
        assert (shapes["q_proj"], shapes["k_proj"], shapes["o_proj"]) == ((512, 8), (256, 8),
                                                                          (8, 512))
        with torch.device("meta"):
            model = model_class(hf_config)(model_args(hf_config))
        attention = model.model.layers[0].self_attn
        assert model.lm_head.tied and attention.head_dim == 256
        assert attention.qkv_proj.out_features == 512 + 2 * 256
        assert attention.o_proj.in_features == 512
        untied = adapter_spec({**hf_config, "tie_word_embeddings": False, "head_dim": 4}, 4)
        assert not untied.tie_word_embeddings and untied.module_shapes["q_proj"] == (8, 8)


# ---- adapters ------------------------------------------------------------------------------
ADAPTERS = {
    "attn-r2": dict(r=2, lora_alpha=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "all-r8": dict(r=8, lora_alpha=16, target_modules=ALL_SEVEN),
    "mlp-r4": dict(r=4, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"]),
    # embed_tokens' LoRA is scaled by sqrt(hidden) with the embedding, as PEFT does for Gemma
    "embed-q-r4": dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"]),
}
REQUESTS = ["attn-r2", None, "all-r8", "mlp-r4", "embed-q-r4", None, "all-r8", "attn-r2",
            "mlp-r4", "embed-q-r4"]
LORA_TOKENS = 12


@pytest.fixture(scope="module")
def gemma_world(tiny_checkpoint, tmp_path_factory):
    """A tiny Gemma 2, PEFT adapters on it, and PEFT's greedy tokens for REQUESTS."""
    base = tiny_checkpoint("gemma2")
    dirs = save_peft_adapters(base, str(tmp_path_factory.mktemp("gemma-adapters")), ADAPTERS, 1)
    oracle = load_peft(base, dirs)
    oracle.base_model.model.generation_config.eos_token_id = None  # the engine ignores EOS
    prompts = make_prompts(500, (13, 2, 27, 9, 31, 18, 5, 22, 11, 16))
    with torch.inference_mode():
        expected = peft_greedy(oracle, prompts, REQUESTS, LORA_TOKENS)
        plain = peft_greedy(oracle, prompts, [None] * len(prompts), LORA_TOKENS)
    for want, base_tokens, adapter in zip(expected, plain, REQUESTS, strict=True):
        assert (want != base_tokens) == (adapter is not None), f"adapter {adapter} changes nothing"
    return base, dirs, prompts, expected


@pytest.mark.parametrize("options", [dict(), dict(max_loras=2, max_num_batched_tokens=8)],
                         ids=["batched", "2-slots-chunked"])
def test_mixed_adapters_match_peft(gemma_world, options):
    base, dirs, prompts, expected = gemma_world
    llm = LLM(base, **(dict(device="cpu", dtype="float32", max_loras=len(dirs),
                            max_lora_rank=8, lora_backend="torch") | options))
    for name, path in dirs.items():
        llm.add_adapter(name, path)
    params = SamplingParams(max_tokens=LORA_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params, adapters=REQUESTS)
    for i, (out, want) in enumerate(zip(outputs, expected, strict=True)):
        assert out.token_ids == want, f"request {i} ({REQUESTS[i]}) differs from PEFT"
    assert llm.engine.num_free_kv_blocks == llm.engine.block_manager.num_blocks
