"""Completions in OpenAI's legacy shapes: chunks and whole responses, logprobs with their
text offsets, `echo` (the prompt's text first, and with logprobs the prompt tokens' logprobs:
the first null, as the legacy API and vLLM give them), and vLLM's `prompt_logprobs`."""

from __future__ import annotations

from dataclasses import replace

from msgspec import UNSET

from loragw.engine.api import RequestOutput, TokenLogprob
from loragw.gateway.http.jobs import Choice, TokenCounts
from loragw.gateway.http.response_bodies import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    Usage,
)
from loragw.gateway.openai.formats import Format, usage, vllm_prompt_logprobs


class CompletionFormat(Format):
    """`echo`: each prompt's text, by prompt index; a choice's text starts with its prompt's (a
    stream sends it first, with the prompt's logprobs when `logprobs` is asked for). `prompts`:
    each prompt's token ids (their first token has no logprob). `only_prompt`: max_tokens 0,
    so the one token the engine generated is not shown (nor counted)."""

    def __init__(self, *args, echo: list[str] | None = None,
                 prompts: list[list[int]] | None = None, only_prompt: bool = False):
        super().__init__(*args)
        self.echo, self.prompts, self.only_prompt = echo, prompts, only_prompt
        self.offsets: dict[int, int] = {}  # text_offset of each choice's next token
        self.echoed: set[int] = set()  # choices whose prompt went out already

    def _logprobs(self, index: int, entries: list[TokenLogprob | None],
                  first_token: int | None = None) -> CompletionLogprobs:
        """Entries as the legacy API shows them; None (a prompt's first token, `first_token`)
        has no logprob and no top alternatives."""
        text = self.token_text
        ids = [first_token if e is None else e.token_id for e in entries]
        tokens = [text(t) for t in ids]
        offsets, at = [], self.offsets.get(index, 0)
        for token in tokens:
            offsets.append(at)
            at += len(token)
        self.offsets[index] = at
        return CompletionLogprobs(
            tokens=tokens, token_logprobs=[None if e is None else e.logprob for e in entries],
            top_logprobs=[None if e is None else {text(t): lp for t, lp in e.top}
                          for e in entries], text_offset=offsets)

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None):
        return CompletionResponse(id=self.id, created=self.created, model=self.model,
                                  choices=choices, usage=usage)

    def head(self, choices: list[Choice]) -> list:
        if self.echo is None or self.logprobs:  # with logprobs: the first output brings them
            return []
        self.echoed.update(c.index for c in choices)
        return [self._chunk([CompletionChoice(c.index, self.echo[c.prompt_index], None, None)])
                for c in choices]

    def _shown(self, choice: Choice, out: RequestOutput) -> tuple[str, list]:
        """(text, logprob entries) a choice shows of `out`: its prompt first if it is owed."""
        text, entries = out.new_text, list(out.new_logprobs)
        if self.only_prompt:
            text, entries = "", []
        if self.echo is not None and choice.index not in self.echoed:
            self.echoed.add(choice.index)
            text = self.echo[choice.prompt_index] + text
            if self.logprobs and out.prompt_logprobs is not None:
                entries = list(out.prompt_logprobs) + entries
        return text, entries

    def delta(self, choice: Choice, out: RequestOutput):
        text, entries = self._shown(choice, out)
        logprobs = (self._logprobs(choice.index, entries, self._first(choice))
                    if self.logprobs else None)
        prompt = vllm_prompt_logprobs(out.prompt_logprobs, self.token_text, self.prompt_logprobs)
        if not text and not (logprobs and logprobs.tokens) and prompt is UNSET:
            return None
        return self._chunk([CompletionChoice(choice.index, text, logprobs, None, prompt)])

    def finish(self, choice: Choice):
        return self._chunk([CompletionChoice(choice.index, "", None, self.finish_reason(choice))])

    def whole(self, choices: list[Choice], parts: dict[int, list[RequestOutput]],
              counts: TokenCounts):
        out = []
        for c in choices:
            shown = [self._shown(c, o) for o in parts[c.index]]
            entries = [e for _, es in shown for e in es]
            logprobs = self._logprobs(c.index, entries, self._first(c)) if self.logprobs else None
            prompt = next((o.prompt_logprobs for o in parts[c.index]
                           if o.prompt_logprobs is not None), None)
            out.append(CompletionChoice(c.index, "".join(t for t, _ in shown), logprobs,
                                        self.finish_reason(c),
                                        vllm_prompt_logprobs(prompt, self.token_text,
                                                             self.prompt_logprobs)))
        if self.only_prompt:
            counts = replace(counts, completion=0)
        return self._chunk(out, usage(counts))

    def usage_chunk(self, counts: TokenCounts):
        return super().usage_chunk(replace(counts, completion=0) if self.only_prompt else counts)

    def _first(self, choice: Choice) -> int | None:
        return self.prompts[choice.prompt_index][0] if self.prompts else None
