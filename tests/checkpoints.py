"""Tiny random Hugging Face checkpoints for the engine's tests.

`make_tiny_checkpoint(out_dir, arch, **overrides)` writes, in about a second, a float32
checkpoint of one of ARCHS (hidden 64, 2 layers, 4 heads / 2 kv heads, intermediate 128,
max_position_embeddings 512, vocab = the tokenizer's 512) with tokenizer files
(demo.model.build_tokenizer: BOS prepended, ChatML template), a generation_config.json
(eos = [<|im_end|>, <|end_of_text|>]) and weights large enough (std 0.15, norms drawn from
[0.5, 1.5], biases non-zero) that greedy decoding wanders over many tokens instead of repeating
one, so that token-for-token parity with transformers means something.

Overrides go to the transformers config (`tie_word_embeddings=True`, `head_dim=32`,
`rope_scaling={...}`, `rope_theta=...`, `sliding_window=...`), except these:
    sharded=True          model-0000i-of-0000n.safetensors + model.safetensors.index.json
    config_style="hub"    (default) config.json as checkpoints on the Hub carry it, see below;
                          "transformers5": as transformers 5's save_pretrained writes it
    init_std=0.15, seed=0

config.json, style "hub" (Llama-3.1, Qwen2.5, Mistral-7B as published), rope keys:
    "rope_theta": 10000.0
    "rope_scaling": null                      without scaling
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    "rope_scaling": {"rope_type": "linear", "factor": 2.0}
    "torch_dtype": "float32"; "head_dim" absent for llama, mistral and qwen2 when it is
    hidden_size // num_attention_heads (present when overridden, and always for qwen3).
config.json, style "transformers5" (what save_pretrained writes in 5.x), rope keys:
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}
    "rope_parameters": {"rope_type": "llama3", "factor": 8.0, ..., "rope_theta": 10000.0}
    "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    "dtype": "float32"; "head_dim" present for llama, mistral and qwen3, absent for qwen2.
Either way transformers 5 reads it back to the same model.
Mixture-of-Experts archs (MOE_DEFAULTS: mixtral, qwen2_moe, qwen3_moe, olmoe) are saved with
per-expert tensor names, as transformers 5's save_pretrained writes them
(`block_sparse_moe.experts.<e>.w1` for Mixtral, `mlp.experts.<e>.gate_proj` for the others).
Other architecture-specific keys: qwen2 has q/k/v biases in the weights ("attention_bias" is
not a Qwen2 config key) and "use_sliding_window": false, "sliding_window": null; qwen3 has
"attention_bias": false and q_norm/k_norm weights; mistral has "sliding_window": null (as
Mistral-7B-v0.2 and later); phi3 has fused qkv_proj / gate_up_proj weights (as transformers
saves Phi3ForCausalLM), "sliding_window": 2047 (past every test context) and a top-level
"original_max_position_embeddings" (512 unless overridden, for longrope), and an overridden
partial_rotary_factor is written top-level, as Phi-4-mini carries it. gemma2 and gemma3 have
head_dim 16, untied embeddings (Gemma ties them, but a tied random Gemma mostly repeats its
last token: tie them by override), layers
[sliding, full] with "sliding_window": 8 and "query_pre_attn_scalar": 24; gemma2 caps scores at
5 and logits at 8; gemma3 (no caps, q/k norms) has, hub style, "rope_theta" (full layers)
and "rope_local_base_freq": 100 (sliding layers).

`with_weight(src_dir, out_dir, name, index, value)` copies a checkpoint with one weight changed
(past float16's range, NaN), for the loader's checks.
"""

from __future__ import annotations

import json
import os

from loragw.demo.model import (
    BOS,
    END_OF_TEXT,
    IM_END,
    SPECIAL_TOKENS,
    build_tokenizer,
    hub_style_config,
)

ARCHS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, max_position_embeddings=512, rope_theta=10000.0,
            rms_norm_eps=1e-6, tie_word_embeddings=False)
# Mixture-of-Experts: odd expert counts, expert widths unlike hidden (64) or the dense 128.
MOE_DEFAULTS = {
    "mixtral": {"num_local_experts": 5, "num_experts_per_tok": 2, "intermediate_size": 96,
                "sliding_window": None},
    # 3 layers, layer 1 dense (mlp_only_layers); experts 48 wide, the shared expert 80
    "qwen2_moe": {"num_hidden_layers": 3, "num_experts": 5, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 48, "shared_expert_intermediate_size": 80,
                  "mlp_only_layers": [1], "use_sliding_window": False, "sliding_window": None},
    # 3 layers, decoder_sparse_step 2 keeps layers 0 and 2 dense; top-k renormalised
    "qwen3_moe": {"num_hidden_layers": 3, "head_dim": 16, "num_experts": 3,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                  "decoder_sparse_step": 2, "norm_topk_prob": True,
                  "use_sliding_window": False, "sliding_window": None},
    "olmoe": {"num_experts": 5, "num_experts_per_tok": 2, "intermediate_size": 96},
}
ARCH_DEFAULTS = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "qwen2": {"use_sliding_window": False, "sliding_window": None},
    "qwen3": {"head_dim": 16, "use_sliding_window": False, "sliding_window": None},
    # Phi-3's fused qkv_proj / gate_up_proj; a window past every test context (override it to
    # slide), original_max_position_embeddings for longrope overrides
    "phi3": {"sliding_window": 2047, "original_max_position_embeddings": 512},
    **MOE_DEFAULTS,
    # layers [sliding, full]; a window shorter than the tests' prompts; caps that bite
    "gemma2": {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 24,
               "attn_logit_softcapping": 5.0, "final_logit_softcapping": 8.0},
    "gemma3": {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 24,
               "sliding_window_pattern": 2, "rope_local_base_freq": 100.0},
}
HUB_OMITS_DEFAULT_HEAD_DIM = ("llama", "mistral", "qwen2")
TOKENIZER_VOCAB = 512


def make_tiny_checkpoint(out_dir: str, arch: str, *, sharded: bool = False,
                         config_style: str = "hub", init_std: float = 0.15, seed: int = 0,
                         **overrides) -> str:
    """Writes a tiny random `arch` checkpoint into out_dir (see the module docstring) and
    returns out_dir."""
    import copy

    import torch
    import transformers

    overrides = copy.deepcopy(overrides)  # transformers writes rope_theta into rope_scaling
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}; got {arch!r}")
    if config_style not in ("hub", "transformers5"):
        raise ValueError(f"config_style must be 'hub' or 'transformers5'; got {config_style!r}")
    os.makedirs(out_dir, exist_ok=True)
    vocab_size = build_tokenizer(out_dir, TOKENIZER_VOCAB, seed, TINY["max_position_embeddings"])
    bos, eot, im_end = (SPECIAL_TOKENS.index(t) for t in (BOS, END_OF_TEXT, IM_END))
    model_class = getattr(transformers, ARCHS[arch])
    fields = TINY | ARCH_DEFAULTS[arch] | overrides
    config = model_class.config_class(vocab_size=vocab_size, bos_token_id=bos, eos_token_id=im_end,
                                      pad_token_id=eot, dtype="float32", **fields)
    torch.manual_seed(seed)
    model = model_class(config)
    randomize_(model, init_std)

    total = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    model.save_pretrained(out_dir, max_shard_size=total // 3 if sharded else "10GB")
    if config_style == "hub":
        written = _read_json(os.path.join(out_dir, "config.json"))
        partial = (written.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)
        hub = hub_style_config(_gemma3_hub_rope(written) if arch == "gemma3" else written)
        (hub.get("rope_scaling") or {}).pop("partial_rotary_factor", None)
        if partial != 1.0:
            hub["partial_rotary_factor"] = partial  # top-level, as Phi-4-mini carries it
        default_head_dim = hub["hidden_size"] // hub["num_attention_heads"]
        if arch in HUB_OMITS_DEFAULT_HEAD_DIM and hub.get("head_dim") == default_head_dim:
            del hub["head_dim"]
        _write_json(os.path.join(out_dir, "config.json"), hub)
    transformers.GenerationConfig(bos_token_id=bos, eos_token_id=[im_end, eot], pad_token_id=eot,
                                  do_sample=False).save_pretrained(out_dir)
    return out_dir


def with_weight(src_dir: str, out_dir: str, name: str, index: tuple[int, ...],
                value: float) -> str:
    """A copy of the single-file checkpoint `src_dir` in out_dir, with element `index` of tensor
    `name` set to `value` (1e5: past float16's range; nan); returns out_dir."""
    import shutil

    import safetensors.torch

    shutil.copytree(src_dir, out_dir, dirs_exist_ok=True)
    path = os.path.join(out_dir, "model.safetensors")
    weights = safetensors.torch.load_file(path)
    weights[name][index] = value
    safetensors.torch.save_file(weights, path, metadata={"format": "pt"})
    return out_dir


def randomize_(model, std: float) -> None:
    """Re-draws every weight: matrices and biases ~ N(0, std), norm weights ~ U(0.5, 1.5).
    transformers' own init (std 0.02, norms at 1, biases at 0) would hide a missing bias or
    norm, and its outputs collapse to one repeated token."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, std)


def _gemma3_hub_rope(config: dict) -> dict:
    """Gemma 3's per-layer-kind rope_parameters as the Hub has them: rope_theta and
    rope_scaling (full layers), rope_local_base_freq (sliding layers)."""
    config = dict(config)
    nested = config.pop("rope_parameters")
    full, local = dict(nested["full_attention"]), nested["sliding_attention"]
    config["rope_local_base_freq"] = local["rope_theta"]
    config["rope_parameters"] = full  # hub_style_config splits it into rope_theta / rope_scaling
    return config


def _read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
