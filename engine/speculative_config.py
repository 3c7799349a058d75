"""`--speculative-config JSON` (vLLM's flag and keys), parsed and checked once.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
     "prompt_lookup_max": 4}
    {"method": "draft_model", "model": DIR, "num_speculative_tokens": 4,
     "draft_adapters": {"pirate": DIR}}

`num_speculative_tokens` is the most drafts a request proposes in a step; how many it does (0
included) is chosen per request and step from its measured acceptance and the step's measured
cost (engine/spec/goodput.py), which also stops proposing when a batch is large enough that
verification costs more than it saves. `disable_by_batch_size` (vLLM's key), when given, is a
hard limit on top: a step with more decoding sequences than this proposes nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1  # ngram: shortest suffix looked up in the request's tokens
    prompt_lookup_max: int = 3  # ngram: longest
    model: str | None = None  # draft_model: the draft checkpoint (same tokenizer)
    draft_adapters: dict[str, str] = field(default_factory=dict)  # target adapter -> draft LoRA
    disable_by_batch_size: int | None = None  # None: the goodput model alone decides

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(METHODS)}, "
                             f"got {self.method!r}")
        ints = ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                "disable_by_batch_size")
        for name in ints:
            value = getattr(self, name)
            if value is None and name == "disable_by_batch_size":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config {name} must be an integer >= 1, got "
                                 f"{value!r}")
        if self.num_speculative_tokens > 16:
            raise ValueError("speculative_config num_speculative_tokens must be at most 16, "
                             f"got {self.num_speculative_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) "
                             f"must not exceed prompt_lookup_max ({self.prompt_lookup_max})")
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ValueError('speculative_config method "draft_model" needs "model": the '
                                 "draft checkpoint's directory")
        elif self.model is not None or self.draft_adapters:
            raise ValueError('speculative_config "model" and "draft_adapters" go with method '
                             '"draft_model"')
        if not isinstance(self.draft_adapters, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.draft_adapters.items()):
            raise ValueError("speculative_config draft_adapters must map adapter names to "
                             "draft LoRA directories")


KEYS = tuple(f.name for f in fields(SpeculativeConfig))


EMPTY = ("speculative_config is empty; leave the flag out to serve without speculation, or "
         'give {"method": ..., "num_speculative_tokens": ...}')


def parse_speculative_config(value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """The flag's JSON text, or a dict (`LLM(speculative_config={...})`), checked; None (the
    flag left out) for off. An empty one ("", {}) is refused rather than read as off: it is
    most often a config template's unset variable, and silence would hide that."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(EMPTY)
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
    if not value:
        raise ValueError(EMPTY)
    unknown = sorted(set(value) - set(KEYS))
    if unknown:
        raise ValueError(f"speculative_config has unknown keys {unknown}; known: "
                         f"{', '.join(KEYS)}")
    if "method" not in value or "num_speculative_tokens" not in value:
        raise ValueError('speculative_config needs "method" and "num_speculative_tokens"')
    return SpeculativeConfig(**value)


def as_json(config: SpeculativeConfig) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in fields(config)}
