"""The chart's optional objects for watching and routing a fleet: the Gateway API Inference
Extension's InferencePool and InferenceObjective, the ServiceMonitor, and the Grafana dashboard
ConfigMap. Rendered by Helm's own engine (tools/helm_render); the two CRDs are checked against
the part of their published schemas (the extension's v1.5 CRDs) the chart uses.

That every query of the dashboard names a series a live gateway exports is checked against a
real /metrics in tests/gateway/test_dashboard_series.py.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm"
sys.path.insert(0, str(ROOT / "tools"))

import helm_render  # noqa: E402

RELEASE, NAMESPACE = "demo", "llm"
DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
VALUE_SETS = {"default": {}, **{p.name.removesuffix("-values.yaml"): yaml.safe_load(p.read_text())
                                for p in sorted(CHART.glob("ci/*-values.yaml"))}}
ON = {"inferenceExtension": {"enabled": True}}
DASHBOARD_ON = {"grafana": {"dashboard": {"enabled": True}}}


def render(values: dict[str, Any] | None = None) -> helm_render.Rendered:
    try:
        helm_render.backend()
    except helm_render.HelmUnavailable:
        pytest.fail(helm_render.INSTALL_HINT, pytrace=False)
    return helm_render.render(CHART, values, release=RELEASE, namespace=NAMESPACE)


def pod_labels(rendered: helm_render.Rendered, kind: str) -> dict[str, str]:
    return rendered.one(kind)["spec"]["template"]["metadata"]["labels"]


# ---- the CRDs' schemas, as far as the chart uses them ------------------------------------------
_DNS_SUBDOMAIN = {"type": "string", "minLength": 1, "maxLength": 253,
                  "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"}
_PORT = {"type": "object", "required": ["number"], "additionalProperties": False,
         "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}}}
_LABEL_VALUE = {"type": "string", "maxLength": 63,
                "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"}


def _object(api_version: str | list[str], kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    versions = [api_version] if isinstance(api_version, str) else api_version
    return {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
            "properties": {"apiVersion": {"enum": versions}, "kind": {"const": kind},
                           "metadata": {"type": "object", "required": ["name", "namespace"],
                                        "properties": {"name": _DNS_SUBDOMAIN}},
                           "spec": spec}}


INFERENCE_POOL_SCHEMA = _object("inference.networking.k8s.io/v1", "InferencePool", {
    "type": "object", "additionalProperties": False,
    "required": ["selector", "targetPorts", "endpointPickerRef"],
    "properties": {
        "selector": {"type": "object", "additionalProperties": False, "required": ["matchLabels"],
                     "properties": {"matchLabels": {"type": "object", "minProperties": 1,
                                                    "maxProperties": 64,
                                                    "additionalProperties": _LABEL_VALUE}}},
        "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": _PORT},
        "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
        "endpointPickerRef": {
            "type": "object", "additionalProperties": False, "required": ["name", "port"],
            "properties": {"group": {"type": "string"}, "kind": {"const": "Service"},
                           "name": _DNS_SUBDOMAIN, "port": _PORT,
                           "failureMode": {"enum": ["FailOpen", "FailClose"]}}},
    }})
INFERENCE_OBJECTIVE_SCHEMA = _object(
    ["inference.networking.x-k8s.io/v1alpha2", "llm-d.ai/v1alpha2"], "InferenceObjective", {
        "type": "object", "additionalProperties": False, "required": ["poolRef"],
        "properties": {
            "priority": {"type": "integer"},
            "poolRef": {"type": "object", "additionalProperties": False, "required": ["name"],
                        "properties": {"group": {"const": "inference.networking.k8s.io"},
                                       "kind": {"const": "InferencePool"},
                                       "name": _DNS_SUBDOMAIN}}}})
CRD_SCHEMAS = {"InferencePool": INFERENCE_POOL_SCHEMA,
               "InferenceObjective": INFERENCE_OBJECTIVE_SCHEMA}


@pytest.mark.parametrize("value_set", list(VALUE_SETS))
def test_inference_extension_objects_match_their_crds_in_every_value_set(value_set):
    for m in render(VALUE_SETS[value_set]).manifests:
        if m.kind in CRD_SCHEMAS:
            jsonschema.Draft7Validator(CRD_SCHEMAS[m.kind]).validate(m.obj)
            assert m.obj["metadata"]["namespace"] == NAMESPACE


# ---- InferencePool and InferenceObjective ------------------------------------------------------
def test_the_inference_extension_is_off_by_default():
    kinds = render().kinds()
    assert "InferencePool" not in kinds and "InferenceObjective" not in kinds


def test_the_pool_selects_exactly_the_gateway_pods_on_their_container_port():
    rendered = render(ON)
    pool = rendered.one("InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    selector = pool["spec"]["selector"]["matchLabels"]
    gateway_pods = pod_labels(rendered, "Deployment")
    assert selector.items() <= gateway_pods.items()
    assert not selector.items() <= pod_labels(rendered, "StatefulSet").items(), "not Redis"
    assert selector == rendered.one("Deployment")["spec"]["selector"]["matchLabels"]
    (container,) = [c for c in rendered.one("Deployment")["spec"]["template"]["spec"]["containers"]
                    if c["name"] == "gateway"]
    assert pool["spec"]["targetPorts"] == [{"number": p["containerPort"]}
                                           for p in container["ports"]]
    assert pool["spec"]["appProtocol"] == "http"
    assert pool["spec"]["endpointPickerRef"] == {"name": "demo-lora-gateway-epp",
                                                 "port": {"number": 9002},
                                                 "failureMode": "FailClose"}


def test_the_endpoint_picker_and_the_pool_name_come_from_values():
    pool = render({"inferenceExtension": {
        "enabled": True, "poolName": "qwen-pool",
        "endpointPicker": {"serviceName": "router-epp", "port": 9010, "failureMode": "FailOpen"},
    }}).one("InferencePool")
    assert pool["metadata"]["name"] == "qwen-pool"
    assert pool["spec"]["endpointPickerRef"] == {"name": "router-epp", "port": {"number": 9010},
                                                 "failureMode": "FailOpen"}
    unnamed_epp = render({"inferenceExtension": {"enabled": True, "poolName": "qwen-pool"}})
    assert unnamed_epp.one("InferencePool")["spec"]["endpointPickerRef"]["name"] == "qwen-pool-epp"


def test_the_objective_names_the_pool_with_its_priority():
    rendered = render(VALUE_SETS["all-features"])
    objective = rendered.one("InferenceObjective")
    assert objective["apiVersion"] == "inference.networking.x-k8s.io/v1alpha2"
    assert objective["metadata"]["name"] == "interactive"
    assert objective["spec"] == {"priority": 10, "poolRef": {
        "group": "inference.networking.k8s.io", "kind": "InferencePool",
        "name": rendered.one("InferencePool")["metadata"]["name"]}}
    assert rendered.one("InferencePool")["spec"]["endpointPickerRef"]["name"] == "llm-epp"
    default = render(ON).one("InferenceObjective")
    assert default["metadata"]["name"] == "demo-lora-gateway" and default["spec"]["priority"] == 0


def test_the_objective_can_be_left_out_or_take_llm_d_api_group():
    alone = render({"inferenceExtension": {"enabled": True, "objective": {"enabled": False}}})
    assert alone.kinds().count("InferencePool") == 1 and "InferenceObjective" not in alone.kinds()
    llm_d = render({"inferenceExtension": {"enabled": True, "objective": {
        "apiVersion": "llm-d.ai/v1alpha2", "priority": -5}}}).one("InferenceObjective")
    assert llm_d["apiVersion"] == "llm-d.ai/v1alpha2" and llm_d["spec"]["priority"] == -5
    assert "InferenceObjective" not in render(
        {"inferenceExtension": {"enabled": False, "objective": {"enabled": True}}}).kinds()


BAD_VALUES = {
    "failure mode misspelt": {"inferenceExtension": {"endpointPicker": {"failureMode": "Open"}}},
    "epp port zero": {"inferenceExtension": {"endpointPicker": {"port": 0}}},
    "epp service with capitals": {"inferenceExtension": {"endpointPicker": {"serviceName": "EPP"}}},
    "priority as words": {"inferenceExtension": {"objective": {"priority": "high"}}},
    "objective api version unknown": {"inferenceExtension": {"objective": {"apiVersion": "v1"}}},
    "misspelt extension key": {"inferenceExtension": {"pool": "x"}},
    "dashboard label value a number": {"grafana": {"dashboard": {"labelValue": 1}}},
    "dashboard label key with a space": {"grafana": {"dashboard": {"labelKey": "grafana dash"}}},
    "misspelt dashboard key": {"grafana": {"dashboard": {"enable": True}}},
    "scrape interval without unit": {"serviceMonitor": {"interval": "30"}},
}


@pytest.mark.parametrize("values", BAD_VALUES.values(), ids=BAD_VALUES.keys())
def test_values_violating_the_schema_are_rejected(values):
    merged = helm_render.merge_values(DEFAULTS, values)
    assert list(jsonschema.Draft7Validator(SCHEMA).iter_errors(merged)), "jsonschema accepted it"
    with pytest.raises(helm_render.RenderError):
        render(values)


# ---- ServiceMonitor ----------------------------------------------------------------------------
def test_the_service_monitor_scrapes_metrics_on_the_services_port_at_the_set_interval():
    rendered = render({"serviceMonitor": {"enabled": True, "interval": "1m",
                                          "scrapeTimeout": "20s"}})
    monitor = rendered.one("ServiceMonitor")
    (endpoint,) = monitor["spec"]["endpoints"]
    assert (endpoint["path"], endpoint["interval"], endpoint["scrapeTimeout"]) == (
        "/metrics", "1m", "20s")
    service = rendered.one("Service", "demo-lora-gateway")
    assert endpoint["port"] in [p["name"] for p in service["spec"]["ports"]]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= \
        service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert render({"serviceMonitor": {"enabled": True}}).one("ServiceMonitor")["spec"][
        "endpoints"][0]["interval"] == DEFAULTS["serviceMonitor"]["interval"]


# ---- the Grafana dashboard ---------------------------------------------------------------------
def dashboard(rendered: helm_render.Rendered) -> dict[str, Any]:
    (config_map,) = rendered.of_kind("ConfigMap")
    (text,) = config_map["data"].values()
    return json.loads(text)


def panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in board["panels"] if p["type"] != "row"]


def exprs(panel: dict[str, Any]) -> list[str]:
    return [t["expr"] for t in panel["targets"]]


def test_the_dashboard_is_off_by_default_and_labelled_for_the_sidecar_when_on():
    assert "ConfigMap" not in render().kinds()
    config_map = render(DASHBOARD_ON).one("ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["namespace"] == NAMESPACE
    assert list(config_map["data"]) == ["lora-gateway.json"]
    custom = render({"grafana": {"dashboard": {
        "enabled": True, "labelKey": "example.com/dashboard", "labelValue": "llm",
        "namespace": "monitoring", "annotations": {"grafana_folder": "LLM"}}}}).one("ConfigMap")
    assert custom["metadata"]["labels"]["example.com/dashboard"] == "llm"
    assert "grafana_dashboard" not in custom["metadata"]["labels"]
    assert custom["metadata"]["namespace"] == "monitoring"
    assert custom["metadata"]["annotations"] == {"grafana_folder": "LLM"}


def test_the_configmap_carries_the_charts_dashboard_file_as_json():
    board = dashboard(render(DASHBOARD_ON))
    assert board == json.loads((CHART / "dashboards" / "lora-gateway.json").read_text())
    assert board["uid"] == "lora-gateway" and board["title"]
    assert len(panels(board)) >= 10
    for panel in panels(board):
        assert panel["targets"] and all(exprs(panel)), panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])


def test_the_dashboard_has_datasource_adapter_and_version_variables():
    variables = {v["name"]: v for v in dashboard(render(DASHBOARD_ON))["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["adapter"]["query"]["query"] == "label_values(loragw_requests_total, adapter)"
    assert variables["adapter"]["datasource"]["uid"] == "${datasource}"
    assert variables["version"]["query"]["query"].startswith("label_values(loragw_requests_total")


def test_panels_do_not_overlap():
    taken: set[tuple[int, int]] = set()
    for panel in dashboard(render(DASHBOARD_ON))["panels"]:
        g = panel["gridPos"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert g["x"] + g["w"] <= 24 and not cells & taken, panel["title"]
        taken |= cells


def _panel_using(board: dict[str, Any], series: str) -> list[str]:
    return [e for p in panels(board) for e in exprs(p) if series in e]


def test_latency_panels_are_p50_and_p99_by_adapter_and_version():
    board = dashboard(render(DASHBOARD_ON))
    for histogram in ("loragw_time_to_first_token_seconds", "loragw_time_per_output_token_seconds"):
        queries = _panel_using(board, f"{histogram}_bucket")
        quantiles = sorted(re.match(r"histogram_quantile\(([0-9.]+),", q).group(1) for q in queries)
        assert quantiles == ["0.5", "0.99"], histogram
        assert all("sum by (adapter, version, le)" in q for q in queries)


def test_the_dashboard_covers_traffic_errors_adapters_kv_queues_and_spec_decode():
    board = dashboard(render(DASHBOARD_ON))
    everything = " ".join(e for p in panels(board) for e in exprs(p))
    used = set(re.findall(r"\b(?:loragw|vllm)[a-z_:]*", everything))
    assert {"loragw_requests_total", "loragw_prompt_tokens_total",
            "loragw_completion_tokens_total", "loragw_time_to_first_token_seconds_bucket",
            "loragw_time_per_output_token_seconds_bucket", "loragw_adapter_loads_total",
            "loragw_adapter_evictions_total", "loragw_adapter_load_seconds_bucket",
            "loragw_adapter_residency", "loragw_spec_decode_acceptance_rate",
            "loragw_kv_blocks_used", "loragw_kv_blocks_total", "loragw_num_requests_running",
            "loragw_num_requests_waiting", "vllm:num_requests_waiting",
            "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
            "vllm:lora_requests_info"} <= used
    (errors,) = [e for e in _panel_using(board, "loragw_requests_total") if "status" in e]
    assert 'status=~"[4-5][0-9][0-9]"' in errors and "by (adapter, version)" in errors
