"""Each checkpoint format's tensors of one projection -> kernels/quant.py's QuantWeight, read
once at load. What each tool writes (all integers little-endian, packed low bits first):

    compressed-tensors pack-quantized   weight_packed int32 [O, I*b/32] (element j of a word at
        bits j*b, stored unsigned: q + 2^(b-1)), weight_scale [O, G], weight_zero_point packed
        the same way along O: int32 [O*b/32, G] (asymmetric), weight_shape [2], weight_g_idx [I]
    compressed-tensors float-quantized  weight float8_e4m3fn [O, I], weight_scale [1] | [O, 1] |
        [ceil(O/bo), ceil(I/bi)] (block)
    compressed-tensors int-quantized    weight int8 [O, I], weight_scale, weight_zero_point
    gptq    qweight int32 [I*b/32, O] packed along I, qzeros int32 [G, O*b/32] packed along O
            (v1 "gptq" format: each zero stored minus one), scales fp16 [G, O], g_idx int32 [I]
    awq     qweight int32 [I, O/8], qzeros int32 [G, O/8] packed along O in the order
            0 2 4 6 1 3 5 7, scales fp16 [G, O]
    fp8     weight float8_e4m3fn [O, I], weight_scale_inv [ceil(O/bo), ceil(I/bi)] (multiplied,
            despite the name) or a per-tensor scale

Scales become float32 [O, G] (a block's scale repeated on each of its rows, FP8 per-tensor on
every row); unsigned integers are re-centred on zero with their zero points, so (q - z) is the
tool's own (u - z_u) and W is the same number. A scheme that quantizes input activations gets
an ActQuant (kernels/act_quant.py): dynamic ones need no tensor; static ones read
`<module>.input_scale` [1] (and `input_zero_point` [1], int8 or e4m3, where nonzero).
"""

from __future__ import annotations

import torch
from torch import Tensor

from loragw.engine.quant.scheme import QuantConfig, WeightScheme
from loragw.kernels.act_quant import ActQuant
from loragw.kernels.quant import QuantWeight, pack_int4

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i]
# Per-method tensors of a quantized module (suffixes after "<module>."); `weight` is one only
# for a module its scheme quantizes.
PARTS = {"compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point",
                                "weight_shape", "weight_g_idx", "weight", "input_scale",
                                "input_zero_point", "weight_global_scale"),
         "gptq": ("qweight", "qzeros", "scales", "g_idx"),
         "awq": ("qweight", "qzeros", "scales"),
         "fp8": ("weight", "weight_scale_inv", "weight_scale", "input_scale")}


def unpack_words(words: Tensor, bits: int, name: str) -> Tensor:
    """int32 [..., n] -> uint8 values [..., n * 32/bits], element j of a word at bits j*bits.
    `name`: the checkpoint tensor the words are, for the error when they are not int32."""
    assert bits in (4, 8), bits  # the scheme's, checked when the Config was read
    if words.dtype != torch.int32:
        raise ValueError(f"checkpoint tensor {name} is {words.dtype}, expected torch.int32 "
                         f"(packed {bits}-bit values); the checkpoint is corrupt or was not "
                         "written by a quantization tool")
    as_bytes = words.contiguous().view(torch.uint8)  # little-endian: byte 0 holds bits 0-7
    if bits == 8:
        return as_bytes
    return torch.stack((as_bytes & 0xF, as_bytes >> 4), dim=-1).flatten(-2)


def convert(config: QuantConfig, scheme: WeightScheme, module: str,
            parts: dict[str, Tensor]) -> QuantWeight:
    """The QuantWeight of checkpoint module `module` from its tensors (`parts`: suffix ->
    tensor), checked: a tensor missing, of the wrong shape or not finite is named."""
    method = config.method
    need = {"compressed-tensors": ("weight_scale",), "gptq": ("qweight", "scales"),
            "awq": ("qweight", "scales", "qzeros"), "fp8": ("weight",)}[method]
    for suffix in need:
        if suffix not in parts:
            raise ValueError(f"checkpoint has no {module}.{suffix}, which {method} "
                             f"({scheme.describe()}) needs")
    convert_one = {"compressed-tensors": _compressed_tensors, "gptq": _gptq, "awq": _awq,
                   "fp8": _fp8}[method]
    try:
        w = convert_one(config, scheme, module, parts)
        w.act = _activations(scheme, module, parts)
        w.check()
    except (RuntimeError, IndexError, ValueError) as exc:  # tensors that contradict each other
        raise ValueError(f"checkpoint module {module!r} ({method}, {scheme.describe()}): "
                         f"{exc}") from exc
    if not bool(torch.isfinite(w.scales).all()):
        raise ValueError(f"checkpoint tensor {module}'s scale holds NaN or infinite values: "
                         "the checkpoint is corrupt; download or export it again")
    return w


def _activations(scheme: WeightScheme, module: str,
                 parts: dict[str, Tensor]) -> ActQuant | None:
    """The ActQuant of the scheme's input activations (static: the module's input_scale)."""
    a = scheme.activations
    if a is None:
        return None
    if a.dynamic:
        return ActQuant(a.kind, True, a.symmetric, a.group_size)
    scale, zero = parts.get("input_scale"), parts.get("input_zero_point")
    if scale is None:
        raise ValueError(f"checkpoint has no {module}.input_scale, which static {a.kind} "
                         "activations need")
    if scale.numel() != 1 or zero is not None and zero.numel() != 1:
        raise ValueError(f"checkpoint tensor {module}.input_scale (or input_zero_point) has "
                         f"shape {tuple(scale.shape)}, expected one per tensor")
    if zero is None and not a.symmetric:
        raise ValueError(f"checkpoint has no {module}.input_zero_point, which asymmetric static "
                         "activations need")
    zeros = None if zero is None or not bool(zero.float().any()) else zero.float().reshape(1)
    return ActQuant(a.kind, False, a.symmetric, scales=scale.float().reshape(1), zeros=zeros)


def _scales(scale: Tensor, rows: int, groups: int, block_rows: int | None, name: str) -> Tensor:
    """A checkpoint scale as float32 [rows, groups]: per tensor ([] / [1] / [1, 1]), per row
    ([rows] / [rows, 1] / [rows, groups]) or per block of `block_rows` rows."""
    s = scale.float()
    if s.numel() == 1:
        return s.reshape(1, 1).expand(rows, groups).contiguous()
    if s.dim() == 1:
        s = s.unsqueeze(1)
    if block_rows is not None:
        s = s.repeat_interleave(block_rows, dim=0)[:rows]
    if tuple(s.shape) != (rows, groups):
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(scale.shape)}, expected "
                         f"{rows} x {groups} scales")
    return s.contiguous()


def _layout(scheme: WeightScheme, kind_values: Tensor, scales: Tensor, zeros: Tensor | None,
            in_features: int, g_idx: Tensor | None) -> QuantWeight:
    """QuantWeight from signed values q [O, I] (int4/int8) or e4m3 [O, I] (fp8)."""
    rows = kind_values.shape[0]
    if scheme.kind == "int4":
        qweight = pack_int4(kind_values)
    elif scheme.kind == "int8":
        qweight = kind_values.to(torch.int8)
    else:
        qweight = kind_values.view(torch.uint8)
    if zeros is not None and not bool(zeros.any()):
        zeros = None  # symmetric after all (GPTQ sym, a zero tensor of zero points)
    row_slice = None
    if g_idx is not None:
        g_idx = g_idx.to(torch.int32).reshape(1, in_features)
        row_slice = torch.zeros(rows, dtype=torch.int32)
    w = QuantWeight(scheme.kind, qweight.contiguous(), scales, zeros,
                    scheme.columns_per_scale(in_features), in_features, g_idx, row_slice)
    return w


def _g_idx(parts: dict[str, Tensor], suffix: str, scheme: WeightScheme, in_features: int,
           module: str) -> Tensor | None:
    """The act-order map if it is one (a trivial k // group map is dropped)."""
    g = parts.get(suffix)
    if g is None:
        if scheme.act_order:
            raise ValueError(f"checkpoint has no {module}.{suffix}, which act order needs")
        return None
    if g.shape != (in_features,):
        raise ValueError(f"checkpoint tensor {module}.{suffix} has shape {tuple(g.shape)}, "
                         f"expected ({in_features},)")
    size = scheme.columns_per_scale(in_features)
    if bool((g.long() == torch.arange(in_features) // size).all()):
        return None
    return g


def _compressed_tensors(config: QuantConfig, scheme: WeightScheme, module: str,
                        parts: dict[str, Tensor]) -> QuantWeight:
    bits = 4 if scheme.kind == "int4" else 8
    if "weight_packed" in parts:
        rows, columns = (int(n) for n in parts["weight_shape"].tolist())
        packed = unpack_words(parts["weight_packed"], bits, f"{module}.weight_packed")
        q = (packed[:, :columns].to(torch.int16) - (1 << bits - 1)).to(torch.int8)
        if q.shape != (rows, columns):
            raise ValueError(f"checkpoint tensor {module}.weight_packed does not hold "
                             f"weight_shape {rows} x {columns}")
    elif "weight" in parts:
        q = parts["weight"]
        rows, columns = q.shape
        if scheme.kind == "fp8" and q.dtype != torch.float8_e4m3fn or (
                scheme.kind == "int8" and q.dtype != torch.int8):
            raise ValueError(f"checkpoint tensor {module}.weight is {q.dtype}, expected "
                             f"{scheme.kind} ({config.format})")
    else:
        raise ValueError(f"checkpoint has no {module}.weight_packed or {module}.weight")
    size = scheme.columns_per_scale(columns)
    groups = -(-columns // size)
    g_idx = _g_idx(parts, "weight_g_idx", scheme, columns, module)
    if g_idx is not None:
        groups = parts["weight_scale"].shape[-1]
    scales = _scales(parts["weight_scale"], rows, groups, scheme.block_rows,
                     f"{module}.weight_scale")
    zeros = parts.get("weight_zero_point")
    if zeros is not None:
        if zeros.dtype == torch.int32:  # packed along the rows
            zeros = unpack_words(zeros.T, bits, f"{module}.weight_zero_point")[:, :rows].T
            zeros = (zeros.to(torch.int16) - (1 << bits - 1)).to(torch.int8)
        zeros = zeros.to(torch.int8).reshape(-1, 1 if zeros.numel() == rows else groups)
        if scheme.block_rows is not None:
            zeros = zeros.repeat_interleave(scheme.block_rows, dim=0)[:rows]
        zeros = zeros.expand(rows, groups).contiguous()
    return _layout(scheme, q, scales, zeros, columns, g_idx)


def _unsigned_to_signed(u: Tensor, bits: int) -> Tensor:
    return (u.to(torch.int16) - (1 << bits - 1)).to(torch.int8)


def _gptq(config: QuantConfig, scheme: WeightScheme, module: str,
          parts: dict[str, Tensor]) -> QuantWeight:
    bits = 4 if scheme.kind == "int4" else 8
    q = unpack_words(parts["qweight"].T, bits, f"{module}.qweight")  # [O, I] unsigned
    rows, columns = q.shape
    groups = parts["scales"].shape[0]
    scales = _scales(parts["scales"].T, rows, groups, None, f"{module}.scales")
    zeros = None
    if "qzeros" in parts:
        z = unpack_words(parts["qzeros"], bits, f"{module}.qzeros")[:, :rows].T  # [O, G]
        if config.zero_minus_one:
            z = (z.to(torch.int16) + 1) & ((1 << bits) - 1)
        zeros = _unsigned_to_signed(z, bits)
    g_idx = _g_idx(parts, "g_idx", scheme, columns, module)
    if g_idx is None and groups != -(-columns // scheme.columns_per_scale(columns)):
        raise ValueError(f"checkpoint tensor {module}.scales has {groups} groups, expected "
                         f"{-(-columns // scheme.columns_per_scale(columns))}")
    return _layout(scheme, _unsigned_to_signed(q, bits), scales, zeros, columns, g_idx)


def _awq_columns(words: Tensor, name: str) -> Tensor:
    """AWQ's int32 [R, C/8] -> unsigned [R, C] in column order."""
    nibbles = unpack_words(words, 4, name).unflatten(-1, (-1, 8))  # [R, C/8, 8], nibble i
    ordered = torch.empty_like(nibbles)
    ordered[..., list(AWQ_ORDER)] = nibbles
    return ordered.flatten(-2)


def _awq(config: QuantConfig, scheme: WeightScheme, module: str,
         parts: dict[str, Tensor]) -> QuantWeight:
    q = _awq_columns(parts["qweight"], f"{module}.qweight").T  # [O, I] unsigned
    rows, columns = q.shape
    groups = parts["scales"].shape[0]
    scales = _scales(parts["scales"].T, rows, groups, None, f"{module}.scales")
    zeros = _unsigned_to_signed(_awq_columns(parts["qzeros"], f"{module}.qzeros")[:, :rows].T, 4)
    if groups != -(-columns // scheme.columns_per_scale(columns)):
        raise ValueError(f"checkpoint tensor {module}.scales has {groups} groups, expected "
                         f"{-(-columns // scheme.columns_per_scale(columns))}")
    return _layout(scheme, _unsigned_to_signed(q, 4), scales, zeros, columns, None)


def _fp8(config: QuantConfig, scheme: WeightScheme, module: str,
         parts: dict[str, Tensor]) -> QuantWeight:
    q = parts["weight"]
    if q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"checkpoint tensor {module}.weight is {q.dtype}, expected "
                         "float8_e4m3fn (fp8)")
    rows, columns = q.shape
    scale = parts.get("weight_scale_inv", parts.get("weight_scale"))
    if scale is None:
        raise ValueError(f"checkpoint has no {module}.weight_scale_inv, which fp8 needs")
    groups = -(-columns // scheme.columns_per_scale(columns))
    scales = _scales(scale, rows, groups, scheme.block_rows, f"{module}.weight_scale_inv")
    return _layout(scheme, q, scales, None, columns, None)
