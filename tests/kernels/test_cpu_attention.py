"""kernels/cpu_attention.py (the C paged decode kernel) against the float64 reference over a
grid of head layouts, head sizes, ragged contexts, windows and caps, and the backend rule that
picks it (engine/forward/backends.py)."""

from __future__ import annotations

import pytest
import torch

from loragw.engine.forward import backends
from loragw.engine.forward.backends import AttentionShape
from loragw.kernels import cpu_attention, native
from loragw.kernels.reference import oracle_paged_attention

CPU = torch.device("cpu")


def paged_case(heads: int, kv_heads: int, head_dim: int, lens: list[int], block_size: int = 16,
               seed: int = 0):
    """A shuffled paged cache holding contexts of `lens` tokens, and one query per context."""
    g = torch.Generator().manual_seed(seed)
    width = max(1, -(-max(lens) // block_size)) + 1  # one spare column: never read
    blocks = len(lens) * width + 3
    tables = torch.randperm(blocks, generator=g)[:len(lens) * width].view(len(lens), width)
    k_cache, v_cache = (torch.randn(blocks, block_size, kv_heads, head_dim, generator=g)
                        for _ in range(2))
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    return q, k_cache, v_cache, tables.to(torch.int32), torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("head_dim", [16, 64, 80, 128])
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 30.0), (17, 50.0)])
def test_decode_is_the_reference(heads, kv_heads, head_dim, window, softcap):
    lens = [1, 15, 16, 17, 40, 0, 100]  # block edges, an empty context, one past a window
    q, k_cache, v_cache, tables, context = paged_case(heads, kv_heads, head_dim, lens)
    scale = head_dim ** -0.5
    got = cpu_attention.paged_attention_decode(q, k_cache, v_cache, tables, context, scale,
                                               sliding_window=window, softcap=softcap)
    want = oracle_paged_attention(q, k_cache, v_cache, tables, context, scale, window, softcap)
    assert got.shape == q.shape and got.dtype == torch.float32
    assert (got.double() - want).abs().max().item() < 1e-5


def test_strided_queries_and_a_given_out():
    """q as the attention layer hands it over (a view of the fused q/k/v rows), out written in
    place; block size 4."""
    q_full, k_cache, v_cache, tables, context = paged_case(8, 2, 32, [9, 3, 30], block_size=4)
    qkv = torch.cat([q_full.flatten(1), torch.randn(3, 128)], dim=1)  # [3, 8 * 32 + 128]
    q = qkv[:, :256].view(3, 8, 32)
    assert not q.is_contiguous()
    out = torch.full_like(q_full, float("nan"))
    result = cpu_attention.paged_attention_decode(q, k_cache, v_cache, tables, context, 0.2,
                                                  out=out)
    assert result is out
    want = oracle_paged_attention(q_full, k_cache, v_cache, tables, context, 0.2)
    assert (out.double() - want).abs().max().item() < 1e-5


def test_store_kv_is_index_copy():
    """The step's new K/V land where index_copy_ puts them, from strided rows (v as a view of
    the fused q/k/v rows) and from rows that need a copy first."""
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, 3 * 16, generator=g)
    k, v = qkv[:, 16:32].view(5, 2, 8), qkv[:, 32:].view(5, 2, 8)
    odd = torch.randn(5, 8, 2, generator=g).transpose(1, 2)  # [5, 2, 8], D not contiguous
    slots = torch.tensor([3, 17, 39, 0, 22])
    for new_k in (k, odd):
        got = [torch.zeros(10, 4, 2, 8) for _ in range(2)]
        cpu_attention.store_kv(new_k, v, *got, slots)
        want = [torch.zeros(10, 4, 2, 8) for _ in range(2)]
        want[0].view(40, 2, 8).index_copy_(0, slots, new_k)
        want[1].view(40, 2, 8).index_copy_(0, slots, v)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_auto_picks_the_kernel_on_a_float32_cpu_engine():
    shape = AttentionShape(8, 2, 64)
    assert backends.resolve_attention_backend("auto", CPU, torch.float32, shape) == "cpu"
    assert backends.resolve_attention_backend("auto", CPU, torch.bfloat16, shape) == "torch"
    assert backends.resolve_attention_backend("torch", CPU, torch.float32, shape) == "torch"
    with pytest.raises(ValueError, match="float32 only"):
        backends.resolve_attention_backend("cpu", CPU, torch.bfloat16, shape)


def test_a_kernel_that_cannot_build_leaves_torch_serving(monkeypatch, caplog):
    monkeypatch.setattr(cpu_attention, "_library", lambda: (_ for _ in ()).throw(
        RuntimeError("no C compiler (cc or $CC) to build the CPU attention kernel")))
    shape = AttentionShape(4, 4, 16)
    assert backends.resolve_attention_backend("auto", CPU, torch.float32, shape) == "torch"
    assert "no C compiler" in caplog.text
    with pytest.raises(ValueError, match="no C compiler"):
        backends.resolve_attention_backend("cpu", CPU, torch.float32, shape)


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
