"""Check adapter_model.safetensors from its header alone, before anything deserializes it.

Two layers of checks. ``check_safetensors``: the container. ``check_lora_tensors``: its
contents, against the adapter config and the served base model (keys, targets, layers, shapes,
ranks, dtypes).

Layout: ``[8-byte little-endian header length N][N bytes of JSON header][tensor data]``.
The header maps each tensor name to ``{"dtype", "shape", "data_offsets": [start, end]}``,
offsets relative to the start of the data. We insist on what the format promises: a sane
header, known dtypes, every tensor's bytes exactly ``prod(shape) * itemsize``, and tensors that
tile the data region with no gap, overlap or trailing bytes. Anything else is refused before
``safetensors`` or torch sees it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from adapters.errors import AdapterError
from adapters.errors import short_repr as _show

if TYPE_CHECKING:
    from adapters.format import BaseModelSpec
    from adapters.lora_config import LoraConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FLOAT_DTYPES = ("F32", "F16", "BF16")
BLOCK_OF = {t: "self_attn" for t in TARGET_MODULES[:4]} | {t: "mlp" for t in TARGET_MODULES[4:]}

# PEFT saves keys without the adapter name; some exporters keep ".default". The module name
# (group "module") is what PEFT matched target_modules / rank_pattern against.
_KEY = re.compile(
    r"base_model\.model\.(?P<module>(?:model\.)?layers\.(?P<layer>0|[1-9][0-9]{0,5})\."
    r"(?P<block>self_attn|mlp)\.(?P<target>\w+))\.lora_(?P<ab>[AB])(?:\.default)?\.weight"
)
_ANY_LORA_KEY = re.compile(
    r"base_model\.model\.(?P<module>[\w.]+)\.lora_[AB](?:\.default)?\.weight"
)

MAX_HEADER_BYTES = 100_000_000  # the limit the safetensors library itself enforces
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    start: int  # byte offset into the data region
    end: int


def _corrupt(why: str) -> AdapterError:
    return AdapterError(f"truncated or corrupt safetensors: {why}")


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _corrupt(f"header repeats key {_show(key)}")
        out[key] = value
    return out


def _reject_constant(name: str) -> None:
    raise _corrupt(f"header contains non-JSON constant {name}")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_safetensors(data: bytes) -> dict[str, TensorInfo]:
    """Validate the header of a safetensors buffer; return tensor name -> TensorInfo.

    Raises AdapterError("truncated or corrupt safetensors: ...") on any inconsistency.
    """
    if len(data) < 8:
        raise _corrupt(f"file is {len(data)} bytes, shorter than the 8-byte header length")
    header_len = int.from_bytes(data[:8], "little")
    if header_len > MAX_HEADER_BYTES:
        raise _corrupt(f"header length {header_len} exceeds {MAX_HEADER_BYTES} bytes")
    if header_len > len(data) - 8:
        raise _corrupt(f"header length {header_len} runs past the end of a {len(data)}-byte file")
    try:
        text = bytes(data[8 : 8 + header_len]).decode("utf-8")
        header = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except AdapterError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _corrupt(f"header is not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(header, dict):
        raise _corrupt("header is not a JSON object")

    data_len = len(data) - 8 - header_len
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise _corrupt("__metadata__ must map strings to strings")
            continue
        tensors[name] = _check_entry(name, entry, data_len)

    pos = 0
    for name, t in sorted(tensors.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        if t.start != pos:
            kind = "overlaps the previous tensor" if t.start < pos else "leaves a gap before it"
            raise _corrupt(f"tensor {_show(name)} at bytes [{t.start}, {t.end}) {kind}")
        pos = t.end
    if pos != data_len:
        raise _corrupt(f"tensors cover {pos} of {data_len} data bytes")
    return tensors


def _check_entry(name: str, entry: object, data_len: int) -> TensorInfo:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise _corrupt(f"tensor {_show(name)} entry must have exactly dtype, shape, data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPE_BYTES:
        raise _corrupt(f"tensor {_show(name)} has unknown dtype {_show(dtype)}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise _corrupt(f"tensor {_show(name)} has invalid shape {_show(shape)}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise _corrupt(f"tensor {_show(name)} has invalid data_offsets {_show(offsets)}")
    start, end = offsets
    if end > data_len:
        raise _corrupt(
            f"tensor {_show(name)} ends at byte {end}, past the {data_len}-byte data region"
        )
    expected = math.prod(shape) * DTYPE_BYTES[dtype]
    if end - start != expected:
        raise _corrupt(
            f"tensor {_show(name)} {dtype}{shape} needs {expected} bytes but spans {end - start}"
        )
    return TensorInfo(dtype, tuple(shape), start, end)


def _explain_unknown_key(key: str) -> AdapterError:
    if "lora_magnitude_vector" in key:
        return AdapterError(
            f"tensor {_show(key)} is a DoRA magnitude vector; DoRA is not supported"
        )
    if "lora_embedding_" in key:
        return AdapterError(
            f"tensor {_show(key)} is an embedding LoRA; embeddings are not supported"
        )
    if m := _ANY_LORA_KEY.fullmatch(key):
        target = m["module"].rsplit(".", 1)[-1]
        if target not in TARGET_MODULES:
            return _unsupported_target(target, key)
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
        f" support; supported target modules: {', '.join(TARGET_MODULES)}"
    )


def check_lora_tensors(
    header: dict[str, TensorInfo], config: LoraConfig, spec: BaseModelSpec
) -> dict[tuple[int, str], tuple[str, str, str]]:
    """Check every tensor against config and spec from the header alone (nothing loaded yet).

    Returns (layer, target) -> (module_name, lora_A key, lora_B key).
    """
    found: dict[tuple[int, str], dict[str, str]] = {}
    for key, info in header.items():
        m = _KEY.fullmatch(key)
        if m is None:
            raise _explain_unknown_key(key)
        layer, target, module = int(m["layer"]), m["target"], m["module"]
        if target not in TARGET_MODULES:
            raise _unsupported_target(target, key)
        if m["block"] != BLOCK_OF[target]:
            raise AdapterError(f"tensor {_show(key)} puts {target} under {m['block']}")
        if layer >= spec.num_layers:
            raise AdapterError(
                f"tensor {_show(key)} is for layer {layer} but the base model has {spec.num_layers}"
                " layers; the adapter was trained for a different base model"
            )
        if info.dtype not in FLOAT_DTYPES:
            raise AdapterError(
                f"tensor {_show(key)} has dtype {info.dtype}; expected F32, F16 or BF16"
            )
        if not config.targets_module(module, layer):
            raise AdapterError(
                f"tensor {_show(key)} is for module {_show(module)}, which {CONFIG_FILE}"
                " does not target"
                f" (target_modules={_show(config.target_modules)},"
                f" layers_to_transform={config.layers_to_transform!r})"
            )
        slot = found.setdefault((layer, target), {"module": module})
        if m["ab"] in slot or slot["module"] != module:
            raise AdapterError(
                f"tensor {_show(key)} duplicates the lora_{m['ab']} of layer {layer} {target}"
            )
        slot[m["ab"]] = key
    if not found:
        raise AdapterError(f"{WEIGHTS_FILE} holds no LoRA tensors")

    plan, worst_rank = {}, 0
    for (layer, target), slot in sorted(found.items()):
        module = slot["module"]
        for ab in ("A", "B"):
            if ab not in slot:
                raise AdapterError(f"module {_show(module)} has no lora_{ab} tensor")
        a, b = header[slot["A"]].shape, header[slot["B"]].shape
        out_f, in_f = spec.module_shapes[target]
        if len(a) != 2 or len(b) != 2 or a[1] != in_f or b[0] != out_f or a[0] != b[1]:
            raise AdapterError(
                f"module {_show(module)} has lora_A {list(a)} and lora_B {list(b)}; the base model"
                f" needs lora_A [r, {in_f}] and lora_B [{out_f}, r]; was the adapter trained"
                " for a different base model?"
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
