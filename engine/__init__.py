"""The inference engine: paged KV cache, continuous batching, per-token LoRA."""

from loragw.engine.config import Config
from loragw.engine.llm import LLM, GenerationOutput
from loragw.engine.request.params import SamplingParams

__all__ = ["LLM", "Config", "GenerationOutput", "SamplingParams"]
