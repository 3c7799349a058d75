"""What one Triton binary is (`Variant`) and how a launch's arguments make one (`specialize`,
by Triton's rules): the vocabulary of kernels/compile_targets.py's list and its builders.
Importing this module does not import Triton."""

from __future__ import annotations

from dataclasses import dataclass

from loragw.kernels.quant import FP8_MIN_CAPABILITY

DTYPES = ("fp16", "bf16")
ArgValue = str | int | float | None  # "*bf16" pointer | int (None: neither 1 nor aligned) | float
# The kernel modules own which arguments are never specialized (their do_not_specialize).
_RUNTIME_LISTS = {"_shrink_kernel": ("loragw.kernels.lora_triton", "SHRINK_RUNTIME_ARGS"),
                  "_expand_kernel": ("loragw.kernels.lora_triton", "EXPAND_RUNTIME_ARGS"),
                  "_decode_kernel": ("loragw.kernels.paged_attention", "DECODE_RUNTIME_ARGS"),
                  "_reduce_kernel": ("loragw.kernels.paged_attention", "REDUCE_RUNTIME_ARGS"),
                  "_quant_matmul_kernel": ("loragw.kernels.quant_triton", "QUANT_RUNTIME_ARGS"),
                  "_add_rms_norm_kernel": ("loragw.kernels.fused_triton", "RUNTIME_ARGS"),
                  "_rotary_kernel": ("loragw.kernels.fused_triton", "RUNTIME_ARGS"),
                  "_silu_and_mul_kernel": ("loragw.kernels.fused_triton", "RUNTIME_ARGS")}


def runtime_args(kernel: str) -> frozenset[str]:
    """The arguments of `kernel` Triton never specializes (imports the kernel's module)."""
    import importlib

    module, name = _RUNTIME_LISTS[kernel]
    return frozenset(getattr(importlib.import_module(module), name))


_LABEL_SKIP = {"CAST_FP32", "PRECISION", "USE_DOT", "BLOCK_SIZE", "stride_xh", "stride_oo",
               "stride_xi", "GROUP_M"}


@dataclass(frozen=True)
class Variant:
    kernel: str                                 # a kernel function (aot_compile.KERNEL_MODULES)
    signature: tuple[tuple[str, str], ...]      # (arg, "*bf16" | "i32" | "fp32" | "constexpr")
    constexprs: tuple[tuple[str, object], ...]  # (arg, value), ints specialized to 1 included
    aligned: tuple[str, ...]                    # args Triton marks tt.divisibility=16
    num_warps: int
    num_stages: int | None                      # None: the launch passes none (backend default)

    @property
    def label(self) -> str:
        """Kernel, dtype, the constexprs that vary, and fixed ints that are not 16-aligned."""
        parts = [self.kernel.strip("_").removesuffix("_kernel"), self.dtype]
        parts += [f"{k}={v}" for k, v in self.constexprs if k not in _LABEL_SKIP]
        runtime = runtime_args(self.kernel)
        parts += [f"{name}%16!=0" for name, ty in self.signature if ty == "i32"
                  and name not in self.aligned and name not in runtime]
        return " ".join(parts)

    @property
    def min_capability(self) -> int:
        """The oldest GPU (10 * major + minor) the binary is for: fp8 weights need e4m3."""
        return FP8_MIN_CAPABILITY if dict(self.constexprs).get("KIND") == "fp8" else 0

    @property
    def family(self) -> str:
        """Kernel and tile kind: what a summary row groups."""
        consts = dict(self.constexprs)
        kind = {16: " decode tiles", 64: " prefill tiles"}.get(consts.get("BLOCK_M"), "")
        return f"{self.kernel.strip('_').removesuffix('_kernel')}{kind} {self.dtype}"

    @property
    def dtype(self) -> str:
        """The activation dtype: the element type of x (shrink) or out (the others)."""
        args = dict(self.signature)
        return args.get("out_ptr", args.get("x_ptr", args.get("q_ptr", ""))).removeprefix("*")


def specialize(kernel: str, args: dict[str, ArgValue], constexprs: dict[str, object],
               num_warps: int, num_stages: int | None = None) -> Variant:
    """A launch's variant, by Triton's rules: pointers (torch allocations, 16-byte aligned) and
    ints divisible by 16 are marked aligned, an int equal to 1 is a constexpr, floats are fp32;
    the kernel's runtime_args are none of these (their values do not matter here)."""
    runtime = runtime_args(kernel)
    signature, aligned, consts = [], [], dict(constexprs)
    for name, value in args.items():
        if isinstance(value, str):
            signature.append((name, value))
            if name not in runtime:
                aligned.append(name)
        elif isinstance(value, float):
            signature.append((name, "fp32"))
        elif name in runtime:
            signature.append((name, "i32"))
        elif value == 1:
            signature.append((name, "constexpr"))
            consts[name] = 1
        else:
            signature.append((name, "i32"))
            if value is not None and value % 16 == 0:
                aligned.append(name)
    signature += [(name, "constexpr") for name in constexprs]
    return Variant(kernel, tuple(signature), tuple(consts.items()), tuple(aligned), num_warps,
                   num_stages)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
