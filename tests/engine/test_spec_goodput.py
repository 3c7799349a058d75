"""How many drafts a request proposes (engine/spec/goodput.py): against a stub cost model, the
greedy choice reaches the best goodput an exhaustive search finds, drafts where a step's cost
barely grows with its tokens and stops where it grows in step (the batch rule, derived), and
pays for a draft model's step only when the rows together earn it; through the Speculator with
prompt lookup, a request learns from its own history (shadow drafts while it proposes none)
to stop drafting when its drafts miss and to draft again when they hit; a proposer that cannot
draft for free probes."""

import itertools

import numpy as np
import pytest

from loragw.engine import SamplingParams
from loragw.engine.request.sequence import Sequence
from loragw.engine.runner.sampler import Sampler
from loragw.engine.spec.goodput import (
    MIN_GAIN,
    PROBE_EVERY,
    Acceptance,
    StepCosts,
    choose_lengths,
    expected_tokens,
)
from loragw.engine.spec.ngram import lookup
from loragw.engine.spec.speculator import Speculator
from loragw.engine.speculative_config import parse_speculative_config


def measured(intercept: float, per_token: float, counts=range(1, 80)) -> StepCosts:
    """A stub cost model: t(n) = intercept + per_token * n, as if every count had been timed."""
    costs = StepCosts()
    for n in counts:
        costs.observe(n, intercept + per_token * n)
    return costs


def goodput(alphas, ks, rows, costs) -> float:
    emitted = rows + sum(expected_tokens(a, k) - 1 for a, k in zip(alphas, ks))
    return emitted / (costs.cost(rows + sum(ks)) + costs.proposal * max(ks, default=0))


@pytest.mark.parametrize("alphas", [(0.9,), (0.5,), (0.1,), (0.8, 0.3), (0.95, 0.6, 0.0),
                                    (0.4, 0.4, 0.4)])
@pytest.mark.parametrize("intercept,per_token,proposal", [
    (10.0, 0.5, 0.0),   # memory-bound decode: a token more costs 5% of a step
    (10.0, 3.0, 0.0),   # a costlier verification
    (10.0, 0.5, 4.0),   # a draft model's step per drafted position
    (0.0, 1.0, 0.0)])   # compute-bound: cost in step with tokens
def test_greedy_reaches_the_exhaustive_optimum(alphas, intercept, per_token, proposal):
    costs = measured(intercept, per_token)
    costs.proposal = proposal
    caps = [4] * len(alphas)
    ks = choose_lengths(list(alphas), caps, len(alphas), costs)
    best = max(goodput(alphas, list(c), len(alphas), costs)
               for c in itertools.product(range(5), repeat=len(alphas)))
    assert goodput(alphas, ks, len(alphas), costs) >= best / MIN_GAIN ** 2, ks


def test_memory_bound_batch_one_drafts_by_acceptance():
    costs = measured(10.0, 0.5)
    assert choose_lengths([0.9], [4], 1, costs) == [4]
    assert choose_lengths([0.02], [4], 1, costs) == [0]  # drafts that miss: none
    assert choose_lengths([0.9, 0.02], [4, 4], 2, costs) == [4, 0]  # each row its own


def test_the_batch_rule_follows_from_the_cost_model():
    """Where a step's time grows with every token (a big batch on a compute-bound device), no
    acceptance short of certainty pays for verification; at batch 1 the same rates draft."""
    compute_bound = measured(0.0, 1.0)
    assert choose_lengths([0.8] * 16, [4] * 16, 16, compute_bound) == [0] * 16
    light = measured(10.0, 0.5)
    assert choose_lengths([0.8], [4], 1, light) != [0]


def test_a_draft_models_step_is_paid_for_by_the_rows_together():
    costs = measured(10.0, 0.1)
    costs.proposal = 4.0  # one draft position costs 40% of a target step, for the whole batch
    assert choose_lengths([0.3], [3], 1, costs) == [0]
    # one row of eight cannot pay for the draft model's step; all eight together can
    assert choose_lengths([0.9] + [0.0] * 7, [3] * 8, 8, costs) == [0] * 8
    together = choose_lengths([0.9] * 8, [3] * 8, 8, costs)
    assert min(together) >= 1 and len(set(together)) == 1, together


def test_caps_forced_probes_and_unmeasured_costs():
    costs = measured(10.0, 0.5)
    assert choose_lengths([0.9, 0.9], [2, 0], 2, costs) == [2, 0]  # no drafts past a cap
    assert choose_lengths([0.0], [4], 1, costs, forced=[1]) == [1]  # a probe stays
    assert choose_lengths([0.9], [4], 1, StepCosts()) == [4]  # the prior alone: drafts pay
    assert choose_lengths([0.05], [4], 1, StepCosts()) == [0]


def test_step_costs_interpolate_extend_and_never_fall():
    costs = StepCosts()
    assert costs.cost(3) == 0.0
    costs.observe(1, 10.0)
    costs.observe(5, 12.0)
    costs.observe(9, 11.0)  # a noisy dip
    assert costs.cost(3) == pytest.approx(11.0)
    assert costs.cost(9) == 12.0 and costs.cost(7) == pytest.approx(12.0)
    assert costs.cost(13) > 12.0  # beyond the measured counts: the prior's slope
    costs.observe(1, 20.0)  # a slower machine: recent times weigh more
    assert 10.0 < costs.cost(1) < 20.0


def test_acceptance_counts_trials_to_the_first_miss():
    rate = Acceptance()
    rate.add(2, 4)  # two kept, the third rejected: 3 trials
    rate.add(4, 4)  # all kept: 4 trials, no miss
    assert (rate.kept, rate.trials) == pytest.approx((2 * 0.85 + 4, 3 * 0.85 + 4))
    assert Acceptance().rate(0.3) == pytest.approx(0.3)


# ---- through the Speculator, with prompt lookup ----------------------------------------------
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 2}


def decode(speculator: Speculator, seq: Sequence, next_token) -> list[int]:
    """One engine step for a lone decoding row: its drafts proposed, then (verification by a
    stub target) the drafts the target agrees with kept and one token of its own emitted."""
    speculator.propose([seq], Sampler())
    drafts, emitted = list(seq.spec_tokens), []
    for draft in drafts:
        token = next_token(seq.token_ids + emitted)
        emitted.append(token)
        if token != draft:
            break
    else:
        emitted.append(next_token(seq.token_ids + emitted))
    if drafts:
        speculator._learn(seq, len(emitted) - 1, len(drafts), speculator._row(seq))
    seq.token_ids.extend(emitted)
    seq.num_computed_tokens = seq.num_tokens - 1
    seq.spec_tokens = []
    return drafts


def contrary(tokens: list[int]) -> int:
    """A target that never writes what prompt lookup predicts (its drafts all miss)."""
    predicted = lookup(np.array(tokens), NGRAM["prompt_lookup_min"], NGRAM["prompt_lookup_max"], 1)
    return (predicted[0] + 1) % 5 if predicted else 0


def running(prompt: list[int]) -> Sequence:
    seq = Sequence(list(prompt), SamplingParams(max_tokens=500))
    seq.num_computed_tokens = seq.num_tokens - 1
    return seq


def batch_one_costs() -> StepCosts:
    return measured(10.0, 0.5, counts=range(1, 5))


def test_a_request_whose_lookups_miss_stops_drafting_and_one_whose_lookups_hit_drafts():
    speculator = Speculator(parse_speculative_config(NGRAM), None, 0, 0)
    speculator.costs = batch_one_costs()
    # lookups find matches in a small vocabulary, and every one is wrong
    missing = running([1, 3, 1, 3, 1])
    drafted = [decode(speculator, missing, contrary) for _ in range(40)]
    assert sum(map(bool, drafted[-20:])) == 0, drafted  # learnt from shadows: no drafts
    # the target repeats a cycle its prompt shows: lookups hit and it drafts in full
    hitting = running([5, 6, 4, 5, 6, 4, 5])
    drafted = [decode(speculator, hitting, lambda t: t[-3]) for _ in range(20)]
    assert all(len(d) == 3 for d in drafted[-10:]), drafted
    counts = speculator.counts[None]
    assert counts.choices == 60 and 0 < counts.chosen_tokens < 3 * 60


def test_a_request_whose_drafts_start_to_hit_drafts_again():
    speculator = Speculator(parse_speculative_config(NGRAM), None, 0, 0)
    speculator.costs = batch_one_costs()
    seq = running([1, 3, 1, 3, 1])
    for _ in range(30):
        decode(speculator, seq, contrary)
    assert not decode(speculator, seq, contrary)
    # from here the target repeats its last three tokens: the shadows see it within a few steps
    drafted = [decode(speculator, seq, lambda t: t[-3]) for _ in range(25)]
    assert all(len(d) == 3 for d in drafted[-10:]), drafted


class ModelDrafts:
    """A stand-in for the draft model: drafting needs a model step, so nothing is free."""

    def __init__(self):
        self.asked: list[int] = []

    def free_drafts(self, seqs, ks):
        return None

    def propose(self, seqs, ks, sampler):
        self.asked.extend(ks)
        return [([9] * k, None) for k in ks]

    def forget(self, seq_id):
        pass

    def forget_all_but(self, alive):
        pass


def test_a_proposer_that_cannot_draft_for_free_probes_every_few_steps():
    speculator = Speculator(parse_speculative_config(NGRAM), None, 0, 0)
    speculator.proposer = ModelDrafts()
    speculator.costs = batch_one_costs()
    speculator.costs.proposal = 8.0  # a draft position costs most of a step
    seq = running([1, 2, 3])
    drafted = [decode(speculator, seq, lambda t: (t[-1] + 1) % 50) for _ in range(3 * PROBE_EVERY + 3)]
    probes = [i for i, d in enumerate(drafted) if d]
    assert probes and all(len(drafted[i]) == 1 for i in probes), drafted
    assert all(b - a >= PROBE_EVERY for a, b in zip(probes, probes[1:])), probes
    assert len(probes) <= 4
