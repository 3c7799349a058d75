"""Bounded work per prompt text. A text too long to fit the context window is refused before it
is tokenized: no token covers more characters than the tokenizer's longest token has bytes, so
a text needs at least len(text) / longest tokens. A text that might fit but is long has only a
prefix tokenized first; whole texts are tokenized only once that prefix fits. Tokenizations off
the event loop share a cap, so a few callers cannot take the whole worker pool.

The refusal is check_request's (engine/request/checks.py): 400 context_length_exceeded naming
`prompt`, or `max_tokens` when the request asked for some.
"""

from __future__ import annotations

import asyncio
import os
import weakref
from dataclasses import dataclass

from loragw.gateway.common.errors import APIError

# A prefix of this many characters per context token is tokenized before a long text is: about
# twice the tokens English has, so a text that cannot fit is usually refused on the prefix.
PROBE_CHARS_PER_TOKEN = 8
# Tokens a prefix's cut may add to its last word (the whole text can have that many fewer).
PROBE_SLACK_TOKENS = 64
_longest: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_caps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True, slots=True)
class ContextBound:
    """The room a prompt has: the context window less max_tokens (None: at least one)."""

    max_model_len: int
    max_tokens: int | None

    def check(self, at_least: int, why: str) -> None:
        """Refuse a prompt known to have `at_least` tokens when that cannot fit."""
        if at_least + (self.max_tokens or 1) <= self.max_model_len:
            return
        plus = "" if self.max_tokens is None else f" plus {self.max_tokens} in max_tokens"
        raise APIError.bad_request(
            f"This model's maximum context length is {self.max_model_len} tokens, but the "
            f"request has at least {at_least} prompt tokens ({why}){plus}; shorten the prompt "
            "or lower max_tokens", param="prompt" if self.max_tokens is None else "max_tokens",
            code="context_length_exceeded")


def longest_token_bytes(tokenizer) -> int:
    """The most characters one token covers: the UTF-8 length of the tokenizer's longest
    decoded token (special tokens included), plus one; computed once per tokenizer, through
    its Rust decoder where it has one (Services does it at start-up)."""
    try:
        return _longest[tokenizer]
    except (KeyError, TypeError):
        pass
    ids = [[i] for i in range(len(tokenizer))]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    texts = (backend.decode_batch(ids, skip_special_tokens=False) if backend is not None
             else tokenizer.batch_decode(ids, skip_special_tokens=False))
    # +1: a decoder may drop a lone token's leading space (Metaspace's "▁"), which the token
    # covers in a text (byte-fallback pieces decoding to U+FFFD only overcount)
    longest = max((len(t.encode("utf-8", "surrogatepass")) for t in texts), default=0) + 1
    try:
        _longest[tokenizer] = longest
    except TypeError:  # not weak-referenceable: computed again next time
        pass
    return longest


def encode_bounded(tokenizer, text: str, bound: ContextBound,
                   add_special_tokens: bool = True) -> list[int]:
    """tokenizer.encode(text), unless the text cannot fit `bound`: refused on its length alone,
    or on the tokens of a bounded prefix, before the whole text is tokenized."""
    longest = longest_token_bytes(tokenizer) if len(text) > bound.max_model_len else 1
    bound.check(-(-len(text) // longest), f"{len(text)} characters, and no token of this "
                f"model covers more than {longest}")
    probe = (bound.max_model_len + 1) * PROBE_CHARS_PER_TOKEN
    if len(text) > probe:
        head = len(tokenizer.encode(text[:probe], add_special_tokens=False))
        bound.check(head - PROBE_SLACK_TOKENS, f"its first {probe} characters alone have "
                    f"{head} tokens")
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def tokenizing_cap() -> asyncio.Semaphore:
    """This event loop's cap on tokenizations running on worker threads: half the default
    executor's threads (asyncio.to_thread's pool), so other work always finds a thread."""
    loop = asyncio.get_running_loop()
    cap = _caps.get(loop)
    if cap is None:
        workers = getattr(getattr(loop, "_default_executor", None), "_max_workers", None)
        workers = workers or min(32, (os.cpu_count() or 1) + 4)  # ThreadPoolExecutor's default
        cap = _caps[loop] = asyncio.Semaphore(max(1, workers // 2))
    return cap
