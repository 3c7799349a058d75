"""The float world every quantized checkpoint starts from: a tiny random base, a tiny tokenizer,
and LoRA adapters made and saved by PEFT itself on the float base.

The base (`build_base`): float32, hidden 128, intermediate 256, 2 layers, 4 heads / 2 kv heads
(head_dim 32), the vocabulary size asked for, no BOS / EOS (every token counts), untied lm_head;
matrices and biases ~ N(0, 0.15) and norms ~ U(0.5, 1.5), as tests/checkpoints.py draws them,
so that greedy decoding wanders instead of repeating one token. "qwen2" has q/k/v biases. Every
projection's input is a multiple of 128 (group 128 and FP8 blocks of [128, 128] fit); k_proj /
v_proj have 64 outputs, half an FP8 block.

The tokenizer is a WordLevel one (tokens "t0", "t1", ... up to the vocabulary size, split on
whitespace, no special tokens): AutoRound needs one, and with it text prompts work too
("t1 t7 t3").
"""

from __future__ import annotations

import os

import torch

SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
             tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
ARCH_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
ARCH_FIELDS = {"llama": {}, "qwen2": {"use_sliding_window": False, "sliding_window": None}}
INIT_STD = 0.15


def build_tokenizer(vocab: int):
    """The WordLevel tokenizer described above, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core)


def build_base(path: str, arch: str, vocab: int, seed: int = 0) -> str:
    """Writes the tiny random `arch` base (module docstring) with its tokenizer into path."""
    import transformers

    if arch not in ARCH_CLASSES:
        raise ValueError(f"arch must be one of {', '.join(ARCH_CLASSES)}; got {arch!r}")
    model_class = getattr(transformers, ARCH_CLASSES[arch])
    config = model_class.config_class(vocab_size=vocab, dtype="float32",
                                      **SHAPE, **ARCH_FIELDS[arch])
    torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, INIT_STD)
    if arch == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None, "qwen2 lost its biases"
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    build_tokenizer(vocab).save_pretrained(path)
    return path


def save_adapters(base: str, out_dir: str, specs: dict[str, dict], seed: int = 1
                  ) -> dict[str, str]:
    """PEFT LoRA adapters for `specs` (name -> LoraConfig keyword arguments) on the float base,
    LoRA weights ~ N(0, 0.3) so that each changes outputs, saved by PEFT; name -> dir."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = None
    for name, spec in specs.items():
        config = LoraConfig(**spec, init_lora_weights=False)
        if model is None:
            model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), config, name)
        else:
            model.add_adapter(name, config)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "lora_" in param_name:
                param.normal_(0, 0.3)
    model.save_pretrained(out_dir)  # adapter `name` lands in out_dir/name
    return {name: os.path.join(out_dir, name) for name in specs}
