"""A parsed adapter as bytes, to hand it to an engine in another process without parsing and
validating it again there: `pack(adapter)` on the side that read and checked its files,
`unpack(data)` on the other. Only the layout crosses: tensors in a safetensors blob (never
pickle), everything else in its JSON header. `unpack` trusts what it is given (the engine
process's own server), so it checks nothing but the layout.
"""

from __future__ import annotations

import json
import struct

import msgspec
import safetensors.torch
import torch

from loragw.adapters.format import LoraAdapter, LoraModuleWeights
from loragw.adapters.types import LoraConfig

HEADER = "lora-gateway.adapter"


class _Module(msgspec.Struct, array_like=True):
    layer: int | None
    target: str
    scaling: float
    slices: tuple[tuple[str, int], ...]


class _Header(msgspec.Struct):
    config: LoraConfig
    modules: list[_Module]
    sha256: str
    num_bytes: int
    saved: dict[str, str]  # saved-module target -> the tensor key it is stored under
    warnings: tuple[str, ...]


def pack(adapter: LoraAdapter) -> bytes:
    tensors: dict[str, torch.Tensor] = {}
    modules = []
    for i, weights in enumerate(adapter.modules.values()):
        tensors[f"m{i}.a"], tensors[f"m{i}.b"] = weights.lora_a, weights.lora_b
        modules.append(_Module(weights.layer, weights.target, weights.scaling, weights.slices))
    saved, keys = {}, {}  # a tied pair (one tensor for both ends) is stored once
    for target, tensor in adapter.saved_modules.items():
        key = keys.setdefault(id(tensor), f"s.{target}")
        tensors.setdefault(key, tensor)
        saved[target] = key
    header = _Header(adapter.config, modules, adapter.sha256, adapter.num_bytes, saved,
                     adapter.warnings)
    return safetensors.torch.save({k: t.contiguous() for k, t in tensors.items()},
                                  {HEADER: msgspec.json.encode(header).decode()})


def unpack(data: bytes) -> LoraAdapter:
    tensors = safetensors.torch.load(data)
    header = msgspec.json.decode(_metadata(data)[HEADER], type=_Header)
    modules = {(m.layer, m.target): LoraModuleWeights(m.layer, m.target, tensors[f"m{i}.a"],
                                                      tensors[f"m{i}.b"], m.scaling, m.slices)
               for i, m in enumerate(header.modules)}
    saved = {target: tensors[key] for target, key in header.saved.items()}
    return LoraAdapter(header.config, modules, header.sha256, header.num_bytes, saved,
                       header.warnings)


def _metadata(data: bytes) -> dict[str, str]:
    """The `__metadata__` of a safetensors blob: an 8-byte length, then its JSON header."""
    (length,) = struct.unpack_from("<Q", data)
    return json.loads(data[8:8 + length])["__metadata__"]
