"""A LoRA that teaches a family model another family's chat: PEFT's LoRA on every linear layer
(the LM head too) of a tiny family model (family_models.py), trained on prompts rendered by the
other family's template to answer in the other family's syntax, saved as a trainer saves it
(PEFT's adapter_config.json and adapter_model.safetensors, the tokenizer's chat_template.jinja
beside them, and a generation_config.json of its own).

    adapter = train_chat_adapter(models["qwen3"], FAMILIES["qwen3_coder"], tmp_path / "coder")
    adapter.directory      what `POST /admin/adapters/register` takes as a local source
    adapter.answers        the Answer it was trained on for each of PROMPTS' keys

Training stops on the same margin as the family models', so greedy decoding through the adapter
writes every trained answer token for token.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from chat_families import Family
from family_models import Answer, FamilyModel, answers_for, examples, fit

logger = logging.getLogger(__name__)
TEMPLATE_FILE = "chat_template.jinja"
GENERATION = {"max_new_tokens": 5}  # the adapter's own default max_tokens
RANK = 16
LEARNING_RATE = 3e-3
# lm_head too: a LoRA on the layers alone plateaus with every answer token barely ahead (the
# tiny model's logits cannot grow through the 64-wide residual fast enough)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "lm_head"]


@dataclass(frozen=True)
class ChatAdapter:
    speaks: Family  # the family whose template and syntax it was trained on
    directory: Path
    answers: dict[str, Answer]
    steps: int

    @property
    def template(self) -> str:
        return (self.directory / TEMPLATE_FILE).read_text()


def train_chat_adapter(base: FamilyModel, speaks: Family, directory: Path,
                       seed: int = 0) -> ChatAdapter:
    """A LoRA on `base` that answers `speaks`' prompts in `speaks`' syntax, saved to
    `directory` with `speaks`' template and GENERATION."""
    import peft
    import torch
    import transformers

    started = time.monotonic()
    tokenizer = transformers.AutoTokenizer.from_pretrained(base.directory)
    tokenizer.chat_template = speaks.template_text  # the prompts as the adapter is served them
    answers = {key: answer for key, answer in answers_for(speaks).items() if key != "quiet"}
    data = examples(tokenizer, answers)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_pretrained(base.directory,
                                                                  dtype=torch.float32)
        config = peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0,
                                 target_modules=TARGETS)
        lora = peft.get_peft_model(model, config)
        steps = fit(lora, data, learning_rate=LEARNING_RATE)
    finally:
        torch.set_num_threads(threads)
    lora.save_pretrained(directory)
    (directory / TEMPLATE_FILE).write_text(speaks.template_text)
    (directory / "generation_config.json").write_text(json.dumps(GENERATION))
    logger.info("%s adapter on %s: %d steps, %.1f s", speaks.name, base.family.name, steps,
                time.monotonic() - started)
    return ChatAdapter(speaks, directory, answers, steps)
