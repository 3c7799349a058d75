"""Generated token ids -> streamed text deltas, with stop strings cut out.

Incremental decoding after vLLM: keep two offsets into the token list, `prefix_offset` and
`read_offset`. The text of tokens[prefix:read] has been emitted already; decoding
tokens[prefix:] and dropping that known prefix gives the new text. Decoding a few tokens of
context (rather than the new token alone) keeps tokenizers that render a token differently at
the start of a string (SentencePiece's leading space) correct, and the window stays a handful of
tokens long, so each token costs O(1) however long the output grows.

The `tokenizers` library runs this same algorithm in Rust (`decoders.DecodeStream`, see
engine/decode_stream.py for where it gives the same text): one call per token instead of two
decodes from Python, half the cost. Where it might not, the window is decoded here.
`prefix_offset` / `read_offset` move the same either way, so `flush`, and a switch between the
two in the middle of a stream, find the window where the other left it.
"""

from __future__ import annotations

import re

from transformers import PreTrainedTokenizerBase

from engine.decode_stream import REPLACEMENT_CHAR, can_stream, open_decode_stream
from engine.sampling_params import SamplingParams

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
        self.decoded = ""  # all stable output text, stop strings included
        self.text = ""  # the part of `decoded` already emitted
        self.stop_reason: str | None = None
        # Rust's copy of the window, or None while the window is decoded from here.
        self.streamable = can_stream(self.backend)
        self.stream = None
        if self.streamable:
            self._open_stream()

    def step(self, new_token_ids: list[int]) -> str:
        """Add generated tokens; return the text newly safe to show."""
        if self.stop_reason is not None:
            return ""
        for token_id in new_token_ids:
            self._advance(token_id)
        self.num_tokens += len(new_token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """At finish: release held-back text, including any incomplete bytes as U+FFFD."""
        if self.stop_reason is not None:
            return ""
        if self.read_offset < len(self.tokens):  # some tokens are held
            prefix_text, new_text = self._window()
            self.decoded += new_text[len(prefix_text):]
        self.prefix_offset = self.read_offset = len(self.tokens)
        self.stream = None  # its window is not this one now
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

    def _advance(self, token_id: int) -> None:
        """Move the new stable text into `decoded` and slide the window past it."""
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
            return
        self.decoded += new_text
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        if self.stream is None and self.streamable:
            self._open_stream()

    def _open_stream(self) -> None:
        # Only where the read offset is at the end, as a new DecodeStream's is: at the start and
        # right after text was emitted.
        self.stream = open_decode_stream(self.backend, self.tokens[self.prefix_offset:],
                                         self.skip_special_tokens)

    def _window_step(self) -> str | None:
        """The newest token's stable text, or None while it is held."""
        prefix_text, new_text = self._window()
        # Hold while the token added nothing visible (a skipped special token) or the tail is an
        # unfinished multi-byte character; the window widens until the character completes.
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return None
        return new_text[len(prefix_text):]

    def _emit(self, final: bool) -> str:
        """Cut at the first stop string, else emit all but a possible stop-string beginning."""
        if not self.stop or self.num_tokens <= self.min_tokens:  # no stop string to look for
            delta, self.text = self.decoded[len(self.text):], self.decoded
            return delta
        # Every stop string that could still match starts at or after len(self.text), because
        # anything that might begin one has been held back.
        hit = self._find_stop(start=len(self.text))
        if hit is not None:
            index, stop = hit
            self.stop_reason = stop
            end = index + len(stop) if self.include_stop else index
        else:
            end = len(self.decoded) if final else len(self.decoded) - self._stop_prefix_len()
        assert end >= len(self.text), (end, len(self.text))
        delta = self.decoded[len(self.text):end]
        self.text = self.decoded[:end]
        return delta

    def _find_stop(self, start: int) -> tuple[int, str] | None:
        """(index, stop string) of the earliest stop string in decoded[start:], if any."""
        match = self.stop_pattern.search(self.decoded, start)
        return None if match is None else (match.start(), match.group())

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of the unemitted text that is a proper prefix of a stop
        string (text emitted before min_tokens ran out is never taken back)."""
        if len(self.decoded) == len(self.text) or self.decoded[-1] not in self.stop_prefix_ends:
            return 0
        best = 0
        for s in self.stop:
            tail = self.decoded[max(len(self.text), len(self.decoded) - len(s) + 1):]
            i = tail.find(s[0])  # each start of a candidate: only where s's first char is
            while i != -1 and len(tail) - i > best:
                if s.startswith(tail[i:]):
                    best = len(tail) - i
                    break
                i = tail.find(s[0], i + 1)
        return best
