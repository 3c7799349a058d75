"""Automatic prefix caching: full KV blocks are found again by content hash and shared (ref
counted), cached blocks nobody references are evicted least recently used first, blocks are
never shared across adapters or adapter versions, and outputs are exactly those without it."""

import pytest
import torch
from peft_reference import hf_greedy

from loragw.engine import LLM, SamplingParams
from loragw.engine.kv.block_manager import BlockManager
from loragw.engine.kv.prefix_cache import block_hash
from loragw.engine.request.sequence import Sequence

BS = 4  # block size of every test here: prompts span many blocks while staying tiny
MAX_TOKENS = 20  # greedy tokens per request


def seq_of(tokens) -> Sequence:
    return Sequence(list(tokens), SamplingParams(max_tokens=1))


def admit(bm: BlockManager, seq: Sequence, key=None) -> int:
    """Admission as the scheduler does it, then a prefill of the rest; returns tokens matched."""
    seq.set_cache_key(key)
    cached = bm.match(seq)
    assert bm.can_allocate(seq, seq.num_tokens, cached)
    bm.allocate(seq, seq.num_tokens, cached)
    matched = seq.num_computed_tokens
    bm.commit([seq], [seq.num_tokens - matched])
    return matched


def refs(bm: BlockManager, seq: Sequence) -> list[int]:
    return [bm.blocks[b].ref_count for b in seq.block_table]


# ---- the block manager ------------------------------------------------------------------------
def test_block_hash_chains_parent_tokens_and_adapter_key():
    tokens = [1, 2, 3, 4]
    root = block_hash(None, tokens, None)
    assert root == block_hash(None, list(tokens), None)  # deterministic
    variants = [root, block_hash(None, [1, 2, 3, 5], None), block_hash(root, tokens, None),
                block_hash(None, tokens, ("a", 1)), block_hash(None, tokens, ("a", 2)),
                block_hash(None, tokens, ("b", 1)), block_hash(None, tokens, ("a1", 1))]
    assert len(set(variants)) == len(variants)
    # Same second block after a different first one: not a match (the chain carries the prefix).
    bm = BlockManager(8, BS)
    admit(bm, seq_of([9, 9, 9, 9, 5, 6, 7, 8, 0]))
    assert admit(bm, seq_of([1, 1, 1, 1, 5, 6, 7, 8, 0])) == 0


def test_shared_prefix_is_matched_and_ref_counted():
    bm = BlockManager(16, BS)
    a = seq_of(range(13))  # three full blocks and one token
    assert admit(bm, a) == 0 and a.num_cached_tokens == 0
    b = seq_of([*range(12), 99, 98])
    assert admit(bm, b) == 12 and b.num_cached_tokens == 12
    assert b.block_table[:3] == a.block_table[:3] and b.block_table[3] != a.block_table[3]
    assert refs(bm, a) == [2, 2, 2, 1] and bm.num_used_blocks == 5
    bm.free(a)
    assert refs(bm, b) == [1, 1, 1, 1] and bm.num_used_blocks == 4
    bm.free(b)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 16
    assert len(bm.cache.evictable) == 3  # full blocks stay cached; partial ones are plain free
    c = seq_of(range(13))
    assert admit(bm, c) == 12 and not bm.cache.evictable  # revived out of the LRU
    assert (bm.cache.stats.queries, bm.cache.stats.hits) == (13 + 14 + 13, 24)


def test_at_least_one_token_is_computed_in_a_block_of_its_own():
    bm = BlockManager(16, BS)
    a = seq_of(range(12))
    admit(bm, a)
    assert len(bm.cache) == 3  # every block of the prompt is full and cached
    b = seq_of(range(12))
    assert admit(bm, b) == 8  # not 12: the last block is recomputed, into a private block
    assert b.block_table[2] != a.block_table[2] and refs(bm, b) == [2, 2, 1]
    assert len(bm.cache) == 3  # the private copy duplicates a cached block: not registered
    bm.free(a)
    bm.free(b)
    assert bm.num_used_blocks == 0 and len(bm.cache.evictable) == 3
    assert admit(bm, seq_of(range(4))) == 0  # a one-block prompt computes its block


def test_blocks_are_never_shared_across_adapters_or_versions():
    bm = BlockManager(32, BS)
    keys = [None, ("a", 1), ("a", 2), ("b", 1)]
    for key in keys:
        assert admit(bm, seq_of(range(9)), key) == 0, f"{key} matched another key's blocks"
    for key in keys:
        assert admit(bm, seq_of(range(9)), key) == 8, f"{key} missed its own blocks"
    # A sequence re-admitted under a new version (its adapter was replaced) rehashes.
    seq = seq_of([7] * 9)
    admit(bm, seq, ("a", 1))
    bm.free(seq)
    old = list(seq.block_hashes)
    seq.set_cache_key(("a", 3))
    assert bm.match(seq) == [] and seq.block_hashes and seq.block_hashes != old[:2]


def test_eviction_takes_free_blocks_first_then_least_recently_freed():
    bm = BlockManager(6, BS)
    a, b = seq_of(range(9)), seq_of(range(100, 109))  # two full blocks and a partial one each
    admit(bm, a)
    admit(bm, b)
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    bm.free(a)  # tail first: a[1] is less recently used than a[0]
    bm.free(b)
    assert list(bm.cache.evictable) == [a_blocks[1], a_blocks[0], b_blocks[1], b_blocks[0]]
    c = seq_of(range(200, 216))
    admit(bm, c)  # four blocks: the two plain free ones, then a's cached ones
    assert c.block_table == [a_blocks[2], b_blocks[2], a_blocks[1], a_blocks[0]]
    assert bm.match(seq_of(range(9))) == [], "a's blocks were evicted"
    assert bm.match(seq_of(range(100, 109))) == b_blocks[:2]


def test_shared_cached_blocks_leave_the_free_pool():
    bm = BlockManager(4, BS)
    a = seq_of(range(13))
    admit(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4 and len(bm.cache.evictable) == 3
    b = seq_of([*range(12), 50, 51, 52, 53, 54])
    cached = bm.match(b)
    assert len(cached) == 3
    assert bm.can_allocate(b, 16, cached)  # three revived + one new = 4
    assert not bm.can_allocate(b, 17, cached)  # three revived + two new > 4


def test_decode_fills_and_registers_blocks():
    bm = BlockManager(8, BS)
    a = seq_of(range(6))
    admit(bm, a)
    assert len(bm.cache) == 1
    for token in (6, 7):  # two decode steps fill the second block
        a.token_ids.append(token)
        bm.allocate(a, a.num_tokens)
        bm.commit([a], [1])
    assert len(bm.cache) == 2
    assert admit(bm, seq_of(range(9))) == 8


def test_caching_off_shares_nothing():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    for _ in range(2):
        seq = seq_of(range(9))
        assert admit(bm, seq) == 0
        bm.free(seq)
    assert len(bm.cache) == 0 and bm.num_free_blocks == len(bm.free_block_ids) == 8


# ---- the engine -------------------------------------------------------------------------------
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
PREFIX = 37  # nine full blocks and one token
SCHEDULES = {
    "batched": {},
    "chunked-prefill": {"max_num_batched_tokens": 16},
    "preempted": {"num_kv_blocks": 24},
}


def shared_prefix_prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    prefix = torch.randint(0, vocab, (PREFIX,), generator=g).tolist()
    return [prefix + torch.randint(0, vocab, (n,), generator=g).tolist() for n in (3, 1, 9, 4, 6)]


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_shared_prefix_outputs_equal_transformers_with_caching_on_and_off(tiny_checkpoint,
                                                                          schedule):
    path = tiny_checkpoint("llama")
    from transformers import AutoConfig

    prompts = shared_prefix_prompts(AutoConfig.from_pretrained(path).vocab_size)
    expected = hf_greedy(path, prompts, MAX_TOKENS)
    for caching in (True, False):
        llm = LLM(path, device="cpu", dtype="float32", block_size=BS,
                  enable_prefix_caching=caching, **SCHEDULES[schedule])
        first = llm.generate(prompts[:1], GREEDY)  # fills the cache
        rest = llm.generate(prompts[1:], GREEDY)  # shares its prefix blocks
        for i, out in enumerate(first + rest):
            assert out.token_ids == expected[i], f"{schedule}, caching {caching}: prompt {i}"
        cached = [out.num_cached_tokens for out in first + rest]
        # The whole blocks of the shared prefix, all of it in every schedule.
        assert cached == ([0] + [PREFIX // BS * BS] * len(rest) if caching else [0] * 5)
        engine = llm.engine
        assert engine.block_manager.num_used_blocks == 0, "a block is still referenced"
        assert engine.num_free_kv_blocks == engine.block_manager.num_blocks
        if schedule == "preempted":
            assert engine.scheduler.num_preemptions > 0, "the schedule did not force preemption"
            if caching:  # recomputed sequences found (some of) their own blocks again
                assert engine.block_manager.cache.stats.hits > sum(cached)


def test_a_repeated_prompt_recomputes_only_its_last_block(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    prompt = shared_prefix_prompts(512)[0][:10 * BS]  # whole blocks only
    expected = hf_greedy(path, [prompt], MAX_TOKENS)[0]
    llm = LLM(path, device="cpu", dtype="float32", block_size=BS)
    first, second = (llm.generate([prompt], GREEDY)[0] for _ in range(2))
    assert first.token_ids == second.token_ids == expected
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 9 * BS)
    assert llm.engine.block_manager.num_used_blocks == 0


def test_a_burst_shares_the_prefix_within_one_step(tiny_checkpoint):
    """All five requests arrive together: the first one's prefix blocks are registered when
    allocated, so the others, admitted in the same step, share them at once."""
    path = tiny_checkpoint("llama")
    prompts = shared_prefix_prompts(512)
    expected = hf_greedy(path, prompts, MAX_TOKENS)
    llm = LLM(path, device="cpu", dtype="float32", block_size=BS)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert [o.num_cached_tokens for o in outs] == [0] + [PREFIX // BS * BS] * 4
    assert llm.engine.block_manager.num_used_blocks == 0


def test_a_failed_step_forgets_the_blocks_it_registered(tiny_checkpoint, monkeypatch):
    path = tiny_checkpoint("llama")
    prompt = shared_prefix_prompts(512)[0]
    llm = LLM(path, device="cpu", dtype="float32", block_size=BS)
    engine = llm.engine
    real_run = engine.runner.run
    monkeypatch.setattr(engine.runner, "run", lambda *a, **kw: 1 / 0)
    request_id = engine.add_request(prompt, GREEDY)
    with pytest.raises(ZeroDivisionError):
        engine.step()
    assert len(engine.block_manager.cache) == 0, "blocks whose K/V were never written stay cached"
    engine.abort(request_id)  # what AsyncEngine does with the requests of a failed step
    monkeypatch.setattr(engine.runner, "run", real_run)
    out = llm.generate([prompt], GREEDY)[0]
    assert out.num_cached_tokens == 0 and out.token_ids == hf_greedy(path, [prompt], MAX_TOKENS)[0]
    assert engine.block_manager.num_used_blocks == 0


def long_prompt(seed: int = 5, length: int = 30) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_adapters_never_share_blocks_and_equal_their_solo_runs(lora_world):
    prompt = long_prompt()
    adapters = ["kv-layer-patterns", "attn-r1", None]  # LoRA on k_proj and v_proj, and none
    solo_llm = lora_world.llm(lora_backend="torch", block_size=BS, enable_prefix_caching=False)
    solo = [solo_llm.generate([prompt], GREEDY, adapters=[a])[0].token_ids for a in adapters]
    assert len({tuple(s) for s in solo}) == 3, "the adapters should change the output"
    llm = lora_world.llm(lora_backend="torch", block_size=BS)
    for adapter, want in zip(adapters, solo):
        out = llm.generate([prompt], GREEDY, adapters=[adapter])[0]
        assert out.num_cached_tokens == 0, f"{adapter} shared another adapter's blocks"
        assert out.token_ids == want, f"{adapter}: differs from its solo run"
    again = llm.generate([prompt] * 3, GREEDY, adapters=adapters)
    assert [o.num_cached_tokens for o in again] == [(len(prompt) - 1) // BS * BS] * 3
    assert [o.token_ids for o in again] == solo
    assert llm.engine.block_manager.num_used_blocks == 0


def test_a_replaced_adapter_never_matches_its_old_blocks(lora_world, qv_replacement):
    prompt = long_prompt(seed=6)
    llm = lora_world.llm(lora_backend="torch", block_size=BS)
    old = llm.generate([prompt, prompt], GREEDY, adapters=["qv-r16", None])
    llm.add_adapter("qv-r16", qv_replacement.path)  # same name, new weights: a new version
    new = llm.generate([prompt, prompt], GREEDY, adapters=["qv-r16", None])
    fresh = LLM(lora_world.base, device="cpu", dtype="float32", lora_backend="torch",
                enable_prefix_caching=False)
    fresh.add_adapter("qv-r16", qv_replacement.path)
    want = fresh.generate([prompt], GREEDY, adapters=["qv-r16"])[0].token_ids
    assert new[0].num_cached_tokens == 0 and new[0].token_ids == want != old[0].token_ids
    assert new[1].num_cached_tokens > 0 and new[1].token_ids == old[1].token_ids  # base reused
    assert llm.engine.block_manager.num_used_blocks == 0
