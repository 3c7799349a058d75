"""What each quantized format's tensors mean, written out independently of the tools: unpacking
and dequantizing in float64 (then rounded once to float32), one function per format, and the
GPTQ packer used for the desc_act checkpoint that no installed tool writes.

A quantized Linear of `out` x `in` features is stored as (q: stored integer, z: zero point,
s: scale, g: group of an input column):
  compressed-tensors pack-quantized (W4A16, W8A16, ..._ASYM):
    weight_packed int32 [out, in*b/32]: element i of a row in bits [b*(i%(32/b)), +b) of word
      i//(32/b) (lowest bits first), stored as q + 2**(b-1) (q signed)
    weight_scale [out, in/group] (channel: [out, 1]); weight_shape int64 [2] = [out, in]
    weight_zero_point (asymmetric) int32 [out*b/32, in/group]: packed the same way along dim 0
    w[o, i] = (q[o, i] - z[o, i // group]) * s[o, i // group]
    (compressed_tensors/compressors/pack_quantized/helpers.py: pack_to_int32, unpack_from_int32)
  compressed-tensors int-quantized (W8A8): weight int8 [out, in], weight_scale [out, 1]
  compressed-tensors float-quantized (FP8_DYNAMIC, FP8_BLOCK, FP8): weight float8_e4m3fn
    [out, in], weight_scale [out, 1] (channel), [1] (tensor) or [ceil(out/128), ceil(in/128)]
    (block); w[o, i] = q[o, i] * s[o // 128, i // 128]
  static activation schemes (FP8, W8A8 static) add input_scale [1] and, asymmetric,
    input_zero_point int8 [1]: the activations' quantization, not the weight's
  GPTQ (checkpoint_format "gptq", the v1 layout of AutoGPTQ / GPTQModel / AutoRound):
    qweight int32 [in*b/32, out]: input row i in bits [b*(i%(32/b)), +b) of word i//(32/b), q
      unsigned in [0, 2**b)
    qzeros int32 [groups, out*b/32]: output column j in bits [b*(j%(32/b)), +b), stored as z - 1
    scales float16 [groups, out]; g_idx int32 [in]: the group of each input row (i // group
    unless desc_act, when groups follow the activation order)
    w[o, i] = (q[i, o] - z[g_idx[i], o]) * s[g_idx[i], o]
    (auto_round_extension/torch/qlinear_torch_zp.py: QuantLinear.pack_248_bits and forward)
  AWQ GEMM: qweight int32 [in, out/8], qzeros int32 [groups, out/8] (z itself, no minus one),
    scales float16 [groups, out]; nibble p (bits [4p, 4p+4)) of word c holds output column
    8c + AWQ_ORDER[p]; w[o, i] = (q[i, o] - z[i // group, o]) * s[i // group, o]
    (auto_round/export/export_to_awq/utils.py: WQLinear_GEMM.from_linear, reverse_awq_order)
  Hugging Face fp8 (DeepSeek-V3, Qwen3-FP8): weight float8_e4m3fn [out, in], weight_scale_inv
    float32 [ceil(out/128), ceil(in/128)]; w[o, i] = q[o, i] * s[o // 128, i // 128]
    (transformers/integrations/finegrained_fp8.py: Fp8Dequantize)
"""

from __future__ import annotations

import math

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble p of an AWQ word holds column 8c + AWQ_ORDER[p]


def unpack_rows(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The unsigned `bits`-wide fields of each row of int32 `packed` [R, W], lowest bits first:
    int64 [R, count]."""
    per_word = 32 // bits
    words = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    fields = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [R, W, per_word]
    return fields.reshape(packed.shape[0], -1)[:, :count]


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """unpack_rows' inverse: unsigned fields int64 [R, C] (C a multiple of 32/bits) into int32
    [R, C*bits/32]."""
    per_word = 32 // bits
    assert values.shape[1] % per_word == 0 and 0 <= values.min() and values.max() < 1 << bits
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    words = (values.to(torch.int64).reshape(values.shape[0], -1, per_word) << shifts).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _per_column(table: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """table [G, out] indexed by the group of each input column: [in, out] float64."""
    return table.to(torch.float64)[groups.long()]


def _blocks(scale: torch.Tensor, shape: torch.Size, block: list[int]) -> torch.Tensor:
    """A block scale [ceil(out/b0), ceil(in/b1)] spread over shape [out, in]: float64."""
    rows = torch.arange(shape[0]) // block[0]
    cols = torch.arange(shape[1]) // block[1]
    return scale.to(torch.float64)[rows][:, cols]


def dequant_compressed_tensors(tensors: dict[str, torch.Tensor], prefix: str, weights: dict,
                               fmt: str) -> torch.Tensor:
    """compressed-tensors Linear `prefix` ("model.layers.0.self_attn.q_proj.") as float32
    [out, in]; `weights` is its config group's weights arguments, fmt its format."""
    scale = tensors[prefix + "weight_scale"]
    if fmt == "pack-quantized":
        bits = weights["num_bits"]
        out, inp = tensors[prefix + "weight_shape"].tolist()
        offset = 1 << (bits - 1)
        q = unpack_rows(tensors[prefix + "weight_packed"], bits, inp) - offset
        group = weights["group_size"] if weights["strategy"] == "group" else inp
        groups = torch.arange(inp) // group
        zero = torch.zeros(out, scale.shape[1], dtype=torch.int64)
        if not weights["symmetric"]:
            packed = tensors[prefix + "weight_zero_point"]
            zero = unpack_rows(packed.t().contiguous(), bits, out).t() - offset  # [out, G]
        w = (q - zero[:, groups]).to(torch.float64) * scale.to(torch.float64)[:, groups]
    elif fmt in ("int-quantized", "float-quantized"):
        q = tensors[prefix + "weight"]
        if weights["strategy"] == "block":
            s = _blocks(scale, q.shape, weights["block_structure"])
        else:
            assert weights["strategy"] in ("channel", "tensor"), weights["strategy"]
            s = scale.to(torch.float64).expand(q.shape)  # [out, 1] or [1]
        w = q.to(torch.float64) * s
    else:
        raise ValueError(f"no dequantizer for compressed-tensors format {fmt!r}")
    return w.to(torch.float32)


def gptq_groups(tensors: dict[str, torch.Tensor], prefix: str, inp: int,
                group: int) -> torch.Tensor:
    """The group of each input row: g_idx if stored, else i // group."""
    g_idx = tensors.get(prefix + "g_idx")
    return g_idx.long() if g_idx is not None else torch.arange(inp) // group


def gptq_integers(tensors: dict[str, torch.Tensor], prefix: str, bits: int,
                  v1_zeros: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ (q [in, out], z [groups, out]) as int64; v1_zeros: qzeros hold z - 1."""
    qweight, scales = tensors[prefix + "qweight"], tensors[prefix + "scales"]
    inp, out = qweight.shape[0] * 32 // bits, scales.shape[1]
    q = unpack_rows(qweight.t().contiguous(), bits, inp).t()
    z = unpack_rows(tensors[prefix + "qzeros"], bits, out)
    if v1_zeros:
        z = z + 1  # as GPTQ v1 loaders read it: field + 1 (a field of 15 reads as 16)
    return q, z


def dequant_gptq(tensors: dict[str, torch.Tensor], prefix: str, config: dict) -> torch.Tensor:
    """GPTQ Linear `prefix` as float32 [out, in] (config: its quantization_config)."""
    bits = config["bits"]
    v1 = config.get("checkpoint_format", "gptq") == "gptq"
    q, z = gptq_integers(tensors, prefix, bits, v1)
    groups = gptq_groups(tensors, prefix, q.shape[0], config["group_size"])
    scale = _per_column(tensors[prefix + "scales"], groups)
    w = (q - z[groups]).to(torch.float64) * scale  # [in, out]
    return w.t().contiguous().to(torch.float32)


def awq_integers(tensors: dict[str, torch.Tensor], prefix: str,
                 bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ (q [in, out], z [groups, out]) as int64, columns in their natural order."""
    assert bits == 4, "AWQ GEMM packs 4-bit weights only"
    out = tensors[prefix + "scales"].shape[1]
    natural = torch.arange(out).view(-1, 8)[:, list(AWQ_ORDER)].reshape(-1)
    result = []
    for name in ("qweight", "qzeros"):
        fields = unpack_rows(tensors[prefix + name], bits, out)
        ordered = torch.empty_like(fields)
        ordered[:, natural] = fields  # field 8c + p is column 8c + AWQ_ORDER[p]
        result.append(ordered)
    return result[0], result[1]


def dequant_awq(tensors: dict[str, torch.Tensor], prefix: str, config: dict) -> torch.Tensor:
    """AWQ GEMM Linear `prefix` as float32 [out, in]."""
    q, z = awq_integers(tensors, prefix, config["bits"])
    groups = torch.arange(q.shape[0]) // config["group_size"]
    w = (q - z[groups]).to(torch.float64) * _per_column(tensors[prefix + "scales"], groups)
    return w.t().contiguous().to(torch.float32)


def dequant_hf_fp8(tensors: dict[str, torch.Tensor], prefix: str, config: dict) -> torch.Tensor:
    """Hugging Face fp8 Linear `prefix` as float32 [out, in]."""
    q = tensors[prefix + "weight"]
    s = _blocks(tensors[prefix + "weight_scale_inv"], q.shape, config["weight_block_size"])
    return (q.to(torch.float64) * s).to(torch.float32)


def quantize_desc_act(w: torch.Tensor, order: torch.Tensor, group: int,
                      bits: int) -> dict[str, torch.Tensor]:
    """Symmetric round-to-nearest GPTQ with desc_act: input columns taken in `order` (by
    activation size, largest first), each run of `group` of them one group; returns the GPTQ
    tensors (qweight, qzeros, scales fp16, g_idx) of float weight w [out, in]."""
    out, inp = w.shape
    maxq = (1 << bits) - 1
    zero = (maxq + 1) // 2
    g_idx = torch.empty(inp, dtype=torch.int64)
    g_idx[order] = torch.arange(inp) // group
    groups = math.ceil(inp / group)
    scales = torch.empty(groups, out, dtype=torch.float16)
    for g in range(groups):
        amax = w[:, g_idx == g].abs().amax(dim=1).clamp(min=1e-8)
        scales[g] = (2 * amax / maxq).to(torch.float16)  # GPTQ's sym scale: (xmax - xmin) / maxq
    s = _per_column(scales, g_idx)  # [in, out]
    q = torch.clamp(torch.round(w.t().to(torch.float64) / s) + zero, 0, maxq).to(torch.int64)
    zeros = torch.full((groups, out), zero - 1, dtype=torch.int64)  # v1: z - 1 is stored
    return {"qweight": pack_rows(q.t().contiguous(), bits).t().contiguous(),
            "qzeros": pack_rows(zeros, bits), "scales": scales,
            "g_idx": g_idx.to(torch.int32)}
