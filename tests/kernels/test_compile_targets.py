"""Every Triton kernel binary the engine can launch, compiled for sm_80 and sm_90 without a GPU.

kernels/compile_targets.py lists the variants; kernels/aot_compile.py compiles them in spawned
workers with TRITON_INTERPRET unset (conftest sets it for the other kernel tests) and reads
registers, spills and shared memory from each cubin. Results are cached by source hash in a
per-user temporary directory (never the repository): a cold run compiles everything (minutes
on 2 cores), a warm one only what a kernel or Triton change touched.

The list is checked against the launch sites: each test below runs the real entry points
(kernels.ops, paged_attention_decode, quant_matmul) on the shipped shapes with the kernel launch
intercepted, asks Triton's own specializer what binary that launch would get, and looks it up in
the list.
"""

import importlib
import inspect
from dataclasses import fields

import pytest
import torch

from loragw.kernels import apply_lora, embedding_lora, make_lora_meta
from loragw.kernels import compile_targets as ct
from loragw.kernels.aot_compile import (
    TARGETS,
    Resources,
    compile_all,
    default_cache_dir,
    problems,
    targets_for,
)
from loragw.kernels.elementwise_targets import elementwise_variants
from loragw.kernels.quant import FP8_MIN_CAPABILITY, QuantWeight

lt = importlib.import_module("loragw.kernels.lora_triton")
pa = importlib.import_module("loragw.kernels.paged_attention")
qt = importlib.import_module("loragw.kernels.quant_triton")
ft = importlib.import_module("loragw.kernels.fused_triton")
TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _broken() -> list[ct.Variant]:
    """Variants the check must reject: a constexpr Triton cannot compile (tl.arange of 48),
    and tiles whose pipeline buffers exceed every target's shared memory."""
    bad_arange = ct.shrink_variant("bf16", 4096, 64, 16, lt.ShrinkConfig(16, 48, 1))
    huge = pa.DecodeConfig(block_n=128, num_splits=1, num_warps=8, num_stages=12)  # ~340 KB
    return [bad_arange, ct.decode_variants("bf16", 32, 8, 128, 16, huge)[0]]


@pytest.fixture(scope="module")
def variants() -> list[ct.Variant]:
    return ct.all_variants()


@pytest.fixture(scope="module")
def compiled(variants):
    """Everything the tests read, compiled in one pool (cached across runs)."""
    return compile_all(variants + _broken(), TARGETS, default_cache_dir())


def test_every_variant_compiles_without_spills_within_shared_memory(variants, compiled):
    found = problems({key: res for key, res in compiled.items() if key[0] in set(variants)})
    assert found == [], (f"{len(found)} problems in {len(variants)} variants x {len(TARGETS)} "
                         "targets (fix the kernel's *_config, then rerun):\n" + "\n".join(found))


def test_fp8_variants_are_compiled_for_sm90_only(variants, compiled):
    fp8 = [v for v in variants if dict(v.constexprs).get("KIND") == "fp8"]
    assert fp8 and all(v.min_capability == FP8_MIN_CAPABILITY for v in fp8)
    assert {target for (v, target) in compiled if v in set(fp8)} == {"sm_90"}
    assert all(targets_for(v) == TARGETS for v in variants if v not in set(fp8))


def test_the_check_rejects_broken_variants(compiled):
    bad_arange, huge = _broken()
    for target in TARGETS:
        assert compiled[bad_arange, target.name].error
        assert compiled[huge, target.name].shared > target.max_shared
        assert any("does not compile" in line for line in problems({
            (bad_arange, target.name): compiled[bad_arange, target.name]}))
        assert any("shared memory" in line for line in problems({
            (huge, target.name): compiled[huge, target.name]}))
    spilled = Resources(registers=255, stack=0, local=48, shared_static=0, shared_dynamic=0,
                        num_warps=4, num_stages=3)
    assert problems({(huge, "sm_90"): spilled}) == [
        f"sm_90 {huge.label}: spills (STACK 0 B, LOCAL 48 B per thread, 255 registers, 4 warps)"]


# --- the list against the launch sites ---------------------------------------------------


def _launched(kernel, args: tuple, kwargs: dict) -> ct.Variant:
    """The canonical variant Triton's specializer (what JITFunction.run calls) gives a launch."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    params = inspect.signature(kernel.fn).parameters
    bound = dict(zip(kernel.arg_names, args)) | kwargs
    # A JITFunction keeps do_not_specialize; under the interpreter, the decorator's kwargs.
    fixed = set(getattr(kernel, "do_not_specialize", None)
                or kernel.kwargs.get("do_not_specialize") or ())
    signature, aligned, consts, ones = [], [], {}, {}
    for name in kernel.arg_names:
        if "constexpr" in str(params[name].annotation):
            signature.append((name, "constexpr"))
            consts[name] = bound[name]
            continue
        ty, attr = native_specialize_impl(CUDABackend, bound[name], False, name not in fixed,
                                          True)
        signature.append((name, ty))
        if ty == "constexpr":
            ones[name] = attr
        elif attr == "D":
            aligned.append(name)
    if "CAST_FP32" in consts:  # INTERPRET under the interpreter; False on a GPU
        consts["CAST_FP32"] = False
    return ct.Variant(kernel.fn.__name__, tuple(signature), tuple((consts | ones).items()),
                      tuple(aligned), kwargs["num_warps"], kwargs.get("num_stages"))


@pytest.fixture
def launches(monkeypatch):
    """Intercept every kernel launch (nothing runs) with the GPU block configs in force."""
    seen: list[ct.Variant] = []
    for module, kernels, configs in ((lt, ("_shrink_kernel", "_expand_kernel"),
                                      ("shrink_config", "expand_config")),
                                     (pa, ("_decode_kernel", "_reduce_kernel"), ("decode_config",)),
                                     (qt, ("_quant_matmul_kernel",), ("quant_config",)),
                                     (ft, ("_add_rms_norm_kernel", "_rotary_kernel",
                                           "_silu_and_mul_kernel"), ())):
        for name in kernels:
            kernel = getattr(module, name)
            monkeypatch.setattr(kernel, "run", lambda *a, grid, warmup, _k=kernel, **kw:
                                seen.append(_launched(_k, a, kw)))
        for name in configs:
            real = getattr(module, name)
            monkeypatch.setattr(module, name, lambda *a, _f=real, **kw: _f(*a, **(kw | {"interpret": False})))
    return seen


def _diff(launched: ct.Variant, built: ct.Variant) -> str:
    """The fields that differ; for tuples, the items only one side has."""
    out = []
    for f in fields(launched):
        a, b = getattr(launched, f.name), getattr(built, f.name)
        if a != b:
            if isinstance(a, tuple):
                a, b = sorted(set(a) - set(b), key=str), sorted(set(b) - set(a), key=str)
            out.append(f"{f.name}: launch {a}, builder {b}")
    return "; ".join(out)


def _missing(launched: list[ct.Variant], expected: list[ct.Variant], listed: set) -> list[str]:
    assert [v.kernel for v in launched] == [e.kernel for e in expected], (
        f"launched {[v.kernel for v in launched]}, expected {[e.kernel for e in expected]}")
    out = [f"{v.label}: the launch and kernels/compile_targets.py differ in {_diff(v, e)}"
           for v, e in zip(launched, expected) if v != e]
    return out + [f"{v.label}: launched but not in all_variants()" for v in launched
                  if v not in listed]


@pytest.mark.parametrize("model", ct.SHIPPED_MODELS, ids=lambda m: m.name)
def test_lora_launches_are_listed(model, variants, launches):
    listed, problems_found = set(variants), []
    g = torch.Generator().manual_seed(0)
    for proj in model.projections:
        n, H, width, offsets = len(proj.widths), proj.hidden, sum(proj.widths), [0]
        for w in proj.widths:
            offsets.append(offsets[-1] + w)
        for T, R, S, dtype in ((1, 8, 4, "fp16"), (37, 64, 16, "bf16"), (300, 16, 8, "bf16"),
                               (300, 256, 4, "fp16")):
            meta = make_lora_meta(torch.randint(-1, S, (T,), generator=g).tolist(), S)
            td = TORCH_DTYPES[dtype]
            launches.clear()
            apply_lora(torch.empty(T, width, dtype=td), torch.empty(T, H, dtype=td),
                       torch.empty(n, S, R, H, dtype=td), torch.empty(S, width, R, dtype=td),
                       torch.full((n, S), R, dtype=torch.int32), torch.ones(n, S),
                       tuple(offsets), meta, backend="triton")
            nt = meta.tile_slots.shape[0]
            expected = [ct.shrink_variant(dtype, H, R, meta.block_m,
                                          lt.shrink_config(nt, n, R, H, meta.block_m, interpret=False)),
                        ct.expand_variant(dtype, width, R, meta.block_m,
                                          lt.expand_config(max(proj.widths), R, meta.block_m,
                                                           interpret=False))]
            problems_found += _missing(list(launches), expected, listed)
    # embed_tokens: a gather, then the expand of one slice of width hidden.
    H, V, S, R = model.projections[0].hidden, model.projections[-1].widths[0], 4, 16
    for T in (1, 37):
        meta = make_lora_meta([t % S for t in range(T)], S)
        launches.clear()
        embedding_lora(torch.empty(T, H, dtype=torch.bfloat16), torch.randint(0, V, (T,)),
                       torch.empty(S, V, R, dtype=torch.bfloat16),
                       torch.empty(S, H, R, dtype=torch.bfloat16),
                       torch.full((1, S), R, dtype=torch.int32), torch.ones(1, S), meta,
                       backend="triton")
        cfg = lt.expand_config(H, R, meta.block_m, interpret=False)
        problems_found += _missing(list(launches),
                                   [ct.expand_variant("bf16", H, R, meta.block_m, cfg)], listed)
    assert problems_found == [], "\n".join(problems_found)


def _quant_weight(scheme: tuple[str, bool, bool], rows: int, columns: int,
                  n_slices: int) -> QuantWeight:
    """An engine-made QuantWeight's tensors (empty: nothing runs), groups of 128."""
    kind, asym, act_order = scheme
    packed, groups = -(-columns // 2) if kind == "int4" else columns, -(-columns // 128)
    codes = torch.int8 if kind == "int8" else torch.uint8
    return QuantWeight(kind, torch.empty(rows, packed, dtype=codes), torch.empty(rows, groups),
                       torch.empty(rows, groups, dtype=torch.int8) if asym else None, 128, columns,
                       torch.empty(n_slices, columns, dtype=torch.int32) if act_order else None,
                       torch.empty(rows, dtype=torch.int32) if act_order else None)


@pytest.mark.parametrize("model", ct.SHIPPED_MODELS, ids=lambda m: m.name)
def test_quant_launches_are_listed(model, variants, launches):
    """Every scheme on every quantized projection, decode and prefill steps, with and without
    a bias (Qwen2's qkv_proj has one), fp16 and bf16."""
    listed, problems_found = set(variants), []
    for proj in (p for p in model.projections if p.name in ct.QUANT_PROJECTIONS):
        rows, columns = sum(proj.widths), proj.hidden
        for scheme in ct.QUANT_SCHEMES:
            w = _quant_weight(scheme, rows, columns, len(proj.widths))
            for T, dtype, bias in ((1, "fp16", False), (37, "bf16", True), (300, "bf16", False),
                                   (2048, "fp16", True)):
                td = TORCH_DTYPES[dtype]
                launches.clear()
                qt.quant_matmul(torch.empty(T, columns, dtype=td), w,
                                torch.empty(rows, dtype=td) if bias else None)
                cfg = qt.quant_config(T, rows, columns, interpret=False)
                expected = ct.quant_variant(dtype, scheme, columns, rows, cfg)
                problems_found += _missing(list(launches), [expected], listed)
    assert problems_found == [], "\n".join(problems_found)


HEAD_SHAPES = sorted({*ct.ATTENTION_GRID, *(m.attention for m in ct.SHIPPED_MODELS)})


@pytest.mark.parametrize("heads", HEAD_SHAPES, ids=lambda h: f"{h[0]}q-{h[1]}kv-d{h[2]}")
def test_decode_attention_launches_are_listed(heads, variants, launches):
    """Engine layouts: q a view of the qkv output, tables a view into a packed int32 buffer
    after the context lengths (engine/runner/inputs.py), out a view of the step's output."""
    n_heads, n_kv, D = heads
    listed, problems_found = set(variants), []
    for B, W, dtype in ((1, 1, "bf16"), (5, 3, "fp16"), (64, 1, "fp16"), (300, 7, "bf16")):
        td = TORCH_DTYPES[dtype]
        q = torch.empty(B, (n_heads + 2 * n_kv) * D, dtype=td)[:, :n_heads * D].view(B, n_heads, D)
        k_cache, v_cache = (torch.empty(8, ct.KV_BLOCK_SIZE, n_kv, D, dtype=td) for _ in range(2))
        rows = B + 1
        ids32 = torch.zeros(rows + rows * W, dtype=torch.int32)
        out = torch.empty(B + 2, n_heads, D, dtype=td)[:B]
        launches.clear()
        pa.paged_attention_decode(q, k_cache, v_cache, ids32[rows:rows + B * W].view(B, W),
                                  ids32[:B], D ** -0.5, out=out)
        cfg = pa.decode_config(B, n_kv, D, interpret=False)
        expected = ct.decode_variants(dtype, n_heads, n_kv, D, ct.KV_BLOCK_SIZE, cfg)
        problems_found += _missing(list(launches), expected, listed)
    assert problems_found == [], "\n".join(problems_found)


@pytest.mark.parametrize("model", ct.SHIPPED_MODELS, ids=lambda m: m.name)
def test_fused_elementwise_launches_are_listed(model, variants, launches):
    """Engine layouts: the residual stream and o_proj / down_proj outputs contiguous [T, H],
    q and k views of the qkv output, the gate_up output [T, 2I]."""
    proj = {p.name: p for p in model.projections}
    hidden, inter = proj["qkv_proj"].hidden, proj["gate_up_proj"].widths[0]
    n_q, n_k, D = model.attention
    listed, problems_found = set(variants), []
    for T, dtype in ((1, "bf16"), (37, "fp16")):
        td = TORCH_DTYPES[dtype]
        x, delta, weight = (torch.empty(T, hidden, dtype=td), torch.empty(T, hidden, dtype=td),
                            torch.empty(hidden, dtype=td))
        qkv = torch.empty(T, (n_q + 2 * n_k) * D, dtype=td)
        q = qkv[:, :n_q * D].view(T, n_q, D)
        k = qkv[:, n_q * D:(n_q + n_k) * D].view(T, n_k, D)
        cos = torch.empty(T, 1, D, dtype=td)
        launches.clear()
        ft.add_rms_norm(x, None, weight, 1e-6)
        ft.add_rms_norm(x, delta, weight, 1e-6)
        ft.rotary(q, k, cos, cos)
        ft.silu_and_mul(torch.empty(T, 2 * inter, dtype=td))
        expected = elementwise_variants([model], [dtype])
        problems_found += _missing(list(launches), expected, listed)
    assert problems_found == [], "\n".join(problems_found)


def test_bounds_cover_the_engine_defaults():
    from loragw.engine.config import EngineOptions

    defaults = {name: f.default for name, f in EngineOptions.__dataclass_fields__.items()}
    assert defaults["block_size"] == ct.KV_BLOCK_SIZE
    assert defaults["max_lora_rank"] in ct.RANKS
    assert defaults["max_num_seqs"] <= ct.MAX_BATCH
    assert defaults["max_num_batched_tokens"] <= ct.MAX_STEP_TOKENS
