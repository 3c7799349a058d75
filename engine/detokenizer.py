"""Generated token ids -> streamed text deltas, with stop strings cut out.

Incremental decoding after vLLM: keep two offsets into the token list, `prefix_offset` and
`read_offset`. The text of tokens[prefix:read] has been emitted already; decoding
tokens[prefix:] and dropping that known prefix gives the new text. Decoding a few tokens of
context (rather than the new token alone) keeps tokenizers that render a token differently at
the start of a string (SentencePiece's leading space) correct, and the window stays a handful of
tokens long, so each token costs O(1) however long the output grows.

The `tokenizers` library runs this same algorithm in Rust (`decoders.DecodeStream`, see
engine/decode_stream.py for where it gives the same text): one call per token instead of two
decodes from Python, half the cost. Where it might not, the window is decoded here. A
byte-level tokenizer needs neither: the same rule over each token's bytes (engine/token_bytes.py)
costs a lookup for most tokens, and keeps only the bytes of an unfinished character.
`prefix_offset` / `read_offset` move the same on the other two paths, so `flush`, and a switch
between them in the middle of a stream, find the window where the other left it.
"""

from __future__ import annotations

import re

from transformers import PreTrainedTokenizerBase

from engine.decode_stream import REPLACEMENT_CHAR, can_stream, open_decode_stream
from engine.sampling_params import SamplingParams
from engine.token_bytes import render, table_for

# How many prompt tokens seed the first window, as vLLM does.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """One request's output text. `step` per engine step, `flush` once at finish."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int],
                 params: SamplingParams):
        self.tokenizer = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", None)  # tokenizers.Tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = list(params.stop)
        # One search for them all: the leftmost match, and at one index the one listed first.
        self.stop_pattern = re.compile("|".join(map(re.escape, self.stop))) if self.stop else None
        self.include_stop = params.include_stop_str_in_output
        # Stop strings are looked for only in text that arrives after the first min_tokens
        # tokens (text those tokens made is never cut off or held back).
        self.min_tokens = params.min_tokens
        # The characters a proper prefix of a stop string can end with: text ending otherwise
        # holds nothing back, the common case, checked without a search.
        self.stop_prefix_ends = frozenset(c for s in self.stop for c in s[:-1])
        self.num_tokens = 0  # output tokens seen
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.tokens = context  # prompt tail, then every output token
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.pending = ""  # stable text not emitted yet (what may begin a stop string)
        self.emitted: list[str] = []  # the deltas returned, joined now and then (`text`)
        self.stop_reason: str | None = None
        # A byte-level tokenizer's token bytes (engine/token_bytes.py): the fastest path, where
        # the prompt tail ends on a whole character (else its bytes would join the output's).
        self.table = table_for(self.backend)
        if self.table is not None and render(self.table, context, self.skip_special_tokens) \
                .endswith(REPLACEMENT_CHAR):
            self.table = None
        self.held = b""  # the table path's bytes not yet emitted (an unfinished character)
        self.skipped = (self.table.special if self.table and self.skip_special_tokens
                        else frozenset())
        # Rust's copy of the window, or None while the window is decoded from here.
        self.streamable = self.table is None and can_stream(self.backend)
        self.stream = None
        if self.streamable:
            self._open_stream()

    def step(self, new_token_ids: list[int]) -> str:
        """Add generated tokens; return the text newly safe to show."""
        if self.stop_reason is not None:
            return ""
        self.num_tokens += len(new_token_ids)
        if not self.stop and len(new_token_ids) == 1:  # a decode step's token, nothing held back
            new_text = self._advance(new_token_ids[0])
            if new_text is None:
                return ""
            self.pending = ""  # = _emit's delta, without its search
            return self._emitting(new_text)
        for token_id in new_token_ids:
            self._advance(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """At finish: release held-back text, including any incomplete bytes as U+FFFD."""
        if self.stop_reason is not None:
            return ""
        if self.table is not None:
            self.pending += self.held.decode("utf-8", "replace")
        elif self.read_offset < len(self.tokens):  # some tokens are held
            prefix_text, new_text = self._window()
            self.pending += new_text[len(prefix_text):]
        self.prefix_offset = self.read_offset = len(self.tokens)
        self.stream, self.held = None, b""  # their window is not this one now
        return self._emit(final=True)

    def _decode(self, ids: list[int]) -> str:
        # No clean-up of spaces: it is not concatenation-safe across windows (and is a no-op for
        # the BPE tokenizers LLMs use). A fast tokenizer's own Rust decode is what
        # transformers' decode calls then; called directly it costs a third (2 vs 7 µs), and
        # the window path runs it twice per token.
        if self.backend is not None:
            return self.backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _window(self) -> tuple[str, str]:
        prefix_text = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.tokens[self.prefix_offset:])
        return prefix_text, new_text

    def _advance(self, token_id: int) -> str | None:
        """Move the new stable text into `pending` and slide the window past it; returns that
        text (None while the token is held)."""
        if self.table is not None:  # its held bytes are all its state: no window to slide
            new_text = self._table_step(token_id)
            if new_text is not None:
                self.pending += new_text
            return new_text
        self.tokens.append(token_id)
        if self.stream is None:
            new_text = self._window_step()
        else:
            try:
                new_text = self.stream.step(self.backend, token_id)
            except Exception:  # its one error, InvalidPrefix, is not the caller's to see
                # The decoder rewrote text already emitted (byte-fallback bytes that stopped
                # forming a character): the window path decodes this step as it always did.
                self.stream = None
                new_text = self._window_step()
        if new_text is None:
            return None
        self.pending += new_text
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        if self.stream is None and self.streamable:
            self._open_stream()
        return new_text

    def _open_stream(self) -> None:
        # Only where the read offset is at the end, as a new DecodeStream's is: at the start and
        # right after text was emitted.
        self.stream = open_decode_stream(self.backend, self.tokens[self.prefix_offset:],
                                         self.skip_special_tokens)

    def _table_step(self, token_id: int) -> str | None:
        """The window rule in the byte model: the held bytes and the token's, decoded; held
        while that is empty or ends in U+FFFD. (An id past the tokenizer's, as a padded
        vocabulary samples, renders nothing, as its decode gives.)"""
        table = self.table
        known = token_id < len(table.bytes) and token_id not in self.skipped
        if not self.held and known:
            text = table.text[token_id]  # a whole character or more: the common case
            if text is not None:
                return text
        data = self.held + table.bytes[token_id] if known else self.held
        text = data.decode("utf-8", "replace")
        if not text or text.endswith(REPLACEMENT_CHAR):
            self.held = data
            return None
        self.held = b""
        return text

    def _window_step(self) -> str | None:
        """The newest token's stable text, or None while it is held."""
        prefix_text, new_text = self._window()
        # Hold while the token added nothing visible (a skipped special token) or the tail is an
        # unfinished multi-byte character; the window widens until the character completes.
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return None
        return new_text[len(prefix_text):]

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self.emitted)

    def _emitting(self, delta: str) -> str:
        self.emitted.append(delta)
        if len(self.emitted) >= 256:  # (a long output's text without one copy per token)
            self.emitted = ["".join(self.emitted)]
        return delta

    def _emit(self, final: bool) -> str:
        """Cut at the first stop string, else emit all but a possible stop-string beginning."""
        pending = self.pending
        if not self.stop or self.num_tokens <= self.min_tokens:  # no stop string to look for
            self.pending = ""
            return self._emitting(pending)
        # Every stop string that could still match starts in `pending`, because anything that
        # might begin one has been held back.
        hit = self._find_stop()
        if hit is not None:
            index, stop = hit
            self.stop_reason = stop
            end = index + len(stop) if self.include_stop else index
        else:
            end = len(pending) if final else len(pending) - self._stop_prefix_len()
        self.pending = pending[end:]
        return self._emitting(pending[:end])

    def _find_stop(self) -> tuple[int, str] | None:
        """(index, stop string) of the earliest stop string in `pending`, if any."""
        match = self.stop_pattern.search(self.pending)
        return None if match is None else (match.start(), match.group())

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of the unemitted text that is a proper prefix of a stop
        string (text emitted before min_tokens ran out is never taken back)."""
        pending = self.pending
        if not pending or pending[-1] not in self.stop_prefix_ends:
            return 0
        best = 0
        for s in self.stop:
            tail = pending[max(0, len(pending) - len(s) + 1):]
            i = tail.find(s[0])  # each start of a candidate: only where s's first char is
            while i != -1 and len(tail) - i > best:
                if s.startswith(tail[i:]):
                    best = len(tail) - i
                    break
                i = tail.find(s[0], i + 1)
        return best
