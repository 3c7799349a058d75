"""Check adapter_model.safetensors from its header alone, before anything deserializes it.

Two layers of checks. ``check_safetensors`` (here): the container. ``check_lora_tensors``
(adapters.lora_tensors): its contents, against the adapter config and the served base model.

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
import sys
from dataclasses import dataclass

import torch

from loragw.adapters.errors import AdapterError
from loragw.adapters.errors import short_repr as _show

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_HEADER_BYTES = 100_000_000  # the limit the safetensors library itself enforces
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
TORCH_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3": torch.float8_e4m3fn, "I16": torch.int16, "F16": torch.float16,
    "BF16": torch.bfloat16, "I32": torch.int32, "F32": torch.float32, "I64": torch.int64,
    "F64": torch.float64,
}  # fmt: skip; U16, U32 and U64 are refused by the LoRA and saved-module checks first


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


def data_start(data: bytes | bytearray) -> int:
    """Where the tensor data begins: after the length prefix and the header."""
    return 8 + int.from_bytes(data[:8], "little")


def tensor_views(data: bytearray, tensors: dict[str, TensorInfo],
                 names: list[str]) -> dict[str, torch.Tensor]:
    """Tensors `names` of a buffer check_safetensors passed, as views into `data` (no copy: a
    parse reads each byte once); one whose offset its dtype cannot align to is copied out."""
    if sys.byteorder != "little":  # safetensors is little-endian; views would read it swapped
        raise AdapterError("adapters are parsed on little-endian hosts only")
    base, out = data_start(data), {}
    for name in names:
        t = tensors[name]
        dtype = TORCH_DTYPES[t.dtype]
        if t.end == t.start:
            out[name] = torch.empty(t.shape, dtype=dtype)
            continue
        source, offset = data, base + t.start
        if offset % DTYPE_BYTES[t.dtype]:
            source, offset = bytearray(data[offset:base + t.end]), 0
        flat = torch.frombuffer(source, dtype=dtype, count=math.prod(t.shape), offset=offset)
        out[name] = flat.view(t.shape)
    return out
