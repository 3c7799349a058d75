"""`loragw bench`'s settings: one BenchConfig, each field a flag (gateway/common/flags.py) that also
reads LORAGW_<FLAG>."""

from __future__ import annotations

import math
from dataclasses import dataclass

from loragw.engine.api import option

DISTRIBUTIONS = ("uniform", "zipf")
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class BenchConfig:
    url: str | None = option(None, "base URL of a running server, e.g. http://127.0.0.1:8000")
    model: str | None = option(None, "without --url: start `loragw serve --model PATH`")
    demo: bool = option(False, "without --url: start `loragw serve --demo`")
    adapter: tuple[str, ...] = option((), "NAME=SOURCE adapter the started server registers "
                                      "(repeatable)")
    num_requests: int = option(64, "requests to send")
    concurrency: int = option(8, "requests in flight at most")
    request_rate: float = option(math.inf, "mean Poisson arrivals per second (inf: all at once)")
    # () = the base model only, ("all",) = every adapter GET /v1/models lists.
    adapters: tuple[str, ...] = option((), "model ids to spread requests over; 'all': every "
                                       "adapter in GET /v1/models (default: the base model)")
    adapter_distribution: str = option("uniform", "uniform: round-robin; zipf: the k-th id with "
                                       "weight 1/k", choices=DISTRIBUTIONS)
    max_tokens: int = option(32, "max_tokens of each request")
    prompt: str | None = option(None, "the prompt of every request (default: a built-in set)")
    endpoint: str = option("completions", "/v1/completions or /v1/chat/completions",
                           choices=tuple(ENDPOINTS))
    stream: bool = option(True, "stream responses, on by default (--no-stream: whole responses, "
                          "so no TTFT or TPOT)")
    ignore_eos: bool = option(False, "generate max_tokens even past end-of-sequence (vLLM "
                              "extension)")
    api_key: str | None = option(None, "Bearer key for /v1/* (and of the started server)")
    seed: int = option(0, "seed for arrivals and zipf draws")
    json_path: str | None = option(None, "also write the results as JSON", flag="json")

    def __post_init__(self) -> None:
        for name in ("num_requests", "concurrency", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, "
                                 f"got {getattr(self, name)}")
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 (inf: no pacing), "
                             f"got {self.request_rate}")
        if self.adapter_distribution not in DISTRIBUTIONS:
            raise ValueError(f"--adapter-distribution must be one of {', '.join(DISTRIBUTIONS)}")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {', '.join(ENDPOINTS)}")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--url {self.url!r} needs its scheme, e.g. http://127.0.0.1:8000")
        starts_server = self.model is not None or self.demo or bool(self.adapter)
        if self.url is not None and starts_server:
            raise ValueError("--model, --demo and --adapter start a server of our own; "
                             "leave them out with --url")
        if self.url is None and self.model is None and not self.demo:
            raise ValueError("give --url of a running server, or --model PATH or --demo to "
                             "start one for the benchmark")
        if self.model is not None and self.demo:
            raise ValueError("--model and --demo exclude each other; pass one")

    def serve_args(self) -> list[str]:
        """The `loragw serve` flags of the server started when there is no --url."""
        args = ["--demo"] if self.demo else ["--model", str(self.model)]
        for spec in self.adapter:
            args += ["--adapter", spec]
        return args
