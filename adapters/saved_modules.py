"""PEFT's modules_to_save on the vocabulary ends: an adapter that carries its own full copy of
embed_tokens and/or lm_head, [vocab, hidden] each, which replaces the base model's module for
that adapter's tokens (embed_tokens) and sampling rows (lm_head).

What PEFT (0.21) writes, verified by saving real adapters (tests/adapters/test_saved_modules.py):
    base_model.model.model.embed_tokens.weight   [V, H]   the adapter's embed_tokens
    base_model.model.lm_head.weight              [V, H]   the adapter's lm_head
the module's own state dict under the base model's module name: no ``modules_to_save`` or
adapter-name infix and no copy of the original module. adapter_config.json lists the modules as
given ('lm_head', 'embed_tokens', 'model.embed_tokens'). A module named in both target_modules
and modules_to_save gets no LoRA (PEFT wraps it for saving first and its LoRA is never made),
so a file holding both for one module is refused. On a base with tied embeddings each saved
copy replaces only its own module, unless ensure_weight_tying: then PEFT lists embed_tokens,
saves lm_head's copy too (equal to it) and reloads both ends as one tensor.

The same keys appear in adapters PEFT saved from a model whose vocabulary was resized
(save_embedding_layers); unlisted, or listed with another vocabulary size, they are refused.

Saved modules are opt-in (--max-full-module-slots): each resident adapter with them holds up to
two [V, H] matrices on the device (about 1 GB each on an 8B model in bf16).
"""

from __future__ import annotations

from loragw.adapters.errors import AdapterError
from loragw.adapters.errors import short_repr as _show
from loragw.adapters.safetensors_check import CONFIG_FILE, TensorInfo
from loragw.adapters.types import (
    EMBED_LORA_KEY,
    EMBED_TOKENS,
    FLOAT_DTYPES,
    HEAD_LORA_KEY,
    LM_HEAD,
    MODEL_TARGETS,
    SAVED_KEY,
    BaseModelSpec,
    LoraConfig,
    no_vocab_error,
)

SAVED_TARGETS = MODEL_TARGETS  # the only modules a saved copy may replace: the vocabulary ends
# modules_to_save entries for the vocabulary ends, as PEFT users and PEFT itself write them
# (ensure_weight_tying adds 'model.embed_tokens') -> the target whose full copy is saved
SAVED_MODULE_NAMES = {"embed_tokens": EMBED_TOKENS, "model.embed_tokens": EMBED_TOKENS,
                      "lm_head": LM_HEAD}
FLAG = "--max-full-module-slots"


def parse_modules_to_save(v: object) -> tuple[str, ...]:
    """The targets of PEFT's modules_to_save. PEFT wraps every module whose name ends with an
    entry; we take only the names PEFT writes for the two vocabulary ends and refuse the rest
    rather than guess what a looser suffix would have matched."""
    if not v:
        return ()
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise AdapterError(
            f"{CONFIG_FILE}: modules_to_save must be a list of module names, got {_show(v)}"
        )
    targets = set()
    for name in v:
        if name not in SAVED_MODULE_NAMES:
            raise AdapterError(
                f"{CONFIG_FILE}: modules_to_save names {_show(name)}; lora-gateway serves saved"
                " copies of embed_tokens and lm_head only (named 'embed_tokens',"
                " 'model.embed_tokens' or 'lm_head'), not of other modules such as classifier"
                " or score heads, norms or layers"
            )
        targets.add(SAVED_MODULE_NAMES[name])
    return tuple(sorted(targets))


def full_modules_off(targets: tuple[str, ...]) -> AdapterError:
    return AdapterError(
        f"{CONFIG_FILE}: modules_to_save is {_show(list(targets))}: the adapter replaces whole"
        " modules with its own trained copies ([vocab, hidden] each), which this server keeps"
        f" on the device only when started with {FLAG} N (LLM(max_full_module_slots=N));"
        " restart with it, or train a LoRA on embed_tokens / lm_head instead"
    )


def tied_to_embedding(config: LoraConfig, spec: BaseModelSpec) -> bool:
    """PEFT ties lm_head's saved copy to embed_tokens' (ensure_weight_tying on a tied base)."""
    return (config.ensure_weight_tying and spec.tie_word_embeddings
            and EMBED_TOKENS in config.modules_to_save)


def check_saved_modules(
    header: dict[str, TensorInfo], config: LoraConfig, spec: BaseModelSpec
) -> dict[str, str]:
    """Check the saved modules from the header alone; return target -> tensor key.

    Refuses, naming what to do: saved modules on a server without full-module slots, full
    copies modules_to_save does not list (a resized vocabulary), shapes other than the base's
    [vocab, hidden], a listed module with no tensor, and a LoRA beside a saved copy.
    """
    tied = tied_to_embedding(config, spec)
    expected = set(config.modules_to_save) | ({LM_HEAD} if tied else set())
    if expected and spec.max_full_module_slots < 1:
        raise full_modules_off(config.modules_to_save)
    if config.ensure_weight_tying and spec.tie_word_embeddings and expected == {LM_HEAD}:
        raise AdapterError(
            f"{CONFIG_FILE} sets ensure_weight_tying on a base model with tied embeddings and"
            " lists only lm_head in modules_to_save; PEFT saves such an adapter listing"
            " embed_tokens (both ends share one saved copy); save the adapter again with PEFT"
        )
    found: dict[str, str] = {}
    for key, info in header.items():
        m = SAVED_KEY.fullmatch(key)
        if m is None:
            continue
        target = m["module"].rsplit(".", 1)[-1]
        if target not in expected:
            raise AdapterError(
                f"tensor {_show(key)} is a full copy of {target}, which {CONFIG_FILE} does not"
                " list in modules_to_save; PEFT saves one for modules_to_save, or with every"
                " adapter of a model whose vocabulary was resized (new tokens), which is not"
                " supported"
            )
        if target in found:
            raise AdapterError(f"tensor {_show(key)} duplicates {_show(found[target])}")
        _check_shape(key, info, target, spec)
        found[target] = key
    for target in sorted(expected - set(found)):
        why = (" (ensure_weight_tying on a base with tied embeddings saves lm_head's copy too)"
               if tied and target == LM_HEAD else "")
        raise AdapterError(
            f"{CONFIG_FILE} lists {target} in modules_to_save but the file holds no"
            f" {target} weight{why}; save the adapter again with PEFT"
        )
    for key in header:
        m = EMBED_LORA_KEY.fullmatch(key) or HEAD_LORA_KEY.fullmatch(key)
        if m and (target := m["module"].rsplit(".", 1)[-1]) in found:
            raise AdapterError(
                f"adapter holds both a LoRA on {target} (tensor {_show(key)}) and a full saved"
                f" copy of it (modules_to_save); PEFT never saves both, the saved copy replaces"
                " the module; save the adapter again with PEFT"
            )
    return found


def _check_shape(key: str, info: TensorInfo, target: str, spec: BaseModelSpec) -> None:
    if target not in spec.module_shapes:
        raise no_vocab_error(key, target)
    vocab, hidden = spec.module_shapes[LM_HEAD]
    shape = list(info.shape)
    if info.dtype not in FLOAT_DTYPES:
        raise AdapterError(f"tensor {_show(key)} has dtype {info.dtype}; expected F32, F16 or BF16")
    if len(shape) != 2 or shape[1] != hidden:
        raise AdapterError(
            f"tensor {_show(key)} is {shape}, but the base model's {target} is [{vocab}, {hidden}];"
            " was the adapter trained for a different base model?"
        )
    if shape[0] != vocab:
        raise AdapterError(
            f"tensor {_show(key)} is {shape}, but the base model's {target} is [{vocab}, {hidden}];"
            " an adapter trained with a resized vocabulary (new tokens) is not supported"
        )
