"""adapter_config.json: parse it into a LoraConfig (adapters.types), refusing what this engine
would serve differently from PEFT (DoRA, trained biases, fan_in_fan_out, layers_to_transform
with target_modules as a str, regexes whose backtracking cost is unbounded, ...). Which module
gets a LoRA, and with what rank and scaling, is LoraConfig's to answer.
"""

from __future__ import annotations

import json
import math
import re

from loragw.adapters.errors import AdapterError
from loragw.adapters.errors import short_repr as _show
from loragw.adapters.saved_modules import parse_modules_to_save
from loragw.adapters.types import (
    ALL_LINEAR,
    EXPERT_PARAMS,
    SUPPORTED_PARAMETERS,
    SUPPORTED_TARGETS,
    LoraConfig,
)

__all__ = ["parse_adapter_config"]

# Config regexes (target_modules as a str, rank_pattern / alpha_pattern keys) come from the
# adapter's author. Python's re cannot be interrupted, so we bound their cost: a repeat may
# only repeat a single character class (no nested or grouped repeats, the source of
# exponential backtracking) and a pattern holds few of them.
MAX_PATTERN_LEN = 256
MAX_PATTERN_REPEATS = 3
MAX_PATTERN_ENTRIES = 64
SERVED_TASK_TYPE = "CAUSAL_LM"  # PEFT's TaskType for a causal language model's LoRA
_UNSUPPORTED_FEATURES = {
    "use_dora": "DoRA", "lora_bias": "lora_bias", "use_qalora": "QA-LoRA",
    "alora_invocation_tokens": "aLoRA", "layer_replication": "layer_replication",
    "trainable_token_indices": "trainable_token_indices",
    "use_bdlora": "block-diagonal LoRA",
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
    if c.get("task_type") not in (None, SERVED_TASK_TYPE):  # PEFT leaves it None when untold
        raise _bad("task_type", f"is {_show(c['task_type'])}; lora-gateway serves text generation "
                   f"only ({SERVED_TASK_TYPE}): a classifier or seq2seq head would be served as "
                   f"a language model; train the adapter with task_type={SERVED_TASK_TYPE}")
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
    auto_mapping = c.get("auto_mapping")
    if auto_mapping is not None and not isinstance(auto_mapping, dict):
        raise _bad("auto_mapping", f"must be an object or null, got {_show(auto_mapping)}")
    target_parameters = _target_parameters(c.get("target_parameters"))
    target_modules = (() if target_parameters and c.get("target_modules") in (None, [])
                      else _target_modules(c.get("target_modules")))
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
        base_model_name_or_path=_name(c.get("base_model_name_or_path"), "base_model_name_or_path"),
        bias="none",
        fan_in_fan_out=False,
        modules_to_save=parse_modules_to_save(c.get("modules_to_save")),
        use_dora=False,
        exclude_modules=_exclude(c.get("exclude_modules")),
        ensure_weight_tying=_bool(c, "ensure_weight_tying"),
        base_model_class=_name((auto_mapping or {}).get("base_model_class"),
                               "auto_mapping.base_model_class"),
        target_parameters=target_parameters,
    )  # fmt: skip


def _bool(c: dict, field: str) -> bool:
    v = c.get(field)
    if v is not None and not isinstance(v, bool):
        raise _bad(field, f"must be true or false, got {_show(v)}")
    return bool(v)


def _name(v: object, field: str) -> str | None:
    """A name PEFT records (a Hub id, a path, a class): a string, or absent / null / ""."""
    if v is not None and not isinstance(v, str):
        raise _bad(field, f"must be a string or null, got {_show(v)}")
    return v or None


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


def _target_parameters(t: object) -> tuple[str, ...]:
    """PEFT's target_parameters: names of parameters, matched as dotted suffixes. PEFT writes
    bare "down_proj" / "gate_up_proj" itself when it converts target_modules for a fused-expert
    base (transformers_weight_conversion)."""
    if t is None or t == []:
        return ()
    if not isinstance(t, list) or not all(isinstance(x, str) and x for x in t):
        raise _bad("target_parameters", f"must be a list of parameter names, got {_show(t)}")
    for name in t:
        if name not in EXPERT_PARAMS and not any(
                name == p or name.endswith("." + p) for p in SUPPORTED_PARAMETERS):
            raise _bad("target_parameters", f"names {_show(name)}; lora-gateway serves"
                       " parameter LoRAs only on an MoE block's experts.gate_up_proj and"
                       " experts.down_proj (its fused experts) and gate.weight (its router)")
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
