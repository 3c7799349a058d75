"""The paged-attention decode kernel against the float64 oracle, and the engine through it.

Under the interpreter on CPU (small shapes, one program at a time), compiled on CUDA. Every case
reads a cache whose unused blocks, table padding and stale slots past each context hold NaN, so
a read outside the table's blocks up to the context length poisons the output. GPU-only tests
(bf16, Llama-3-8B shapes, CUDA-graph replay) are marked gpu and skip without a device.
"""

import importlib
from dataclasses import dataclass
from itertools import product

import pytest
import torch

from loragw.kernels.reference import oracle_paged_attention

pa = importlib.import_module("loragw.kernels.paged_attention")
DEVICE = "cpu" if pa.INTERPRET else "cuda"
on_device = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                               reason="TRITON_INTERPRET is off and there is no CUDA device")
compiled = pytest.mark.skipif(not torch.cuda.is_available() or pa.INTERPRET,
                              reason="needs a CUDA device and TRITON_INTERPRET unset (compiled kernel)")

TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # atol = rtol


@dataclass
class Problem:
    q: torch.Tensor             # [B, n_heads, D]
    k_cache: torch.Tensor       # [N, block_size, n_kv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, W] int32
    context_lens: torch.Tensor  # [B] int32
    scale: float

    def oracle(self) -> torch.Tensor:
        return oracle_paged_attention(self.q, self.k_cache, self.v_cache, self.block_tables,
                                      self.context_lens, self.scale)


def make_problem(lens: list[int], block_size: int, n_heads: int, n_kv: int, head_dim: int,
                 dtype: torch.dtype, device: str = DEVICE, spare_blocks: int = 5,
                 seed: int = 0) -> Problem:
    """Each sequence's blocks drawn at random (out of order) from a pool with spare blocks; every
    cache entry no context covers, and every table entry past a context, is NaN / a NaN block."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    width = max(max(need), 1) + 1                       # one padding column at least
    num_blocks = sum(need) + spare_blocks
    order = torch.randperm(num_blocks, generator=g)
    poisoned = int(order[-1])                           # a spare block: padding points at it
    tables = torch.full((len(lens), width), poisoned, dtype=torch.int32)
    k = torch.full((num_blocks * block_size, n_kv, head_dim), float("nan"))  # flat slots
    v = k.clone()
    used = 0
    for b, (n, nb) in enumerate(zip(lens, need)):
        tables[b, :nb] = order[used:used + nb].int()
        used += nb
        t = torch.arange(n)
        slots = tables[b, t // block_size].long() * block_size + t % block_size  # [n]
        k[slots] = torch.randn(n, n_kv, head_dim, generator=g)
        v[slots] = torch.randn(n, n_kv, head_dim, generator=g)
    k, v = (x.view(num_blocks, block_size, n_kv, head_dim) for x in (k, v))
    q = torch.randn(len(lens), n_heads, head_dim, generator=g)
    to = lambda t: t.to(device=device, dtype=dtype)
    return Problem(to(q), to(k), to(v), tables.to(device),
                   torch.tensor(lens, dtype=torch.int32, device=device), head_dim ** -0.5)


def ragged_lens(block_size: int) -> list[int]:
    """Length 1, exact block boundaries, one past them, one short of them, and a long odd one."""
    return [1, block_size, block_size + 1, 2 * block_size - 1, 3 * block_size, 45]


def check(out: torch.Tensor, p: Problem) -> None:
    tol, want = TOLERANCE[p.q.dtype], p.oracle()
    assert out.dtype == p.q.dtype and out.shape == p.q.shape
    assert torch.isfinite(out).all(), "a NaN crossed in: the kernel read outside the tables"
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    # normwise too: over long contexts the outputs shrink toward atol
    assert (out.double() - want).norm() <= tol * want.norm()


SMALL_CONFIGS = {  # several tiles per split, several splits (some empty), a non-power-of-2 count
    "default": None,
    "tile16": pa.DecodeConfig(block_n=16, num_splits=1),
    "tile16-split3": pa.DecodeConfig(block_n=16, num_splits=3),
}
GRID = list(product([4, 16], [(4, 2), (4, 4)], [16, 32], [torch.float32, torch.float16]))


@on_device
@pytest.mark.parametrize("config", list(SMALL_CONFIGS))
@pytest.mark.parametrize("block_size,heads,head_dim,dtype", GRID, ids=str)
def test_decode_matches_oracle(block_size, heads, head_dim, dtype, config):
    p = make_problem(ragged_lens(block_size), block_size, *heads, head_dim, dtype,
                     seed=block_size + head_dim)
    out = pa.paged_attention_decode(p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens,
                                    p.scale, config=SMALL_CONFIGS[config])
    check(out, p)


@on_device
def test_only_the_tables_blocks_are_read():
    """Zero every block the tables name: a kernel that reads only them returns exactly the
    oracle even though the rest of the pool (and each last block's tail) is NaN."""
    p = make_problem([3, 9, 17], block_size=4, n_heads=4, n_kv=2, head_dim=16,
                     dtype=torch.float32, spare_blocks=12)
    assert torch.isnan(p.k_cache).any() and torch.isnan(p.v_cache).any()
    for cfg in (None, pa.DecodeConfig(block_n=16, num_splits=4)):
        check(pa.paged_attention_decode(p.q, p.k_cache, p.v_cache, p.block_tables,
                                        p.context_lens, p.scale, config=cfg), p)


@on_device
def test_odd_head_dim_group_of_three_and_block_size_not_a_power_of_two():
    """head_dim 24 (masked to a 32-wide tile), 6 query heads on 2 kv heads, 6-token blocks."""
    p = make_problem([1, 6, 7, 20], block_size=6, n_heads=6, n_kv=2, head_dim=24,
                     dtype=torch.float32)
    for cfg in (None, pa.DecodeConfig(block_n=16, num_splits=2)):
        check(pa.paged_attention_decode(p.q, p.k_cache, p.v_cache, p.block_tables,
                                        p.context_lens, p.scale, config=cfg), p)


@on_device
def test_empty_context_gives_zeros():
    """A padding row (context 0, e.g. in a captured batch) yields zeros, not NaN."""
    p = make_problem([5, 0, 9], block_size=4, n_heads=4, n_kv=2, head_dim=16, dtype=torch.float32)
    for cfg in (None, pa.DecodeConfig(block_n=16, num_splits=2)):
        out = pa.paged_attention_decode(p.q, p.k_cache, p.v_cache, p.block_tables,
                                        p.context_lens, p.scale, config=cfg)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        check(out, p)


@on_device
def test_strided_query_and_output_views():
    """The engine hands q as a head view of a wider activation and out as rows of a bigger one."""
    p = make_problem([2, 11], block_size=4, n_heads=4, n_kv=2, head_dim=16, dtype=torch.float32)
    wide = torch.full((2, 8, 16), float("nan"), device=DEVICE)            # [B, q + k + v heads, D]
    wide[:, :4] = p.q
    out_rows = torch.full((5, 4, 16), 7.0, device=DEVICE)
    pa.paged_attention_decode(wide[:, :4], p.k_cache, p.v_cache, p.block_tables, p.context_lens,
                              p.scale, out=out_rows[1:3])
    check(out_rows[1:3], p)
    assert (out_rows[0] == 7).all() and (out_rows[3:] == 7).all()


def test_split_rule_and_fixed_grid():
    """Splits fill the GPU at small batches and vanish at large ones; the grid depends only on
    (B, n_kv_heads, config), never on context lengths (CUDA-graph capturable)."""
    assert pa.num_splits_for(batch=64, num_kv_heads=8) == 2
    assert pa.num_splits_for(batch=256, num_kv_heads=8) == 1
    assert pa.num_splits_for(batch=1, num_kv_heads=8) == pa.MAX_SPLITS
    assert pa.num_splits_for(batch=64, num_kv_heads=8, target_programs=8 * 132) == 4  # H200
    cfg = pa.decode_config(64, 8, 128, interpret=False)
    assert cfg == pa.DecodeConfig(block_n=64, num_splits=2)
    assert pa.decode_config(64, 8, 256, interpret=False).block_n == 32
    assert pa.decode_grid(64, 8, cfg) == (64, 8, 2)
    assert pa.decode_config(3, 2, 16, interpret=True) == pa.DecodeConfig(block_n=128, num_splits=1)


def test_backend_option(monkeypatch, tiny_checkpoint):
    backends = importlib.import_module("loragw.engine.forward.backends")
    monkeypatch.setattr(pa, "self_check", lambda *args: None)  # the kernel passed its check
    shape = backends.AttentionShape(4, 2, 16)
    resolve = lambda name, device: backends.resolve_attention_backend(
        name, torch.device(device), torch.float32, shape)
    assert resolve("auto", "cpu") == "cpu"  # the C kernel (tests/kernels/test_cpu_attention.py)
    assert resolve("auto", "cuda") == "triton"
    assert resolve("triton", "cpu") == "triton"
    from loragw.engine import Config

    with pytest.raises(ValueError, match="torch, triton, cpu"):
        Config(tiny_checkpoint("llama"), attention_backend="flash")


@on_device
def test_engine_greedy_tokens_match_torch_backend(tiny_checkpoint, monkeypatch):
    """A tiny Llama (4 q / 2 kv heads, head_dim 16) decodes the same greedy tokens through the
    Triton kernel as through the torch gather+SDPA path, with ragged contexts over 4-token blocks."""
    from loragw.engine import LLM, SamplingParams

    path = tiny_checkpoint("llama")
    prompts = [[5], [9, 3, 200, 17], [11] * 7, list(range(30, 43))]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    calls = []
    kernel = pa.paged_attention_decode
    monkeypatch.setattr(pa, "paged_attention_decode",
                        lambda *a, **kw: calls.append(a[0].shape[0]) or kernel(*a, **kw))
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(path, device=DEVICE, dtype="float32", block_size=4, attention_backend=backend)
        assert llm.engine.runner.backends.attention == backend
        outputs[backend] = [out.token_ids for out in llm.generate(prompts, params)]
    assert calls and max(calls) == len(prompts), "the engine never decoded through the kernel"
    assert outputs["triton"] == outputs["torch"]


# ---- compiled kernel on a GPU ------------------------------------------------------------

@pytest.mark.gpu
@compiled
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("block_size,head_dim", [(16, 128), (32, 128), (16, 64), (16, 256)])
@pytest.mark.parametrize("batch", [1, 64])
def test_compiled_at_llama_shapes(batch, block_size, head_dim, dtype):
    """32 q / 8 kv heads, ragged contexts up to 4k, the engine's split rule (1 to 32 splits)."""
    g = torch.Generator().manual_seed(batch + head_dim)
    lens = torch.randint(1, 4097, (batch,), generator=g).tolist()
    lens[0] = 4096
    p = make_problem(lens, block_size, 32, 8, head_dim, dtype, device="cuda", seed=batch)
    p.q *= 4  # peaky softmax: outputs of order 1 even over 4k tokens
    check(pa.paged_attention_decode(p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens,
                                    p.scale), p)


@pytest.mark.gpu
@compiled
def test_compiled_cuda_graph_replays_with_new_tables_and_lengths():
    """The grid is fixed per (B, n_kv_heads): capture once, copy a new step's tables/lens in,
    replay; includes a padding row of context 0."""
    steps = [make_problem(lens, 16, 32, 8, 128, torch.bfloat16, device="cuda", seed=s)
             for s, lens in enumerate(([100, 1, 4000, 17], [2048, 33, 1, 0], [1, 1, 1, 1]))]
    blocks = max(p.k_cache.shape[0] for p in steps)
    width = max(p.block_tables.shape[1] for p in steps)
    k = torch.zeros(blocks, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    v, q = torch.zeros_like(k), torch.zeros_like(steps[0].q)
    tables = torch.zeros(4, width, dtype=torch.int32, device="cuda")
    lens = torch.zeros(4, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    run = lambda: pa.paged_attention_decode(q, k, v, tables, lens, steps[0].scale, out=out)

    def load(p: Problem) -> None:
        for static in (k, v, tables):
            static.zero_()
        k[:p.k_cache.shape[0]] = p.k_cache.nan_to_num(0.0)
        v[:p.v_cache.shape[0]] = p.v_cache.nan_to_num(0.0)
        tables[:, :p.block_tables.shape[1]] = p.block_tables
        q.copy_(p.q)
        lens.copy_(p.context_lens)

    load(steps[0])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()                                                            # compile
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for p in steps:
        load(p)
        graph.replay()
        torch.testing.assert_close(out.double(), p.oracle(), atol=2e-2, rtol=2e-2)



@on_device
def test_self_check_passes_a_correct_kernel_and_names_a_wrong_one(monkeypatch):
    device = torch.device(DEVICE)
    assert pa.self_check(device, torch.float32, 4, 2, 16) is None
    pa.self_check.cache_clear()
    monkeypatch.setattr(pa, "paged_attention_decode", lambda q, *args, **kw: torch.zeros_like(q))
    try:
        assert "max error" in pa.self_check(device, torch.float32, 4, 2, 16)
    finally:
        pa.self_check.cache_clear()


def test_auto_keeps_torch_when_the_self_check_fails(monkeypatch, caplog):
    from loragw.engine.forward.backends import AttentionShape, resolve_attention_backend

    monkeypatch.setattr(pa, "self_check", lambda *args: "RuntimeError: no luck")
    shape, cuda = AttentionShape(num_heads=4, num_kv_heads=2, head_dim=16), torch.device("cuda")
    with caplog.at_level("WARNING"):
        assert resolve_attention_backend("auto", cuda, torch.float32, shape) == "torch"
    assert "no luck" in caplog.text
    assert resolve_attention_backend("triton", cuda, torch.float32, shape) == "triton"  # forced: no check


@on_device
@pytest.mark.parametrize("config", list(SMALL_CONFIGS))
@pytest.mark.parametrize("window,softcap", [(5, None), (16, None), (None, 2.0), (9, 2.0)],
                         ids=["window5", "window16", "cap2", "window9-cap2"])
def test_decode_window_and_softcap_match_oracle(window, softcap, config):
    """Sliding window and score cap (Mistral, Gemma): the oracle's meaning, and table entries
    wholly before the window (blocks the engine freed) point at a NaN block, never read."""
    block_size = 4
    p = make_problem(ragged_lens(block_size), block_size, 4, 2, 16, torch.float32)
    poisoned = p.block_tables[0, -1].item()  # every table's padding names the NaN block
    if window is not None:
        for b, n in enumerate(p.context_lens.tolist()):
            p.block_tables[b, :max(0, n - window) // block_size] = poisoned
    out = pa.paged_attention_decode(p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens,
                                    p.scale, config=SMALL_CONFIGS[config],
                                    sliding_window=window, softcap=softcap)
    want = oracle_paged_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens,
                                  p.scale, window, softcap)
    assert torch.isfinite(out).all(), "a NaN crossed in: the kernel read before the window"
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


@on_device
def test_self_check_covers_window_and_cap(monkeypatch):
    """A kernel that ignores the window passes the plain check but not the model's."""
    device = torch.device(DEVICE)
    kernel = pa.paged_attention_decode
    monkeypatch.setattr(pa, "paged_attention_decode",
                        lambda *a, sliding_window=None, softcap=None, **kw: kernel(*a, **kw))
    pa.self_check.cache_clear()
    try:
        assert pa.self_check(device, torch.float32, 4, 2, 16) is None
        assert "max error" in pa.self_check(device, torch.float32, 4, 2, 16, 8, None)
    finally:
        pa.self_check.cache_clear()
