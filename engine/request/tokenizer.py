"""Loading the base model's tokenizer and turning chat messages into prompt token ids."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from loragw.engine.request.chat_template import ChatTemplate, render_chat
from loragw.engine.request.params import InvalidParam
from loragw.engine.request.token_bytes import table_for

logger = logging.getLogger(__name__)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in a local model directory. Never touches the network."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"tokenizer directory {str(path)!r} does not exist; pass the local "
                         "directory holding tokenizer.json / tokenizer_config.json "
                         "(download the model first, e.g. with `huggingface-cli download`)")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def tokenize(tokenizer: PreTrainedTokenizerBase | None, prompt: str | list[int]) -> list[int]:
    """Text through the tokenizer; token ids as given (the engine's check_request checks them)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidParam("prompt", "this model has no tokenizer; pass prompts as token-id "
                               "lists")
        return tokenizer.encode(prompt)
    return list(prompt)


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, Any]],
                tools: list[dict[str, Any]] | None = None, *,
                template: ChatTemplate | None = None, kwargs: Mapping[str, Any] | None = None,
                add_generation_prompt: bool = True,
                continue_final_message: bool = False) -> list[int]:
    """Prompt token ids for an OpenAI-style message list, rendered by the chat template
    (engine/request/chat_template.py render_chat: its arguments and refusals). Rendered to
    text, then encoded without special tokens: the template already writes BOS and friends."""
    text = render_chat(tokenizer, messages, template=template or ChatTemplate(), tools=tools,
                       kwargs=kwargs, add_generation_prompt=add_generation_prompt,
                       continue_final_message=continue_final_message)
    return tokenizer.encode(text, add_special_tokens=False)


def try_load_tokenizer(model_dir: str, detokenizing: bool = False):
    """detokenizing: also build the token-bytes table now (~0.4 s for a 150k vocabulary),
    rather than on the first request (engine/request/token_bytes.py)."""
    if not any(os.path.isfile(os.path.join(model_dir, name))
               for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        logger.warning("%s has no tokenizer files: prompts must be token ids", model_dir)
        return None
    tokenizer = load_tokenizer(model_dir)
    if detokenizing:
        table_for(getattr(tokenizer, "backend_tokenizer", None))
    return tokenizer


def eos_token_ids(model_dir: str, tokenizer) -> set[int]:
    ids: set[int] = set()
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if not ids and tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class TokenText:
    """Token id -> its text as logprobs show it (special tokens included), cached."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = (self.tokenizer.decode([token_id]) if self.tokenizer is not None
                    else f"token_id:{token_id}")
            self._cache[token_id] = text
        return text
