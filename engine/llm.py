"""The offline API, vLLM-style: `LLM(path).generate(prompts, params)`."""

from __future__ import annotations

from dataclasses import dataclass, field

from tqdm import tqdm

from engine.config import Config
from engine.llm_engine import LLMEngine, Prompt
from engine.sampling_params import SamplingParams
from engine.sequence import TokenLogprob


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
    def __init__(self, model: str, device: str = "auto", dtype: str = "auto",
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048, block_size: int = 16,
                 num_kv_blocks: int | None = None, max_model_len: int | None = None,
                 max_loras: int = 4, max_lora_rank: int = 16, max_cpu_loras: int | None = None,
                 lora_backend: str = "auto", lora_starvation_steps: int | None = 32,
                 seed: int = 0, enable_prefix_caching: bool = True,
                 max_full_module_slots: int = 0):
        self.config = Config(model=model, device=device, dtype=dtype, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
                             num_kv_blocks=num_kv_blocks, max_model_len=max_model_len,
                             enable_prefix_caching=enable_prefix_caching,
                             max_loras=max_loras, max_lora_rank=max_lora_rank,
                             max_cpu_loras=max_cpu_loras,
                             lora_backend=lora_backend,
                             lora_starvation_steps=lora_starvation_steps,
                             max_full_module_slots=max_full_module_slots, seed=seed)
        self.engine = LLMEngine(self.config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | list[Prompt],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 adapters: list[str | None] | None = None,
                 use_tqdm: bool = False) -> list[GenerationOutput]:
        """Run prompts to completion, batched together; outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        adapters = adapters if adapters is not None else [None] * len(prompts)
        if not (len(params_list) == len(adapters) == len(prompts)):
            raise ValueError("prompts, params and adapters must have the same length")
        engine = self.engine
        # Validate everything before queueing anything, so a bad prompt changes nothing.
        tokenized = [engine.tokenize(p) for p in prompts]
        for ids, p, adapter in zip(tokenized, params_list, adapters):
            engine.validate(ids, p)
            if adapter is not None:
                engine.lora.check_known(adapter)
        results: dict[str, GenerationOutput] = {}
        order = []
        for ids, p, adapter in zip(tokenized, params_list, adapters):
            request_id = engine.add_request(ids, p, adapter)
            results[request_id] = GenerationOutput(request_id, ids, adapter=adapter)
            order.append(request_id)
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
        return [results[r] for r in order]

    def add_adapter(self, name: str, path: str) -> None:
        self.engine.add_adapter(name, path)

    def remove_adapter(self, name: str) -> None:
        self.engine.remove_adapter(name)
