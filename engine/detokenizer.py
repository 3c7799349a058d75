"""Generated token ids -> streamed text deltas, with stop strings cut out.

Incremental decoding after vLLM: keep two offsets into the token list, `prefix_offset` and
`read_offset`. The text of tokens[prefix:read] has been emitted already; decoding
tokens[prefix:] and dropping that known prefix gives the new text. Decoding a few tokens of
context (rather than the new token alone) keeps tokenizers that render a token differently at
the start of a string (SentencePiece's leading space) correct, and the window stays a handful of
tokens long, so each token costs O(1) however long the output grows.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from engine.sampling_params import SamplingParams

# How many prompt tokens seed the first window, as vLLM does.
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"  # what a decoder writes for an incomplete UTF-8 sequence


class IncrementalDetokenizer:
    """One request's output text. `step` per engine step, `flush` once at finish."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int],
                 params: SamplingParams):
        self.tokenizer = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", None)  # tokenizers.Tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = list(params.stop)
        self.include_stop = params.include_stop_str_in_output
        # Stop strings are looked for only in text that arrives after the first min_tokens
        # tokens (text those tokens made is never cut off or held back).
        self.min_tokens = params.min_tokens
        self.num_tokens = 0  # output tokens seen
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.tokens = context  # prompt tail, then every output token
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.decoded = ""  # all stable output text, stop strings included
        self.text = ""  # the part of `decoded` already emitted
        self.stop_reason: str | None = None

    def step(self, new_token_ids: list[int]) -> str:
        """Add generated tokens; return the text newly safe to show."""
        if self.stop_reason is not None:
            return ""
        for token_id in new_token_ids:
            self.tokens.append(token_id)
            self._advance()
        self.num_tokens += len(new_token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """At finish: release held-back text, including any incomplete bytes as U+FFFD."""
        if self.stop_reason is not None:
            return ""
        prefix_text, new_text = self._window()
        self.decoded += new_text[len(prefix_text):]
        self.prefix_offset = self.read_offset = len(self.tokens)
        return self._emit(final=True)

    def _decode(self, ids: list[int]) -> str:
        # No clean-up of spaces: it is not concatenation-safe across windows (and is a no-op for
        # the BPE tokenizers LLMs use). A fast tokenizer's own Rust decode is what
        # transformers' decode calls then; called directly it costs a third (2 vs 7 µs), and
        # this runs twice per token of every stream.
        if self.backend is not None:
            return self.backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _window(self) -> tuple[str, str]:
        prefix_text = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.tokens[self.prefix_offset:])
        return prefix_text, new_text

    def _advance(self) -> None:
        """Move new stable text into `decoded` and slide the window past it."""
        prefix_text, new_text = self._window()
        # Hold while the token added nothing visible (a skipped special token) or the tail is an
        # unfinished multi-byte character; the window widens until the character completes.
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return
        self.decoded += new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)

    def _emit(self, final: bool) -> str:
        """Cut at the first stop string, else emit all but a possible stop-string beginning."""
        if self.num_tokens <= self.min_tokens:  # too early for a stop string: emit it all
            delta = self.decoded[len(self.text):]
            self.text += delta
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
        self.text += delta
        return delta

    def _find_stop(self, start: int) -> tuple[int, str] | None:
        """(index, stop string) of the earliest stop string in decoded[start:], if any."""
        hits = [(i, s) for s in self.stop if (i := self.decoded.find(s, start)) != -1]
        return min(hits, key=lambda h: h[0]) if hits else None

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of `decoded` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.decoded)), best, -1):
                if self.decoded.endswith(s[:n]):
                    best = n
                    break
        return best
