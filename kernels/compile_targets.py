"""Every Triton kernel binary the engine can launch for the shipped model shapes, as data.

A variant is what Triton compiles one binary for: the kernel, each argument's type (pointers
and scalars; an int equal to 1 becomes a constexpr), which arguments Triton marks 16-divisible
(tt.divisibility), the constexprs, num_warps and num_stages. The builders mirror the launch
sites in kernels/lora_triton.py, kernels/paged_attention.py, kernels/quant_triton.py and
kernels/fused_triton.py argument
for argument, with the block configs from their own shrink_config / expand_config /
decode_config / quant_config (interpret=False: the GPU configs). kernels/aot_compile.py
compiles each for sm_80 / sm_90 without a GPU; tests/kernels/test_compile_targets.py intercepts the real launches and checks them against
these builders, so the list cannot drift from the code.

    variants = all_variants()        # every distinct binary (x 2 targets; cached after one run)

Only classes of values reach a binary: an int is 1 (a constexpr), a multiple of 16 (aligned)
or neither, so the model widths collapse onto a few variants. The arguments whose class would
change from step to step (tokens T, slots S, the LoRAMeta fields and block tables, which are
views at offsets into one packed int32 buffer, the table width W, the split counts) are
`do_not_specialize` in the kernels themselves (runtime_args): one binary serves every step,
and the list needs no "== 1" or aligned copies of them. A variant is compiled for the targets
at or above its min_capability (fp8 weights: sm_89+, so sm_90 only).
Importing this module does not import Triton (compile workers must import it themselves).
"""

from __future__ import annotations

# the enumerations below range over them (the tests read them from here too)
from loragw.kernels.model_shapes import ATTENTION_GRID, SHIPPED_MODELS
from loragw.kernels.variants import (  # noqa: F401  (the list's vocabulary, read from here too)
    DTYPES,
    ArgValue,
    Variant,
    _cdiv,
    _pow2_at_least,
    runtime_args,
    specialize,
)

RANKS = (8, 16, 32, 64, 128, 256)    # --max-lora-rank: the pool's R
KV_BLOCK_SIZE = 16                   # --block-size (default): a constexpr of the decode kernel
MAX_BATCH = 1024                     # decode batches enumerated for decode_config's split count
MAX_STEP_TOKENS = 16384              # steps enumerated for quant_config: --max-num-batched-tokens
# The quantized projections' schemes (kind, zero points, act order) the checkpoint formats give:
# GPTQ / compressed-tensors int4 and int8 (symmetric, either order), AWQ and asymmetric
# compressed-tensors int4 (either order), FP8 weights (symmetric, in order). lm_head stays
# unquantized (every format leaves it out by default).
QUANT_SCHEMES = (("int4", False, False), ("int4", True, False), ("int4", False, True),
                 ("int4", True, True), ("int8", False, False), ("int8", False, True),
                 ("fp8", False, False))
QUANT_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
def shrink_variant(dtype: str, hidden: int, rank: int, block_m: int, cfg) -> Variant:
    """lora_triton.lora_shrink's launch. x: [T, H] contiguous   lora_a: [n, S, R, H]"""
    p = f"*{dtype}"
    args = dict(x_ptr=p, a_ptr=p, y_ptr="*fp32", ranks_ptr="*i32", sorted_ids_ptr="*i32",
                tile_slots_ptr="*i32", tile_starts_ptr="*i32", tile_lens_ptr="*i32",
                T=None, H=hidden, S=None, R=rank, stride_xt=hidden, stride_xh=1,
                split_k=cfg.split_k)
    consts = dict(BLOCK_M=block_m, BLOCK_R=cfg.block_r, BLOCK_K=cfg.block_k,
                  ATOMIC=cfg.split_k > 1,
                  NUM_R_BLOCKS=_cdiv(rank, cfg.block_r), CAST_FP32=False, PRECISION="tf32",
                  USE_DOT=block_m >= 16)
    return specialize("_shrink_kernel", args, consts, cfg.num_warps)


def expand_variant(dtype: str, out_width: int, rank: int, block_m: int, cfg) -> Variant:
    """lora_triton.lora_expand's launch. out: [T, O] contiguous   lora_b: [S, O, R]"""
    p = f"*{dtype}"
    args = dict(y_ptr="*fp32", b_ptr=p, out_ptr=p, ranks_ptr="*i32", scales_ptr="*fp32",
                offsets_ptr="*i32", sorted_ids_ptr="*i32", tile_slots_ptr="*i32",
                tile_starts_ptr="*i32", tile_lens_ptr="*i32", T=None, S=None, R=rank,
                O_total=out_width, stride_ot=out_width, stride_oo=1)
    consts = dict(BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_R=cfg.block_r, PRECISION="tf32",
                  USE_DOT=block_m >= 16)
    return specialize("_expand_kernel", args, consts, cfg.num_warps)


def decode_variants(dtype: str, n_heads: int, n_kv: int, head_dim: int, block_size: int,
                    cfg) -> list[Variant]:
    """paged_attention_decode's launches: the decode kernel, and the reduce when it splits.
    q, out: [B, n_heads, D] (rows may be strided: q is a view of qkv)   caches: [N, block_size,
    n_kv, D]   tables: [B, W]. Every stride but W is a multiple of 16 for the shipped shapes."""
    p, group, block_d = f"*{dtype}", n_heads // n_kv, max(16, _pow2_at_least(head_dim))
    args = dict(q_ptr=p, k_cache_ptr=p, v_cache_ptr=p, tables_ptr="*i32", lens_ptr="*i32",
                out_ptr=p, part_acc_ptr="*fp32", part_m_ptr="*fp32", part_l_ptr="*fp32",
                scale_log2=0.5, softcap_log2=0.5, window=0,
                stride_qb=n_heads * head_dim, stride_qh=head_dim,
                stride_cb=block_size * n_kv * head_dim, stride_ct=n_kv * head_dim,
                stride_ch=head_dim, stride_tb=None, stride_ob=n_heads * head_dim,
                stride_oh=head_dim, num_splits=cfg.num_splits)
    consts = dict(GROUP=group, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
                  BLOCK_H=max(16, _pow2_at_least(group)), BLOCK_N=cfg.block_n, BLOCK_D=block_d,
                  SPLIT=cfg.num_splits > 1, CAST_FP32=False, PRECISION="tf32")
    out = [specialize("_decode_kernel", args, consts, cfg.num_warps, cfg.num_stages)]
    if cfg.num_splits > 1:
        args = dict(part_acc_ptr="*fp32", part_m_ptr="*fp32", part_l_ptr="*fp32", out_ptr=p,
                    stride_ob=n_heads * head_dim, stride_oh=head_dim, num_splits=cfg.num_splits)
        consts = dict(HEAD_DIM=head_dim,
                      BLOCK_S=max(2, _pow2_at_least(cfg.num_splits)), BLOCK_D=block_d)
        out.append(specialize("_reduce_kernel", args, consts, 4))
    return out


def quant_variant(dtype: str, scheme: tuple[str, bool, bool], in_features: int,
                  out_features: int, cfg) -> Variant:
    """quant_triton.quant_matmul's launch. x: [T, I] contiguous   qweight: [O, packed]; an
    absent zeros / g_idx / row_slice is passed the fp32 scales, an absent bias y (x.dtype)."""
    from loragw.kernels.quant_triton import GROUP_M

    (kind, asym, act_order), p, absent = scheme, f"*{dtype}", "*fp32"
    row_bytes = -(-in_features // 2) if kind == "int4" else in_features
    args = dict(x_ptr=p, qweight_ptr="*i8" if kind == "int8" else "*u8", scales_ptr="*fp32",
                zeros_ptr="*i8" if asym else absent, g_idx_ptr="*i32" if act_order else absent,
                row_slice_ptr="*i32" if act_order else absent, bias_ptr=p, y_ptr=p, T=None,
                out_features=out_features, in_features=in_features, G=None, group_size=None,
                stride_xt=in_features, stride_xi=1, stride_qo=row_bytes, has_bias=None)
    consts = dict(KIND=kind, HAS_ZEROS=asym, ACT_ORDER=act_order,
                  BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=GROUP_M,
                  CAST_FP32=False, PRECISION="tf32")
    return specialize("_quant_matmul_kernel", args, consts, cfg.num_warps)


def quant_variants(models=SHIPPED_MODELS, schemes=QUANT_SCHEMES, dtypes=DTYPES) -> list[Variant]:
    """The quantized GEMM for every quantized projection x scheme x dtype, for every block
    config quant_config picks over the step sizes 1..MAX_STEP_TOKENS."""
    from loragw.kernels.quant_triton import quant_config

    found: dict[Variant, None] = {}
    for model in models:
        for proj in (p for p in model.projections if p.name in QUANT_PROJECTIONS):
            rows, columns = sum(proj.widths), proj.hidden
            configs = dict.fromkeys(quant_config(T, rows, columns, interpret=False)
                                    for T in range(1, MAX_STEP_TOKENS + 1))
            for scheme in schemes:
                for dtype in dtypes:
                    for cfg in configs:
                        found[quant_variant(dtype, scheme, columns, rows, cfg)] = None
    return list(found)


def tile_counts(block_m: int) -> range:
    """Tile counts NT a step with this tile size can have (meta.num_tiles_bound): decode-sized
    steps (<= DECODE_MAX_TOKENS tokens) use DECODE_BLOCK_M; past SHRINK_TARGET_PROGRAMS tiles
    shrink_config no longer splits K, so larger counts add no variant."""
    from loragw.kernels.lora_triton import SHRINK_TARGET_PROGRAMS
    from loragw.kernels.meta import (
        DECODE_BLOCK_M,
        DECODE_MAX_TOKENS,
        PREFILL_BLOCK_M,
        num_tiles_bound,
    )

    if block_m == DECODE_BLOCK_M:
        return range(1, num_tiles_bound(DECODE_MAX_TOKENS, DECODE_MAX_TOKENS, block_m) + 1)
    assert block_m == PREFILL_BLOCK_M, block_m
    return range(num_tiles_bound(DECODE_MAX_TOKENS + 1, 1, block_m), SHRINK_TARGET_PROGRAMS + 1)


def lora_variants(models=SHIPPED_MODELS, ranks=RANKS, dtypes=DTYPES) -> list[Variant]:
    """Shrink and expand for every projection x rank x tile size x dtype, for every block
    config shrink_config picks over the tile counts a step can have."""
    from loragw.kernels.lora_triton import expand_config, shrink_config
    from loragw.kernels.meta import DECODE_BLOCK_M, PREFILL_BLOCK_M

    found: dict[Variant, None] = {}   # insertion-ordered set
    for model in models:
        for proj in model.projections:
            n, width, out_width = len(proj.widths), max(proj.widths), sum(proj.widths)
            for rank in ranks:
                for block_m in (DECODE_BLOCK_M, PREFILL_BLOCK_M):
                    shrinks = sorted({shrink_config(nt, n, rank, proj.hidden, block_m,
                                                    interpret=False)
                                      for nt in tile_counts(block_m)}, key=lambda c: c.split_k)
                    expand = expand_config(width, rank, block_m, interpret=False)
                    for dtype in dtypes:
                        for cfg in shrinks:
                            found[shrink_variant(dtype, proj.hidden, rank, block_m, cfg)] = None
                        found[expand_variant(dtype, out_width, rank, block_m, expand)] = None
    return list(found)


def attention_variants(models=SHIPPED_MODELS, grid=ATTENTION_GRID, dtypes=DTYPES,
                       block_size=KV_BLOCK_SIZE) -> list[Variant]:
    """Decode (and reduce) for every head shape x block config decode_config picks x dtype."""
    from loragw.kernels.paged_attention import decode_config

    found: dict[Variant, None] = {}
    for n_heads, n_kv, head_dim in (*grid, *(m.attention for m in models)):
        configs = sorted({decode_config(batch, n_kv, head_dim, interpret=False)
                          for batch in range(1, MAX_BATCH + 1)}, key=lambda c: c.num_splits)
        for dtype in dtypes:
            for cfg in configs:
                for variant in decode_variants(dtype, n_heads, n_kv, head_dim, block_size, cfg):
                    found[variant] = None
    return list(found)


def all_variants() -> list[Variant]:
    from loragw.kernels.elementwise_targets import elementwise_variants

    return lora_variants() + attention_variants() + quant_variants() + elementwise_variants()
