"""A slot refilled over another adapter holds exactly what a fresh slot filled with the new
adapter holds: the old adapter's columns past the new rank and its modules the new one does not
adapt are zero, the ranks and scales are the new adapter's, and a clear leaves the slot all
zero (engine/lora/pool.py fills over the old adapter instead of clearing the whole slot first).
The grid: every order of a rank-16, a rank-1 and a q_proj-only adapter, and the greedy tokens
of an evicting run against a run where every adapter stays resident."""

import dataclasses
import itertools

import pytest
import torch
from small_world import make_engine, make_llm, prompts

from loragw.adapters.format import read_adapter
from loragw.engine import SamplingParams

pytestmark = pytest.mark.timeout(120)


def adapters(checkpoint, engine) -> dict[str, object]:
    """ad3 (rank 16), ad0 (rank 1) and ad3 cut to q_proj only, parsed for `engine`'s base."""
    _, paths = checkpoint
    spec = engine.lora.spec
    wide, narrow = read_adapter(paths["ad3"], spec), read_adapter(paths["ad0"], spec)
    q_only = dataclasses.replace(wide, modules={k: m for k, m in wide.modules.items()
                                                if k[1] == "q_proj"})
    return {"wide": wide, "narrow": narrow, "q_only": q_only}


def slot_state(pool, index: int) -> list[torch.Tensor]:
    """Every buffer of slot `index` in the projection pools, ranks and scales included."""
    out = []
    for _, linear in pool.model.lora_linears():
        lora = linear.lora
        out += [lora.lora_a[:, index], lora.lora_b[index], lora.ranks[:, index],
                lora.scales[:, index]]
    return out


@pytest.mark.parametrize("order", list(itertools.permutations(["wide", "narrow", "q_only"])))
def test_refill_equals_a_fresh_fill(checkpoint, order):
    engine, fresh = make_engine(checkpoint, max_loras=2), make_engine(checkpoint, max_loras=2)
    parsed = adapters(checkpoint, engine)
    pool, fresh_pool = engine.lora.pool, fresh.lora.pool
    for name in order:
        pool.fill(0, parsed[name])
        expected = make_engine(checkpoint, max_loras=2).lora.pool
        expected.fill(0, parsed[name])
        for got, want in zip(slot_state(pool, 0), slot_state(expected, 0), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    pool.clear(0)
    fresh_pool.reserve(parsed["wide"])
    for got, want in zip(slot_state(pool, 0), slot_state(fresh_pool, 0), strict=True):
        assert torch.equal(got, want)  # all zero again
    assert not any(any(ranks) for ranks, _ in pool.tables[0])


def test_evicting_run_matches_resident_run(checkpoint):
    """Five adapters of ranks 1-16 through two slots (every step may refill one) give the
    tokens that five slots give."""
    batch = prompts(10, seed=3)
    names = [f"ad{k % 5}" for k in range(10)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tight = make_llm(checkpoint, max_loras=2, max_num_seqs=2)
    roomy = make_llm(checkpoint, max_loras=5)
    got = [o.token_ids for o in tight.generate(batch, params, adapters=names)]
    want = [o.token_ids for o in roomy.generate(batch, params, adapters=names)]
    assert got == want
    assert tight.engine.lora.stats.device_evictions > 0
