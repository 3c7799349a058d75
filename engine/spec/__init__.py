"""Speculative decoding: proposals (prompt lookup, spec/ngram.py), exact verification in the
batch as it is (spec/verify.py), and where both sit in the engine's step with their counters
(spec/speculator.py). Its configuration: engine/speculative_config.py."""
