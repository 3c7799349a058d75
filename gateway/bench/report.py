"""What `loragw bench` measured: one RequestResult per request, summarized (a pure function of
the results and the wall time) into a BenchResult, printed as a table or written as JSON."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

QUANTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestResult:
    """One benchmark request. Times in seconds from just before the request was sent."""

    model: str
    ok: bool = False
    error: str | None = None
    ttft: float | None = None  # to the first chunk with text; None when not streamed
    e2e: float = 0.0
    output_tokens: int = 0
    usage_counted: bool = False  # output_tokens from the server's usage, not counted chunks

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None without TTFT or a second token."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), interpolating linearly between the closest ranks (numpy's
    default, as vLLM's benchmark reports)."""
    assert values and 0 <= q <= 100, (len(values), q)
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


@dataclass(frozen=True)
class Latency:
    """Mean and percentiles of one latency, in milliseconds."""

    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Latency | None:
        if not seconds:
            return None
        ms = [s * 1e3 for s in seconds]
        return cls(sum(ms) / len(ms), *(percentile(ms, q) for q in QUANTILES))


@dataclass
class ModelStats:
    completed: int = 0
    failed: int = 0
    output_tokens: int = 0


@dataclass(frozen=True)
class BenchResult:
    completed: int
    failed: int
    duration_s: float
    total_output_tokens: int
    request_throughput: float  # completed requests per second
    output_throughput: float  # output tokens per second
    ttft_ms: Latency | None  # None when nothing was streamed
    tpot_ms: Latency | None  # None when no request had two tokens
    e2e_ms: Latency | None
    per_model: dict[str, ModelStats]  # in order of first appearance
    usage_counted: bool  # every token count came from the server's usage
    first_error: str | None
    requests: list[RequestResult] = field(repr=False)


def summarize(results: Sequence[RequestResult], duration_s: float) -> BenchResult:
    """Counts, throughputs and latency percentiles over the successful requests."""
    ok = [r for r in results if r.ok]
    per_model: dict[str, ModelStats] = {}
    for r in results:
        stats = per_model.setdefault(r.model, ModelStats())
        stats.completed += r.ok
        stats.failed += not r.ok
        stats.output_tokens += r.output_tokens if r.ok else 0
    tokens = sum(r.output_tokens for r in ok)
    per_second = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    return BenchResult(
        completed=len(ok), failed=len(results) - len(ok), duration_s=duration_s,
        total_output_tokens=tokens, request_throughput=per_second(len(ok)),
        output_throughput=per_second(tokens),
        ttft_ms=Latency.of([r.ttft for r in ok if r.ttft is not None]),
        tpot_ms=Latency.of([r.tpot for r in ok if r.tpot is not None]),
        e2e_ms=Latency.of([r.e2e for r in ok]), per_model=per_model,
        usage_counted=all(r.usage_counted for r in ok),
        first_error=next((r.error for r in results if not r.ok), None), requests=list(results))


WIDTH = 56


def format_table(result: BenchResult, concurrency: int, request_rate: float) -> str:
    """The human-readable report, in the layout of vLLM's benchmark_serving."""
    def row(label: str, value) -> str:
        return f"{label:<40}{value:>16}"

    tokens_label = "Total output tokens:" if result.usage_counted else \
        "Total output tokens (text chunks):"  # the server sent no usage to count from
    lines = [" Serving Benchmark Result ".center(WIDTH, "="),
             row("Successful requests:", result.completed),
             row("Failed requests:", result.failed),
             row("Maximum request concurrency:", concurrency),
             row("Request rate (req/s):", "inf" if math.isinf(request_rate) else request_rate),
             row("Benchmark duration (s):", f"{result.duration_s:.2f}"),
             row(tokens_label, result.total_output_tokens),
             row("Request throughput (req/s):", f"{result.request_throughput:.2f}"),
             row("Output token throughput (tok/s):", f"{result.output_throughput:.2f}"),
             " Latency (ms) ".center(WIDTH, "-"),
             f"{'':<16}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}"]
    for name, latency in (("TTFT", result.ttft_ms), ("TPOT", result.tpot_ms),
                          ("E2E", result.e2e_ms)):
        if latency is None:
            lines.append(f"{name:<16}{'n/a':>10}")
        else:
            lines.append(f"{name:<16}" + "".join(f"{v:>10.2f}" for v in (
                latency.mean, latency.p50, latency.p90, latency.p99)))
    lines += [" Per model ".center(WIDTH, "-"),
              f"{'model':<26}{'ok':>10}{'failed':>10}{'tokens':>10}"]
    lines += [f"{name[:25]:<26}{s.completed:>10}{s.failed:>10}{s.output_tokens:>10}"
              for name, s in result.per_model.items()]
    lines.append("=" * WIDTH)
    return "\n".join(lines) + "\n"
