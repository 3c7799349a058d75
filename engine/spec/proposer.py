"""What proposes a step's drafts: prompt lookup in the request's own tokens (NgramProposer,
engine/spec/ngram.py) or a small draft model (DraftProposer, engine/spec/draft.py), chosen once
from --speculative-config's method. The Speculator asks it through this interface only."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from torch import Tensor

from loragw.engine.request.sequence import Sequence
from loragw.engine.runner.sampler import Sampler
from loragw.engine.spec.ngram import NgramProposer

if TYPE_CHECKING:
    from loragw.engine.config import Config
    from loragw.engine.speculative_config import SpeculativeConfig


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], ks: list[int],
                sampler: Sampler) -> list[tuple[list[int], Tensor | None]]:
        """Up to ks[j] drafts for seqs[j] and, where the drafts were sampled, their
        distribution q: [len(drafts), V] (None: greedy, or no model behind them)."""

    def free_drafts(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]] | None:
        """Up to ks[j] drafts for seqs[j] made without a model step (prompt lookup), or None
        where drafting needs one (a draft model): the Speculator then learns a row's
        acceptance from rows that did not verify them too, and proposes with them."""

    def forget(self, seq_id: int) -> None:
        """Drop what it keeps of a finished or aborted request."""

    def forget_all_but(self, alive: set[int]) -> None:
        """Drop what it keeps of every request but these (preempted ones included)."""

    def add_adapter(self, name: str, path: str) -> None:
        """Register (or replace) the draft LoRA that drafts for adapter `name`'s rows;
        ValueError where there is no draft model to hold it."""

    def close(self) -> None:
        """Free what it holds (a draft model's weights and KV cache)."""


def make_proposer(config: SpeculativeConfig, target: Config, num_kv_blocks: int,
                  vocab_size: int) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    from loragw.engine.spec.draft import DraftProposer  # loads a second model

    return DraftProposer(target, config.model, config.draft_adapters, num_kv_blocks, vocab_size)
