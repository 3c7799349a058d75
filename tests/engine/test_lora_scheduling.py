"""LoRA-aware scheduling, watched step by step on the engine itself: slots are never
oversubscribed or overwritten under a running sequence, waiting adapters do not stall resident
ones, an adapter kept out by busy resident ones gets a slot within a bounded wait (aging),
requests without an adapter never reach the LoRA kernels, and everything is freed."""


import pytest
from small_world import NUM_ADAPTERS, make_engine, make_llm, prompts

from loragw.engine import SamplingParams
from loragw.engine.config import Config
from loragw.engine.llm_engine import LLMEngine
from loragw.kernels import LoRAKernels

# Each test takes about a second; a scheduler that stalls would spin in generate() forever.
pytestmark = pytest.mark.timeout(120)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def assert_all_free(engine: LLMEngine) -> None:
    assert not engine.has_unfinished()
    assert engine.num_free_kv_blocks == engine.block_manager.num_blocks
    assert all(slot.ref_count == 0 for slot in engine.lora.slots)
    assert engine.lora.slots_in_use == 0


class SlotWatch:
    """Checks the slot invariants every step, from inside LoRAManager.prepare and _fill."""

    def __init__(self, engine: LLMEngine, monkeypatch):
        self.engine, self.lora = engine, engine.lora
        self.held: dict[int, tuple[int, int]] = {}  # seq_id -> (slot, version) while running
        self.steps = self.max_distinct = 0
        lora, prepare, fill = self.lora, self.lora.prepare, self.lora._fill

        def watched_prepare(batch):
            self.check(batch)
            return prepare(batch)

        def watched_fill(index, name, entry):
            assert lora.slots[index].ref_count == 0, (
                f"slot {index} ({lora.slots[index].adapter}) refilled with {name} while "
                f"{lora.slots[index].ref_count} running sequences use it")
            return fill(index, name, entry)

        monkeypatch.setattr(lora, "prepare", watched_prepare)
        monkeypatch.setattr(lora, "_fill", watched_fill)

    def check(self, batch) -> None:
        lora = self.lora
        self.steps += 1
        distinct = {seq.adapter for seq in batch.seqs if seq.adapter}
        self.max_distinct = max(self.max_distinct, len(distinct))
        assert len(distinct) <= lora.num_slots, f"{len(distinct)} adapters in a step, {lora.num_slots} slots"
        for seq in batch.seqs:
            if seq.adapter is None:
                assert seq.lora_slot == -1
                continue
            slot = lora.slots[seq.lora_slot]
            assert slot.adapter == seq.adapter and not slot.stale
            assert slot.version == lora.adapters[seq.adapter].version
            held = self.held.setdefault(seq.seq_id, (seq.lora_slot, slot.version))
            assert held == (seq.lora_slot, slot.version), f"seq {seq.seq_id} moved slots mid-run"
        users = [0] * lora.num_slots
        for seq in self.engine.scheduler.running:
            if seq.adapter is not None:
                users[seq.lora_slot] += 1
        assert [s.ref_count for s in lora.slots] == users, "slot ref counts != running users"


def test_more_adapters_than_slots_never_oversubscribe_or_overwrite(checkpoint, monkeypatch):
    ps = prompts(12)
    adapters = [f"ad{k % NUM_ADAPTERS}" if k % 4 != 3 else None for k in range(12)]
    params = [greedy(6 + 3 * (k % 4)) for k in range(12)]
    reference = make_llm(checkpoint, max_loras=NUM_ADAPTERS).generate(ps, params, adapters)
    llm = make_llm(checkpoint, max_loras=2, max_num_seqs=8)
    watch = SlotWatch(llm.engine, monkeypatch)
    outputs = llm.generate(ps, params, adapters)
    for k, (out, ref) in enumerate(zip(outputs, reference, strict=True)):
        assert out.token_ids == ref.token_ids, f"request {k} ({adapters[k]}) differs with 2 slots"
    assert watch.max_distinct == 2, "the test never filled both slots"
    assert llm.engine.lora.stats.device_evictions > 0, "the test never reused a slot"
    assert_all_free(llm.engine)


def test_waiting_adapter_does_not_stall_resident_ones(checkpoint):
    llm = make_llm(checkpoint, max_loras=1)
    engine = llm.engine
    ps = prompts(3, seed=1)
    long_a = engine.add_request(ps[0], greedy(24), adapter="ad0")
    engine.step()  # long_a takes the only slot
    waiting_b = engine.add_request(ps[1], greedy(3), adapter="ad1")
    short_a = engine.add_request(ps[2], greedy(3), adapter="ad0")  # queued behind waiting_b
    b_seq = engine.sequence(waiting_b)
    finished = []
    for _ in range(100):  # 30 tokens' worth of steps, with room to spare
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                finished.append(out.request_id)
        if long_a not in finished:
            assert b_seq.num_computed_tokens == 0 and b_seq.lora_slot == -1, (
                "ad1 got ad0's slot while ad0 still had a running request")
    assert finished == [short_a, long_a, waiting_b], "short_a must overtake waiting_b"
    assert_all_free(llm.engine)


STARVATION_STEPS = 4
STREAM_TOKENS = 4  # each request of a stream: a prefill step, then three decode steps
STARVING_TOKENS = 3


def serve_stream(engine: LLMEngine, stream: list[str | None], starving: str, steps: int) -> dict:
    """For `steps` steps, one new request per entry of `stream` (an adapter, or None for the base
    model) arrives every step, so the stream's slots never go idle, while one request for the
    non-resident `starving` adapter waits from the start; then the stream stops and everything
    drains. Returns what a test needs to judge it (see the keys below)."""
    ps = prompts(4, seed=5)
    requests: dict[str, tuple[int, str | None, int, list[int]]] = {}  # id -> (prompt, adapter, max_tokens, tokens)

    def add(k: int, adapter: str | None, max_tokens: int) -> str:
        rid = engine.add_request(ps[k % len(ps)], greedy(max_tokens), adapter=adapter)
        requests[rid] = (k % len(ps), adapter, max_tokens, [])
        return rid

    for k, adapter in enumerate(stream):
        add(k, adapter, STREAM_TOKENS)
    for out in engine.step():  # the stream's adapters take their slots
        requests[out.request_id][3].extend(out.new_token_ids)
    assert set(engine.lora.resident()) == set(stream) - {None}
    waiting = add(len(stream), starving, STARVING_TOKENS)
    held_back = {adapter: 0 for adapter in stream}  # arrivals not admitted in their first step
    drained, finished_at, step = [], None, 0  # drained: each adapter that gave way, in turn
    while engine.has_unfinished():
        arrivals = [(add(step + k, a, STREAM_TOKENS), a) for k, a in enumerate(stream)
                    if step < steps]
        for out in engine.step():
            requests[out.request_id][3].extend(out.new_token_ids)
            if out.finished and out.request_id == waiting:
                finished_at = step
        for rid, adapter in arrivals:
            held_back[adapter] += engine.sequence(rid).num_computed_tokens == 0
        if engine.scheduler.draining not in (None, *drained[-1:]):
            drained.append(engine.scheduler.draining)
        step += 1
    assert not engine.scheduler.slot_waits and engine.scheduler.draining is None
    return {"finished_at": finished_at, "requests": requests, "held_back": held_back,
            "drained": drained}


def assert_solo_tokens(checkpoint, requests: dict) -> None:
    """Every request produced the tokens it produces when run alone."""
    llm = make_llm(checkpoint, max_loras=NUM_ADAPTERS)
    ps = prompts(4, seed=5)
    solo = {}
    for prompt, adapter, max_tokens, tokens in requests.values():
        key = (prompt, adapter, max_tokens)
        if key not in solo:
            solo[key] = llm.generate([ps[prompt]], greedy(max_tokens), [adapter])[0].token_ids
        assert tokens == solo[key], f"prompt {prompt} on {adapter} differs from its solo run"


def test_aging_gives_a_starving_adapter_the_only_slot(checkpoint, monkeypatch):
    engine = make_engine(checkpoint, max_loras=1, lora_starvation_steps=STARVATION_STEPS)
    watch = SlotWatch(engine, monkeypatch)  # never refills a slot under a running sequence
    run = serve_stream(engine, ["ad0", None], starving="ad1", steps=30)
    # It waits out the bound, then ad0's slot drains (its newest request runs to the end),
    # then it runs its own tokens: steps 0-3 refused, 4-6 draining, 7-9 its own.
    assert run["finished_at"] is not None
    assert run["finished_at"] <= STARVATION_STEPS + STREAM_TOKENS + STARVING_TOKENS
    # ad0 gave way; then its own held-back requests waited out the bound and ad1 gave it back.
    assert run["drained"] == ["ad0", "ad1"]
    assert run["held_back"][None] == 0, "aging held back requests without an adapter"
    assert watch.steps > 30
    assert_solo_tokens(checkpoint, run["requests"])
    assert_all_free(engine)


def test_without_aging_a_busy_resident_adapter_starves_the_others(checkpoint):
    engine = make_engine(checkpoint, max_loras=1, lora_starvation_steps=None)
    run = serve_stream(engine, ["ad0"], starving="ad1", steps=30)
    assert run["finished_at"] >= 30, "ad1 ran while ad0's stream was still arriving"
    assert run["held_back"]["ad0"] == 0 and run["drained"] == []
    assert_all_free(engine)


def test_aging_drains_one_slot_and_leaves_the_other_adapters_alone(checkpoint, monkeypatch):
    engine = make_engine(checkpoint, max_loras=2, lora_starvation_steps=STARVATION_STEPS)
    watch = SlotWatch(engine, monkeypatch)
    run = serve_stream(engine, ["ad0", "ad2", None], starving="ad3", steps=24)
    assert run["finished_at"] <= STARVATION_STEPS + STREAM_TOKENS + STARVING_TOKENS
    # ad0 and ad2 tie on running sequences: one of them gives way (one slot is enough), and
    # later ad3 hands that slot back; the other is never held back.
    drained, kept = run["drained"][0], ({"ad0", "ad2"} - set(run["drained"][:1])).pop()
    assert run["drained"] == [drained, "ad3"] and drained in ("ad0", "ad2")
    assert run["held_back"][kept] == 0, f"{kept} was held back though only {drained}'s slot was needed"
    assert run["held_back"][None] == 0, "aging held back requests without an adapter"
    assert watch.max_distinct == 2
    assert_solo_tokens(checkpoint, run["requests"])
    assert_all_free(engine)


def test_lora_starvation_steps_is_validated(checkpoint):
    with pytest.raises(ValueError, match="lora_starvation_steps must be at least 1"):
        Config(checkpoint[0], lora_starvation_steps=0)


def test_requests_without_adapters_never_reach_the_lora_kernels(checkpoint, monkeypatch):
    llm = make_llm(checkpoint, max_loras=2)
    ps = prompts(4, seed=2)
    calls = []
    apply = LoRAKernels.apply  # what the projections call (engine/layers/linear.py)
    monkeypatch.setattr(LoRAKernels, "apply", lambda *a, **k: (calls.append(1), apply(*a, **k)))
    steps = []  # (step has adapter tokens, kernel calls in it)
    prepare = llm.engine.lora.prepare

    def watched_prepare(batch):
        steps.append([any(seq.adapter for seq in batch.seqs), len(calls)])
        return prepare(batch)

    monkeypatch.setattr(llm.engine.lora, "prepare", watched_prepare)
    base_alone = llm.generate(ps, greedy(8))
    assert not calls, "a batch without adapters called the LoRA kernels"

    steps.clear()
    mixed = llm.generate(ps + ps[:1], [greedy(8)] * 4 + [greedy(2)], [None] * 4 + ["ad3"])
    counts = [b - a for (_, a), (_, b) in zip(steps, [*steps[1:], [None, len(calls)]], strict=True)]
    with_lora = [has for has, _ in steps]
    assert with_lora[:2] == [True, True] and not any(with_lora[2:]), with_lora
    assert all(n > 0 for n in counts[:2]) and not any(counts[2:]), counts
    assert [o.token_ids for o in mixed[:4]] == [o.token_ids for o in base_alone]
    assert_all_free(llm.engine)


def test_abort_releases_the_slot_at_once(checkpoint):
    llm = make_llm(checkpoint, max_loras=1)
    engine = llm.engine
    running = engine.add_request(prompts(1)[0], greedy(50), adapter="ad2")
    engine.step()
    waiting = engine.add_request(prompts(1, seed=3)[0], greedy(2), adapter="ad4")
    engine.step()
    assert engine.sequence(waiting).lora_slot == -1 and engine.lora.slots_in_use == 1
    engine.abort(running)
    assert engine.lora.slots_in_use == 0
    while engine.has_unfinished():
        engine.step()
    assert engine.lora.resident() == ["ad4"]
    assert_all_free(llm.engine)

