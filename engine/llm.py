"""The offline API, vLLM-style: `LLM(path).generate(prompts, params)`."""

from __future__ import annotations

from dataclasses import dataclass, field

from tqdm import tqdm

from loragw.engine.config import Config
from loragw.engine.llm_engine import EngineRequest, LLMEngine, Prompt
from loragw.engine.request.params import SamplingParams
from loragw.engine.request.sequence import TokenLogprob


@dataclass
class GenerationOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    adapter: str | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


class LLM:
    """`LLM(model_dir, max_loras=8, ...)`: the keyword arguments are engine.Config's options
    (EngineOptions), validated there; or `LLM(config)` with a Config built already.

    `close()` (or leaving `with LLM(...) as llm:`) frees what it holds at once: the model, its
    KV cache, the adapters, and under tensor parallelism the worker ranks and their process
    group; a dropped LLM frees them when it is collected. One tensor-parallel LLM runs in a
    process at a time (torch.distributed has one default group): building another closes the
    previous one, so `llm = LLM(..., tensor_parallel_size=2)` may run again and again."""

    def __init__(self, model: str | Config, **options):
        self.config = model if isinstance(model, Config) else Config(model, **options)
        self.engine = LLMEngine(self.config)

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | list[Prompt],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 adapters: list[str | None] | None = None,
                 use_tqdm: bool = False) -> list[GenerationOutput]:
        """Run prompts to completion, batched together; outputs in prompt order. Every
        request is checked before any is queued, so a bad one changes nothing."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        adapters = adapters if adapters is not None else [None] * len(prompts)
        if not (len(params_list) == len(adapters) == len(prompts)):
            raise ValueError("prompts, params and adapters must have the same length")
        engine = self.engine
        order = engine.add_requests([EngineRequest(prompt, p, adapter) for prompt, p, adapter
                                     in zip(prompts, params_list, adapters)])
        results = {request_id: GenerationOutput(request_id, engine.sequence(request_id)
                                                .prompt_token_ids, adapter=adapter)
                   for request_id, adapter in zip(order, adapters)}
        with tqdm(total=len(order), desc="generating", disable=not use_tqdm) as bar:
            while engine.has_unfinished():
                for out in engine.step():
                    result = results.get(out.request_id)
                    if result is None:
                        continue
                    result.token_ids.extend(out.new_token_ids)
                    result.text += out.new_text
                    result.logprobs.extend(out.new_logprobs)
                    result.num_cached_tokens = out.num_cached_tokens
                    if out.finished:
                        result.finish_reason = out.finish_reason
                        result.stop_reason = out.stop_reason
                        bar.update(1)
                for _, why in engine.take_failures():
                    raise RuntimeError(why)
        return [results[r] for r in order]

    def add_adapter(self, name: str, path: str) -> None:
        self.engine.add_adapter(name, path)

    def add_draft_adapter(self, name: str, path: str) -> None:
        """The draft model's LoRA for adapter `name`'s rows (speculative decoding with a draft
        model; the config's "draft_adapters" register them at start)."""
        self.engine.add_draft_adapter(name, path)

    def remove_adapter(self, name: str) -> None:
        self.engine.remove_adapter(name)
