"""PEFT LoRA adapters: validate adapter_config.json and adapter_model.safetensors against the
served base model, and return float32 host tensors per (layer, target), plus the full module
copies of modules_to_save (adapters.saved_modules) in the dtype they were saved in. Every
tensor must be finite, and stay finite once cast to the dtype the engine serves in
(BaseModelSpec.dtype): under --dtype float16 a weight past 65504 is refused, not served as inf.

Everything is checked before anything is returned: the config (adapters.lora_config), then the
safetensors header (adapters.safetensors_check) and every key, shape, rank and dtype in it
(adapters.saved_modules, adapters.lora_tensors), and only then are the tensors deserialized. Pickled weights are
refused and never opened.

The base model named in adapter_config.json is checked too: an adapter trained on another class
(auto_mapping.base_model_class != the served config.json's architectures[0]) is refused; one
whose base_model_name_or_path only names the base differently is served with a warning
(LoraAdapter.warnings, logged once per load), since a Hub id and a local path legitimately
name the same weights.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from dataclasses import dataclass, field

import torch

from loragw.adapters.errors import AdapterError
from loragw.adapters.errors import short_repr as _show
from loragw.adapters.expert_tensors import expert_factors
from loragw.adapters.lora_config import parse_adapter_config
from loragw.adapters.lora_tensors import check_lora_tensors
from loragw.adapters.safetensors_check import (
    CONFIG_FILE,
    check_safetensors,
    data_start,
    tensor_views,
)
from loragw.adapters.saved_modules import check_saved_modules, tied_to_embedding
from loragw.adapters.sources import MAX_CONFIG_BYTES, read_adapter_files
from loragw.adapters.types import (
    EMBED_TOKENS,
    EXPERT_TARGETS,
    LM_HEAD,
    BaseModelSpec,
    LoraConfig,
    base_name,
)

# BaseModelSpec lives in adapters.types; the engine imports it from here with the loader.
__all__ = [
    "BaseModelSpec", "LoraModuleWeights", "LoraAdapter", "read_adapter", "parse_adapter",
]  # fmt: skip

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class LoraModuleWeights:
    """One adapted module: delta(x) = scaling * (x @ lora_a.T) @ lora_b.T. For embed_tokens x
    is the token's one-hot row, so delta = scaling * lora_a[:, token] @ lora_b.T (PEFT's
    lora_embedding_A and lora_embedding_B). An expert target (adapters.types.EXPERT_TARGETS)
    holds one pair per expert: delta_e(x) = scaling * (x @ lora_a[e].T) @ lora_b[e].T."""

    layer: int | None  # None for the model-level targets: embed_tokens, lm_head
    target: str  # one of adapters.types.SUPPORTED_TARGETS, EXPERT_TARGETS or ROUTER
    lora_a: torch.Tensor  # [r, in]  float32, CPU (embed_tokens: in = vocab; experts [E, r, in])
    lora_b: torch.Tensor  # [out, r] float32, CPU (lm_head: out = vocab; experts [E, out, r])
    scaling: float
    # a fused module (Phi-3's qkv_proj, gate_up_proj): (slice, rows of lora_b) in row order;
    # () otherwise (BaseModelSpec.fused)
    slices: tuple[tuple[str, int], ...] = ()

    @property
    def rank(self) -> int:
        return self.lora_a.shape[-2]

    def split(self) -> dict[str, LoraModuleWeights]:
        """A fused module as one LoRA per slice: the same A, that slice's rows of B (the
        same delta, s * B A x, row for row)."""
        rows = self.lora_b.split([n for _, n in self.slices])  # views, [n, r] each
        return {name: LoraModuleWeights(self.layer, name, self.lora_a, b, self.scaling)
                for (name, _), b in zip(self.slices, rows, strict=True)}


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    config: LoraConfig
    modules: dict[tuple[int | None, str], LoraModuleWeights]  # (layer, target) -> weights
    sha256: str  # hex digest of the adapter_model.safetensors bytes
    num_bytes: int  # size of adapter_model.safetensors
    # modules_to_save: target ("embed_tokens", "lm_head") -> the adapter's own weight [V, H],
    # CPU, as saved (F32/F16/BF16); with PEFT's weight tying both ends are one tensor
    saved_modules: dict[str, torch.Tensor] = field(default_factory=dict)
    # served anyway, but worth a look (e.g. adapter_config.json names another base model);
    # each is one sentence for a person, shown in the admin API's adapter info
    warnings: tuple[str, ...] = ()

    @property
    def max_rank(self) -> int:
        return max(m.rank for m in self.modules.values())

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(sorted({target for _, target in self.modules}))

    def by_slice(self) -> dict[tuple[int | None, str], LoraModuleWeights]:
        """`modules` with every fused module split into its slices (q_proj, ..., up_proj),
        as the engine's Linears hold them."""
        out = {}
        for (layer, target), weights in self.modules.items():
            parts = weights.split() if weights.slices else {target: weights}
            out |= {(layer, name): part for name, part in parts.items()}
        return out


def read_adapter(path: str | os.PathLike, spec: BaseModelSpec,
                 weights_sha256: str | None = None) -> LoraAdapter:
    """Read, validate and parse a local PEFT adapter directory. `weights_sha256`: the weights'
    digest where the caller registered these very bytes before (a re-read of its own disk
    tier), so they are not hashed again."""
    return parse_adapter(*read_adapter_files(os.fspath(path)), spec, weights_sha256)


def parse_adapter(config_raw: bytes, weights_raw: bytes | bytearray, spec: BaseModelSpec,
                  weights_sha256: str | None = None) -> LoraAdapter:
    """Validate an adapter_config.json + adapter_model.safetensors pair (an upload, a fetch) and
    parse it; `weights_sha256`: the weights' digest where the caller has it already. A
    bytearray is taken over, not copied: the float32 tensors returned are views into it."""
    if len(config_raw) > MAX_CONFIG_BYTES:
        raise AdapterError(f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
    config = parse_adapter_config(config_raw)
    _check_base_model_class(config, spec)
    if not isinstance(weights_raw, bytearray):
        weights_raw = bytearray(weights_raw)  # ours alone: checked once, never changed after
    header = check_safetensors(weights_raw)
    saved_keys = check_saved_modules(header, config, spec)
    plan = check_lora_tensors(header, config, spec)
    names = [k for _, a, b in plan.values() for k in (a, b)] + list(saved_keys.values())
    tensors = tensor_views(weights_raw, header, names)
    if not _finite_at_once(weights_raw, header, spec):
        for key in names:  # one at a time, to name the culprit
            _check_finite(key, tensors[key], spec)
    modules = {}
    for (layer, target), (module_name, a_key, b_key) in plan.items():
        a = tensors[a_key].to(torch.float32).contiguous()  # [r, in]
        b = tensors[b_key].to(torch.float32).contiguous()  # [out, r]
        if target in EXPERT_TARGETS:
            a, b = expert_factors(a, b, spec.num_experts)  # [E, r, in], [E, out, r]
        modules[(layer, target)] = LoraModuleWeights(
            layer, target, a, b, config.scaling(module_name), spec.fused.get(target, ())
        )
    if config.ensure_weight_tying and spec.tie_word_embeddings:
        _check_tied_head(modules)
    saved = {target: tensors[key].contiguous() for target, key in saved_keys.items()}
    if tied_to_embedding(config, spec):
        if not torch.equal(saved[LM_HEAD], saved[EMBED_TOKENS]):
            raise AdapterError(
                "adapter sets ensure_weight_tying on a base model with tied embeddings, so its"
                " saved lm_head must equal its saved embed_tokens, but the saved tensors differ"
            )
        saved[LM_HEAD] = saved[EMBED_TOKENS]  # one tensor, as PEFT reloads it
    sha256 = weights_sha256 or hashlib.sha256(weights_raw).hexdigest()
    warnings = _base_model_name_warnings(config, spec)
    for warning in warnings:
        logger.warning("adapter (sha256 %s...): %s", sha256[:12], warning)
    return LoraAdapter(
        config=config,
        modules=modules,
        sha256=sha256,
        num_bytes=len(weights_raw),
        saved_modules=saved,
        warnings=warnings,
    )


def _finite_at_once(data: bytearray, header: dict, spec: BaseModelSpec) -> bool:
    """One aminmax over the whole data region when every tensor in it is float32 (PEFT's usual
    save): True when all of it is finite and fits the served dtype, so no tensor needs a pass
    of its own; False sends the parse to _check_finite per tensor, which names the culprit."""
    start = data_start(data)
    if len(data) == start or start % 4 or any(t.dtype != "F32" for t in header.values()):
        return False
    region = torch.frombuffer(data, dtype=torch.float32, offset=start,
                              count=(len(data) - start) // 4)
    lo, hi = _extremes(region)
    return _plainly_fits(lo, hi, spec)


def _extremes(t: torch.Tensor) -> tuple[float, float]:
    return tuple(float(x) for x in torch.aminmax(t))  # exact: every float dtype fits a double


def _plainly_fits(lo: float, hi: float, spec: BaseModelSpec) -> bool:
    """Finite, and within the served dtype's largest value without any rounding question."""
    return (math.isfinite(lo) and math.isfinite(hi)
            and max(-lo, hi) <= torch.finfo(getattr(torch, spec.dtype)).max)


def _check_finite(key: str, t: torch.Tensor, spec: BaseModelSpec) -> None:
    """Refuse a tensor holding NaN / inf, or values that become inf once cast to the served
    dtype (spec.dtype; past float16's 65504, say): the engine would serve infs. One pass
    (aminmax: NaN propagates to both ends) and no temporaries: this runs on every load."""
    if not t.numel():
        return
    lo, hi = _extremes(t)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise AdapterError(f"tensor {_show(key)} contains NaN or infinite values")
    if _plainly_fits(lo, hi, spec):
        return  # the common case, without a tensor op
    served = getattr(torch, spec.dtype)
    # its largest magnitude, rounded once to the served dtype as the cast of t would round it
    peak = torch.tensor(max(-lo, hi), dtype=torch.float64)
    if bool(torch.isinf(peak.to(served))):  # rounding is monotone: the largest overflows first
        wider = [f"--dtype {name}" for name in ("bfloat16", "float32") if name != spec.dtype
                 and not torch.isinf(peak.to(getattr(torch, name)))]
        raise AdapterError(
            f"tensor {_show(key)} holds values up to {peak.item():.4g} in magnitude, past"
            f" {spec.dtype}'s largest ({torch.finfo(served).max:.6g}), the dtype this server runs"
            " in, so it would be served as inf; use an adapter with smaller weights"
            + (f", or a server started with {' or '.join(wider)}" if wider else "")
        )


def _check_base_model_class(config: LoraConfig, spec: BaseModelSpec) -> None:
    """Refuse an adapter trained on another architecture class; unknown on either side
    (no auto_mapping, no architectures in config.json) checks nothing."""
    trained, served = config.base_model_class, spec.architecture
    if trained is None or served is None or trained == served:
        return
    raise AdapterError(
        f"adapter_config.json says the adapter was trained on {_show(trained)}"
        f" (auto_mapping.base_model_class), but this server serves {_show(served)}; use an"
        f" adapter trained on {_show(served)}, or serve this one on a {_show(trained)} base model"
    )


def _base_model_name_warnings(config: LoraConfig, spec: BaseModelSpec) -> tuple[str, ...]:
    """One warning when base_model_name_or_path names none of the served model's names, compared
    by base_name (a Hub id and a local path to the same weights share their last component)."""
    trained = config.base_model_name_or_path
    if trained is None or not base_name(trained) or not spec.model_names:
        return ()
    if base_name(trained) in {base_name(name) for name in spec.model_names}:
        return ()
    return (
        f"adapter_config.json says it was trained on {_show(trained)}; this server serves"
        f" {_show(spec.model_names[0])} (shapes match, so it is served; check it is the right"
        " base)",
    )


def _check_tied_head(modules: dict[tuple[int | None, str], LoraModuleWeights]) -> None:
    """ensure_weight_tying on a tied base: PEFT's lm_head LoRA *is* the embedding LoRA,
    transposed. Served as saved, so the saved copy must be exactly that."""
    embed, head = modules.get((None, EMBED_TOKENS)), modules.get((None, LM_HEAD))
    if embed is None or head is None:
        return
    if not (torch.equal(head.lora_a, embed.lora_b.T) and torch.equal(head.lora_b, embed.lora_a.T)):
        raise AdapterError(
            "adapter sets ensure_weight_tying on a base model with tied embeddings, so its lm_head"
            " LoRA must be its embed_tokens LoRA transposed (lora_A = lora_embedding_B.T, lora_B ="
            " lora_embedding_A.T), but the saved tensors differ"
        )
