"""The engine: requests in, token increments out. One `step()` = schedule, run, sample.

Knows tokens, blocks and slots; knows nothing of HTTP. Not thread-safe by itself: the
offline `LLM` drives it directly, engine/core/loop.py's EngineLoop from one thread (of a
server's, or of a process of its own). `close()` frees everything it holds.
"""

from __future__ import annotations

import gc
import logging
import time

import torch

from loragw.engine.adapter_calls import AdapterCalls
from loragw.engine.config import Config
from loragw.engine.kv.block_manager import BlockManager
from loragw.engine.lora.manager import LoRAManager
from loragw.engine.parallel.runner import start_runner
from loragw.engine.request.checks import RequestLimits, check_request
from loragw.engine.request.detokenizer import IncrementalDetokenizer
from loragw.engine.request.params import SamplingParams, with_max_tokens
from loragw.engine.request.sequence import (
    EngineRequest,
    Prompt,
    RequestOutput,
    Sequence,
    SequenceStatus,
)
from loragw.engine.request.state import RequestState
from loragw.engine.request.stops import StopRule
from loragw.engine.request.structured import GrammarCompiler, GuidedState
from loragw.engine.request.tokenizer import eos_token_ids, tokenize, try_load_tokenizer
from loragw.engine.runner.prompt_logprobs import record_prompt_logprobs
from loragw.engine.runner.sampler import Sampler
from loragw.engine.sched.batch import ScheduledBatch
from loragw.engine.sched.pipeline import InFlight, drop_pending
from loragw.engine.sched.plan import plan_step
from loragw.engine.sched.scheduler import Scheduler
from loragw.engine.spec.speculator import Speculator
from loragw.engine.spec.verify import NewTokens, sample_plain
from loragw.kernels.meta import host_to_device

logger = logging.getLogger(__name__)


class LLMEngine(AdapterCalls):
    def __init__(self, config: Config):
        self.config = config
        started = time.perf_counter()
        self.tokenizer = try_load_tokenizer(config.model, detokenizing=True)
        # the step's runner, this process's model runner, and where slot changes also go
        self.runner, self.model_runner, sink = start_runner(config)
        local = self.model_runner
        self.vocab_size = local.args.vocab_size
        self.block_manager = BlockManager(local.num_kv_blocks, config.block_size,
                                          config.enable_prefix_caching, local.kv_window,
                                          config.max_num_batched_tokens)
        self.lora = LoRAManager(config, local.model, local.device, local.dtype, sink)
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens,
                                   self.block_manager, slots=self.lora,
                                   max_prefill_decoding=config.max_prefill_tokens_decoding)
        self.eos_token_ids = eos_token_ids(config.model, self.tokenizer)
        blocks = self.block_manager
        self.limits = RequestLimits(self.vocab_size, config.max_model_len, config.max_logprobs,
                                    frozenset(self.eos_token_ids), blocks.num_blocks,
                                    blocks.block_size, blocks.window, blocks.max_chunk)
        self.sampler = Sampler(config.seed, self.eos_token_ids)
        self.speculator = (None if config.speculative is None else Speculator(
            config.speculative, config, blocks.num_blocks, self.vocab_size))
        self.requests: dict[str, RequestState] = {}
        self.closed = False
        self._grammars: GrammarCompiler | None = None  # built by the first guided request
        self._aborted: list[RequestOutput] = []  # final outputs of requests ended between steps
        self.in_flight: InFlight | None = None  # a step whose tokens are not read (pipeline.py)
        logger.info("engine ready in %.1f s: %s", time.perf_counter() - started, config.model)

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """The engine's admission rules (engine/request/checks.py), run on every request before
        any is queued: the gateway and the offline API get the same refusals."""
        check_request(self.limits, prompt_ids, params)

    def close(self) -> None:
        """Free what the engine holds now, not when collected: requests, tensor-parallel
        workers, model, KV cache, adapter slots and host copies. Idempotent; serves nothing after."""
        if self.closed:
            return
        self.closed = True
        for request_id in list(self.requests):
            self.abort(request_id)
        self._aborted.clear()
        self.in_flight = None
        self.runner.close()
        self.lora.close()
        if self.speculator is not None:
            self.speculator.close()
        gc.collect()  # the model's modules and the pools refer to each other
        if self.model_runner.device.type == "cuda":
            torch.cuda.empty_cache()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this engine is closed: build another to serve")

    def add_requests(self, requests: list[EngineRequest]) -> list[str]:
        """Check every request, then queue them all (so a bad one changes nothing); returns
        their request ids. ValueError (InvalidParam, AdapterError) on bad input."""
        self._check_open()
        staged = []
        for r in requests:
            prompt_ids = tokenize(self.tokenizer, r.prompt)
            self.check_request(prompt_ids, r.params)
            if r.request_id is not None and r.request_id in self.requests:
                raise ValueError(f"request id {r.request_id!r} is already in use")
            if r.adapter is not None:
                self.lora.check_known(r.adapter)
            # Structured output's matcher: compiling the grammar also checks the spec.
            guided = self.grammars.new_state(r.params.guided) if r.params.guided else None
            staged.append((r, prompt_ids, guided))
        return [self._queue(r, prompt_ids, guided) for r, prompt_ids, guided in staged]

    def add_request(self, prompt: Prompt, params: SamplingParams, adapter: str | None = None,
                    request_id: str | None = None) -> str:
        """Check and queue one request; raises ValueError (changing nothing) on bad input."""
        return self.add_requests([EngineRequest(prompt, params, adapter, request_id)])[0]

    def _queue(self, r: EngineRequest, prompt_ids: list[int], guided: GuidedState | None) -> str:
        params = with_max_tokens(r.params, len(prompt_ids), self.config.max_model_len)
        assert len(prompt_ids) + params.max_tokens <= self.config.max_model_len, "check_request"
        seq = Sequence(prompt_ids, params, adapter=r.adapter, request_id=r.request_id or "",
                       arrival=time.monotonic())
        self.scheduler.add(seq)
        detok = (IncrementalDetokenizer(self.tokenizer, prompt_ids, params)
                 if self.tokenizer is not None else None)
        stop = StopRule.of(params, len(prompt_ids), self.limits.eos_token_ids,
                           self.config.max_model_len)
        self.requests[seq.request_id] = RequestState(seq, detok, stop, guided=guided)
        return seq.request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Drop a request now: its KV blocks and adapter slot are freed before this returns."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        drop_pending(request.seq)  # a token in flight is never read
        self._finish(request.seq, "abort")
        out = request.output([], [], "")
        self._aborted.append(out)
        return out

    def drain_aborted(self) -> list[RequestOutput]:
        """Final outputs of requests aborted since the last call (for streams to close)."""
        aborted, self._aborted = self._aborted, []
        return aborted

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run and sample one step (drafts first; timed for engine/spec/goodput.py):
        the outputs of the tokens read back in it (async: the step before's, and this one's)."""
        self._check_open()
        if self.speculator is None:
            return self._step()[0]
        self.speculator.propose(self.scheduler.running, self.sampler)
        started = time.perf_counter()
        outputs, batch = self._step()
        self.speculator.measure(batch, time.perf_counter() - started)
        return outputs

    def _step(self) -> tuple[list[RequestOutput], ScheduledBatch]:
        batch = self.scheduler.schedule()
        flight, self.in_flight = self.in_flight, None
        if not batch.seqs:
            if flight is not None:
                return self._read(flight), batch
            if self.lora.reads.pending:  # what waits, waits for an adapter read
                self.lora.reads.wait(timeout=0.01)
            return [], batch
        try:
            lora = self.lora.prepare(batch)  # None when no row has an adapter
            sampling = batch.sampling_seqs()
            masks = self._fill_masks(sampling)  # on the mask thread, during the forward pass
            pending = flight.inputs(batch) if flight is not None else None
            step = self.runner.run(plan_step(batch, lora), pending)  # logit rows' logits [L, V]
        except BaseException:
            self.block_manager.rollback()  # blocks registered for this step hold no K/V
            self.in_flight = flight  # its tokens are still the host's to read
            raise
        self.block_manager.commit(batch.seqs, batch.num_new_tokens)
        record_prompt_logprobs(step, batch)
        if (self.config.async_scheduling and sampling and masks is None and not step.prompt
                and all(seq.params.pipelines for seq in sampling)):
            launched = InFlight(sampling, self.sampler.tokens(self._sampling_logits(step),
                                                              sampling))
            outputs = self._read(flight) if flight is not None else []
            launched.hold()
            self.in_flight = launched
            return outputs, batch
        if flight is None:  # (the common step: no row can have ended since it was scheduled)
            return (self._advance(sampling, *self._sample(step, sampling, masks)) if sampling
                    else []), batch
        outputs = self._read(flight)
        if sampling:
            outputs += self._advance(sampling, *self._sample(step, sampling, masks), True)
        return outputs, batch

    def _advance(self, seqs: list[Sequence], tokens: list[list[int]], logprobs: list,
                 after_read: bool = False) -> list[RequestOutput]:
        """Take each sequence's new tokens (RequestState.advance); retire those that ended.
        after_read: rows may have ended on the token read before them (async scheduling)."""
        outputs, requests, finished = [], self.requests, SequenceStatus.FINISHED
        for seq, new, new_logprobs in zip(seqs, tokens, logprobs):
            if after_read and seq.status is finished:
                continue  # its token here follows the one that ended it: never taken
            out = requests[seq.request_id].advance(new, new_logprobs)
            if seq.spec_tokens:  # verified: its kept drafts are all its new tokens but the last
                if not out.finished:
                    self.block_manager.settle_verified(seq, len(new) - 1)
                seq.spec_tokens = []
            if out.finished:
                self._finish(seq, out.finish_reason)
                del requests[seq.request_id]
            outputs.append(out)
        return outputs

    def _read(self, flight: InFlight) -> list[RequestOutput]:
        """The outputs of the step in flight: its tokens read back and taken."""
        seqs, tokens = flight.take()  # the sequences still waiting for a token: none has ended
        outputs = self._advance(seqs, [[token] for token in tokens], [None] * len(seqs))
        for seq in seqs:
            if seq.status is SequenceStatus.RUNNING:
                self.block_manager.settle_pending(seq)
        return outputs

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)  # frees its KV blocks and adapter slot
        if self.speculator is not None:
            self.speculator.forget(seq)  # and the proposer's copy

    def _sample(self, step, sampling: list[Sequence], masks) -> NewTokens:
        """Each sampling sequence's new tokens: one sampled, or its kept drafts and one more."""
        mask = masks.result() if masks else None
        if self.speculator is not None:
            return self.speculator.sample(self.sampler, step, sampling, mask)
        return sample_plain(self.sampler, self._sampling_logits(step), sampling, mask)

    @staticmethod
    def _sampling_logits(step) -> torch.Tensor:
        """The sampling rows' logits [S, V] of the step's logit rows."""
        logits = step.logits
        if len(step.sampling) < logits.shape[0]:
            logits = logits[host_to_device(step.sampling, logits.device)]
        return logits

    @property
    def grammars(self) -> GrammarCompiler:
        """The structured-output compiler, built on first use (needs the tokenizer)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("structured output needs a tokenizer, and this model has none")
            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size,
                                             sorted(self.eos_token_ids))
        return self._grammars

    def _fill_masks(self, sampling: list[Sequence]):
        """A future of the TokenMask of the constrained rows of `sampling`, or None. Its rows
        are the sampler's: the rows without drafts first, one each, then the drafted rows'
        k + 1 each (Speculator.sample splits them)."""
        if self._grammars is None:
            return None  # no request has ever been guided
        states, row = [], 0
        for seq in sorted(sampling, key=lambda s: bool(s.spec_tokens)):  # plain, then drafted
            guided = self.requests[seq.request_id].guided
            start = guided.constrained_from(seq.spec_tokens) if guided is not None else None
            if start is not None:  # rows before the end of its thinking are free
                states.append((row + start, guided, seq.spec_tokens[start:]))
            row += len(seq.spec_tokens) + 1
        return self._grammars.fill_async(states) if states else None

    @property  # introspection (metrics, tests)
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_free_kv_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    def sequence(self, request_id: str) -> Sequence | None:
        request = self.requests.get(request_id)
        return request.seq if request else None


__all__ = ["EngineRequest", "LLMEngine", "RequestOutput", "SequenceStatus"]
