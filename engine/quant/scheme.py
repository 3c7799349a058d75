"""Which quantization a checkpoint carries, read once from config.json's `quantization_config`
when the Config is built, so that anything the engine cannot serve fails there, before any
process starts or any weight is read, naming the method or scheme and what is supported.

    quant = read_quantization(section, "auto")  # config.json's quantization_config -> QuantConfig | None
    quant.scheme("model.layers.0.self_attn.q_proj")    # WeightScheme | None (not quantized)

Methods (vLLM's `--quantization` names): `compressed-tensors` (llm-compressor's formats),
`gptq`, `awq`, and Hugging Face's `fp8`. Every one is converted at load to the same in-memory
layout (kernels/quant.py) by engine/quant/formats.py; a WeightScheme is what that layout needs
to know of one projection: kind, group size, zero points, act order, and the ActScheme its
input activations are quantized with (W8A8, FP8_DYNAMIC, FP8_BLOCK, FP8: kernels/act_quant.py
runs it as compressed-tensors' forward does), None for weight-only schemes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

METHODS = ("compressed-tensors", "gptq", "awq", "fp8")
CHOICES = ("auto", *METHODS, "none")
CT_FORMATS = ("pack-quantized", "float-quantized", "int-quantized", "naive-quantized")
SUPPORTED = ("compressed-tensors (pack-quantized int4/int8, float-quantized FP8 tensor/channel/"
             "block, int-quantized W8A8; input activations int8/fp8, dynamic per token or group "
             "or static per tensor), gptq (4/8-bit, desc_act), awq (4-bit GEMM), "
             "fp8 (weight_block_size, activation_scheme dynamic)")


class QuantizationError(ValueError):
    """A quantization the engine does not serve, said when the Config is read."""

    def __init__(self, problem: str):
        super().__init__(f"{problem}; supported: {SUPPORTED}")


@dataclass(frozen=True, slots=True)
class ActScheme:
    """How a projection's input activations are quantized before its GEMM."""

    kind: str  # "int8" | "fp8"
    dynamic: bool  # scales from each token's values; else the checkpoint's input_scale
    group_size: int | None = None  # dynamic: columns per scale along a token (None: the row)
    symmetric: bool = True

    def describe(self) -> str:
        where = ("per tensor" if not self.dynamic else "per token" if self.group_size is None
                 else f"per token group {self.group_size}")
        return (f"{self.kind} {'dynamic' if self.dynamic else 'static'} {where}"
                f"{'' if self.symmetric else ' asym'}")


@dataclass(frozen=True, slots=True)
class WeightScheme:
    """One projection's quantized weight: what kernels/quant.py's layout needs of it."""

    kind: str  # "int4" | "int8" | "fp8"
    strategy: str  # "tensor" | "channel" | "group" | "block": how the checkpoint holds scales
    group_size: int | None = None  # input columns per scale (group; block: its width)
    block_rows: int | None = None  # block: output rows per scale
    symmetric: bool = True
    act_order: bool = False  # a g_idx tensor maps each input column to its group
    activations: ActScheme | None = None  # None: weight-only (activations stay as they come)

    def columns_per_scale(self, in_features: int) -> int:
        """Input columns sharing one scale along a row (the layout's group_size)."""
        return self.group_size if self.strategy in ("group", "block") else in_features

    def describe(self) -> str:
        group = {"group": f" group {self.group_size}",
                 "block": f" block [{self.block_rows}, {self.group_size}]"}.get(
                     self.strategy, f" per {self.strategy}")
        return (f"{self.kind}{group}{'' if self.symmetric else ' asym'}"
                f"{' act-order' if self.act_order else ''}"
                f"{'' if self.activations is None else ', activations '}"
                f"{'' if self.activations is None else self.activations.describe()}")


@dataclass(frozen=True, slots=True)
class QuantConfig:
    method: str
    format: str  # compressed-tensors' format; the method's name for the others
    # (targets, scheme) in the checkpoint's order: a module takes the first group it matches
    groups: tuple[tuple[tuple[str, ...], WeightScheme], ...]
    ignore: tuple[str, ...] = ()
    zero_minus_one: bool = False  # GPTQ v1 checkpoints store each zero point minus one

    def scheme(self, module: str) -> WeightScheme | None:
        """The scheme of checkpoint Linear `module` (`model.layers.0.mlp.down_proj`), None when
        it is left in floating point (ignored, or matched by no group)."""
        if any(_matches(pattern, module) for pattern in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(_matches(t, module) for t in targets):
                return scheme
        return None

    def describe(self) -> str:
        schemes = sorted({s.describe() for _, s in self.groups})
        return f"{self.method} ({self.format}: {'; '.join(schemes)})"

    def check_shapes(self, shapes: dict[str, tuple[int, int]]) -> None:
        """Every projection's input splits into whole groups (shapes: projection -> (out, in),
        the base's, by checkpoint module suffix)."""
        for name, (_, columns) in shapes.items():
            for _, scheme in self.groups:
                act = scheme.activations
                for what, size in (("", scheme.group_size if scheme.strategy == "group" else None),
                                   ("activation ", act.group_size if act else None)):
                    if size is not None and size < columns and columns % size:
                        raise QuantizationError(
                            f"{self.method} {what}group_size {size} does not divide {name}'s "
                            f"{columns} input features")


def _matches(pattern: str, module: str) -> bool:
    """compressed-tensors' target rules: "Linear" (every projection here), "re:REGEX", or a
    module name (or its last part)."""
    if pattern == "Linear":
        return True
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return module == pattern or module.endswith("." + pattern)


def read_quantization(raw: dict | None, requested: str) -> QuantConfig | None:
    """The checkpoint's quantization from config.json's quantization_config (None: a
    floating-point checkpoint), checked against `--quantization` (auto takes what the
    checkpoint says)."""
    if requested not in CHOICES:
        raise QuantizationError(f"--quantization {requested!r} is not one of {', '.join(CHOICES)}")
    method = None if raw is None else str(raw.get("quant_method", "")).lower().replace("_", "-")
    if method is None:
        if requested not in ("auto", "none"):
            raise ValueError(f"--quantization {requested} needs a quantized checkpoint, and this "
                             "one's config.json has no quantization_config")
        return None
    if method not in METHODS:
        raise QuantizationError(f"quantization_config.quant_method {raw.get('quant_method')!r} "
                                "is not served")
    if requested == "none":
        raise ValueError(f"the checkpoint is quantized ({method}) and its weights exist only "
                         f"quantized; serve it with --quantization auto or {method}")
    if requested not in ("auto", method):
        raise ValueError(f"--quantization {requested} does not match the checkpoint, which is "
                         f"quantized with {method}")
    return READERS[method](raw)


def _compressed_tensors(raw: dict) -> QuantConfig:
    fmt = raw.get("format")
    if raw.get("sparsity_config"):
        kind = raw["sparsity_config"].get("format", "sparse")
        if kind != "dense":
            raise QuantizationError(f"compressed-tensors sparsity ({kind}, e.g. 2:4) is not served")
    if fmt not in CT_FORMATS:
        raise QuantizationError(f"compressed-tensors format {fmt!r} is not served")
    groups = []
    for name, group in (raw.get("config_groups") or {}).items():
        groups.append((tuple(group.get("targets") or ("Linear",)), _ct_scheme(name, group, fmt)))
    if not groups:
        raise QuantizationError("compressed-tensors quantization_config has no config_groups")
    return QuantConfig("compressed-tensors", fmt, tuple(groups), tuple(raw.get("ignore") or ()))


def _ct_scheme(name: str, group: dict, fmt: str) -> WeightScheme:
    w: dict[str, Any] = group.get("weights") or {}
    where = f"compressed-tensors config_groups.{name}"
    if not w:
        raise QuantizationError(f"{where} quantizes no weights (activation-only schemes)")
    kind_type, bits = w.get("type", "int"), w.get("num_bits")
    if kind_type == "float" and bits == 8:
        kind = "fp8"
    elif kind_type == "int" and bits in (4, 8):
        kind = f"int{bits}"
    else:
        raise QuantizationError(f"{where}: {bits}-bit {kind_type} weights (e.g. NVFP4/MXFP4) "
                                "are not served")
    strategy = w.get("strategy") or "tensor"
    if strategy not in ("tensor", "channel", "group", "block"):
        raise QuantizationError(f"{where}: weight strategy {strategy!r} is not served")
    if fmt == "pack-quantized" and kind == "fp8" or fmt == "float-quantized" and kind != "fp8":
        raise QuantizationError(f"{where}: {kind} weights in format {fmt} are not served")
    group_size = block_rows = None
    if strategy == "group":
        group_size = w.get("group_size")
        if not isinstance(group_size, int) or group_size < 1:
            raise QuantizationError(f"{where}: group strategy needs a positive group_size, got "
                                    f"{group_size!r}")
    if strategy == "block":
        block = w.get("block_structure")
        if not (isinstance(block, list) and len(block) == 2 and all(
                isinstance(b, int) and b > 0 for b in block)):
            raise QuantizationError(f"{where}: block strategy needs block_structure [rows, "
                                    f"columns], got {block!r}")
        block_rows, group_size = block
    act_order = w.get("actorder") == "group"
    if group.get("output_activations"):
        raise QuantizationError(f"{where}: output activation quantization is not served")
    activations = _ct_activations(where, group.get("input_activations"))
    return WeightScheme(kind, strategy, group_size, block_rows, bool(w.get("symmetric", True)),
                        act_order, activations)


def _ct_activations(where: str, a: dict | None) -> ActScheme | None:
    """compressed-tensors' input_activations as an ActScheme; what kernels/act_quant.py does
    not compute as compressed-tensors does is refused, not served weight-only."""
    if not a:
        return None
    kind_type, bits = a.get("type", "int"), a.get("num_bits", 8)
    if bits != 8 or kind_type not in ("int", "float"):
        raise QuantizationError(f"{where}: {bits}-bit {kind_type} input activations (e.g. W4A4, "
                                "NVFP4) are not served")
    kind = "fp8" if kind_type == "float" else "int8"
    dynamic, strategy = a.get("dynamic", False), a.get("strategy") or (
        "group" if a.get("group_size") else "tensor")
    if a.get("scale_dtype") is not None or a.get("zp_dtype") not in (None, "torch.int8",
                                                                      "torch.float8_e4m3fn"):
        raise QuantizationError(f"{where}: input activation scales stored as "
                                f"{a.get('scale_dtype') or a.get('zp_dtype')} (e.g. MXFP8) are "
                                "not served")
    symmetric = bool(a.get("symmetric", True))
    if dynamic is True and strategy == "token":
        return ActScheme(kind, True, None, symmetric)
    if dynamic is True and strategy == "group":
        size = a.get("group_size")
        if not isinstance(size, int) or size < 1:
            raise QuantizationError(f"{where}: group input activations need a positive "
                                    f"group_size, got {size!r}")
        return ActScheme(kind, True, size, symmetric)
    if dynamic is False and strategy == "tensor":
        return ActScheme(kind, False, None, symmetric)
    # dynamic per tensor: its scale would depend on which requests share a batch
    raise QuantizationError(f"{where}: {'dynamic' if dynamic else 'static'} per-{strategy} "
                            "input activations are not served (dynamic per token or group, "
                            "static per tensor are)")


def _gptq(raw: dict) -> QuantConfig:
    bits, group = raw.get("bits"), raw.get("group_size", -1)
    if bits not in (4, 8):
        raise QuantizationError(f"gptq bits {bits!r} is not served (4 or 8)")
    fmt = raw.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise QuantizationError(f"gptq checkpoint_format {fmt!r} is not served (gptq, gptq_v2)")
    if not isinstance(group, int) or group == 0 or group < -1:
        raise QuantizationError(f"gptq group_size {group!r} is not served (-1 or positive)")
    scheme = WeightScheme(f"int{bits}", "channel" if group == -1 else "group",
                          None if group == -1 else group, None, bool(raw.get("sym", True)),
                          bool(raw.get("desc_act", False)))
    return QuantConfig("gptq", fmt, ((("Linear",), scheme),), _modules(raw),
                       zero_minus_one=fmt == "gptq")


def _awq(raw: dict) -> QuantConfig:
    bits, group = raw.get("bits", raw.get("w_bit")), raw.get("group_size", raw.get("q_group_size"))
    version = str(raw.get("version", "gemm")).lower()
    if bits != 4:
        raise QuantizationError(f"awq bits {bits!r} is not served (4)")
    if version != "gemm":
        raise QuantizationError(f"awq version {version!r} is not served (gemm)")
    if not isinstance(group, int) or group == 0 or group < -1:
        raise QuantizationError(f"awq group_size {group!r} is not served")
    scheme = WeightScheme("int4", "channel" if group == -1 else "group",
                          None if group == -1 else group, None, not raw.get("zero_point", True))
    return QuantConfig("awq", "gemm", ((("Linear",), scheme),), _modules(raw))


def _fp8(raw: dict) -> QuantConfig:
    block = raw.get("weight_block_size")
    if block is None:
        scheme = WeightScheme("fp8", "tensor")
    elif isinstance(block, list) and len(block) == 2 and all(
            isinstance(b, int) and b > 0 for b in block):
        scheme = WeightScheme("fp8", "block", block[1], block[0])
    else:
        raise QuantizationError(f"fp8 weight_block_size {block!r} is not served ([rows, cols])")
    activations = raw.get("activation_scheme", "dynamic")
    if activations != "dynamic":
        # transformers runs static FP8 activations only in its GPU kernel (CPU: dequantized,
        # scales dropped), so there is no forward here to be exact against
        raise QuantizationError(f"fp8 activation_scheme {activations!r} is not served "
                                "(dynamic is); a compressed-tensors FP8 checkpoint serves "
                                "static input scales")
    # transformers' fp8 kernel quantizes x per token and weight block column (the whole row
    # for per-tensor weights) with s = max|x| / 448: compressed-tensors' dynamic group rule
    scheme = WeightScheme(scheme.kind, scheme.strategy, scheme.group_size, scheme.block_rows,
                          activations=ActScheme("fp8", True, scheme.group_size))
    return QuantConfig("fp8", "fp8", ((("Linear",), scheme),), _modules(raw))


def _modules(raw: dict) -> tuple[str, ...]:
    """Modules a gptq / awq / fp8 checkpoint leaves unquantized (besides lm_head, never
    quantized by these tools)."""
    return ("lm_head", *(raw.get("modules_to_not_convert") or ()))


READERS = {"compressed-tensors": _compressed_tensors, "gptq": _gptq, "awq": _awq, "fp8": _fp8}
