"""Speculative decoding (engine/spec): prompt lookup, and verification that keeps the output
the target's: greedy tokens equal decoding without speculation (and PEFT's) in mixed-adapter
batches under chunked prefill and preemption; sampled tokens follow the target's distribution
(chi-square, with a deliberately wrong rule shown to fail the same test)."""

import numpy as np
import pytest
import torch
from peft_reference import MAX_TOKENS
from small_world import make_llm, prompts

from loragw.engine import SamplingParams
from loragw.engine.request.sequence import Sequence
from loragw.engine.runner.sampler import Sampler, draw
from loragw.engine.spec import verify as verify_module
from loragw.engine.spec.ngram import lookup
from loragw.engine.spec.verify import verify
from loragw.engine.speculative_config import parse_speculative_config

# engines with a draft model, many generations; verification is checked on every draft the
# proposer makes (the lengths' choice: test_spec_goodput.py)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("every_draft")]

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "disable_by_batch_size": 64}
ADAPTERS = [None, "ad0", "ad1", "ad2", None, "ad3", "ad4", "ad1"]


def test_lookup_takes_the_latest_longest_match():
    t = np.array([5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7])
    assert lookup(t, 1, 3, 2) == [9, 2]  # "6 7" last seen before the end at 5..6
    assert lookup(t, 1, 3, 5) == [9, 2, 6, 7]  # no more than the history holds
    assert lookup(np.array([1, 2, 3]), 1, 3, 4) == []
    assert lookup(np.array([4, 1, 2, 3, 1, 2, 3]), 3, 3, 2) == [1, 2]
    assert lookup(np.array([4, 1, 2, 3, 1, 2, 3]), 4, 4, 2) == []  # too short a match


@pytest.mark.parametrize("bad, problem", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3,
      "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown keys"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ("{not json", "not valid JSON"),
    ("", "empty; leave the flag out"),  # an unset template variable, never a silent "off"
    ("  ", "empty"),
    ({}, "empty"),
])
def test_bad_configs_are_refused_naming_the_problem(bad, problem):
    with pytest.raises(ValueError, match=problem):
        parse_speculative_config(bad)


def repetitive(n, seed=0):
    """Prompts that repeat a span, so prompt lookup has something to find."""
    return [p + p[: len(p) // 2] + p for p in prompts(n, seed)]


def accepted(llm) -> int:
    return sum(c.accepted_tokens for c in llm.engine.speculator.counts.values())


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=24, temperature=0.0),
    # two allowed tokens: the output cycles, so most drafts are kept (long accepted runs,
    # the bonus token, blocks filled by drafts); penalties and min_tokens see the drafts
    SamplingParams(max_tokens=40, temperature=0.0, allowed_token_ids=[3, 9],
                   repetition_penalty=1.3, presence_penalty=0.5, min_tokens=5),
], ids=["plain", "cycling-penalized"])
def test_greedy_tokens_equal_decoding_without_speculation(checkpoint, params):
    ps = repetitive(8)
    with make_llm(checkpoint) as plain:
        want = [o.token_ids for o in plain.generate(ps, params, ADAPTERS)]
    # 16-token steps chunk every prompt; 32 KV blocks of 4 tokens preempt
    with make_llm(checkpoint, speculative_config=NGRAM, max_num_batched_tokens=16,
                  num_kv_blocks=32, block_size=4) as spec:
        got = [o.token_ids for o in spec.generate(ps, params, ADAPTERS)]
        assert spec.engine.scheduler.num_preemptions > 0
        assert accepted(spec) > 0
        assert spec.engine.block_manager.num_used_blocks == 0
    assert got == want


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_mixed_adapters_match_peft(lora_world, method):
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    config = NGRAM if method == "ngram" else {
        "method": "draft_model", "num_speculative_tokens": 3, "model": lora_world.base,
        "disable_by_batch_size": 64, "draft_adapters": {"qv-r16": lora_world.dirs["qv-r16"]}}
    llm = lora_world.llm(speculative_config=config, max_num_batched_tokens=24)
    lora_world.check(llm.generate(lora_world.prompts, greedy, adapters=lora_world.requests),
                     f"{method} speculation")
    assert sum(c.draft_tokens for c in llm.engine.speculator.counts.values()) > 0


def test_requests_opt_out_and_large_batches_turn_it_off(checkpoint):
    ps = repetitive(4)
    off = SamplingParams(max_tokens=12, temperature=0.0, speculative=False)
    with make_llm(checkpoint, speculative_config=NGRAM) as llm:
        llm.generate(ps, off, ADAPTERS[:4])
        assert llm.engine.speculator.counts == {}
    # four decoding sequences > disable_by_batch_size 3: no step drafts until one finishes
    config = NGRAM | {"disable_by_batch_size": 3}
    with make_llm(checkpoint, speculative_config=config) as llm:
        lengths = [3, 12, 12, 12]
        llm.generate(ps, [SamplingParams(max_tokens=n, temperature=0.0) for n in lengths])
        # once the short request has finished, three decode: the others draft
        assert sum(c.draft_tokens for c in llm.engine.speculator.counts.values()) > 0
        with make_llm(checkpoint, speculative_config=config) as same:
            same.generate(ps, [SamplingParams(max_tokens=12, temperature=0.0)] * 4)
            assert same.engine.speculator.counts == {}


def test_seeded_sampling_repeats_itself(checkpoint):
    ps = repetitive(6)
    params = [SamplingParams(max_tokens=20, temperature=0.8, top_k=5, seed=i) for i in range(6)]
    runs = []
    for _ in range(2):
        with make_llm(checkpoint, speculative_config=NGRAM) as llm:
            runs.append([o.token_ids for o in llm.generate(ps, params, ADAPTERS[:6])])
    assert runs[0] == runs[1]


# ---- the rejection rule keeps the target's distribution ---------------------------------------
VOCAB = 6
TRIALS = 20000
# chi-square critical value at p = 0.001 for VOCAB - 1 = 5 degrees of freedom
CHI2_CRITICAL = 20.52


def _chi_square(counts: np.ndarray, p: np.ndarray) -> float:
    expected = p * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def _first_token_counts(p_logits: torch.Tensor, draft: int | None,
                        q: torch.Tensor | None) -> np.ndarray:
    """The first tokens of TRIALS sequences, verified in one batch, each with one draft: `draft`
    (a point mass), or drawn from q for each sequence."""
    seqs = [Sequence([0], SamplingParams(temperature=1.0)) for _ in range(TRIALS)]
    logits = p_logits.expand(2 * TRIALS, VOCAB)  # row 1 of each (after the draft): the bonus
    if q is None:
        drafts = [[draft]] * TRIALS
    else:
        rng = np.random.default_rng(0)
        p = q.double().numpy()
        drafts = [[int(d)] for d in rng.choice(VOCAB, TRIALS, p=p / p.sum())]
    draft_probs = None if q is None else [q[None, :]] * TRIALS
    verified = verify(Sampler(seed=0), logits, seqs, drafts, draft_probs)
    return np.bincount([v.token_ids[0] for v in verified], minlength=VOCAB)


P_LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 0.3])
Q = torch.tensor([0.05, 0.6, 0.1, 0.05, 0.1, 0.1])


@pytest.mark.parametrize("draft, q", [(0, None), (4, None), (None, Q)],
                         ids=["likely-point-draft", "unlikely-point-draft", "draft-distribution"])
def test_sampling_with_drafts_matches_the_target_distribution(draft, q):
    p = torch.softmax(P_LOGITS, -1).numpy()
    assert _chi_square(_first_token_counts(P_LOGITS, draft, q), p) < CHI2_CRITICAL


def test_a_wrong_acceptance_rule_fails_the_same_test(monkeypatch):
    """Resampling from p (not from the residual max(p - q, 0)) after a rejection over-weights
    the draft: the test above must see it."""
    def wrong(p, drafts, q, generator):
        u = float(torch.rand(1, generator=generator))
        if u < float(p[0, drafts[0]]):
            return [drafts[0], 0]
        return [draw(p[0], generator)]

    monkeypatch.setattr(verify_module, "_rejection_sample", wrong)
    p = torch.softmax(P_LOGITS, -1).numpy()
    assert _chi_square(_first_token_counts(P_LOGITS, 4, None), p) > CHI2_CRITICAL


# ---- text, stop strings, logprobs and grammars on a model with a tokenizer ---------------------
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "tags": {"type": "array", "maxItems": 4,
                                                    "items": {"enum": ["a", "bb", "ccc"]}}},
          "required": ["name", "tags"]}


def test_text_stops_logprobs_and_grammars_as_without_speculation(demo_model):
    import json

    from loragw.engine import LLM
    from loragw.engine.request.structured import GuidedDecoding

    prompts = ["the cat sat on the mat, the cat sat on the mat, the cat",
               "one two three four one two three four one two",
               "JSON please:", "abc abc abc abc"]
    greedy = dict(max_tokens=40, temperature=0.0)
    with LLM(demo_model, max_model_len=512) as plain:
        free = plain.generate(prompts[1:2], SamplingParams(**greedy))[0]
        stop = free.text[len(free.text) // 2:][:3]  # a stop string the output reaches
        params = [SamplingParams(**greedy, logprobs=2),
                  SamplingParams(**greedy, stop=[stop]),
                  SamplingParams(max_tokens=200, temperature=0.0,
                                 guided=GuidedDecoding("json_schema", SCHEMA)),
                  SamplingParams(max_tokens=9, temperature=0.0)]
        want = plain.generate(prompts, params)
    config = NGRAM | {"prompt_lookup_min": 2}
    with LLM(demo_model, max_model_len=512, speculative_config=config) as spec:
        got = spec.generate(prompts, params)
        assert accepted(spec) > 0
    for w, g in zip(want, got, strict=True):
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == \
               (w.token_ids, w.text, w.finish_reason, w.stop_reason)
    assert got[1].finish_reason == "stop" and got[1].stop_reason == stop
    assert len(got[3].token_ids) == 9
    for a, b in zip(want[0].logprobs, got[0].logprobs, strict=True):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert got[2].finish_reason == "stop"
    json.loads(got[2].text)


def test_sampled_grammar_output_stays_valid(demo_model):
    import json

    import jsonschema

    from loragw.engine import LLM
    from loragw.engine.request.structured import GuidedDecoding

    with LLM(demo_model, max_model_len=512, speculative_config=NGRAM) as llm:
        params = [SamplingParams(max_tokens=120, temperature=1.0, seed=i,
                                 guided=GuidedDecoding("json_schema", SCHEMA)) for i in range(8)]
        for out in llm.generate(["JSON:"] * 8, params):
            assert out.finish_reason == "stop", out.text
            jsonschema.validate(json.loads(out.text), SCHEMA)
        assert sum(c.draft_tokens for c in llm.engine.speculator.counts.values()) > 0


def test_guided_rows_draft_and_keep_the_grammar(demo_model):
    """A greedy JSON row alone: its drafts are masked by the grammar at every position."""
    import json

    from loragw.engine import LLM
    from loragw.engine.request.structured import GuidedDecoding

    params = SamplingParams(max_tokens=200, temperature=0.0,
                            guided=GuidedDecoding("json_schema", SCHEMA))
    with LLM(demo_model, max_model_len=512) as plain:
        want = plain.generate(["JSON please:"], params)[0]
    with LLM(demo_model, max_model_len=512, speculative_config=NGRAM) as spec:
        got = spec.generate(["JSON please:"], params)[0]
        counts = spec.engine.speculator.counts[None]
    assert counts.draft_tokens > 0 and counts.accepted_tokens > 0, counts
    assert got.token_ids == want.token_ids and got.finish_reason == "stop"
    json.loads(got.text)


# ---- draft-model proposals --------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory, checkpoint) -> str:
    """A 1-layer Llama of the small world's vocabulary, and a draft LoRA for it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("draft")
    torch.manual_seed(1)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)).save_pretrained(
        root / "model")
    return str(root / "model")


def draft_lora(path: str, seed: int) -> str:
    """A PEFT-format LoRA on the tiny draft's q_proj and down_proj."""
    import json
    import os

    import safetensors.torch

    os.makedirs(path)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                   "target_modules": ["q_proj", "down_proj"]}, f)
    g = torch.Generator().manual_seed(seed)
    prefix = "base_model.model.model.layers.0"
    safetensors.torch.save_file({
        f"{prefix}.self_attn.q_proj.lora_A.weight": torch.randn(4, 32, generator=g),
        f"{prefix}.self_attn.q_proj.lora_B.weight": torch.randn(32, 4, generator=g),
        f"{prefix}.mlp.down_proj.lora_A.weight": torch.randn(4, 64, generator=g),
        f"{prefix}.mlp.down_proj.lora_B.weight": torch.randn(32, 4, generator=g),
    }, os.path.join(path, "adapter_model.safetensors"))
    return path


@pytest.mark.parametrize("draft", ["tiny", "target"])
def test_draft_model_greedy_equals_decoding_without_speculation(checkpoint, tiny_draft, draft,
                                                                tmp_path):
    """A draft that rarely agrees (a tiny random model, with LoRAs for ad1's and ad2's rows) and
    one that agrees wherever it has the row's adapter (the target itself, with ad1 as ad1's
    draft LoRA): same tokens under chunked prefill and preemption."""
    base, _ = checkpoint
    config = {"method": "draft_model", "num_speculative_tokens": 3,
              "model": tiny_draft if draft == "tiny" else base, "disable_by_batch_size": 64}
    if draft == "tiny":
        config["draft_adapters"] = {"ad1": draft_lora(str(tmp_path / "d1"), 5)}
    else:  # ad1's rows are drafted by the target with ad1 itself: every draft is kept
        config["draft_adapters"] = {"ad1": checkpoint[1]["ad1"]}
    ps = repetitive(8)
    params = SamplingParams(max_tokens=20, temperature=0.0)
    with make_llm(checkpoint) as plain:
        want = [o.token_ids for o in plain.generate(ps, params, ADAPTERS)]
    with make_llm(checkpoint, speculative_config=config, max_num_batched_tokens=16,
                  num_kv_blocks=32, block_size=4) as spec:
        proposer = spec.engine.speculator.proposer
        if draft == "tiny":  # one more, registered while serving
            spec.add_draft_adapter("ad2", draft_lora(str(tmp_path / "d2"), 6))
            assert set(proposer.lora.adapters) == {"ad1", "ad2"}
        got = [o.token_ids for o in spec.generate(ps, params, ADAPTERS)]
        counts = spec.engine.speculator.counts
        assert proposer.shadows == {} and proposer.blocks.num_used_blocks == 0
    assert got == want
    drafted = sum(c.draft_tokens for c in counts.values())
    kept = sum(c.accepted_tokens for c in counts.values())
    assert drafted > 0
    if draft == "target":  # only rows of adapters without their draft LoRA can disagree
        for adapter in (None, "ad1"):
            assert counts[adapter].accepted_tokens == counts[adapter].draft_tokens > 0
        assert sum(counts[a].accepted_tokens < counts[a].draft_tokens
                   for a in ("ad0", "ad2", "ad3", "ad4")) >= 2, counts
    else:
        assert kept < drafted


def test_the_draft_never_recomputes_a_running_requests_context(checkpoint, tiny_draft):
    """A running request that drafts nothing for a while (the batch rule here; backing off
    too) keeps its draft K/V: later draft forwards compute only tokens the draft has not seen
    and the drafts it must redo, never the context again."""
    k = 3
    config = {"method": "draft_model", "num_speculative_tokens": k, "model": tiny_draft,
              "disable_by_batch_size": 2}  # 4 running: nobody drafts until 2 have finished
    ps = [p * 3 for p in prompts(4)]
    with make_llm(checkpoint, speculative_config=config) as spec:
        proposer = spec.engine.speculator.proposer
        seen: dict[int, int] = {}  # the request (by its prompt list) -> positions computed
        redone = []
        forward = proposer._forward

        def counting(shadows, num_new):
            for shadow, n in zip(shadows, num_new):
                start, key = shadow.num_computed_tokens, id(shadow.prompt_token_ids)
                redone.append(max(0, min(seen.get(key, 0), start + n) - start))
                seen[key] = max(seen.get(key, 0), start + n)
            return forward(shadows, num_new)

        proposer._forward = counting
        lengths = [6, 12, 30, 30]  # two finish early, then the other two draft
        spec.generate(ps, [SamplingParams(max_tokens=m, temperature=0.0) for m in lengths])
        assert proposer.shadows == {} and proposer.blocks.num_used_blocks == 0
    assert len(seen) == 2 and max(redone) <= k - 1, redone


def test_draft_model_sampling_is_seeded_and_refuses_another_vocabulary(checkpoint, tiny_draft,
                                                                       demo_model):
    config = {"method": "draft_model", "num_speculative_tokens": 3, "model": tiny_draft}
    ps = repetitive(3)
    params = [SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=i) for i in range(3)]
    runs = []
    for _ in range(2):
        with make_llm(checkpoint, speculative_config=config) as llm:
            runs.append([o.token_ids for o in llm.generate(ps, params)])
            assert sum(c.draft_tokens for c in llm.engine.speculator.counts.values()) > 0
    assert runs[0] == runs[1]
    with pytest.raises(ValueError, match="vocabulary"):
        make_llm(checkpoint, speculative_config=config | {"model": demo_model})
