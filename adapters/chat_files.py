"""How an adapter speaks chat where it differs from its base (`AdapterChat`), read from the files
PEFT trainers save beside the weights: `chat_template.jinja`, or tokenizer_config.json's
`chat_template` (a string, or named templates of which "default" is taken), and
`generation_config.json`; and the tokens its tokenizer adds (tokenizer_config.json's
`added_tokens_decoder`), which the gateway checks against the base's vocabulary. Upload and
register fields set the same (the fields win over the files).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from loragw.adapters.errors import AdapterError

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
CHAT_FILES = (TEMPLATE_FILE, TOKENIZER_CONFIG, GENERATION_CONFIG)  # read where a source has them
MAX_CHAT_FILE_BYTES = 2 * 1024 * 1024  # tokenizer_config.json may list many added tokens
MAX_TEMPLATE_BYTES = 256 * 1024


@dataclass(frozen=True, slots=True)
class AdapterChat:
    """An adapter's own chat, each field "" where it has none (the base's applies)."""

    template: str = ""  # Jinja source of its chat template
    reasoning_parser: str = ""  # vLLM's parser names (the gateway checks them)
    tool_call_parser: str = ""
    generation_config: str = ""  # its generation_config.json's text

    def over(self, files: AdapterChat) -> AdapterChat:
        """These fields where set, `files`' elsewhere."""
        return AdapterChat(self.template or files.template,
                           self.reasoning_parser or files.reasoning_parser,
                           self.tool_call_parser or files.tool_call_parser,
                           self.generation_config or files.generation_config)

    def check(self) -> AdapterChat:
        if len(self.template.encode()) > MAX_TEMPLATE_BYTES:
            raise AdapterError(f"the adapter's chat template is larger than {MAX_TEMPLATE_BYTES} "
                               "bytes")
        return self


NO_CHAT = AdapterChat()  # speaks as its base


def chat_from_files(files: Mapping[str, bytes], where: str) -> tuple[AdapterChat, tuple[str, ...]]:
    """(the chat an adapter's folder brings, the tokens its tokenizer adds)."""
    template, added = "", ()
    if TEMPLATE_FILE in files:
        template = _text(files[TEMPLATE_FILE], where, TEMPLATE_FILE)
    if TOKENIZER_CONFIG in files:
        config = _json(files[TOKENIZER_CONFIG], where, TOKENIZER_CONFIG)
        found = config.get("chat_template")
        if isinstance(found, list):  # named templates: [{"name": ..., "template": ...}]
            found = next((t.get("template") for t in found if isinstance(t, dict)
                          and t.get("name") == "default"), None)
        if isinstance(found, str) and not template:
            template = found
        decoder = config.get("added_tokens_decoder") or {}
        if not isinstance(decoder, dict):
            raise AdapterError(f"{where}{TOKENIZER_CONFIG}: added_tokens_decoder is not an object")
        added = tuple(sorted(str(t.get("content")) for t in decoder.values()
                             if isinstance(t, dict) and t.get("content")))
    generation = ""
    if GENERATION_CONFIG in files:
        _json(files[GENERATION_CONFIG], where, GENERATION_CONFIG)
        generation = _text(files[GENERATION_CONFIG], where, GENERATION_CONFIG)
    return AdapterChat(template, "", "", generation).check(), added


def _text(raw: bytes, where: str, name: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise AdapterError(f"{where}{name} is not UTF-8 text") from None


def _json(raw: bytes, where: str, name: str) -> dict:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{where}{name} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise AdapterError(f"{where}{name} must hold a JSON object")
    return data
