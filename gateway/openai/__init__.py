"""The OpenAI API: /v1/completions and /v1/chat/completions (admission, prompts, sampling
parameters, formats, streaming, tool calls), /v1/models, vLLM's adapter and utility routes."""
