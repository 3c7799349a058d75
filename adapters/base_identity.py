"""Which base model an adapter belongs to: the one fingerprint the store and the catalog key by.

Two servers whose bases differ in anything an adapter's tensors must fit (architecture class,
layers, projection shapes, vocabulary, tied embeddings, experts) have different keys, so they
keep different disk stores under one --adapter-dir and different catalogs in one Redis: an
adapter made for one is a 404 on the other, never listed and never forwarded. What does not
change the fit (the served dtype, quantization, --max-lora-rank, the path the weights were
read from) does not change the key, so replicas of one base that mount it at different paths,
or serve it quantized, share one catalog.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from loragw.adapters.types import BaseModelSpec

KEY_CHARS = 16  # hex digits of sha256: 64 bits, a store folder name and a Redis key part


@dataclass(frozen=True, slots=True)
class BaseIdentity:
    """The base model adapters are made for, as the store and the catalog record it."""

    key: str  # KEY_CHARS hex digits of sha256 over what an adapter must fit (base_identity)
    architecture: str  # config.json architectures[0], e.g. "LlamaForCausalLM" ("" unknown)
    name: str  # the served model name, for people reading a listing

    def describe(self) -> str:
        return f"{self.name} ({self.architecture or 'unknown architecture'}, base {self.key})"


def base_identity(spec: BaseModelSpec, name: str) -> BaseIdentity:
    """The identity of the base `spec` describes, served as `name`."""
    fit = {
        "architecture": spec.architecture or "",
        "num_layers": spec.num_layers,
        "module_shapes": sorted((target, list(shape)) for target, shape in
                                spec.module_shapes.items()),
        "tie_word_embeddings": spec.tie_word_embeddings,
        "fused": sorted((target, [list(part) for part in parts])
                        for target, parts in spec.fused.items()),
        "num_experts": spec.num_experts,
        "moe_layers": list(spec.moe_layers),
    }
    digest = hashlib.sha256(json.dumps(fit, sort_keys=True).encode()).hexdigest()
    return BaseIdentity(digest[:KEY_CHARS], spec.architecture or "", name)
