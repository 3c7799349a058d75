"""The inference engine: paged KV cache, continuous batching, per-token LoRA."""

from engine.config import Config
from engine.llm import LLM, GenerationOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "Config", "GenerationOutput", "SamplingParams"]
