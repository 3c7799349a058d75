"""The engine requests behind one HTTP request: a `GenerationJob` of `Choice`s.

A job owns the engine streams of one request (one per choice: prompts x n), each read by its
own pump task that hands every increment to the consumer's sink. `close()` is synchronous,
idempotent and safe inside a cancelled scope: it aborts every unfinished sequence (freeing its
KV blocks and adapter slot) and gives the request's capacity back. Every job is closed by
whoever finishes with it: the collector for a whole response, the SSE generator's `finally`
and the streaming response's after-response hook for a stream (gateway/openai/streaming.py; a
client that disconnects cancels the stream; whichever runs first closes the job).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from loragw.engine.api import EngineClient, RequestOutput
from loragw.gateway.common.tasks import spawn
from loragw.gateway.observe.metrics import Metrics
from loragw.gateway.tenants.windows import Reservation

logger = logging.getLogger(__name__)
@dataclass(frozen=True, slots=True)
class TokenCounts:
    """A job's usage: prompt tokens (each prompt once), generated tokens, cached prompt tokens."""

    prompt: int
    completion: int
    cached: int


@dataclass(slots=True, eq=False)
class Choice:
    """One engine request, which is one OpenAI choice."""

    index: int
    request_id: str
    prompt_index: int
    num_prompt_tokens: int
    stream: AsyncIterator[RequestOutput] | None = None
    started: bool = False  # its pump reads the engine stream (whose clean-up then aborts it)
    finished: bool = False
    finish_reason: str | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # of its prompt's tokens, found in the prefix cache
    first_token_at: float | None = None


Sink = Callable[[Choice, "RequestOutput | BaseException"], None]


@dataclass(eq=False)
class GenerationJob:
    """The engine requests of one HTTP request. `start(sink)` starts one pump task per choice;
    each output, after accounting, goes to the sink (one finished output per choice, then
    nothing more for it), and so does any engine error."""

    id: str  # the response id: cmpl-... or chatcmpl-...
    engine: EngineClient
    choices: list[Choice]
    adapter: str | None
    metrics: Metrics
    arrival: float  # time.monotonic() when the HTTP request arrived
    on_close: Callable[[GenerationJob], None] = lambda job: None
    tenant: str = "operator"  # the caller's tenant, the label of its tenant metrics
    reservation: Reservation | None = None  # of the caller's key limits, finished on close
    version: int | None = None  # the adapter's catalog version (its metrics label)
    # with tracing: each choice's engine phases as spans, given its finished output
    trace: Callable[[str, RequestOutput], None] | None = None
    _sink: Sink | None = None
    _early: list[tuple[Choice, RequestOutput]] = field(default_factory=list)  # before start()
    _pumps: list[asyncio.Task] = field(default_factory=list)
    closed: bool = False

    @property
    def counts(self) -> TokenCounts:
        """Token counts so far: each prompt once, its cached tokens, all choices' outputs."""
        prompts = {c.prompt_index: c.num_prompt_tokens for c in self.choices}
        prompt = sum(prompts.values())
        completion = sum(c.num_output_tokens for c in self.choices)
        # Each prompt counts once (as in prompt_tokens) with what every one of its choices
        # found cached, so cached_tokens never exceeds prompt_tokens.
        cached: dict[int, int] = {}
        for c in self.choices:
            cached[c.prompt_index] = min(cached.get(c.prompt_index, c.num_cached_tokens),
                                         c.num_cached_tokens)
        return TokenCounts(prompt, completion, sum(cached.values()))

    @property
    def num_unfinished(self) -> int:
        """Choices whose finished output the sink is still to get (read before start())."""
        return sum(not c.finished for c in self.choices)

    def start(self, sink: Sink) -> None:
        """Start reading the engine streams into `sink`.

        Each engine stream is read by its own task, even when there is one: a client that
        disconnects cancels the response inside an anyio cancel scope, which would cancel
        the engine stream's own clean-up (its abort) again at every await. A pump task is
        cancelled exactly once, so the abort it runs on the way out completes.
        """
        assert self._sink is None, "a job is consumed once"
        self._sink = sink
        self._pumps = [asyncio.ensure_future(self._pump(c)) for c in self.choices]
        for choice, out in self._early:
            self._deliver(choice, out)

    def _deliver(self, choice: Choice, out: RequestOutput | BaseException) -> None:
        if choice.finished:
            return  # an output that raced with abort()
        if self._sink is None:
            self._early.append((choice, out))
            return
        if not isinstance(out, BaseException):
            self._account(choice, out)
        self._sink(choice, out)

    async def _pump(self, choice: Choice) -> None:
        choice.started = True
        out = None
        try:
            async for out in choice.stream:
                self._deliver(choice, out)
        except Exception as exc:  # the engine failed this sequence: hand it to the consumer
            self._deliver(choice, exc)
            return
        if out is None or not out.finished:
            self._deliver(choice, RuntimeError(f"engine stream {choice.request_id} ended "
                                               "without finishing"))

    def _account(self, choice: Choice, out: RequestOutput) -> None:
        now = time.monotonic()
        if choice.first_token_at is None and out.new_token_ids:
            choice.first_token_at = now
        choice.num_output_tokens = out.num_output_tokens
        choice.num_cached_tokens = out.num_cached_tokens
        if out.finished:
            choice.finished, choice.finish_reason = True, out.finish_reason
            if self.trace is not None:
                self.trace(choice.request_id, out)
            ttft = None if choice.first_token_at is None else choice.first_token_at - self.arrival
            if out.finish_reason == "abort":
                self.metrics.count_completion(self.adapter, self.version,
                                              out.num_output_tokens)
            else:
                self.metrics.observe_sequence(self.adapter, self.version, ttft,
                                              now - self.arrival, out.num_output_tokens)

    def abort(self) -> None:
        """End every unfinished choice now with finish_reason "abort" (its adapter is being
        unloaded, or the server is stopping): the consumer gets a last output per choice and
        finishes normally; the sequences are aborted in the engine."""
        self._cancel_pumps()
        for choice in self.choices:
            if choice.finished:
                continue
            if not choice.started:
                spawn(self.engine.abort(choice.request_id))
            self._deliver(choice, RequestOutput(
                choice.request_id, [], "", [], True, "abort", None, choice.num_prompt_tokens,
                choice.num_output_tokens, choice.num_cached_tokens))

    def close(self) -> None:
        """Abort what is unfinished and give the capacity back; idempotent, synchronous."""
        if self.closed:
            return
        self.closed = True
        self._cancel_pumps()
        for choice in self.choices:
            if choice.finished:
                continue
            self.metrics.count_completion(self.adapter, self.version, choice.num_output_tokens)
            if not choice.started:
                # Never iterated (its pump never ran), so nothing else will abort it.
                spawn(self.engine.abort(choice.request_id))
        self.on_close(self)

    def _cancel_pumps(self) -> None:
        """Cancel each pump once: the CancelledError lands in its stream's __anext__, whose
        finally then awaits the engine's abort. A second cancel would land in that await and
        cancel the engine call itself (an engine call does not survive that)."""
        pumps, self._pumps = self._pumps, []
        for task in pumps:
            task.cancel()

    async def aclose(self) -> None:
        """close() as a coroutine, for Litestar's after-response hook."""
        self.close()
