"""The gateway's own OpenAPI document (GET /schema/openapi.json) tells the truth: errors in the
OpenAI shape actually sent, the statuses each route answers, the bounds the server enforces;
and schemathesis, generating requests from it against the live server, finds no 5xx and no
response that breaks it."""

from __future__ import annotations

import copy
import re
import time

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

BASE = "demo-base"  # conftest's served model name
HI = [{"role": "user", "content": "hi"}]
GENERATION = ("/v1/completions", "/v1/chat/completions")


@pytest.fixture(scope="module")
def spec(http) -> dict:
    return http.get("/schema/openapi.json").json()


def operations(spec: dict):
    for path, item in spec["paths"].items():
        for method, op in item.items():
            yield f"{method.upper()} {path}", op


def test_every_error_is_documented_in_the_openai_shape(spec):
    for label, op in operations(spec):
        for status, response in op["responses"].items():
            if int(status) < 400:
                continue
            schemas = [c["schema"] for c in response["content"].values()]
            assert schemas == [{"$ref": "#/components/schemas/ErrorResponse"}], (
                f"{label} documents {status} as {schemas}, not the ErrorResponse it sends")
    error = spec["components"]["schemas"]["ErrorBody"]
    assert set(error["properties"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("label, statuses", [
    ("POST /v1/completions", {200, 400, 401, 404, 413, 429, 503}),
    ("POST /v1/chat/completions", {200, 400, 401, 404, 413, 429, 503}),
    ("GET /v1/models", {200, 401, 503}),
    ("GET /v1/models/{model_id}", {200, 401, 404, 503}),
    ("POST /v1/load_lora_adapter", {200, 400, 401, 404, 422}),
    ("POST /v1/unload_lora_adapter", {200, 401, 404}),
    ("GET /ready", {200, 503}),
    ("GET /admin/adapters/{adapter_id}", {200, 400, 401, 404}),
    ("POST /admin/adapters/{adapter_id}", {200, 401, 404, 409}),
    ("DELETE /admin/adapters/{adapter_id}", {200, 401, 404}),
    ("POST /admin/adapters", {201, 400, 401, 409, 413, 422}),
    # tenants: 403 is a valid key outside its role or namespace
    ("POST /admin/adapters/register", {201, 400, 401, 403, 409}),
    ("POST /v1/load_lora_adapter", {403}),
    ("POST /v1/unload_lora_adapter", {403}),
    ("POST /admin/tenants/{tenant}/keys", {201, 400, 401, 403, 503}),
    ("GET /admin/tenants/{tenant}/keys", {200, 400, 401, 403}),
    ("POST /admin/tenants/{tenant}/keys/{key_id}/rotate", {200, 400, 401, 403, 404, 503}),
    ("DELETE /admin/tenants/{tenant}/keys/{key_id}", {200, 401, 403, 404, 503}),
    ("GET /admin/audit", {200, 400, 401, 403}),
])
def test_the_statuses_routes_answer_are_documented(spec, label, statuses):
    documented = {int(s) for s in dict(operations(spec))[label]["responses"]}
    assert statuses <= documented, f"{label}: {sorted(statuses - documented)} undocumented"


def test_generation_routes_document_their_event_streams(spec):
    for path in GENERATION:
        ok = spec["paths"][path]["post"]["responses"]["200"]["content"]
        assert set(ok) == {"application/json", "text/event-stream"}
    upload = spec["paths"]["/admin/adapters"]["post"]["requestBody"]["content"]
    assert upload["multipart/form-data"]["schema"]["required"] == [
        "adapter_id", "adapter_config", "adapter_model"]


# A documented bound, the value just past it (refused) and the bound itself (accepted).
BOUNDS = [
    ("temperature", "minimum", 0, -0.01, 0.0),
    ("top_p", "minimum", 0, -0.01, 0.0),
    ("top_p", "maximum", 1, 1.01, 1.0),
    ("min_p", "minimum", 0, -0.01, 0.0),
    ("min_p", "maximum", 1, 1.01, 1.0),
    ("repetition_penalty", "exclusiveMinimum", 0, 0.0, 0.01),
    ("top_k", "minimum", -1, -2, -1),
    ("frequency_penalty", "minimum", -2, -2.01, -2.0),
    ("presence_penalty", "maximum", 2, 2.01, 2.0),
    ("logprobs", "minimum", 0, -1, 0),
    ("logprobs", "maximum", 20, 21, 20),
    ("n", "maximum", 128, 129, None),  # 128 choices exceed this server's capacity: a 400
    ("min_tokens", "minimum", 0, -1, 0),
    ("max_tokens", "minimum", 0, -1, 1),  # 0 only with echo: test_prompt_logprobs_api.py
]


@pytest.mark.parametrize("field, keyword, bound, past, at", BOUNDS)
def test_documented_bounds_are_the_enforced_ones(spec, http, field, keyword, bound, past, at):
    schema = spec["components"]["schemas"]["CompletionRequest"]["properties"][field]
    assert schema[keyword] == bound, f"{field}: {schema}"
    body = {"model": BASE, "prompt": "hi", "max_tokens": 2, "logprobs": 1}
    r = http.post("/v1/completions", json={**body, field: past})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    if at is not None:
        r = http.post("/v1/completions", json={**body, field: at})
        assert r.status_code == 200, r.text


def test_list_items_and_logit_bias_state_their_ranges(spec, http):
    props = spec["components"]["schemas"]["CompletionRequest"]["properties"]
    for field in ("stop_token_ids", "allowed_token_ids"):
        assert props[field]["items"]["minimum"] == 0
    assert props["logit_bias"]["additionalProperties"] == {"type": "number", "minimum": -100,
                                                           "maximum": 100}
    top = spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]["top_logprobs"]
    assert (top["minimum"], top["maximum"]) == (0, 20)
    body = {"model": BASE, "prompt": "hi", "max_tokens": 2}
    for bad in ({"stop_token_ids": [-1]}, {"allowed_token_ids": []}, {"prompt": []},
                {"prompt": [[1], []]}, {"logit_bias": {"1": 100.5}}, {"prompt": [2**64]},
                {"logit_bias": {"9" * 30: 1}}, {"guided_json": {"maxLength": 2**64}}):
        assert http.post("/v1/completions", json={**body, **bad}).status_code == 400, bad


def test_top_p_0_is_the_most_likely_token_as_openai_allows(http):
    body = {"model": "lora-3", "messages": HI, "max_tokens": 6, "ignore_eos": True}
    greedy = http.post("/v1/chat/completions", json={**body, "temperature": 0}).json()
    top_p_0 = http.post("/v1/chat/completions", json={**body, "temperature": 1.0, "top_p": 0,
                                                      "seed": 1}).json()
    assert top_p_0["choices"][0]["message"] == greedy["choices"][0]["message"]


def test_options_allows_exactly_what_the_document_lists(spec, http):
    """RFC 9110's Allow on OPTIONS, for each documented path: every method the document gives
    it (Litestar, left alone, lists only the methods of a path's first handlers)."""
    for path, item in spec["paths"].items():
        url = re.sub(r"{[a-z_]+}", "x", path)
        r = http.options(url)
        assert r.status_code == 204, (path, r.text)
        assert set(r.headers["allow"].split(", ")) == {m.upper() for m in item} | {"OPTIONS"}, \
            (path, r.headers["allow"])


# ---- schemathesis ------------------------------------------------------------------------------
POSITIVE_EXAMPLES = {"POST /v1/completions": 100, "POST /v1/chat/completions": 100}
EXAMPLES = 30  # per operation and mode otherwise
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_headers_conformance, response_schema_conformance]
# What positive generation draws for these request fields: short generations, and names that
# exist (or one that does not). Never an adapter the other tests use as an unload or delete
# target, never a path that exists, never the Hub (an unreachable Hub is an honest 502).
FIELDS = {
    "max_tokens": {"type": "integer", "minimum": 1, "maximum": 3},
    "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": 3},
    "max_output_tokens": {"type": "integer", "minimum": 1, "maximum": 3},
    "n": {"type": "integer", "minimum": 1, "maximum": 2},
    "model": {"enum": [BASE, "lora-0", "lora-1", "unknown/model"]},
    "lora_name": {"enum": ["fuzz-a", "x", "", "../etc", "a/b/c", BASE]},
    "lora_path": {"enum": ["/nonexistent", "", "./relative", "file:///nope"]},
    "source": {"enum": ["/nonexistent", "", "./relative", "file:///nope"]},
    "adapter_id": {"enum": ["fuzz-a", "x", "../etc", "a/b/c"]},
}
REQUIRED = {"max_tokens", "max_output_tokens"}  # left out: the rest of the context, too slow
PATH_PARAMETERS = {"model_id": [BASE, "lora-0", "no/such"],
                   "adapter_id": ["fuzz-a", "no/such", "../x"],
                   # POST /admin/adapters/{adapter_id} is ID/ACTION
                   "POST adapter_id": ["fuzz-a/load", "fuzz-a/pin", "no/such/evict",
                                       "lora-0/nope"]}


def bounded(spec: dict) -> dict:
    """The document with FIELDS and PATH_PARAMETERS narrowed, in request bodies only (the
    responses are checked against the document as served)."""
    spec = copy.deepcopy(spec)
    schemas = spec["components"]["schemas"]
    bodies = [c["schema"] for _, op in operations(spec)
              for c in op.get("requestBody", {}).get("content", {}).values()]
    for body in bodies:
        ref = body.get("$ref", "")
        target = schemas[ref.split("/")[-1]] if ref else body
        props = target.get("properties", {})
        for name in set(props) & set(FIELDS):
            props[name] = FIELDS[name]
            if name in REQUIRED:
                target["required"] = sorted({*target.get("required", []), name})
    for label, op in operations(spec):
        for parameter in op.get("parameters", []):
            for name in (f"{label.split()[0]} {parameter['name']}", parameter["name"]):
                if name in PATH_PARAMETERS:
                    parameter["schema"] = {"enum": PATH_PARAMETERS[name]}
                    break
    return spec


def run_operation(operation, mode, base_url: str, examples: int, checks) -> tuple[dict, list]:
    statuses: dict[int, int] = {}
    failures: list[str] = []

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    def one(case):
        response = case.call(base_url=base_url, timeout=60)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        try:
            case.validate_response(response, checks=checks)
        except schemathesis.errors.FailureGroup as exc:  # collected: one report of each kind
            failures.append(f"{operation.label} ({mode.value}): {str(exc)[:1500]}")

    one()
    return statuses, failures


def test_schemathesis_finds_no_server_error_and_no_response_off_the_schema(server, spec,
                                                                           wait_idle):
    started = time.monotonic()
    positive = schemathesis.openapi.from_dict(bounded(spec))
    negative = schemathesis.openapi.from_dict(spec)
    by_label = {op.ok().label: op.ok() for op in negative.get_all_operations()}
    statuses, failures = {}, []
    for result in positive.get_all_operations():
        operation = result.ok()
        examples = POSITIVE_EXAMPLES.get(operation.label, EXAMPLES)
        got, failed = run_operation(operation, schemathesis.GenerationMode.POSITIVE,
                                    server.url, examples, CHECKS)
        statuses[operation.label], failures = got, failures + failed
        if "requestBody" in dict(operations(spec))[operation.label]:
            # what the document forbids is refused (never a 2xx), and never a 5xx
            _, failed = run_operation(by_label[operation.label],
                                      schemathesis.GenerationMode.NEGATIVE, server.url,
                                      EXAMPLES, [*CHECKS, negative_data_rejection])
            failures += failed
    distinct = {f.split("curl")[0]: f for f in failures}  # one of each kind, with its curl
    assert not failures, f"{len(failures)} failures:\n\n" + "\n\n".join(distinct.values())
    for label in ("POST /v1/completions", "POST /v1/chat/completions"):
        assert statuses[label].get(200, 0) >= 3, f"{label}: too few generations {statuses}"
    assert set(server.services.adapters.records) == {f"lora-{i}" for i in range(8)}
    wait_idle(server.services)
    assert time.monotonic() - started < 120, "keep the run bounded"
