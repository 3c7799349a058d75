"""kernels/cpu_attention.py (the C paged decode kernel) against the float64 reference over a
grid of dtypes, head layouts, head sizes, ragged contexts, windows and caps, and the backend rule
that picks it (engine/forward/backends.py); the C kernels' AVX-512 BF16 builds compile."""

from __future__ import annotations

import subprocess

import pytest
import torch

from loragw.engine.forward import backends
from loragw.engine.forward.backends import AttentionShape
from loragw.kernels import cpu_attention, native
from loragw.kernels.reference import oracle_paged_attention

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16]
AVX512_BF16 = ("-mavx512f", "-mavx512bf16", "-mavx512bw", "-mavx512vl")


def assert_reference(got: torch.Tensor, want: torch.Tensor, v_cache: torch.Tensor) -> None:
    """float32: the sums' order only. bfloat16, two roundings of u = 2^-8 relative: out's, and
    each exp(s - max)'s (as SDPA's), which moves out by at most u * max |v|."""
    assert got.dtype == v_cache.dtype
    bound = 1e-5
    if got.dtype == torch.bfloat16:
        bound += 2**-8 * (want.abs() + v_cache.abs().max().item())
    assert ((got.double() - want).abs() <= bound).all(), (got.double() - want).abs().max()


def paged_case(heads: int, kv_heads: int, head_dim: int, lens: list[int], block_size: int = 16,
               seed: int = 0, dtype: torch.dtype = torch.float32):
    """A shuffled paged cache of `dtype` holding contexts of `lens` tokens, and one query per
    context."""
    g = torch.Generator().manual_seed(seed)
    width = max(1, -(-max(lens) // block_size)) + 1  # one spare column: never read
    blocks = len(lens) * width + 3
    tables = torch.randperm(blocks, generator=g)[:len(lens) * width].view(len(lens), width)
    k_cache, v_cache = (torch.randn(blocks, block_size, kv_heads, head_dim, generator=g)
                        for _ in range(2))
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    return (q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), tables.to(torch.int32),
            torch.tensor(lens, dtype=torch.int32))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("head_dim", [16, 64, 80, 128])
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 30.0), (17, 50.0)])
def test_decode_is_the_reference(heads, kv_heads, head_dim, window, softcap, dtype):
    lens = [1, 15, 16, 17, 40, 0, 100]  # block edges, an empty context, one past a window
    q, k_cache, v_cache, tables, context = paged_case(heads, kv_heads, head_dim, lens, dtype=dtype)
    scale = head_dim ** -0.5
    got = cpu_attention.paged_attention_decode(q, k_cache, v_cache, tables, context, scale,
                                               sliding_window=window, softcap=softcap)
    want = oracle_paged_attention(q, k_cache, v_cache, tables, context, scale, window, softcap)
    assert got.shape == q.shape
    assert_reference(got, want, v_cache)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_queries_and_a_given_out(dtype):
    """q as the attention layer hands it over (a view of the fused q/k/v rows), out written in
    place; block size 4."""
    q_full, k_cache, v_cache, tables, context = paged_case(8, 2, 32, [9, 3, 30], block_size=4,
                                                           dtype=dtype)
    qkv = torch.cat([q_full.flatten(1), torch.randn(3, 128).to(dtype)], dim=1)  # [3, 384]
    q = qkv[:, :256].view(3, 8, 32)
    assert not q.is_contiguous()
    out = torch.full_like(q_full, float("nan"))
    result = cpu_attention.paged_attention_decode(q, k_cache, v_cache, tables, context, 0.2,
                                                  out=out)
    assert result is out
    assert_reference(out, oracle_paged_attention(q_full, k_cache, v_cache, tables, context, 0.2),
                     v_cache)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_kv_is_index_copy(dtype):
    """The step's new K/V land where index_copy_ puts them, from strided rows (v as a view of
    the fused q/k/v rows) and from rows that need a copy first."""
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, 3 * 16, generator=g).to(dtype)
    k, v = qkv[:, 16:32].view(5, 2, 8), qkv[:, 32:].view(5, 2, 8)
    odd = torch.randn(5, 8, 2, generator=g).to(dtype).transpose(1, 2)  # [5, 2, 8], D strided
    slots = torch.tensor([3, 17, 39, 0, 22])
    for new_k in (k, odd):
        got = [torch.zeros(10, 4, 2, 8, dtype=dtype) for _ in range(2)]
        cpu_attention.store_kv(new_k, v, *got, slots)
        want = [torch.zeros(10, 4, 2, 8, dtype=dtype) for _ in range(2)]
        want[0].view(40, 2, 8).index_copy_(0, slots, new_k)
        want[1].view(40, 2, 8).index_copy_(0, slots, v)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_auto_picks_the_kernel_on_a_float32_or_bfloat16_cpu_engine():
    shape = AttentionShape(8, 2, 64, sliding_window=4096, softcap=50.0)
    for dtype in DTYPES:
        assert cpu_attention.self_check(dtype, 8, 2, 64, 4096, 50.0) is None
        assert backends.resolve_attention_backend("auto", CPU, dtype, shape) == "cpu"
    assert backends.resolve_attention_backend("auto", CPU, torch.float16, shape) == "torch"
    assert backends.resolve_attention_backend("torch", CPU, torch.float32, shape) == "torch"
    with pytest.raises(ValueError, match="takes float32 or bfloat16"):
        backends.resolve_attention_backend("cpu", CPU, torch.float16, shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_kernel_that_cannot_build_leaves_torch_serving(monkeypatch, caplog, dtype):
    monkeypatch.setattr(cpu_attention, "_library", lambda dtype: (_ for _ in ()).throw(
        RuntimeError("no C compiler (cc or $CC) to build the CPU attention kernel")))
    shape = AttentionShape(4, 4, 16)
    assert backends.resolve_attention_backend("auto", CPU, dtype, shape) == "torch"
    assert "no C compiler" in caplog.text
    with pytest.raises(ValueError, match="no C compiler"):
        backends.resolve_attention_backend("cpu", CPU, dtype, shape)


def test_the_bf16_kernel_reads_what_the_f32_kernel_reads():
    """bf16 K/V widened in registers are the f32 kernel's inputs: the two agree to bf16's two
    roundings (a wrong element offset or a lost widening shift would not)."""
    q, k_cache, v_cache, tables, context = paged_case(8, 2, 64, [3, 33, 70], seed=2,
                                                      dtype=torch.bfloat16)
    got = cpu_attention.paged_attention_decode(q, k_cache, v_cache, tables, context, 0.125)
    wide = cpu_attention.paged_attention_decode(q.float(), k_cache.float(), v_cache.float(),
                                                tables, context, 0.125)
    assert_reference(got, wide.double(), v_cache)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_scalar_build_is_right(monkeypatch, dtype):
    """Built for x86-64 without AVX2: the portable loops and bf16 conversions, unvectorized."""
    suffix, scalar = native.SUFFIXES[dtype], ("-march=x86-64",)
    monkeypatch.setattr(cpu_attention, "_library", lambda dtype: (
        native.function("paged_decode", f"paged_decode_{suffix}", "plppppp" + "iiiiii" + "fif",
                        "i", scalar),
        native.function("paged_decode", f"cache_store_{suffix}", "plplpppii", None, scalar)))
    q, k_cache, v_cache, tables, context = paged_case(8, 2, 80, [1, 17, 40], dtype=dtype)
    got = cpu_attention.paged_attention_decode(q, k_cache, v_cache, tables, context, 0.1,
                                               sliding_window=20, softcap=30.0)
    want = oracle_paged_attention(q, k_cache, v_cache, tables, context, 0.1, 20, 30.0)
    assert_reference(got, want, v_cache)


@pytest.mark.parametrize("source", ["paged_decode", "lora_bags", "fused_ops"])
def test_the_avx512_bf16_build_compiles(tmp_path, source):
    """This machine may not run AVX-512 BF16; the kernels' bf16 paths must still compile for it
    (attention's q . k to vdpbf16ps)."""
    probe = subprocess.run([native.compiler(), *AVX512_BF16, "-x", "c", "-c", "-", "-o",
                            str(tmp_path / "probe.o")], input="int x;", capture_output=True,
                           text=True)
    if probe.returncode:
        pytest.skip(f"{native.compiler()} does not take {' '.join(AVX512_BF16)}")
    native.build(source, tmp_path / f"{source}.s", (*AVX512_BF16, "-S"))
    if source == "paged_decode":
        assert "vdpbf16ps" in (tmp_path / f"{source}.s").read_text()


def test_the_build_is_cached_by_source_and_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAGW_KERNEL_CACHE", str(tmp_path))
    native.library.cache_clear()
    try:
        native.library("paged_decode")
        built = list(tmp_path.glob("paged_decode-*.so"))
        assert len(built) == 1
        native.library.cache_clear()
        native.library("paged_decode")  # found, not rebuilt
        assert list(tmp_path.glob("paged_decode-*.so")) == built
        assert not [p for p in tmp_path.iterdir() if p.is_dir()], "a temporary build was left"
    finally:
        native.library.cache_clear()


def test_no_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAGW_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    native.library.cache_clear()
    try:
        with pytest.raises((RuntimeError, OSError)):
            native.library("paged_decode")
    finally:
        native.library.cache_clear()
