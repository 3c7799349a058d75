"""Draft-model proposals: a small model of the target's tokenizer runs k cheap steps per
proposal, with its own paged KV cache and, per target adapter, its own LoRA (a drafter
fine-tuned like the adapter it drafts for; rows without one use the plain draft).

Each drafting sequence has a shadow `Sequence` here: its own block table in the draft's cache
and its own copy of the tokens. A proposal step, for all drafting sequences at once:

    catch up   one forward over each shadow's tokens the draft has not seen (the whole prompt
               the first time; after that the target's last kept tokens), giving d_1
    k - 1      one-token forwards, each feeding the previous draft, giving d_2 .. d_k

Drafts' K/V stay in the draft cache; at the next proposal the shadow keeps those whose tokens
the target accepted (the common prefix of its tokens and the target's) and recomputes the rest.
Greedy rows take the draft's argmax; sampled rows draw from the draft's own distribution q
(temperature, top-k/p/min-p of the request) and hand q to verification. The draft runs on this
process's device only, also under tensor parallelism (it is small).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from loragw.adapters.format import read_adapter
from loragw.engine.config import Config
from loragw.engine.kv.block_manager import BlockManager
from loragw.engine.lora.manager import LoRAManager
from loragw.engine.request.sequence import Sequence, SequenceStatus
from loragw.engine.runner.model_runner import ModelRunner
from loragw.engine.runner.sampler import Sampler, argmax_rows, draw
from loragw.engine.sched.batch import ScheduledBatch
from loragw.engine.sched.plan import plan_step

logger = logging.getLogger(__name__)


class DraftProposer:
    def __init__(self, target: Config, model: str, draft_adapters: dict[str, str],
                 num_kv_blocks: int, vocab_size: int):
        self.config = Config(
            model, device=target.device, dtype=target.dtype, max_num_seqs=target.max_num_seqs,
            max_num_batched_tokens=target.max_num_batched_tokens,
            max_model_len=target.max_model_len, block_size=target.block_size,
            num_kv_blocks=num_kv_blocks, enable_prefix_caching=False,
            max_loras=target.max_loras, max_lora_rank=target.max_lora_rank,
            lora_backend=target.lora_backend, attention_backend=target.attention_backend,
            linear_backend=target.linear_backend,
            elementwise_backend=target.elementwise_backend, enforce_eager=True, quantization="auto")
        self.runner = ModelRunner(self.config)
        if self.runner.args.vocab_size != vocab_size:
            raise ValueError(f"the draft model's vocabulary ({self.runner.args.vocab_size} "
                             f"tokens) is not the target's ({vocab_size}): a draft must share "
                             "the target's tokenizer")
        self.blocks = BlockManager(self.runner.num_kv_blocks, target.block_size, False,
                                   self.runner.kv_window, target.max_num_batched_tokens)
        self.lora = LoRAManager(self.config, self.runner.model, self.runner.device,
                                self.runner.dtype)
        self.shadows: dict[int, Sequence] = {}  # target seq_id -> its shadow here
        self.synced: dict[int, int] = {}  # target seq_id -> its token count at the last sync
        for name, path in draft_adapters.items():
            self.add_adapter(name, path)
        self.budget = target.max_num_batched_tokens

    def add_adapter(self, target_adapter: str, path: str) -> None:
        """Register (or replace) the draft LoRA of `target_adapter`'s rows; AdapterError when
        it does not fit the draft model."""
        self.lora.add(target_adapter, read_adapter(path, self.lora.spec), path=path)
        for seq_id, shadow in list(self.shadows.items()):  # K/V of the old weights are void
            if shadow.adapter == target_adapter:
                self._drop(seq_id)

    def close(self) -> None:
        self.shadows.clear()
        self.runner.close()
        self.lora.close()

    def free_drafts(self, seqs: list[Sequence], ks: list[int]) -> None:
        return None  # every draft is a step of the draft model

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int],
                sampler: Sampler) -> list[tuple[list[int], torch.Tensor | None]]:
        """Up to ks[j] drafts for seqs[j] and, for a sampled row, q: [len(drafts), V]. A
        sequence whose unseen tokens exceed the step's budget catches up a chunk at a time and
        drafts once it has caught up."""
        rows, budget = [], self.budget  # (j, shadow, tokens it computes in the first forward)
        for j, seq in enumerate(seqs):
            shadow = self._shadow(seq)
            n = min(shadow.num_tokens - shadow.num_computed_tokens, budget)
            if n and self.blocks.grow(shadow, shadow.num_computed_tokens + n + ks[j] - 1):
                rows.append((j, shadow, n))
                budget -= n
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        while rows:
            logits = self._forward([s for _, s, _ in rows], [n for _, _, n in rows])
            drafting = []
            for j, shadow, _ in rows:
                if shadow.seq_id not in logits:  # still catching up
                    continue
                token, q = self._pick(logits[shadow.seq_id], seqs[j], sampler)
                drafts[j].append(token)
                if q is not None:
                    probs[j].append(q)
                if len(drafts[j]) < ks[j]:
                    shadow.token_ids.append(token)  # fed at the next forward
                    drafting.append((j, shadow, 1))
            rows = drafting
        return [(d, torch.stack(p) if p else None) for d, p in zip(drafts, probs)]

    def _forward(self, shadows: list[Sequence], num_new: list[int]) -> dict[int, torch.Tensor]:
        """One draft forward of num_new[i] unseen tokens of each shadow -> the last logits [V]
        of each shadow that reached its last token, by shadow seq_id."""
        order = sorted(range(len(shadows)), key=lambda i: num_new[i] != 1)  # decode rows first
        batch = ScheduledBatch([shadows[i] for i in order], [num_new[i] for i in order],
                               num_decode=sum(n == 1 for n in num_new))
        step = self.runner.run(plan_step(batch, self.lora.prepare(batch)))
        sampling = batch.sampling_seqs()
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
        return {seq.seq_id: step.logits[row] for seq, row in zip(sampling, step.sampling)}

    def _pick(self, row: torch.Tensor, seq: Sequence, sampler: Sampler) -> tuple[int, torch.Tensor | None]:
        if seq.params.greedy:
            return int(argmax_rows(row[None])[0]), None
        q = sampler.probs(row[None].float(), [seq])[0]  # [V]
        return draw(q, sampler.generator(seq, q.device)), q

    def _shadow(self, seq: Sequence) -> Sequence:
        """seq's shadow, its tokens synced to the target's: the K/V of drafts the target did
        not keep are recomputed."""
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            adapter = seq.adapter if seq.adapter in self.lora.adapters else None
            shadow = Sequence(seq.prompt_token_ids, replace(seq.params, prompt_logprobs=None),
                              adapter=adapter, token_ids=list(seq.token_ids))
            shadow.status = SequenceStatus.RUNNING
            if adapter is not None and not self.lora.acquire(shadow):
                shadow.adapter = None  # no draft slot free: the plain draft serves it
            self.shadows[seq.seq_id] = shadow
            self.synced[seq.seq_id] = len(seq.token_ids)
            return shadow
        mine, theirs = shadow.token_ids, seq.token_ids
        kept = self.synced.get(seq.seq_id, 0)  # tokens both had when it last drafted
        end = min(len(mine), len(theirs), shadow.num_computed_tokens)
        while kept < end and mine[kept] == theirs[kept]:
            kept += 1
        shadow.token_ids = list(theirs)
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, kept)
        self.blocks.trim(shadow, max(shadow.num_computed_tokens, 1))
        self.synced[seq.seq_id] = len(theirs)
        return shadow

    def forget(self, seq_id: int) -> None:
        """Drop a finished or aborted request's shadow and its draft K/V."""
        if seq_id in self.shadows:
            self._drop(seq_id)

    def forget_all_but(self, alive: set[int]) -> None:
        """Drop the shadows (and draft K/V) of finished, aborted and preempted requests. A
        running request that drafts nothing this step (backing off, opted out, the batch rule)
        keeps its shadow: dropping it would recompute its whole context at its next draft."""
        for seq_id in [i for i in self.shadows if i not in alive]:
            self._drop(seq_id)

    def _drop(self, seq_id: int) -> None:
        shadow = self.shadows.pop(seq_id)
        self.synced.pop(seq_id, None)
        self.blocks.free(shadow)
        if shadow.adapter is not None:
            self.lora.release(shadow)
