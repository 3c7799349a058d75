"""OpenTelemetry traces (gateway/observe/tracing.py): two replicas on one redis-server, each started
with --otlp-traces-endpoint pointing at a real OTLP/HTTP receiver on loopback (protobuf
ExportTraceServiceRequest bodies, decoded with opentelemetry-proto). One request for an upload
only r1 holds, sent to r2 under a caller's `traceparent`, is forwarded to r1: the spans of both
replicas form one trace, r2's forward span is the parent of r1's server span, and r1's queue,
prefill and decode spans hang under its request. Without the flag a server serves without
loading any tracing code.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from fleet_harness import REPO, Fleet, redis_fixture, served_by
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanProto

from loragw.gateway.common.config import ServerConfig
from loragw.gateway.observe.tracing import traces_url

SERVER, CLIENT = SpanProto.SPAN_KIND_SERVER, SpanProto.SPAN_KIND_CLIENT


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root span
    start_ns: int
    end_ns: int
    attributes: dict
    instance: str  # the resource's service.instance.id: the replica that made it


def _value(any_value):
    field = any_value.WhichOneof("value")
    if field == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, field) if field else None


class OTLPReceiver:
    """A collector's OTLP/HTTP traces endpoint: POST /v1/traces, application/x-protobuf."""

    def __init__(self):
        self.spans: list[ReceivedSpan] = []
        self.content_types: set[str] = set()
        lock, receiver = threading.Lock(), self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                request = ExportTraceServiceRequest.FromString(body)
                with lock:
                    receiver.content_types.add(self.headers["Content-Type"])
                    receiver.spans.extend(_spans(request))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        return [s for s in list(self.spans) if s.trace_id == trace_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _spans(request: ExportTraceServiceRequest):
    for resource_spans in request.resource_spans:
        resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                yield ReceivedSpan(s.name, s.kind, s.trace_id.hex(), s.span_id.hex(),
                                   s.parent_span_id.hex(), s.start_time_unix_nano,
                                   s.end_time_unix_nano,
                                   {kv.key: _value(kv.value) for kv in s.attributes},
                                   resource.get("service.instance.id", ""))


@pytest.fixture(scope="module")
def receiver():
    receiver = OTLPReceiver()
    yield receiver
    receiver.close()


@pytest.fixture(scope="module")
def fleet(model_dir, receiver, tmp_path_factory):
    """r1 and r2, no shared store (an upload stays where it landed), both tracing to the
    receiver with a 100 ms export delay."""
    workdir = tmp_path_factory.mktemp("fleet-tracing")
    redis_server = redis_fixture.RedisServer(workdir)
    redis_server.start()
    fleet = Fleet(workdir, model_dir, redis_server,
                  extra=("--otlp-traces-endpoint", receiver.url))
    try:
        fleet.start("r1", "r2", env_changes={"OTEL_BSP_SCHEDULE_DELAY": "100"}, wait=False)
        fleet.wait_for("both replicas ready", lambda: all(ready(fleet, r) for r in fleet.urls),
                       timeout=150)
        yield fleet
    finally:
        fleet.stop()
        redis_server.kill()


def ready(fleet: Fleet, rid: str) -> bool:
    assert fleet.procs[rid].poll() is None, f"replica {rid} exited:\n{fleet.log(rid)}"
    try:
        return fleet.http.get(fleet.urls[rid] + "/ready").status_code == 200
    except httpx.TransportError:
        return False


def caller_traceparent() -> tuple[str, str, str]:
    """(traceparent, trace id, span id) of a caller's own span, as a W3C header."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def wait_for_spans(fleet: Fleet, receiver: OTLPReceiver, trace_id: str, wanted) -> list:
    """The trace's spans once `wanted(spans)` holds (the replicas export every 100 ms)."""
    fleet.wait_for("the trace's spans at the receiver",
                   lambda: wanted(receiver.trace(trace_id)), timeout=15)
    return receiver.trace(trace_id)


def one(spans: list[ReceivedSpan], name: str, instance: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name and s.instance == instance]
    assert len(found) == 1, (name, instance, [(s.name, s.instance) for s in spans])
    return found[0]


def test_a_forwarded_request_is_one_trace_across_both_replicas(fleet, receiver, adapter_dirs):
    assert fleet.upload("r1", "lora-6", adapter_dirs["lora-6"]).status_code == 201
    fleet.wait_for("r2 to list lora-6", lambda: "lora-6" in fleet.models("r2"), timeout=3)
    header, trace_id, caller_span = caller_traceparent()
    response = fleet.http.post(fleet.urls["r2"] + "/v1/completions",
                               json={"model": "lora-6", "prompt": "The quick brown fox",
                                     "max_tokens": 8, "temperature": 0},
                               headers={"traceparent": header})
    assert response.status_code == 200, response.text
    assert served_by(response) == "r1"
    generated = response.json()["usage"]["completion_tokens"]

    def complete(spans):
        names = {(s.name, s.instance) for s in spans}
        return {("decode", "r1"), ("forward", "r2"), ("POST /v1/completions", "r2"),
                ("POST /v1/completions", "r1")} <= names

    spans = wait_for_spans(fleet, receiver, trace_id, complete)
    assert receiver.content_types == {"application/x-protobuf"}
    assert {s.trace_id for s in spans} == {trace_id}, "one trace, the caller's"

    # r2: the caller's span -> server -> admission -> forward (CLIENT)
    r2_server = one(spans, "POST /v1/completions", "r2")
    assert r2_server.kind == SERVER and r2_server.parent_id == caller_span
    assert r2_server.attributes["http.route"] == "/v1/completions"
    assert r2_server.attributes["http.response.status_code"] == 200
    assert r2_server.attributes["gen_ai.request.model"] == "lora-6"
    assert r2_server.attributes["loragw.forwarded"] is True
    r2_admission = one(spans, "admission", "r2")
    assert r2_admission.parent_id == r2_server.span_id
    forward = one(spans, "forward", "r2")
    assert forward.kind == CLIENT and forward.parent_id == r2_admission.span_id
    assert forward.attributes["loragw.forward.target"] == "r1"
    for span in (r2_admission, forward):  # what r2 knew: the catalog's id and version
        assert span.attributes["lora.adapter"] == "lora-6"
        assert span.attributes["loragw.replica"] == "r2"
    assert r2_admission.attributes["lora.adapter.version"] == 1

    # r1: its server span continues r2's forward (the injected traceparent)
    r1_server = one(spans, "POST /v1/completions", "r1")
    assert r1_server.kind == SERVER and r1_server.parent_id == forward.span_id
    assert (r1_server.attributes["lora.adapter"], r1_server.attributes["lora.adapter.version"],
            r1_server.attributes["loragw.replica"]) == ("lora-6", 1, "r1")
    assert "loragw.forwarded" not in r1_server.attributes
    assert forward.start_ns <= r1_server.start_ns and r1_server.end_ns <= forward.end_ns
    assert one(spans, "admission", "r1").parent_id == r1_server.span_id

    # r1's engine phases, from the engine's own timestamps, in order, inside its request
    phases = [one(spans, name, "r1") for name in ("queue", "prefill", "decode")]
    for span in phases:
        assert span.parent_id == r1_server.span_id
        assert (span.attributes["lora.adapter"], span.attributes["lora.adapter.version"],
                span.attributes["loragw.replica"]) == ("lora-6", 1, "r1")
        assert span.attributes["gen_ai.request.id"] == phases[0].attributes["gen_ai.request.id"]
        assert r1_server.start_ns <= span.start_ns <= span.end_ns <= r1_server.end_ns
    queue, prefill, decode = phases
    assert queue.end_ns == prefill.start_ns and prefill.end_ns == decode.start_ns
    assert prefill.attributes["gen_ai.usage.input_tokens"] > 0
    assert decode.attributes["gen_ai.usage.output_tokens"] == generated
    assert not [s for s in spans if s.name in ("queue", "prefill", "decode")
                and s.instance == "r2"], "r2 generated nothing"
    # r1 had lora-6 in host memory (the upload): the engine copied it into a device slot
    # while the request was queued
    fill = one(spans, "adapter.load.device", "r1")
    assert fill.parent_id == r1_server.span_id
    assert queue.start_ns <= fill.start_ns <= fill.end_ns <= queue.end_ns
    assert (fill.attributes["lora.adapter"], fill.attributes["lora.adapter.version"],
            fill.attributes["lora.load.tier"]) == ("lora-6", 1, "device")


def test_an_adapter_fetched_for_a_request_is_a_load_span_per_tier(fleet, receiver,
                                                                   adapter_dirs):
    assert fleet.register("r1", "lora-5", adapter_dirs["lora-5"]).status_code == 201
    fleet.wait_for("r2 to list lora-5", lambda: "lora-5" in fleet.models("r2"), timeout=3)
    header, trace_id, _ = caller_traceparent()
    # served by r2 itself (the marker): it reads the path's bytes onto its disk, then into
    # the engine's host memory, inside the request's admission
    response = fleet.http.post(fleet.urls["r2"] + "/v1/completions",
                               json={"model": "lora-5", "prompt": "Hello", "max_tokens": 2},
                               headers={"traceparent": header, "x-loragw-forwarded": "test"})
    assert response.status_code == 200 and served_by(response) == "r2", response.text

    spans = wait_for_spans(fleet, receiver, trace_id,
                           lambda spans: {"decode", "adapter.load.host"}
                           <= {s.name for s in spans})
    admission = one(spans, "admission", "r2")
    for tier in ("disk", "host"):
        load = one(spans, f"adapter.load.{tier}", "r2")
        assert load.parent_id == admission.span_id
        assert admission.start_ns <= load.start_ns <= load.end_ns <= admission.end_ns
        assert (load.attributes["lora.adapter"], load.attributes["lora.adapter.version"],
                load.attributes["lora.load.tier"]) == ("lora-5", 1, tier)
    assert not [s for s in spans if s.instance == "r1"], "never forwarded"


OFF_SCRIPT = """
import json, sys, httpx
from loragw.gateway.common.config import ServerConfig
from loragw.gateway.app import create_app
from loragw.gateway.server import BackgroundServer
config = ServerConfig(model=sys.argv[1], served_model_name="demo-base", device="cpu",
                      adapter_dir=sys.argv[2], max_model_len=128, max_num_seqs=2,
                      engine_process=False)
app = create_app(config)
with BackgroundServer(app) as server:
    server.wait_ready()
    reply = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": "demo-base", "prompt": "Hello", "max_tokens": 2})
    tracing_modules = ("loragw.gateway.observe.tracing", "loragw.gateway.http.tracing_middleware",
                       "opentelemetry.sdk.trace", "opentelemetry.exporter")
    loaded = sorted(m for m in sys.modules if m.startswith(tracing_modules))
    print(json.dumps({"status": reply.status_code, "tracing": app.state.services.tracing is None,
                      "loaded": loaded}))
"""


def test_without_the_flag_the_request_path_imports_no_tracing(model_dir, tmp_path):
    """Neither our tracing modules nor OpenTelemetry's tracing SDK or exporter are loaded by
    a server that served a request. (redis-py >= 8 imports OpenTelemetry's API and metrics SDK
    itself whenever they are installed, to see whether they are: not ours to avoid.)"""
    # its own process: this one imported opentelemetry-proto for the receiver
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    run = subprocess.run([sys.executable, "-P", "-c", OFF_SCRIPT, model_dir, str(tmp_path)],
                         cwd=REPO, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result == {"status": 200, "tracing": True, "loaded": []}


def test_the_endpoint_is_an_http_url_and_a_bare_one_gets_the_traces_path():
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert traces_url("https://otel.example/api/traces") == "https://otel.example/api/traces"
    with pytest.raises(ValueError, match="--otlp-traces-endpoint"):
        ServerConfig(demo=True, otlp_traces_endpoint="collector:4317")
