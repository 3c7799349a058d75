"""Sliding-window attention: transformers' convention (the query at p sees keys p - W < k <= p),
token-identical greedy output for every model kind that slides, and KV blocks bounded by the
window when every layer slides.

Tiny checkpoints with an 8-token window and prompts up to 40 tokens, so most of the context of
most queries lies outside the window.
"""

import os

import pytest
import torch
from peft_reference import hf_greedy
from window_parity import GREEDY, MAX_TOKENS, WINDOW, check_schedules, make_prompts

from loragw.engine import LLM, SamplingParams
from loragw.engine.forward.backends import AttentionShape, attention_shape
from loragw.engine.layers.attention import PagedAttention

VARIANTS = {
    "mistral-window": ("mistral", {"sliding_window": WINDOW}),  # every layer: blocks are freed
    "qwen2-window-layer-1": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW,
                                       "max_window_layers": 1}),  # layer 0 full, layer 1 slides
    "phi3-window": ("phi3", {"sliding_window": WINDOW}),  # every layer, as transformers' Phi-3
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_transformers(tiny_checkpoint, variant):
    arch, overrides = VARIANTS[variant]
    check_schedules(tiny_checkpoint(arch, **overrides), variant)


def test_window_mask_is_transformers_convention():
    """Prefill (explicit mask) and decode (gathered blocks) both let the query at p see exactly
    the keys p - W < k <= p: attention with window W equals full attention over those keys."""
    from loragw.engine.forward.context import AttentionMetadata, ForwardContext, forward_context

    torch.manual_seed(0)
    heads, kv_heads, dim, block, length, window = 4, 2, 8, 4, 11, 3
    attn = PagedAttention(heads, kv_heads, dim, scale=dim ** -0.5, sliding_window=window)
    attn.k_cache = torch.zeros(4, block, kv_heads, dim)
    attn.v_cache = torch.zeros(4, block, kv_heads, dim)
    q, k, v = torch.randn(length, heads, dim), torch.randn(length, kv_heads, dim), torch.randn(
        length, kv_heads, dim)
    table = torch.tensor([2, 0, 1])
    slots = torch.tensor([table[p // block] * block + p % block for p in range(length)])
    meta = AttentionMetadata(slots, 0, None, None, None, None, [0], [length], [length], [table])
    with forward_context(ForwardContext(attn=meta)):
        out = attn(q, k, v).view(length, heads, dim)
    for p in range(length):
        keys = slice(max(0, p - window + 1), p + 1)
        want = torch.nn.functional.scaled_dot_product_attention(
            q[p, :, None, :], k[keys].transpose(0, 1), v[keys].transpose(0, 1), scale=dim ** -0.5,
            enable_gqa=True)[:, 0, :]
        torch.testing.assert_close(out[p], want, msg=f"prefill query at {p}")
    # decode: the query at the last position, through the torch path's gathered blocks
    ids = table  # [max_blocks]: one decode row
    mask = (torch.arange(3 * block) < length)[None, None, None, :]
    decoded = attn._decode(q[-1:], ids, mask, table[None, :].int(),
                           torch.tensor([length], dtype=torch.int32))
    torch.testing.assert_close(decoded[0], out[-1], msg="decode query")


def test_capped_prefill_in_query_chunks(monkeypatch):
    """Soft-capped scores (tanh(s / C) * C before a float32 softmax), windowed, computed a few
    query rows at a time: the same as one eager computation over the whole prompt."""
    from loragw.engine.forward.context import AttentionMetadata, ForwardContext, forward_context
    from loragw.engine.layers import attention

    monkeypatch.setattr(attention, "CAPPED_QUERY_ROWS", 4)
    torch.manual_seed(0)
    heads, kv_heads, dim, length, window, cap = 4, 2, 8, 11, 5, 1.5
    attn = PagedAttention(heads, kv_heads, dim, scale=0.5, sliding_window=window, softcap=cap)
    attn.k_cache = torch.zeros(3, 4, kv_heads, dim)
    attn.v_cache = torch.zeros(3, 4, kv_heads, dim)
    q, k, v = torch.randn(length, heads, dim), torch.randn(length, kv_heads, dim), torch.randn(
        length, kv_heads, dim)
    table = torch.tensor([0, 1, 2])
    meta = AttentionMetadata(torch.arange(length), 0, None, None, None, None, [0], [length],
                             [length], [table])
    with forward_context(ForwardContext(attn=meta)):
        out = attn(q, k, v).view(length, heads, dim)
    kk, vv = (x.repeat_interleave(2, dim=1).transpose(0, 1) for x in (k, v))  # [heads, L, D]
    scores = torch.tanh((q.transpose(0, 1) @ kk.transpose(1, 2)) * 0.5 / cap) * cap
    p, key = torch.arange(length)[:, None], torch.arange(length)[None, :]
    scores = scores.masked_fill(~((key <= p) & (key > p - window)), float("-inf"))
    want = (scores.softmax(-1) @ vv).transpose(0, 1)  # [L, heads, D]
    torch.testing.assert_close(out, want)


def test_kv_blocks_stay_bounded_past_the_window(tiny_checkpoint):
    """A sequence decoding 150 tokens past an 8-token window holds at most
    window / block_size + 2 blocks, and still gives transformers' tokens; so a cache of 6 blocks
    serves a request that would need 45 without the window."""
    path = tiny_checkpoint("mistral", sliding_window=WINDOW)
    prompt = make_prompts(500, (30,))[0]
    expected = hf_greedy(path, [prompt], 150)[0]
    llm = LLM(path, device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=8,
              num_kv_blocks=6)
    engine = llm.engine
    assert engine.block_manager.window == WINDOW
    assert engine.block_manager.peak_blocks(180) == 5  # blocks_for(7 + 8) + 1
    engine.add_request(prompt, SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True))
    held, tokens = [], []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
        held.append(engine.block_manager.num_used_blocks)
    assert tokens == expected
    assert max(held) <= WINDOW // 4 + 2, f"held up to {max(held)} blocks"
    assert engine.num_free_kv_blocks == engine.block_manager.num_blocks


def test_shared_prefix_past_the_window(tiny_checkpoint):
    """Requests sharing a 33-token prefix, one after the other: the second reuses the first's
    cached blocks, including ones the first handed back for lying before its window."""
    path = tiny_checkpoint("mistral", sliding_window=WINDOW)
    prefix = make_prompts(500, (33,))[0]
    prompts = [prefix + [5, 6, 7], prefix + [9], prefix]
    expected = hf_greedy(path, prompts, MAX_TOKENS)
    llm = LLM(path, device="cpu", dtype="float32", block_size=4)
    for prompt, want in zip(prompts, expected):
        assert llm.generate([prompt], GREEDY)[0].token_ids == want
    assert llm.engine.block_manager.cache.stats.hits > 0, "the prefix was not shared"


@pytest.mark.parametrize("arch,overrides", [("mistral", {"sliding_window": WINDOW}),
                                            ("gemma2", {})], ids=["mistral-window", "gemma2"])
def test_triton_decode_matches_torch(tiny_checkpoint, arch, overrides):
    """The Triton decode kernel (under the interpreter on CPU) takes the window and the cap:
    the same greedy tokens as the torch path, with blocks before the window freed."""
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("the Triton kernel needs TRITON_INTERPRET=1 on CPU")
    device = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    path = tiny_checkpoint(arch, **overrides)
    prompts = make_prompts(500, (3, 21, 12))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(path, device=device, dtype="float32", block_size=4, attention_backend=backend)
        assert llm.engine.runner.backends.attention == backend
        outputs[backend] = [out.token_ids for out in llm.generate(prompts, params)]
    assert outputs["triton"] == outputs["torch"]


@pytest.mark.parametrize("arch,overrides", [("mistral", {"sliding_window": WINDOW}),
                                            ("gemma2", {})], ids=["mistral-window", "gemma2"])
def test_cpu_decode_kernel_matches_torch(tiny_checkpoint, arch, overrides):
    """The C decode kernel (kernels/cpu_attention.py) takes the window and the cap: the same
    greedy tokens as the torch path, and auto picks it on a float32 CPU engine."""
    path = tiny_checkpoint(arch, **overrides)
    prompts = make_prompts(500, (3, 21, 12))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "auto"):
        llm = LLM(path, device="cpu", dtype="float32", block_size=4, attention_backend=backend)
        assert llm.engine.runner.backends.attention == {"auto": "cpu"}.get(backend, backend)
        outputs[backend] = [out.token_ids for out in llm.generate(prompts, params)]
    assert outputs["auto"] == outputs["torch"]


def test_attention_shape_names_window_and_cap():
    """What the Triton self-check must also verify: the narrowest window, the cap."""
    layers = [PagedAttention(4, 2, 16, 0.25, sliding_window=8, softcap=50.0),
              PagedAttention(4, 2, 16, 0.25), PagedAttention(4, 2, 16, 0.25, sliding_window=4)]
    assert attention_shape(layers) == AttentionShape(4, 2, 16, 4, 50.0)
    assert attention_shape(layers[1:2]) == AttentionShape(4, 2, 16)
