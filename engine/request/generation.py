"""A model's recommended sampling, from its generation_config.json (vLLM's
`--generation-config auto|vllm|PATH`): what a request that leaves a parameter out samples with.

    auto    the served model's folder's generation_config.json (an adapter's own wins for its
            requests where it has one)
    vllm    none: the engine's defaults
    PATH    that folder's generation_config.json

Read: temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens as the default
max_tokens. A file that is not a JSON object, or a value of the wrong type, is refused by name.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields

FILE = "generation_config.json"
MAX_BYTES = 64 * 1024
MODES = ("auto", "vllm")  # or a path


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # generation_config's max_new_tokens

    def over(self, other: GenerationDefaults) -> GenerationDefaults:
        """These defaults where set, `other`'s elsewhere (an adapter's over the base's)."""
        return GenerationDefaults(**{f.name: getattr(self, f.name) if getattr(self, f.name)
                                     is not None else getattr(other, f.name)
                                     for f in fields(self)})

    def filled(self, asked: dict[str, object]) -> dict[str, object]:
        """`asked` (sampling fields as a request set them, None where left out) with these
        defaults in the gaps."""
        return {name: value if value is not None else getattr(self, name, None)
                for name, value in asked.items()}


NONE = GenerationDefaults()
_KEYS = {"temperature": (float, int), "top_p": (float, int), "top_k": (int,),
         "min_p": (float, int), "repetition_penalty": (float, int),
         "max_new_tokens": (int,)}


def parse_generation_config(raw: bytes | str, where: str) -> GenerationDefaults:
    """The defaults a generation_config.json's text holds (`where` names it in errors)."""
    if len(raw) > MAX_BYTES:
        raise ValueError(f"{where}: larger than {MAX_BYTES} bytes")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where} must hold a JSON object")
    values = {}
    for key, kinds in _KEYS.items():
        value = data.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise ValueError(f"{where}: {key} must be a number, got {value!r}")
        values["max_tokens" if key == "max_new_tokens" else key] = value
    if data.get("do_sample") is False:  # greedy, as transformers decodes it
        values["temperature"] = 0.0
    return GenerationDefaults(**values)


def read_generation_config(folder: str) -> GenerationDefaults:
    """A folder's generation_config.json's defaults; none where it has no such file."""
    path = os.path.join(folder, FILE)
    if not os.path.isfile(path):
        return NONE
    with open(path, "rb") as f:
        return parse_generation_config(f.read(MAX_BYTES + 1), path)


def generation_defaults(mode: str, model_dir: str) -> GenerationDefaults:
    """--generation-config's defaults for the served model in `model_dir`."""
    if mode == "vllm":
        return NONE
    folder = model_dir if mode == "auto" else mode
    if mode != "auto" and not os.path.isdir(folder):
        raise ValueError(f"--generation-config {mode!r} is neither auto, vllm nor a folder")
    return read_generation_config(folder)
