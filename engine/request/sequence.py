"""Shared nouns of the engine: one request's sequence and what a step hands back."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum, auto

import msgspec
import torch

from loragw.engine.request.params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the N most likely alternatives, most likely first
    rank: int | None = None  # of token_id among all tokens, 1 = most likely (prompt logprobs)


_ids = itertools.count()
PENDING = -1  # Sequence.token_ids' placeholder for a token sampled but not read back yet
Prompt = str | list[int]  # text, or token ids


@dataclass(slots=True, eq=False)
class Sequence:
    """One request's tokens, KV blocks and progress. Prompt and outputs share `token_ids`.

    The scheduler fills `block_table` and `num_computed_tokens` (through the block manager),
    and `cache_key` on admission; the block manager memoises `block_hashes` and sets
    `num_cached_tokens`; the sampler appends to `token_ids`; the engine sets `finish_reason`
    (and the detokenizer `stop_reason`).
    """

    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: str | None = None
    request_id: str = ""
    seq_id: int = field(default_factory=lambda: next(_ids))
    token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    # leading block_table entries handed back for lying before every layer's window (they
    # name the padding block now); the block manager's, under a sliding window only
    num_dropped_blocks: int = 0
    # The adapter weights its K/V come from: (adapter, version), None for the base model.
    cache_key: tuple[str, int] | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # of its full blocks, under cache_key
    num_cached_tokens: int | None = None  # prompt tokens found cached at its first admission
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    logprobs: list[TokenLogprob] = field(default_factory=list)
    generator: torch.Generator | None = None  # per-request RNG when params.seed is set
    lora_slot: int = -1  # device slot of its adapter while running (set by LoRAManager)
    adapter_version: int = 0  # the adapter weights' version it started on (0: not yet)
    arrival: float = 0.0  # time.monotonic() when queued, as are the stage times below
    scheduled_at: float | None = None  # first admitted to a batch (the scheduler's)
    first_token_at: float | None = None  # its first output token kept (RequestState.take)
    # (start, end) of the host -> device copy of its adapter it waited for (LoRAManager.acquire)
    device_load: tuple[float, float] | None = None
    # params.prompt_logprobs: one entry per prompt token so far, filled chunk by chunk by the
    # engine (the first token has none); None when not asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Proposed next tokens this step verifies (speculative decoding, engine/spec): set by the
    # proposer, cut to the step's budget by the scheduler, cleared once verified
    spec_tokens: list[int] = field(default_factory=list)
    # Its last token is a placeholder (PENDING) for the token a step still in flight samples:
    # the next step was scheduled before the host read it (--async-scheduling, engine/sched/pipeline.py)
    pending: bool = False
    # len(prompt_token_ids), which never change: read by every row of every step
    num_prompt_tokens: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.prompt_token_ids)
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if not self.request_id:
            self.request_id = str(self.seq_id)
        if self.params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.params.seed)
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asked for prompt logprobs and some prompt tokens have none yet."""
        return (self.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens)

    def set_cache_key(self, key: tuple[str, int] | None) -> None:
        """Run under `key` from now on; hashes made under another adapter version are void."""
        if key != self.cache_key:
            self.cache_key = key
            self.block_hashes.clear()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED


@dataclass(slots=True)
class RequestTimes:
    """When one request reached each stage, in time.monotonic() seconds of the engine's
    process (CLOCK_MONOTONIC: one clock for every process on the host); on its finished
    output only, for the gateway's queue / prefill / decode trace spans."""

    arrival: float
    scheduled: float | None  # None: finished (aborted) before it was ever scheduled
    first_token: float | None
    finished: float
    device_load: tuple[float, float] | None = None  # its adapter's copy into a device slot


class RequestOutput(msgspec.Struct, gc=False):
    """What one step produced for one request (increments; `finished` on the last one).

    A msgspec Struct: one is made per request per step (a third of a dataclass's cost), and it
    crosses to the server as it is. Not tracked by the garbage collector: it refers to nothing
    that refers back to it."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    stop_reason: str | int | None  # the stop string or stop token that ended it
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    # with params.prompt_logprobs, on its first output: one per prompt token, the first None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    times: RequestTimes | None = None  # on the finished output


@dataclass(slots=True)
class EngineRequest:
    """One request to queue: a prompt (text or token ids) and how to sample it."""

    prompt: Prompt
    params: SamplingParams
    adapter: str | None = None
    request_id: str | None = None
