"""The shared nouns of the adapter format: what the base model offers (``BaseModelSpec``), what
an adapter_config.json says (``LoraConfig``), the modules a LoRA may target, and the PEFT key
patterns that more than one checker reads.

Filled by: ``BaseModelSpec`` by the engine (engine.models.adapter_spec, from the args the
engine builds its model from: adapters/ never reads config.json); ``LoraConfig`` by
adapters.lora_config.parse_adapter_config. Read by the checkers (adapters.lora_tensors,
adapters.saved_modules) and the loader (adapters.format). Module names are the base model's:
'model.layers.3.self_attn.k_proj', 'model.embed_tokens', 'lm_head'.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from loragw.adapters.errors import AdapterError
from loragw.adapters.errors import short_repr as _show

# -- targets ----------------------------------------------------------------------------------

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Fused projections (Phi-3's): one module whose output rows stack several of TARGET_MODULES.
# On a base whose spec has them (BaseModelSpec.fused says which slices each stacks) adapters
# target these (PEFT sees no q_proj there), elsewhere never.
FUSED_TARGETS = ("qkv_proj", "gate_up_proj")
# Qwen2-MoE's shared expert on a sparse layer (an MLP every token runs, of
# shared_expert_intermediate_size) and its sigmoid gate [1, H]: ordinary Linear LoRAs, keyed
# "shared_expert.gate_proj" etc. so they never meet a dense layer's gate_proj (intermediate_size)
SHARED_EXPERT = "shared_expert"
SHARED_TARGETS = (*(f"{SHARED_EXPERT}.{t}" for t in TARGET_MODULES[4:]), "shared_expert_gate")
PROJECTIONS = TARGET_MODULES + FUSED_TARGETS + SHARED_TARGETS  # every decoder-layer one
EMBED_TOKENS, LM_HEAD = "embed_tokens", "lm_head"  # the vocabulary ends
MODEL_TARGETS = (EMBED_TOKENS, LM_HEAD)  # one per model, outside the decoder layers
SUPPORTED_TARGETS = PROJECTIONS + MODEL_TARGETS
FLOAT_DTYPES = ("F32", "F16", "BF16")
BLOCK_OF = {t: "self_attn" for t in TARGET_MODULES[:4]} | {t: "mlp" for t in TARGET_MODULES[4:]}
BLOCK_OF |= {"qkv_proj": "self_attn", "gate_up_proj": "mlp"} | {t: "mlp" for t in SHARED_TARGETS}
ALL_LINEAR = "all-linear"  # target_modules shorthand: every projection (not the vocabulary ends)
# An MoE block's parameters a LoRA may target (PEFT's target_parameters): its fused experts'
# 3D parameters, in the order PEFT wraps them (their order in the module: the first is the
# innermost ParamWrapper, saved as "experts.base_layer.lora_A"), and its router's weight, a plain
# 2D LoRA served on the engine Linear "gate". (layer, target) keys: "experts.gate_up_proj",
# "experts.down_proj", "gate".
EXPERTS, ROUTER = "experts", "gate"
EXPERT_PARAMS = ("gate_up_proj", "down_proj")
EXPERT_TARGETS = tuple(f"{EXPERTS}.{p}" for p in EXPERT_PARAMS)
ROUTER_PARAM = f"{ROUTER}.weight"
SUPPORTED_PARAMETERS = (*EXPERT_TARGETS, ROUTER_PARAM)

# -- PEFT keys that both adapters.lora_tensors and adapters.saved_modules read -----------------

# A LoRA on a vocabulary end: PEFT's lora.Embedding (no ".weight") and a Linear LoRA on lm_head.
# PEFT saves keys without the adapter name; some exporters keep ".default".
EMBED_LORA_KEY = re.compile(
    r"base_model\.model\.(?P<module>(?:model\.)?embed_tokens)\.lora_embedding_(?P<ab>[AB])"
    r"(?:\.default)?"
)
HEAD_LORA_KEY = re.compile(
    r"base_model\.model\.(?P<module>lm_head)\.lora_(?P<ab>[AB])(?:\.default)?\.weight"
)
# A full copy of a vocabulary end (PEFT's modules_to_save, or a resized vocabulary's layers).
SAVED_KEY = re.compile(r"base_model\.model\.(?P<module>(?:model\.)?embed_tokens|lm_head)\.weight")


def no_vocab_error(key: str, target: str) -> AdapterError:
    """A tensor for a vocabulary end on a base whose spec has no vocabulary shapes."""
    return AdapterError(
        f"tensor {_show(key)} is for {target}, but the base model's config.json gives no"
        " vocab_size to check it against"
    )


# -- the base model ---------------------------------------------------------------------------


def base_name(name: str) -> str:
    """What two names of one base model share: the last path component, case-folded.
    'meta-llama/Llama-3.1-8B', '/models/llama-3.1-8b/' and 'C:\\m\\Llama-3.1-8B' all give
    'llama-3.1-8b'."""
    return re.split(r"[/\\]", name.strip().rstrip("/\\"))[-1].casefold()


@dataclass(frozen=True, slots=True)
class FileDigests:
    """An adapter's two files' hex sha256s, computed once where its bytes arrive (an upload, a
    fetch) and carried wherever they go: the parse, the object store's key, the disk store."""

    config: str  # adapter_config.json's
    weights: str  # adapter_model.safetensors'

    @classmethod
    def of(cls, config_raw: bytes, weights_raw: bytes) -> FileDigests:
        return cls(hashlib.sha256(config_raw).hexdigest(),
                   hashlib.sha256(weights_raw).hexdigest())


@dataclass(frozen=True)
class BaseModelSpec:
    """What the served base model offers adapters; built by the engine from the args it builds
    the model from (engine.models.adapter_spec), never from config.json here."""

    num_layers: int
    # target -> (out_features, in_features); embed_tokens is (hidden, vocab), lm_head
    # (vocab, hidden): both absent from a spec with no vocabulary shapes. The projections the
    # base offers: the seven, or on a fused base (Phi-3) qkv_proj, o_proj, gate_up_proj,
    # down_proj. On an MoE base EXPERT_TARGETS give one expert's (out, in) and ROUTER (E, H);
    # with a shared expert also SHARED_TARGETS (its gate_proj [S, H] ... and its gate [1, H])
    module_shapes: dict[str, tuple[int, int]]
    max_lora_rank: int
    tie_word_embeddings: bool = False  # lm_head reuses embed_tokens' weight
    # adapters with saved modules (modules_to_save) the server holds at once; 0 refuses them
    max_full_module_slots: int = 0
    # what adapters.format checks adapter_config.json's base model against: the served class
    # (config.json architectures[0], e.g. 'LlamaForCausalLM') and names (the model directory's
    # basename, then config.json's _name_or_path); None / () when unknown, which checks nothing
    architecture: str | None = None
    model_names: tuple[str, ...] = ()
    # the dtype the engine serves in ("float32", "bfloat16", "float16"): every adapter weight
    # must be finite once cast to it (adapters.format)
    dtype: str = "float32"
    # fused target -> (slice, its rows of lora_B) for each slice, in order; {} when not fused
    fused: dict[str, tuple[tuple[str, int], ...]] = field(default_factory=dict)
    num_experts: int = 0  # routed experts per MoE layer; 0 on a dense base
    # the layers whose MLP is experts (no dense gate/up/down_proj there); () on a dense base
    moe_layers: tuple[int, ...] = ()


# -- the adapter's config ---------------------------------------------------------------------


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

    PEFT semantics mirrored here (peft 0.21): target_modules as a list matches a module whose
    name equals an entry or ends with "." + entry, then layers_to_transform filters by layer
    index; as a str it is ``re.fullmatch`` on the full module name; "all-linear" means every
    projection (not lm_head, not embed_tokens). rank_pattern / alpha_pattern: see
    ``pattern_key``.

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
    base_model_name_or_path: str | None  # what it was trained on: a Hub id or a path; or None
    bias: str
    fan_in_fan_out: bool
    modules_to_save: tuple[str, ...]  # sorted subset of MODEL_TARGETS; () if none
    use_dora: bool
    exclude_modules: tuple[str, ...] | str | None = None
    ensure_weight_tying: bool = False
    # the class it was trained on, auto_mapping.base_model_class ('LlamaForCausalLM'); None
    # when absent (PEFT writes auto_mapping only for a LoraConfig without task_type)
    base_model_class: str | None = None
    # parameter names PEFT wraps (suffix match, no layer filter): entries ending in one of
    # SUPPORTED_PARAMETERS, e.g. "experts.gate_up_proj"; () if none
    target_parameters: tuple[str, ...] = ()

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
            return module_name.rsplit(".", 1)[-1] in PROJECTIONS
        if isinstance(self.target_modules, str):  # never with layers_to_transform
            return re.fullmatch(self.target_modules, module_name) is not None
        if module_name in self.target_modules:  # named in full: PEFT skips the layer filter
            return True
        if not any(_suffix_match(t, module_name) for t in self.target_modules):
            return False
        return self.layers_to_transform is None or (
            layer is not None and layer in self.layers_to_transform)


    def targets_parameter(self, param_name: str) -> bool:
        """Whether PEFT would have wrapped parameter param_name (e.g.
        'model.layers.0.mlp.experts.gate_up_proj') with a LoRA: _inject_parameters' suffix
        match on target_parameters, with no layers_to_transform or exclude_modules filter."""
        return any(_suffix_match(t, param_name) for t in self.target_parameters)


def _suffix_match(name: str, module_name: str) -> bool:
    return module_name == name or module_name.endswith("." + name)
