"""adapter_config.json: parse it, refuse what this engine would serve differently from PEFT,
and answer PEFT's per-module questions (is this module adapted? with what rank and scaling?).

PEFT semantics mirrored here (peft 0.21): target_modules as a list matches a module whose name
equals an entry or ends with "." + entry, then layers_to_transform filters by layer index; as a
str it is ``re.fullmatch`` on the full module name (PEFT refuses layers_to_transform with it,
and so do we); "all-linear" means every projection (not lm_head, not embed_tokens).
rank_pattern / alpha_pattern: see ``pattern_key``. Module names are the base model's:
'model.layers.3.self_attn.k_proj', 'model.embed_tokens', 'lm_head'.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

from adapters.errors import AdapterError
from adapters.errors import short_repr as _show
from adapters.lora_tensors import SUPPORTED_TARGETS, TARGET_MODULES
from adapters.saved_modules import parse_modules_to_save

__all__ = ["ALL_LINEAR", "LoraConfig", "parse_adapter_config", "pattern_key"]

ALL_LINEAR = "all-linear"

# Config regexes (target_modules as a str, rank_pattern / alpha_pattern keys) come from the
# adapter's author. Python's re cannot be interrupted, so we bound their cost: a repeat may
# only repeat a single character class (no nested or grouped repeats, the source of
# exponential backtracking) and a pattern holds few of them.
MAX_PATTERN_LEN = 256
MAX_PATTERN_REPEATS = 3
MAX_PATTERN_ENTRIES = 64
_UNSUPPORTED_FEATURES = {
    "use_dora": "DoRA", "lora_bias": "lora_bias", "use_qalora": "QA-LoRA",
    "alora_invocation_tokens": "aLoRA", "layer_replication": "layer_replication",
    "trainable_token_indices": "trainable_token_indices",
    "target_parameters": "target_parameters", "use_bdlora": "block-diagonal LoRA",
    "arrow_config": "Arrow routing", "kasa_config": "KaSA", "monteclora_config": "MonteCLoRA",
}  # fmt: skip

try:  # Python >= 3.11
    from re import _constants as _sre_const
    from re import _parser as _sre_parse
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as _sre_const
    import sre_parse as _sre_parse

_REPEAT_OPS = {_sre_const.MAX_REPEAT, _sre_const.MIN_REPEAT}
_REPEAT_OPS |= {getattr(_sre_const, "POSSESSIVE_REPEAT", _sre_const.MAX_REPEAT)}
_SINGLE_CHAR_OPS = {_sre_const.LITERAL, _sre_const.NOT_LITERAL, _sre_const.ANY, _sre_const.IN}


def _bad(field: str, why: str) -> AdapterError:
    return AdapterError(f"adapter_config.json: {field} {why}")


def _check_regex(pattern: str, field: str, max_repeats: int = MAX_PATTERN_REPEATS) -> str:
    """Refuse regexes that do not compile or whose backtracking cost is unbounded."""
    if not isinstance(pattern, str) or not 0 < len(pattern) <= MAX_PATTERN_LEN:
        raise _bad(field, f"pattern must be a string of 1-{MAX_PATTERN_LEN} characters")
    try:
        re.compile(pattern)
        parsed = _sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError) as e:
        raise _bad(field, f"pattern {_show(pattern)} is not a valid regex: {e}") from None
    repeats = 0

    def walk(node: object) -> None:
        nonlocal repeats
        if isinstance(node, _sre_parse.SubPattern):
            for op, av in node:
                if op in _REPEAT_OPS and av[1] > 1:
                    body = list(av[2])
                    if len(body) != 1 or body[0][0] not in _SINGLE_CHAR_OPS:
                        raise _bad(field, f"pattern {_show(pattern)} repeats a group; simplify it")
                    repeats += 1
                walk(av)
        elif isinstance(node, (tuple, list)):
            for item in node:
                walk(item)

    walk(parsed)
    if repeats > max_repeats:
        raise _bad(field, f"pattern {_show(pattern)} has more than {max_repeats} repeats")
    return pattern


def pattern_key(pattern_keys: Iterable[str], module_name: str) -> str:
    """PEFT's get_pattern_key: the first key, in dict (= file) order, that matches a dotted
    suffix of the full module name, ``re.match(rf"(.*\\.)?({key})$", module_name)``; else
    module_name itself (so ``pattern.get(pattern_key(...), default)`` gives the default).

    module_name is the name inside the base model, e.g. 'model.layers.3.self_attn.k_proj'.
    Keys are regexes ('.' matches any character) anchored at a '.' boundary and at the end:
    'q_proj' and 'layers\\.1\\..*' match, '_proj' does not. The first match wins, not the
    most specific; PEFT writes adapter_config.json with sorted keys, so for overlapping keys
    the file's order is what PeftModel.from_pretrained (and this engine) applies.
    """
    for key in pattern_keys:
        if re.match(rf"(.*\.)?({key})$", module_name):
            return key
    return module_name


@dataclass(frozen=True)
class LoraConfig:
    """The parts of a PEFT LoraConfig that decide what the adapter computes.

    Fields this engine refuses (DoRA, biases, fan_in_fan_out) keep their only accepted value
    so callers can read them. modules_to_save holds the model-level modules the adapter saves
    a full copy of (adapters.saved_modules). Not hashable (holds dicts).
    ensure_weight_tying matters only on a base with tied embeddings (see
    adapters.lora_tensors.check_lora_tensors).
    """

    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | str  # names (suffix match) or a regex (full match)
    rank_pattern: dict[str, int]  # regex key -> rank, first match wins (see pattern_key)
    alpha_pattern: dict[str, float]
    layers_to_transform: tuple[int, ...] | None
    base_model_name_or_path: str | None
    bias: str
    fan_in_fan_out: bool
    modules_to_save: tuple[str, ...]  # sorted subset of saved_modules.SAVED_TARGETS; () if none
    use_dora: bool
    exclude_modules: tuple[str, ...] | str | None = None
    ensure_weight_tying: bool = False

    def rank_for(self, module_name: str) -> int:
        """Rank PEFT gives module_name, e.g. 'model.layers.3.self_attn.k_proj'."""
        return self.rank_pattern.get(pattern_key(self.rank_pattern, module_name), self.r)

    def alpha_for(self, module_name: str) -> float:
        return self.alpha_pattern.get(pattern_key(self.alpha_pattern, module_name), self.lora_alpha)

    def scaling(self, module_name: str) -> float:
        """alpha/r, or alpha/sqrt(r) with use_rslora, after rank_pattern/alpha_pattern."""
        r, alpha = self.rank_for(module_name), self.alpha_for(module_name)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def targets_module(self, module_name: str, layer: int | None) -> bool:
        """Whether PEFT would have put a LoRA on module_name (check_target_module_exists);
        layer is None for modules outside the decoder layers (embed_tokens, lm_head)."""
        ex = self.exclude_modules
        if isinstance(ex, str) and re.fullmatch(ex, module_name):
            return False
        if isinstance(ex, tuple) and any(_suffix_match(e, module_name) for e in ex):
            return False
        if self.target_modules == ALL_LINEAR:
            return module_name.rsplit(".", 1)[-1] in TARGET_MODULES
        if isinstance(self.target_modules, str):  # never with layers_to_transform
            return re.fullmatch(self.target_modules, module_name) is not None
        if module_name in self.target_modules:  # named in full: PEFT skips the layer filter
            return True
        if not any(_suffix_match(t, module_name) for t in self.target_modules):
            return False
        return self.layers_to_transform is None or (
            layer is not None and layer in self.layers_to_transform)


def _suffix_match(name: str, module_name: str) -> bool:
    return module_name == name or module_name.endswith("." + name)


def _reject_constant(name: str) -> None:
    raise _bad("file", f"contains non-JSON constant {name}")


def parse_adapter_config(raw: bytes | str | dict) -> LoraConfig:
    """Parse adapter_config.json; refuse anything this engine would serve differently from PEFT."""
    if isinstance(raw, (bytes, bytearray, str)):
        try:
            raw = json.loads(raw, parse_constant=_reject_constant)
        except AdapterError:
            raise
        except (ValueError, RecursionError) as e:
            raise AdapterError(f"adapter_config.json is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise AdapterError("adapter_config.json must be a JSON object")
    c = raw
    if c.get("peft_type") != "LORA":
        raise _bad("peft_type", f"is {_show(c.get('peft_type'))}; only LORA is supported")
    for field, feature in _UNSUPPORTED_FEATURES.items():
        if c.get(field):
            raise _bad(field, f"is set; {feature} adapters are not supported")
    if c.get("bias") not in (None, "none"):
        raise _bad("bias", f"is {_show(c['bias'])}; only 'none' is supported (no trained biases)")
    if c.get("fan_in_fan_out"):
        raise _bad("fan_in_fan_out", "is true; only nn.Linear-layout adapters are supported")
    for field in ("r", "lora_alpha"):
        if field not in c:
            raise _bad(field, "is missing")
    r = _positive_int(c["r"], "r")
    alpha = _finite(c["lora_alpha"], "lora_alpha")
    layers_pattern = c.get("layers_pattern") or None
    if layers_pattern not in (None, "layers", ["layers"]):
        raise _bad("layers_pattern", f"is {_show(layers_pattern)}; expected 'layers'")
    base_model = c.get("base_model_name_or_path")
    if base_model is not None and not isinstance(base_model, str):
        raise _bad("base_model_name_or_path", f"must be a string, got {_show(base_model)}")
    target_modules = _target_modules(c.get("target_modules"))
    layers = _layers(c.get("layers_to_transform"))
    if isinstance(target_modules, str) and layers is not None:
        raise _bad("layers_to_transform", "cannot be used when target_modules is a string")
    return LoraConfig(
        r=r,
        lora_alpha=alpha,
        use_rslora=_bool(c, "use_rslora"),
        target_modules=target_modules,
        rank_pattern={k: _positive_int(v, f"rank_pattern[{_show(k)}]")
                      for k, v in _patterns(c, "rank_pattern").items()},
        alpha_pattern={k: _finite(v, f"alpha_pattern[{_show(k)}]")
                       for k, v in _patterns(c, "alpha_pattern").items()},
        layers_to_transform=layers,
        base_model_name_or_path=base_model,
        bias="none",
        fan_in_fan_out=False,
        modules_to_save=parse_modules_to_save(c.get("modules_to_save")),
        use_dora=False,
        exclude_modules=_exclude(c.get("exclude_modules")),
        ensure_weight_tying=_bool(c, "ensure_weight_tying"),
    )  # fmt: skip


def _bool(c: dict, field: str) -> bool:
    v = c.get(field)
    if v is not None and not isinstance(v, bool):
        raise _bad(field, f"must be true or false, got {_show(v)}")
    return bool(v)


def _positive_int(v: object, field: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise _bad(field, f"must be a positive integer, got {_show(v)}")
    return v


def _finite(v: object, field: str) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise _bad(field, f"must be a finite number, got {_show(v)}")
    return float(v)


def _patterns(c: dict, field: str) -> dict:
    p = c.get(field) or {}
    if not isinstance(p, dict) or len(p) > MAX_PATTERN_ENTRIES:
        raise _bad(field, f"must be an object of at most {MAX_PATTERN_ENTRIES} entries")
    for key in p:  # PEFT wraps each key as (.*\.)?({key})$, which adds one repeat
        _check_regex(rf"(.*\.)?({key})$", f"{field} key {_show(key)}", MAX_PATTERN_REPEATS + 1)
    return p


def _target_modules(t: object) -> tuple[str, ...] | str:
    if isinstance(t, str):
        return ALL_LINEAR if t.lower() == ALL_LINEAR else _check_regex(t, "target_modules")
    if not isinstance(t, list) or not t or not all(isinstance(x, str) and x for x in t):
        raise _bad("target_modules", f"must be a non-empty list or a regex, got {_show(t)}")
    for name in t:
        if name.rsplit(".", 1)[-1] not in SUPPORTED_TARGETS:
            raise _bad("target_modules", f"names {_show(name)}; lora-gateway supports only "
                       + ", ".join(SUPPORTED_TARGETS))  # fmt: skip
    return tuple(t)


def _layers(v: object) -> tuple[int, ...] | None:
    if v is None or v == []:
        return None
    layers = [v] if isinstance(v, int) and not isinstance(v, bool) else v
    if not isinstance(layers, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers
    ):
        raise _bad("layers_to_transform", f"must be layer indices, got {_show(v)}")
    return tuple(layers)


def _exclude(v: object) -> tuple[str, ...] | str | None:
    if not v:
        return None
    if isinstance(v, str):
        return _check_regex(v, "exclude_modules")
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise _bad("exclude_modules", f"must be a list of names or a regex, got {_show(v)}")
    return tuple(v)
