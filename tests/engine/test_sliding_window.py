"""Sliding-window attention: transformers' convention (the query at p sees keys p - W < k <= p),
token-identical greedy output for every model kind that slides, and KV blocks bounded by the
window when every layer slides.

Tiny checkpoints with an 8-token window and prompts up to 40 tokens, so most of the context of
most queries lies outside the window.
"""

import pytest
import torch
from peft_reference import hf_greedy
from window_parity import GREEDY, MAX_TOKENS, WINDOW, check_schedules, make_prompts

from engine import LLM, SamplingParams
from engine.backends import AttentionShape, kernel_gaps, resolve_attention_backend
from engine.layers.attention import PagedAttention

VARIANTS = {
    "mistral-window": ("mistral", {"sliding_window": WINDOW}),  # every layer: blocks are freed
    "qwen2-window-layer-1": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW,
                                       "max_window_layers": 1}),  # layer 0 full, layer 1 slides
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_transformers(tiny_checkpoint, variant):
    arch, overrides = VARIANTS[variant]
    check_schedules(tiny_checkpoint(arch, **overrides), variant)


def test_window_mask_is_transformers_convention():
    """Prefill (explicit mask) and decode (gathered blocks) both let the query at p see exactly
    the keys p - W < k <= p: attention with window W equals full attention over those keys."""
    from engine.forward_context import AttentionMetadata, ForwardContext, forward_context

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
    decoded = attn._decode(q[-1:], ids, mask, torch.tensor([length], dtype=torch.int32))
    torch.testing.assert_close(decoded[0], out[-1], msg="decode query")


def test_kv_blocks_stay_bounded_past_the_window(tiny_checkpoint):
    """A sequence decoding 150 tokens past an 8-token window holds at most
    window / block_size + 2 blocks, and still gives transformers' tokens."""
    path = tiny_checkpoint("mistral", sliding_window=WINDOW)
    prompt = make_prompts(500, (30,))[0]
    expected = hf_greedy(path, [prompt], 150)[0]
    llm = LLM(path, device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=8)
    engine = llm.engine
    assert engine.block_manager.window == WINDOW
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


def test_triton_decode_refuses_what_it_cannot_do():
    """The Triton kernel has no window or soft-capping: auto keeps torch, forced is an error."""
    shape = AttentionShape(4, 2, 16)
    windowed = [PagedAttention(4, 2, 16, 0.25, sliding_window=8)]
    capped = [PagedAttention(4, 2, 16, 0.25, softcap=50.0)]
    assert kernel_gaps([PagedAttention(4, 2, 16, 0.25)]) is None
    assert "sliding-window" in kernel_gaps(windowed)
    assert "soft-capped" in kernel_gaps(capped)
    cuda = torch.device("cuda")
    assert resolve_attention_backend("auto", cuda, torch.float16, shape,
                                     kernel_gaps(windowed)) == "torch"
    with pytest.raises(ValueError, match="soft-capped"):
        resolve_attention_backend("triton", cuda, torch.float16, shape, kernel_gaps(capped))
