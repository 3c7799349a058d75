"""`loragw bench`: a serving benchmark in the manner of vLLM's `vllm bench serve` (client.py),
its settings (config.py), the pure summary and table (report.py), and the server it starts
when given no --url (server.py)."""

from gateway.bench.client import assign_models, bench_main
from gateway.bench.config import BenchConfig

__all__ = ["BenchConfig", "assign_models", "bench_main"]
