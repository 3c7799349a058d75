"""Loading the base model's tokenizer and turning chat messages into prompt token ids."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in a local model directory. Never touches the network."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"tokenizer directory {str(path)!r} does not exist; pass the local "
                         "directory holding tokenizer.json / tokenizer_config.json "
                         "(download the model first, e.g. with `huggingface-cli download`)")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None = None,
                add_generation_prompt: bool = True) -> list[int]:
    """Prompt token ids for an OpenAI-style message list, rendered by the model's chat template."""
    if not tokenizer.chat_template:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no chat template; use a chat "
                         "(instruct) model, add a `chat_template` to its tokenizer_config.json, "
                         "or send a plain completion request instead")
    # Render to text, then encode: transformers 5 returns a BatchEncoding from tokenize=True, and
    # the template already writes BOS and friends, so encode must not add them a second time.
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
    assert isinstance(text, str), type(text)
    return tokenizer.encode(text, add_special_tokens=False)
