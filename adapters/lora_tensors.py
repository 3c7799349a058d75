"""The contents of adapter_model.safetensors, checked from its header alone against the adapter
config and the served base model: keys, targets, layers, shapes, ranks, dtypes.

Targets: the projections of every decoder layer the base offers (the seven, or Phi-3's fused
qkv_proj and gate_up_proj beside o_proj and down_proj: BaseModelSpec.module_shapes; on an MoE
base's sparse layers no dense MLP, but Qwen2-MoE's shared expert, ``mlp.shared_expert.gate_proj``
etc., target "shared_expert.gate_proj", and its gate ``mlp.shared_expert_gate``), and two
model-level modules,
``embed_tokens`` (PEFT's lora.Embedding: ``...embed_tokens.lora_embedding_A`` [r, vocab] and
``lora_embedding_B`` [hidden, r], no ``.weight``) and ``lm_head`` (a Linear LoRA: ``lora_A``
[r, hidden], ``lora_B`` [vocab, r]). Beside an embedding LoRA PEFT also saves the base layers'
own weights (``...embed_tokens.base_layer.weight``, ``lm_head.base_layer.weight``:
save_embedding_layers); those copies are checked for shape and never loaded: the served base
model's weights are used (as PEFT does when the adapter was trained on this base). Full copies
of embed_tokens / lm_head (``...embed_tokens.weight``, ``lm_head.weight``: modules_to_save) are
adapters.saved_modules' to check; they are skipped here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from loragw.adapters.errors import AdapterError
from loragw.adapters.errors import short_repr as _show
from loragw.adapters.expert_tensors import PARAM_LORA_KEY, check_parameter_tensors
from loragw.adapters.safetensors_check import CONFIG_FILE, WEIGHTS_FILE, TensorInfo
from loragw.adapters.types import (
    BLOCK_OF,
    EMBED_LORA_KEY,
    EMBED_TOKENS,
    FLOAT_DTYPES,
    HEAD_LORA_KEY,
    LM_HEAD,
    MODEL_TARGETS,
    PROJECTIONS,
    SAVED_KEY,
    SHARED_TARGETS,
    SUPPORTED_TARGETS,
    BaseModelSpec,
    LoraConfig,
    no_vocab_error,
)

# A LoRA on a decoder-layer projection. PEFT saves keys without the adapter name; some exporters
# keep ".default". The module name (group "module") is what PEFT matched target_modules /
# rank_pattern against; the target is "shared_expert.<projection>" under a shared expert.
_KEY = re.compile(
    r"base_model\.model\.(?P<module>(?:model\.)?layers\.(?P<layer>0|[1-9][0-9]{0,5})\."
    r"(?P<block>self_attn|mlp)\.(?P<target>(?:shared_expert\.)?\w+))"
    r"\.lora_(?P<ab>[AB])(?:\.default)?\.weight"
)
_BASE_COPY_KEY = re.compile(
    r"base_model\.model\.(?P<module>(?:model\.)?embed_tokens|lm_head)\.base_layer\.weight"
)
_ANY_LORA_KEY = re.compile(
    r"base_model\.model\.(?P<module>[\w.]+)\.lora_[AB](?:\.default)?\.weight"
)


def _explain_unknown_key(key: str) -> AdapterError:
    if "lora_magnitude_vector" in key:
        return AdapterError(
            f"tensor {_show(key)} is a DoRA magnitude vector; DoRA is not supported"
        )
    if "lora_embedding_" in key:
        return AdapterError(
            f"tensor {_show(key)} is an embedding LoRA at an unexpected path; expected"
            " 'base_model.model.model.embed_tokens.lora_embedding_A'"
        )
    if m := _ANY_LORA_KEY.fullmatch(key):
        target = m["module"].rsplit(".", 1)[-1]
        if target not in SUPPORTED_TARGETS:
            return _unsupported_target(target, key)
        if target in MODEL_TARGETS:
            return AdapterError(
                f"tensor {_show(key)} puts {target} at an unexpected path; expected"
                " 'base_model.model.lm_head.lora_A.weight' (and embed_tokens LoRAs as"
                " 'base_model.model.model.embed_tokens.lora_embedding_A')"
            )
        return AdapterError(
            f"tensor {_show(key)} puts {target} at an unexpected path; expected"
            f" 'base_model.model.model.layers.<i>.{BLOCK_OF[target]}.{target}.lora_A.weight'"
        )
    return AdapterError(
        f"unexpected tensor {_show(key)} in {WEIGHTS_FILE}; expected only PEFT LoRA keys like"
        " 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight'"
    )


def _unsupported_target(target: str, key: str) -> AdapterError:
    return AdapterError(
        f"adapter targets module {_show(target)} (tensor {_show(key)}), which lora-gateway does not"
        f" support; supported target modules: {', '.join(SUPPORTED_TARGETS)}"
    )


def _not_offered(target: str, key: str, spec: BaseModelSpec) -> AdapterError:
    """A projection this base does not have: q_proj on Phi-3 (fused), qkv_proj on Llama."""
    offered = ", ".join(t for t in spec.module_shapes if t in PROJECTIONS)
    base = f"the base model ({spec.architecture})" if spec.architecture else "the base model"
    fused_into = next((name for name, slices in spec.fused.items()
                       if target in (part for part, _ in slices)), None)
    why = f"it fuses {target} into {fused_into}" if fused_into else f"it has no {target}"
    if target in SHARED_TARGETS:
        why = "it has no shared expert (only Qwen2-MoE bases with shared_expert_intermediate_size)"
    return AdapterError(
        f"adapter targets module {_show(target)} (tensor {_show(key)}), which {base} does not"
        f" offer: {why}; its projections are {offered}. Use an adapter trained on this base"
        " model's architecture"
    )


def _not_in_layer(key: str, target: str, layer: int, spec: BaseModelSpec) -> AdapterError:
    """An MLP module the layer lacks: a dense one on a sparse layer, a shared expert's on a dense
    one (mlp_only_layers, decoder_sparse_step)."""
    if target in SHARED_TARGETS:
        has = "a dense MLP (mlp.gate_proj, mlp.up_proj, mlp.down_proj), no shared expert"
    else:
        shared = SHARED_TARGETS[0] in spec.module_shapes
        has = "experts (target_parameters experts.gate_up_proj, experts.down_proj)" + (
            " and a shared expert (mlp.shared_expert.gate_proj, ...)" if shared else "")
    return AdapterError(
        f"tensor {_show(key)} is for mlp.{target}, which layer {layer} of this mixture-of-experts"
        f" base model does not have: its MLP there is {has}")


@dataclass(frozen=True, slots=True)
class _LoraKey:
    layer: int | None  # None for the model-level targets (embed_tokens, lm_head)
    target: str
    module: str  # the module name PEFT matched target_modules / rank_pattern against
    ab: str  # "A" or "B"


def _lora_key(key: str, spec: BaseModelSpec) -> _LoraKey:
    """What a LoRA tensor key adapts; refuses keys this engine does not serve."""
    if m := EMBED_LORA_KEY.fullmatch(key) or HEAD_LORA_KEY.fullmatch(key):
        target = m["module"].rsplit(".", 1)[-1]
        if target not in spec.module_shapes:
            raise no_vocab_error(key, target)
        return _LoraKey(None, target, m["module"], m["ab"])
    m = _KEY.fullmatch(key)
    if m is None:
        raise _explain_unknown_key(key)
    layer, target = int(m["layer"]), m["target"]
    if target not in PROJECTIONS:
        raise _unsupported_target(target, key)
    if m["block"] != BLOCK_OF[target]:
        raise AdapterError(f"tensor {_show(key)} puts {target} under {m['block']}")
    if target not in spec.module_shapes:
        raise _not_offered(target, key, spec)
    if layer >= spec.num_layers:
        raise AdapterError(
            f"tensor {_show(key)} is for layer {layer} but the base model has {spec.num_layers}"
            " layers; the adapter was trained for a different base model"
        )
    if BLOCK_OF[target] == "mlp" and (layer in spec.moe_layers) != (target in SHARED_TARGETS):
        raise _not_in_layer(key, target, layer, spec)
    return _LoraKey(layer, target, m["module"], m["ab"])


def _check_base_copy(key: str, info: TensorInfo, spec: BaseModelSpec) -> None:
    """A copy of the base embed_tokens / lm_head weight, [vocab, hidden]. PEFT saves one for
    both ends whenever a model it saves from has a LoRA on either (another adapter's, too)."""
    target = key.split(".base_layer.")[0].rsplit(".", 1)[-1]
    if target not in spec.module_shapes:
        raise no_vocab_error(key, target)
    out_f, in_f = spec.module_shapes[target]
    vocab, hidden = (in_f, out_f) if target == EMBED_TOKENS else (out_f, in_f)
    if info.dtype not in FLOAT_DTYPES or list(info.shape) != [vocab, hidden]:
        raise AdapterError(
            f"tensor {_show(key)} is {info.dtype}{list(info.shape)}, but the base model's"
            f" {target} weight is [{vocab}, {hidden}]; an adapter trained with a resized"
            " vocabulary (new tokens) is not supported"
        )


def _order(item: tuple[tuple[int | None, str], object]) -> tuple[int, str]:
    (layer, target), _ = item
    return (-1 if layer is None else layer, target)


def check_lora_tensors(
    header: dict[str, TensorInfo], config: LoraConfig, spec: BaseModelSpec
) -> dict[tuple[int | None, str], tuple[str, str, str]]:
    """Check every tensor against config and spec from the header alone (nothing loaded yet).

    Returns (layer, target) -> (module_name, lora_A key, lora_B key); layer is None for
    embed_tokens and lm_head. Copies of base weights (see the module docstring) are left out.
    LoRAs on an MoE block's parameters are adapters.expert_tensors' (module_name: the
    parameter's name).
    """
    params, param_rank = check_parameter_tensors(header, config, spec)
    # PEFT's ensure_weight_tying on a tied base: lm_head gets the embedding LoRA, transposed
    # (lm_head lora_A = lora_embedding_B.T, lora_B = lora_embedding_A.T), saved as its own keys.
    tied = config.ensure_weight_tying and spec.tie_word_embeddings
    found: dict[tuple[int | None, str], dict[str, str]] = {}
    for key, info in header.items():
        if _BASE_COPY_KEY.fullmatch(key):
            _check_base_copy(key, info, spec)
            continue
        if SAVED_KEY.fullmatch(key) or PARAM_LORA_KEY.fullmatch(key):  # checked elsewhere
            continue
        k = _lora_key(key, spec)
        if info.dtype not in FLOAT_DTYPES:
            raise AdapterError(
                f"tensor {_show(key)} has dtype {info.dtype}; expected F32, F16 or BF16"
            )
        if not (config.targets_module(k.module, k.layer) or (k.target == LM_HEAD and tied)):
            raise AdapterError(
                f"tensor {_show(key)} is for module {_show(k.module)}, which {CONFIG_FILE}"
                " does not target"
                f" (target_modules={_show(config.target_modules)},"
                f" layers_to_transform={config.layers_to_transform!r})"
            )
        slot = found.setdefault((k.layer, k.target), {"module": k.module})
        if k.ab in slot or slot["module"] != k.module:
            where = f"layer {k.layer} {k.target}" if k.layer is not None else k.target
            raise AdapterError(f"tensor {_show(key)} duplicates the lora_{k.ab} of {where}")
        slot[k.ab] = key
    if not found and not params:
        raise AdapterError(f"{WEIGHTS_FILE} holds no LoRA tensors")
    if tied and ((None, EMBED_TOKENS) in found) != ((None, LM_HEAD) in found):
        raise AdapterError(
            f"{CONFIG_FILE} sets ensure_weight_tying on a base model with tied embeddings, so"
            " PEFT ties lm_head's LoRA to embed_tokens' LoRA, but the file holds only one of them;"
            " save the adapter again with PEFT"
        )

    plan, worst_rank = dict(params), param_rank
    for (layer, target), slot in sorted(found.items(), key=_order):
        module = slot["module"]
        for ab in ("A", "B"):
            if ab not in slot:
                raise AdapterError(f"module {_show(module)} has no lora_{ab} tensor")
        a, b = header[slot["A"]].shape, header[slot["B"]].shape
        out_f, in_f = spec.module_shapes[target]
        if len(a) != 2 or len(b) != 2 or a[1] != in_f or b[0] != out_f or a[0] != b[1]:
            names = ("lora_embedding_A", "lora_embedding_B") if target == EMBED_TOKENS else (
                "lora_A", "lora_B")
            raise AdapterError(
                f"module {_show(module)} has {names[0]} {list(a)} and {names[1]} {list(b)}; the"
                f" base model needs {names[0]} [r, {in_f}] and {names[1]} [{out_f}, r]; was the"
                " adapter trained for a different base model?"
            )
        rank, expected = a[0], config.rank_for(module)
        if rank != expected:
            raise AdapterError(
                f"module {_show(module)} has rank {rank} but {CONFIG_FILE} says {expected}"
                " (r / rank_pattern)"
            )
        worst_rank = max(worst_rank, rank)
        plan[(layer, target)] = (module, slot["A"], slot["B"])
    if worst_rank > spec.max_lora_rank:
        raise AdapterError(
            f"adapter has rank {worst_rank} > --max-lora-rank {spec.max_lora_rank}; restart with"
            f" --max-lora-rank {worst_rank} or use a smaller adapter"
        )
    return plan
