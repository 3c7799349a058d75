"""A request as the engine holds it: its sampling parameters and grammar, its sequence, its
stop rules and admission checks, and its text in and out (tokenizer, detokenizer)."""
