"""PEFT as the reference for the engine's LoRA parity tests: a tiny random Llama, adapters
made and saved by PEFT itself, and PEFT's greedy tokens per request (float32, CPU).

Heavy imports (transformers, peft) stay inside the functions.
"""

import os

import torch

MAX_TOKENS = 10


def build_base(path: str, tie_word_embeddings: bool = False) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=tie_word_embeddings,
                         bos_token_id=None, eos_token_id=None)  # no EOS: every token counts
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)  # diverse greedy outputs
    model.save_pretrained(path)
    return path


def save_peft_adapters(base: str, out_dir: str, specs: dict[str, dict], seed: int) -> dict[str, str]:
    """PEFT-made adapters with N(0, 0.3) LoRA weights and saved modules (modules_to_save) moved
    off the base by N(0, 0.1) noise, so they change outputs; name -> dir."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if not specs:
        return {}
    torch.manual_seed(seed)
    model = None
    for name, spec in specs.items():
        config = LoraConfig(**spec, init_lora_weights=False)
        if model is None:
            model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), config, name)
        else:
            model.add_adapter(name, config)
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if "lora_" in param_name:
                p.normal_(0, 0.3)
            elif ".modules_to_save." in param_name:
                p.add_(torch.randn_like(p), alpha=0.1)
    model.save_pretrained(out_dir)  # adapter `name` lands in out_dir/name
    return {name: os.path.join(out_dir, name) for name in specs}


def peft_greedy(model, prompts: list[list[int]], adapters: list[str | None],
                max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    outputs = []
    for prompt, adapter in zip(prompts, adapters, strict=True):
        ids = torch.tensor([prompt])
        # An explicit mask: without one, generate masks every prompt token equal to pad_token_id.
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                      do_sample=False, pad_token_id=0)
        if adapter is None:
            with model.disable_adapter():
                out = model.generate(input_ids=ids, **kwargs)
        else:
            model.set_adapter(adapter)
            out = model.generate(input_ids=ids, **kwargs)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


def load_peft(base: str, dirs: dict[str, str]):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    names = list(dirs)
    model = PeftModel.from_pretrained(hf, dirs[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(dirs[name], adapter_name=name)
    return model.eval()
