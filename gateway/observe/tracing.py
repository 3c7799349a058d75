"""OpenTelemetry traces, exported over OTLP/HTTP (protobuf) to --otlp-traces-endpoint.

Imported only when that flag is set (Services builds a `Tracing` then); every other module
holds `tracing: Tracing | None` and branches once on None, so a server without the flag
imports neither this module nor OpenTelemetry's tracing SDK, and makes no span. The spans of one request:

    POST /v1/chat/completions  SERVER    gateway/http/tracing_middleware.py; its parent is
                                         the caller's W3C `traceparent`, if it sent one
      admission                INTERNAL  gateway/openai/admission.py, steps 1-9
        adapter.load.<tier>    INTERNAL  one per tier moved into (gateway/residency/tiers.py):
                                         disk (Hub / S3 / the store -> disk), host (disk ->
                                         host), device (host -> a device slot)
        forward                CLIENT    gateway/fleet/router.py: `traceparent` injected, so
                                         the target's SERVER span is its child
      queue, prefill, decode   INTERNAL  per engine request, made when it finishes from the
                                         engine's own timestamps (engine.sequence.RequestTimes),
      adapter.load.device                with the slot fill it waited for, if there was one

Attributes: lora.adapter (the adapter id; "base" for the base model), lora.adapter.version
(the catalog version), loragw.replica (this replica; also the resource's
service.instance.id), gen_ai.request.model (the client's `model`), gen_ai.request.id (the
engine request), gen_ai.usage.input_tokens / output_tokens, lora.load.tier, and HTTP's
http.request.method, http.route, http.response.status_code.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from loragw.engine.api import RequestOutput, RequestTimes

if TYPE_CHECKING:
    from loragw.gateway.common.records import AdapterRecord, Location

SERVICE_NAME = "lora-gateway"
ADAPTER = "lora.adapter"
VERSION = "lora.adapter.version"
REPLICA = "loragw.replica"
LOAD_TIER = "lora.load.tier"
DEVICE_TIER = "device"  # host -> a device slot; "host" and "disk" are the tiers' own names
BASE_ADAPTER = "base"  # lora.adapter of a base-model request (as the metrics label it)

Attributes = dict[str, object]  # OpenTelemetry attribute values
EngineSpans = Callable[[str, RequestOutput], None]  # (engine request id, finished output)


def traces_url(endpoint: str) -> str:
    """The URL spans are POSTed to: the endpoint as given, or with OTLP's /v1/traces when it
    names no path (http://collector:4318)."""
    return endpoint if urlsplit(endpoint).path.strip("/") else endpoint.rstrip("/") + "/v1/traces"


def epoch_clock() -> Callable[[float], int]:
    """time.monotonic() readings (this process's or the engine process's: one clock per host)
    as the epoch nanoseconds spans take; one offset, so equal readings stay equal."""
    offset = time.time_ns() - time.monotonic_ns()
    return lambda monotonic_s: offset + int(monotonic_s * 1e9)


class ClientSpan:
    """A forward's CLIENT span: open from the request sent until the relayed body ends."""

    def __init__(self, span: Span):
        self.span = span

    def failed(self, why: str) -> None:
        """The target failed before any byte reached the caller (the next one is tried)."""
        self.span.set_status(Status(StatusCode.ERROR, why))
        self.span.end()

    def relayed(self, status: int) -> None:
        self.span.set_attribute("http.response.status_code", status)
        if status >= 500:
            self.span.set_status(Status(StatusCode.ERROR))
        self.span.end()


class Tracing:
    """One replica's tracer: spans batched (OTEL_BSP_SCHEDULE_DELAY, default 5 s) and POSTed
    to `endpoint` by the SDK's exporter thread; `shutdown` flushes what is left."""

    def __init__(self, endpoint: str, replica: str):
        self.replica = replica
        resource = Resource.create({"service.name": SERVICE_NAME,
                                    "service.instance.id": replica})
        self.provider = TracerProvider(resource=resource)
        self.provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint))))
        self.tracer = self.provider.get_tracer("gateway")
        self.propagator = TraceContextTextMapPropagator()

    def shutdown(self) -> None:
        self.provider.shutdown()  # exports what is still queued

    def attributes(self, adapter: str | None = None, version: int | None = None) -> Attributes:
        out: Attributes = {REPLICA: self.replica}
        if adapter is not None:
            out[ADAPTER] = adapter
        if version is not None:
            out[VERSION] = version
        return out

    def located(self, location: Location, records: Mapping[str, AdapterRecord]) -> Attributes:
        """The attributes of a located request: its adapter ("base" for the base model) and
        the catalog version (the catalog's word when only another replica holds it)."""
        adapter, version = location.adapter_id, location.version
        if adapter is not None and version is None and adapter in records:
            version = records[adapter].entry.version
        return self.attributes(adapter or BASE_ADAPTER, version)

    # ---- spans in the request's context ----------------------------------------------------
    @contextmanager
    def server_span(self, method: str, path: str,
                    headers: Mapping[str, str]) -> Iterator[Span]:
        """The request's SERVER span, current inside; a child of the caller's `traceparent`."""
        parent = self.propagator.extract(headers)
        attributes = {**self.attributes(), "http.request.method": method, "url.path": path}
        with self.tracer.start_as_current_span(f"{method} {path}", context=parent,
                                               kind=SpanKind.SERVER,
                                               attributes=attributes) as span:
            yield span

    @contextmanager
    def span(self, name: str) -> Iterator[Span]:
        """An INTERNAL span, current inside (its children nest under it)."""
        with self.tracer.start_as_current_span(name, attributes=self.attributes()) as span:
            yield span

    def forward(self, target: str, url: str, headers: MutableMapping[str, str],
                adapter: str | None) -> ClientSpan:
        """A CLIENT span for a forward of a request for `adapter` to replica `target`, its
        `traceparent` put in `headers` (replacing the caller's, this span's ancestor)."""
        span = self.tracer.start_span("forward", kind=SpanKind.CLIENT, attributes={
            **self.attributes(adapter or BASE_ADAPTER), "loragw.forward.target": target,
            "url.full": url, "http.request.method": "POST"})
        for key in [k for k in headers if k.lower() in ("traceparent", "tracestate")]:
            del headers[key]
        self.propagator.inject(headers, context=trace.set_span_in_context(span))
        return ClientSpan(span)

    def adapter_load(self, adapter: str, version: int | None, tier: str,
                     seconds: float) -> None:
        """A load into `tier` that just took `seconds` (measured where the load metric is)."""
        end = time.time_ns()
        span = self.tracer.start_span(f"adapter.load.{tier}", start_time=end - int(seconds * 1e9),
                                      attributes={**self.attributes(adapter, version),
                                                  LOAD_TIER: tier})
        span.end(end_time=end)

    # ---- the engine's phases, after the fact ---------------------------------------------------
    def engine_spans(self, adapter: str | None, version: int | None) -> EngineSpans:
        """The job's hook for each finished engine request: its queue, prefill and decode
        spans, children of the span current where the job's pumps started (the request's)."""
        common = self.attributes(adapter or BASE_ADAPTER, version)

        def record(request_id: str, out: RequestOutput) -> None:
            if out.times is not None:
                self._phases({**common, "gen_ai.request.id": request_id}, out, out.times)

        return record

    def _phases(self, attributes: Attributes, out: RequestOutput, times: RequestTimes) -> None:
        scheduled = times.scheduled if times.scheduled is not None else times.finished
        phases = [("queue", times.arrival, scheduled, {})]
        if times.scheduled is not None:
            prefilled = times.first_token if times.first_token is not None else times.finished
            phases.append(("prefill", times.scheduled, prefilled, {
                "gen_ai.usage.input_tokens": out.num_prompt_tokens,
                "loragw.usage.cached_tokens": out.num_cached_tokens}))
        if times.first_token is not None:
            phases.append(("decode", times.first_token, times.finished, {
                "gen_ai.usage.output_tokens": out.num_output_tokens,
                "gen_ai.response.finish_reasons": [out.finish_reason or ""]}))
        if times.device_load is not None:  # a slot filled for it while it waited to run
            phases.append((f"adapter.load.{DEVICE_TIER}", *times.device_load,
                           {LOAD_TIER: DEVICE_TIER}))
        epoch_ns = epoch_clock()
        for name, start, end, extra in phases:
            span = self.tracer.start_span(name, start_time=epoch_ns(start),
                                          attributes={**attributes, **extra})
            span.end(end_time=epoch_ns(end))
