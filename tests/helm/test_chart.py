"""The Helm chart (helm/), rendered by Helm's own engine and checked against Kubernetes' schemas.

Rendering goes through tools/helm_render: the `helm` binary when it is on PATH (helm template,
helm lint --strict), else helm-python-sdk, Helm's Go SDK as a Python wheel. Every manifest is
validated with kubernetes-validate (strict: unknown fields fail) for the oldest Kubernetes the
chart supports, 1.30, and the newest the package knows; the ServiceMonitor, a CRD, against the
part of its schema the chart uses. Nothing here needs a cluster.
"""

from __future__ import annotations

import json
import re
import shutil
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

try:
    import kubernetes_validate
except ImportError:  # pragma: no cover - the message is the point
    kubernetes_validate = None

RELEASE, NAMESPACE = "demo", "llm"
VALUE_SETS = {"default": CHART / "values.yaml",
              **{p.name.removesuffix("-values.yaml"): p for p in sorted(CHART.glob("ci/*-values.yaml"))}}
KUBE_VERSIONS = ["1.25.0", "1.30.0", "latest"]  # the chart's kubeVersion floor, the brief's, newest

DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())
SCHEMA = json.loads((CHART / "values.schema.json").read_text())


# ---- helpers ---------------------------------------------------------------------------------
def require_helm() -> str:
    try:
        return helm_render.backend()
    except helm_render.HelmUnavailable:
        pass
    pytest.fail(helm_render.INSTALL_HINT, pytrace=False)


def require_kubernetes_validate() -> Any:
    if kubernetes_validate is None:
        pytest.fail("kubernetes-validate is not installed; it carries the Kubernetes JSON schemas "
                    "offline: .venv/bin/pip install 'kubernetes-validate>=1.30' (or make install, "
                    "it is in the dev extra)", pytrace=False)
    return kubernetes_validate


_cache: dict[str, helm_render.Rendered] = {}


def render(values: dict[str, Any] | None = None, *, release: str = RELEASE) -> helm_render.Rendered:
    require_helm()
    key = json.dumps([values, release], sort_keys=True)
    if key not in _cache:
        _cache[key] = helm_render.render(CHART, values, release=release, namespace=NAMESPACE)
    return _cache[key]


def load_set(name: str) -> dict[str, Any]:
    return {} if name == "default" else yaml.safe_load(VALUE_SETS[name].read_text()) or {}


def gateway(rendered: helm_render.Rendered) -> dict[str, Any]:
    pod = rendered.one("Deployment")["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "gateway"]
    return container


def flag(container: dict[str, Any], name: str) -> list[str]:
    """Every value given to `name` in the container's args, in order."""
    args = container["args"]
    return [args[i + 1] for i, a in enumerate(args) if a == name]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Does a LabelSelector (matchLabels, matchExpressions) select these labels?"""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        matched = {"In": key in labels and labels[key] in values,
                   "NotIn": labels.get(key) not in values,
                   "Exists": key in labels,
                   "DoesNotExist": key not in labels}[op]
        if not matched:
            return False
    return True


def env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container["env"]}


# ---- the chart renders, lints and validates ---------------------------------------------------
@pytest.mark.parametrize("value_set", list(VALUE_SETS))
def test_chart_lints_clean_for_every_value_set(value_set):
    require_helm()
    report = helm_render.lint(CHART, load_set(value_set), strict=True)
    assert report.ok, f"helm lint --strict ({report.backend}) failed:\n" + "\n".join(report.messages)


@pytest.mark.parametrize("value_set", list(VALUE_SETS))
def test_every_rendered_manifest_validates_against_the_kubernetes_schemas(value_set):
    kv = require_kubernetes_validate()
    rendered = render(load_set(value_set))
    assert len(rendered) >= 5
    for kube in KUBE_VERSIONS:
        version = kv.latest_version() if kube == "latest" else kube
        for m in rendered.manifests:
            if m.kind == "ServiceMonitor":
                validate_service_monitor(m.obj)
                continue
            if m.kind in ("InferencePool", "InferenceObjective"):
                continue  # CRDs: test_observability_chart.py checks them against their schemas
            try:
                kv.validate(m.obj, version, strict=True)
            except kv.ValidationError as exc:
                pytest.fail(f"{value_set}: {m.kind}/{m.name} ({m.source}) is invalid for "
                            f"Kubernetes {version}: {exc.message} at {list(exc.path)}")


@pytest.mark.parametrize("value_set", list(VALUE_SETS))
def test_every_value_set_satisfies_values_schema(value_set):
    merged = helm_render.merge_values(DEFAULTS, load_set(value_set))
    jsonschema.Draft7Validator(SCHEMA).validate(merged)


@pytest.mark.parametrize("value_set", list(VALUE_SETS))
def test_every_object_carries_the_chart_labels_and_release_namespace(value_set):
    for m in render(load_set(value_set)).manifests:
        labels = m.obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "lora-gateway", m.name
        assert labels["app.kubernetes.io/instance"] == RELEASE, m.name
        assert labels["app.kubernetes.io/managed-by"] == "Helm", m.name
        assert labels["helm.sh/chart"] == "lora-gateway-0.1.0", m.name
        assert m.obj["metadata"]["namespace"] == NAMESPACE, m.name


def test_default_install_is_gateway_plus_redis_plus_secret_and_two_services():
    rendered = render()
    assert sorted(rendered.kinds()) == sorted(
        ["ServiceAccount", "Secret", "Service", "Service", "Service", "Deployment", "StatefulSet"])
    assert {s["metadata"]["name"] for s in rendered.of_kind("Service")} == {
        "demo-lora-gateway", "demo-lora-gateway-headless", "demo-lora-gateway-redis"}


def test_services_select_the_gateway_pods_on_port_8000_named_http():
    rendered = render()
    pod_labels = rendered.one("Deployment")["spec"]["template"]["metadata"]["labels"]
    service = rendered.one("Service", "demo-lora-gateway")
    headless = rendered.one("Service", "demo-lora-gateway-headless")
    assert service["spec"]["type"] == "ClusterIP"
    assert headless["spec"]["clusterIP"] == "None"
    for svc in (service, headless):
        assert svc["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http",
                                         "protocol": "TCP"}]
        assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert gateway(rendered)["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]


def test_long_release_names_still_give_valid_object_names():
    rendered = render(release="a-very-long-release-name-for-a-production-lora-gateway-fleet")
    for m in rendered.manifests:
        assert len(m.name) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", m.name), m.name
    # a StatefulSet's pods get a controller-revision-hash label of name + 11 characters
    assert len(rendered.one("StatefulSet")["metadata"]["name"]) <= 52


# ---- optional objects --------------------------------------------------------------------------
def test_a_disabled_pdb_renders_nothing():
    assert render({"pdb": {"enabled": False}}).of_kind("PodDisruptionBudget") == []


def test_optional_objects_are_off_by_default():
    kinds = render().kinds()
    for kind in ("PodDisruptionBudget", "HorizontalPodAutoscaler", "ServiceMonitor", "Ingress",
                 "PersistentVolumeClaim", "InferencePool", "InferenceObjective", "ConfigMap"):
        assert kind not in kinds


def test_hpa_pdb_servicemonitor_and_ingress_render_when_enabled():
    rendered = render(load_set("all-features"))
    deployment = rendered.one("Deployment")
    selector = deployment["spec"]["selector"]["matchLabels"]

    hpa = rendered.one("HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": deployment["metadata"]["name"]}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"

    pdb = rendered.one("PodDisruptionBudget")
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": selector}}

    monitor = rendered.one("ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    scraped = [s["metadata"]["name"] for s in rendered.of_kind("Service")
               if selects(monitor["spec"]["selector"], s["metadata"]["labels"])]
    assert scraped == ["demo-lora-gateway"], "each pod scraped once, through the main Service"
    assert monitor["spec"]["endpoints"][0] == {"port": "http", "path": "/metrics",
                                               "interval": "15s", "scrapeTimeout": "10s"}

    ingress = rendered.one("Ingress")
    assert ingress["apiVersion"] == "networking.k8s.io/v1"
    assert ingress["spec"]["ingressClassName"] == "nginx"
    (rule,) = ingress["spec"]["rules"]
    assert rule["host"] == "llm.example.com"
    assert rule["http"]["paths"][0]["backend"] == {
        "service": {"name": "demo-lora-gateway", "port": {"name": "http"}}}
    assert ingress["spec"]["tls"][0]["secretName"] == "llm-example-com-tls"


def test_hpa_defaults_to_a_cpu_target_and_takes_custom_metrics_instead():
    cpu = render({"autoscaling": {"enabled": True}}).one("HorizontalPodAutoscaler")
    assert cpu["spec"]["metrics"] == [{"type": "Resource", "resource": {
        "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 80}}}]
    queue = {"type": "Pods", "pods": {"metric": {"name": "loragw_waiting_requests"},
                                      "target": {"type": "AverageValue", "averageValue": "4"}}}
    custom = render({"autoscaling": {"enabled": True, "metrics": [queue]}})
    assert custom.one("HorizontalPodAutoscaler")["spec"]["metrics"] == [queue]


def test_pdb_uses_min_available_unless_max_unavailable_is_set():
    assert render({"pdb": {"enabled": True}}).one("PodDisruptionBudget")["spec"]["minAvailable"] == 1
    pdb = render({"pdb": {"enabled": True, "maxUnavailable": "50%"}}).one("PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == "50%" and "minAvailable" not in pdb["spec"]


# ---- Redis ---------------------------------------------------------------------------------------
def test_in_chart_redis_is_a_statefulset_whose_service_the_gateway_is_pointed_at():
    rendered = render()
    redis = rendered.one("StatefulSet")
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "redis:7"
    assert container["ports"][0]["containerPort"] == 6379
    assert container["args"][container["args"].index("--save") + 1] == "", "no snapshots by default"
    assert "volumeClaimTemplates" not in redis["spec"]
    service = rendered.one("Service", redis["spec"]["serviceName"])
    assert service["spec"]["selector"].items() <= redis["spec"]["template"]["metadata"]["labels"].items()
    assert flag(gateway(rendered), "--redis-url") == [f"redis://{service['metadata']['name']}:6379/0"]


def test_external_redis_removes_the_statefulset_and_puts_the_url_in_the_args():
    rendered = render(load_set("external-redis"))
    assert rendered.of_kind("StatefulSet") == []
    assert "demo-lora-gateway-redis" not in {s["metadata"]["name"] for s in rendered.of_kind("Service")}
    assert flag(gateway(rendered), "--redis-url") == ["redis://shared-redis.cache.svc:6379/3"]


def test_external_redis_without_a_url_is_refused():
    require_helm()
    with pytest.raises(helm_render.RenderError, match="externalUrl"):
        helm_render.render(CHART, {"redis": {"enabled": False}}, release=RELEASE)


def test_redis_persistence_snapshots_to_a_claim():
    redis = render(load_set("persistence")).one("StatefulSet")
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "2Gi"
    assert claim["spec"]["storageClassName"] == "fast-ssd"
    args = redis["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes"


# ---- the gateway pod ---------------------------------------------------------------------------
def test_gpu_count_reaches_the_container_resources():
    rendered = render(load_set("multi-gpu"))
    resources = gateway(rendered)["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 2
    assert resources["requests"]["nvidia.com/gpu"] == 2
    assert resources["requests"]["memory"] == "128Gi" and resources["limits"]["memory"] == "200Gi"
    assert flag(gateway(rendered), "--device") == ["cuda"]
    pod = rendered.one("Deployment")["spec"]["template"]["spec"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert {"key": "dedicated", "operator": "Equal", "value": "llm",
            "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["runtimeClassName"] == "nvidia"


def test_the_default_replica_asks_for_one_gpu():
    container = gateway(render())
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert flag(container, "--tensor-parallel-size") == []


def test_tensor_parallel_size_sets_the_flag_and_the_gpu_count_unless_given():
    container = gateway(render({"engine": {"tensorParallelSize": 4}}))
    assert flag(container, "--tensor-parallel-size") == ["4"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 4
    given = gateway(render({"engine": {"tensorParallelSize": 4}, "gpu": {"count": 8}}))
    assert given["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert flag(gateway(render(load_set("multi-gpu"))), "--tensor-parallel-size") == ["2"]


def test_quantization_passes_the_checkpoint_method_and_refuses_others():
    assert flag(gateway(render()), "--quantization") == ["auto"]
    assert flag(gateway(render({"engine": {"quantization": "fp8"}})), "--quantization") == ["fp8"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(SCHEMA).validate({"engine": {"quantization": "bitsandbytes"}})


def test_gpu_count_zero_requests_no_gpu_and_serves_on_cpu():
    rendered = render(load_set("cpu"))
    container = gateway(rendered)
    assert not any("gpu" in k for part in container["resources"].values() for k in part)
    assert flag(container, "--device") == ["cpu"]
    assert "tolerations" not in rendered.one("Deployment")["spec"]["template"]["spec"]


def test_the_pod_ip_reaches_advertise_url_through_the_downward_api():
    container = gateway(render())
    variables = env(container)
    assert variables["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert variables["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert flag(container, "--advertise-url") == ["http://$(POD_IP):8000"]
    assert flag(container, "--replica-id") == ["$(POD_NAME)"]
    assert (flag(container, "--host"), flag(container, "--port")) == (["0.0.0.0"], ["8000"])


def test_startup_probe_waits_on_ready_for_weight_loading_and_liveness_checks_health():
    container = gateway(render())
    startup, readiness, liveness = (container[p] for p in
                                    ("startupProbe", "readinessProbe", "livenessProbe"))
    assert startup["httpGet"] == {"path": "/ready", "port": "http"}
    assert readiness["httpGet"] == {"path": "/ready", "port": "http"}
    assert liveness["httpGet"] == {"path": "/health", "port": "http"}
    assert startup["failureThreshold"] * startup["periodSeconds"] >= 600, "10 minutes to load"


def test_liveness_fails_once_the_engine_is_silent_past_its_bound():
    container = gateway(render())
    assert flag(container, "--health-timeout-s") == ["30"]
    values = {"probes": {"liveness": {"engineTimeoutSeconds": 90}}}
    assert flag(gateway(render(values)), "--health-timeout-s") == ["90"]


def test_startup_probe_budget_comes_from_values():
    values = {"probes": {"startup": {"periodSeconds": 15, "failureThreshold": 120}}}
    startup = gateway(render(values))["startupProbe"]
    assert (startup["periodSeconds"], startup["failureThreshold"]) == (15, 120)


def test_engine_values_become_loragw_serve_flags():
    container = gateway(render(load_set("multi-gpu")))
    assert container["command"] == ["loragw"] and container["args"][0] == "serve"
    assert flag(container, "--model") == ["meta-llama/Llama-3.1-70B-Instruct"]
    assert flag(container, "--served-model-name") == ["meta-llama/Llama-3.1-70B-Instruct"]
    assert flag(container, "--max-model-len") == ["16384"]
    assert flag(container, "--max-loras") == ["16"]
    assert flag(container, "--max-lora-rank") == ["128"]
    assert flag(container, "--max-cpu-loras") == ["32"]
    assert flag(container, "--max-num-seqs") == ["64"]
    assert flag(container, "--dtype") == ["bfloat16"]
    assert flag(container, "--adapter-dir") == ["/data/adapters"]
    assert all(isinstance(a, str) for a in container["args"]), "args are strings"


def test_the_prefill_cap_reaches_the_server_only_when_set():
    assert flag(gateway(render()), "--max-prefill-tokens-decoding") == []
    container = gateway(render({"engine": {"maxPrefillTokensDecoding": 128}}))
    assert flag(container, "--max-prefill-tokens-decoding") == ["128"]


def test_speculative_config_reaches_the_server_as_json_only_when_set():
    assert flag(gateway(render()), "--speculative-config") == []
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    (text,) = flag(gateway(render({"engine": {"speculativeConfig": spec}})), "--speculative-config")
    assert json.loads(text) == spec
    from loragw.engine.speculative_config import parse_speculative_config
    assert parse_speculative_config(text).num_speculative_tokens == 4
    raw = '{"method": "ngram", "num_speculative_tokens": 2}'
    container = gateway(render({"engine": {"speculativeConfig": raw}}))
    assert flag(container, "--speculative-config") == [raw]


def test_prefix_caching_slot_aging_full_modules_and_async_scheduling_reach_the_server_as_its_flags():
    default = gateway(render())
    assert "--enable-prefix-caching" in default["args"]
    assert flag(default, "--lora-starvation-steps") == ["32"]
    off = gateway(render({"engine": {"enablePrefixCaching": False, "loraStarvationSteps": 0}}))
    assert "--no-enable-prefix-caching" in off["args"] and "--enable-prefix-caching" not in off["args"]
    assert flag(off, "--lora-starvation-steps") == ["0"]
    assert flag(default, "--max-full-module-slots") == []  # 0: the server refuses them
    saved = gateway(render({"engine": {"maxFullModuleSlots": 2}}))
    assert flag(saved, "--max-full-module-slots") == ["2"]
    parsed = serve_args(off)
    assert parsed.enable_prefix_caching is False and parsed.lora_starvation_steps == 0
    assert "--async-scheduling" not in default["args"]
    pipelined = gateway(render({"engine": {"asyncScheduling": True}}))
    assert serve_args(pipelined).async_scheduling is True


def serve_args(container: dict[str, Any]):
    """The container's args as `loragw serve` parses them (flags whose value is a downward-API
    placeholder left out)."""
    import argparse

    from loragw.gateway.common.config import add_serve_arguments

    args = container["args"][1:]  # after "serve"
    kept = [a for i, a in enumerate(args)
            if "$(" not in a and not (i + 1 < len(args) and "$(" in args[i + 1])]
    return add_serve_arguments(argparse.ArgumentParser()).parse_args(kept)


def test_body_limits_and_the_upload_timeout_reach_the_server_as_its_flags():
    default = serve_args(gateway(render()))
    assert (default.max_request_mb, default.max_upload_mb, default.upload_timeout_s) == \
        (16, 512, 60.0)
    limits = {"maxRequestMb": 4, "maxUploadMb": 2048, "uploadTimeoutSeconds": 0.5}
    container = gateway(render({"limits": limits}))
    assert flag(container, "--upload-timeout-s") == ["0.5"]
    given = serve_args(container)
    assert (given.max_request_mb, given.max_upload_mb, given.upload_timeout_s) == (4, 2048, 0.5)


def test_the_metrics_adapter_cap_reaches_the_server_as_its_flag():
    assert serve_args(gateway(render())).metrics_max_adapters == 50
    assert serve_args(gateway(render({"metrics": {"maxAdapters": 0}}))).metrics_max_adapters == 0
    assert serve_args(gateway(render({"metrics": {"maxAdapters": 200}}))).metrics_max_adapters \
        == 200


def test_large_numbers_and_numeric_tags_render_as_written():
    # YAML numbers reach templates as float64: without `int`, 1000000 would print as 1e+06.
    rendered = render({"model": {"maxModelLen": 1000000}, "image": {"tag": 7}})
    container = gateway(rendered)
    assert flag(container, "--max-model-len") == ["1000000"]
    assert container["image"] == "ghcr.io/lora-gateway/lora-gateway:7"


def test_the_default_image_is_what_make_image_builds_for_the_device():
    """`make image` tags the CUDA image with the appVersion and the CPU one with -cpu."""
    repo = "ghcr.io/lora-gateway/lora-gateway"
    assert gateway(render({"gpu": {"count": 1}}))["image"] == f"{repo}:0.1.0"
    assert gateway(render({"engine": {"device": "cpu"}}))["image"] == f"{repo}:0.1.0-cpu"
    assert gateway(render({"engine": {"device": "cpu"}, "image": {"tag": "x"}}))["image"] == \
        f"{repo}:x"


def test_served_model_name_overrides_the_model_path():
    container = gateway(render(load_set("existing-claim")))
    assert flag(container, "--model") == ["/data/models/llama-3.1-8b-instruct"]
    assert flag(container, "--served-model-name") == ["llama-3.1-8b"]


def test_each_hub_allow_pattern_and_preloaded_adapter_becomes_its_own_flag():
    container = gateway(render(load_set("hub-allow")))
    assert flag(container, "--hub-allow") == ["acme/*", "acme-labs/support-*",
                                              "predibase/customer_support"]
    assert flag(container, "--adapter") == ["sql=hf://acme/sql-lora@v2",
                                            "support=/data/adapters-seed/support"]
    assert container["args"][-2:] == ["--max-waiting", "512"], "extraArgs come last"
    assert env(container)["LORAGW_MAX_UPLOAD_MB"]["value"] == "1024"


def test_no_hub_allow_by_default():
    assert flag(gateway(render()), "--hub-allow") == []


def test_versions_kept_reaches_the_server_as_its_flag():
    assert flag(gateway(render()), "--adapter-versions-kept") == ["3"]
    assert serve_args(gateway(render())).adapter_versions_kept == 3
    container = gateway(render({"adapters": {"versionsKept": 5}}))
    assert serve_args(container).adapter_versions_kept == 5


def test_traces_are_off_by_default_and_the_otlp_endpoint_reaches_the_server_as_its_flag():
    assert flag(gateway(render()), "--otlp-traces-endpoint") == []
    assert serve_args(gateway(render())).otlp_traces_endpoint is None
    url = "http://otel-collector.observability:4318/v1/traces"
    container = gateway(render({"tracing": {"otlpTracesEndpoint": url}}))
    assert flag(container, "--otlp-traces-endpoint") == [url]
    assert serve_args(container).otlp_traces_endpoint == url


def test_values_schema_refuses_an_otlp_endpoint_that_is_not_http():
    schema = json.loads((CHART / "values.schema.json").read_text())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"tracing": {"otlpTracesEndpoint": "otel-collector:4317"}}, schema)


# ---- the adapter store and s3:// adapters -------------------------------------------------------
AWS_VARIABLES = ("AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION", "AWS_ACCESS_KEY_ID",
                 "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def test_no_adapter_store_no_s3_allow_and_no_aws_variables_by_default():
    container = gateway(render())
    assert flag(container, "--adapter-store-url") == []
    assert flag(container, "--s3-allow") == []
    assert not set(AWS_VARIABLES) & set(env(container))


def test_the_adapter_store_gets_its_url_endpoint_region_and_keys_from_the_existing_secret():
    rendered = render(load_set("adapter-store"))
    container = gateway(rendered)
    assert flag(container, "--adapter-store-url") == ["s3://lora-adapters/gateway"]
    variables = env(container)
    assert variables["AWS_ENDPOINT_URL"]["value"] == "http://minio.storage.svc:9000"
    assert variables["AWS_DEFAULT_REGION"]["value"] == "us-east-1"
    refs = {name: variables[name]["valueFrom"]["secretKeyRef"]
            for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    # not optional: a key missing from the Secret stops the pod instead of failing the first upload
    assert refs == {
        "AWS_ACCESS_KEY_ID": {"name": "adapter-store-credentials", "key": "access-key",
                              "optional": False},
        "AWS_SECRET_ACCESS_KEY": {"name": "adapter-store-credentials", "key": "secret-key",
                                  "optional": False},
    }
    assert "AWS_SESSION_TOKEN" not in variables
    secrets = {s["metadata"]["name"]: s for s in rendered.of_kind("Secret")}
    assert "adapter-store-credentials" not in secrets, "the user brings the store's Secret"
    assert not any(k.startswith("AWS") or "access" in k for s in secrets.values()
                   for k in s.get("data", {}))


def test_each_s3_allow_pattern_becomes_its_own_flag():
    container = gateway(render(load_set("adapter-store")))
    assert flag(container, "--s3-allow") == ["lora-adapters/tenants/*", "shared-models/support-*"]


def test_the_store_and_s3_allow_flags_parse_as_the_servers_own():
    import argparse

    from loragw.gateway.common.config import add_serve_arguments

    args = gateway(render(load_set("adapter-store")))["args"][1:]
    kept = [a for i, a in enumerate(args)
            if "$(" not in a and not (i + 1 < len(args) and "$(" in args[i + 1])]
    parsed = add_serve_arguments(argparse.ArgumentParser()).parse_args(kept)
    assert parsed.adapter_store_url == "s3://lora-adapters/gateway"
    assert list(parsed.s3_allow) == ["lora-adapters/tenants/*", "shared-models/support-*"]


def test_without_an_existing_secret_no_keys_are_set_and_the_credential_chain_signs():
    # all-features: AWS S3 through IRSA, the role on the ServiceAccount
    rendered = render(load_set("all-features"))
    container = gateway(rendered)
    assert flag(container, "--adapter-store-url") == ["s3://acme-lora-adapters/gateway"]
    assert flag(container, "--s3-allow") == ["acme-lora-adapters/published/*"]
    variables = env(container)
    assert variables["AWS_DEFAULT_REGION"]["value"] == "eu-west-1"
    assert not {"AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                "AWS_SESSION_TOKEN"} & set(variables), "AWS S3 and no keys: IRSA signs"
    role = rendered.one("ServiceAccount")["metadata"]["annotations"]["eks.amazonaws.com/role-arn"]
    assert role.startswith("arn:aws:iam::")


def test_each_aws_variable_is_set_only_when_its_value_is():
    url_only = env(gateway(render({"adapterStore": {"url": "s3://bucket/prefix"}})))
    assert not set(AWS_VARIABLES) & set(url_only)
    gcs = "https://storage.googleapis.com"
    endpoint = env(gateway(render({"adapterStore": {"endpoint": gcs}})))
    assert endpoint["AWS_ENDPOINT_URL"]["value"] == gcs
    assert not (set(AWS_VARIABLES) - {"AWS_ENDPOINT_URL"}) & set(endpoint)


def test_a_session_token_key_adds_aws_session_token_from_the_same_secret():
    values = {"adapterStore": {"url": "s3://bucket/prefix", "existingSecret": "sts-creds",
                               "secretKeys": {"sessionToken": "token"}}}
    variables = env(gateway(render(values)))
    assert variables["AWS_SESSION_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "sts-creds", "key": "token", "optional": False}
    assert variables["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"]["key"] == "AWS_ACCESS_KEY_ID"
    assert variables["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["key"] == \
        "AWS_SECRET_ACCESS_KEY"


def test_caches_live_on_the_data_volume_and_root_is_read_only():
    rendered = render()
    container = gateway(rendered)
    variables = env(container)
    assert variables["HF_HOME"]["value"] == "/data/hf"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts["/data"] == "data" and mounts["/tmp"] == "tmp" and mounts["/dev/shm"] == "dshm"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    pod = rendered.one("Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["terminationGracePeriodSeconds"] == 60


def test_persistence_off_uses_an_emptydir():
    rendered = render({"persistence": {"enabled": False}})
    volumes = {v["name"]: v for v in rendered.one("Deployment")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["data"]["emptyDir"] == {"sizeLimit": "50Gi"}
    assert rendered.of_kind("PersistentVolumeClaim") == []


def test_persistence_on_creates_a_shared_claim_and_mounts_it():
    rendered = render(load_set("persistence"))
    claim = rendered.one("PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["spec"]["storageClassName"] == "nfs-rwx"
    assert claim["spec"]["resources"]["requests"]["storage"] == "200Gi"
    assert claim["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    volumes = {v["name"]: v for v in rendered.one("Deployment")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["data"] == {"name": "data",
                               "persistentVolumeClaim": {"claimName": claim["metadata"]["name"]}}


def test_an_existing_claim_is_mounted_and_none_is_created():
    rendered = render(load_set("existing-claim"))
    assert rendered.of_kind("PersistentVolumeClaim") == []
    volumes = {v["name"]: v for v in rendered.one("Deployment")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["data"]["persistentVolumeClaim"] == {"claimName": "models-and-adapters"}


def test_pods_are_annotated_for_prometheus_scraping():
    annotations = render().one("Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == "8000"
    assert annotations["prometheus.io/path"] == "/metrics"


# ---- keys and the Secret -----------------------------------------------------------------------
KEY_VARIABLES = ("LORAGW_ADMIN_KEY", "LORAGW_API_KEY", "HF_TOKEN")


def test_an_existing_secret_means_no_secret_is_rendered_and_env_refers_to_it():
    rendered = render(load_set("existing-secret"))
    assert rendered.of_kind("Secret") == []
    variables = env(gateway(rendered))
    refs = {name: variables[name]["valueFrom"]["secretKeyRef"] for name in KEY_VARIABLES}
    assert refs == {
        "LORAGW_ADMIN_KEY": {"name": "gateway-keys", "key": "ADMIN_KEY", "optional": True},
        "LORAGW_API_KEY": {"name": "gateway-keys", "key": "API_KEY", "optional": True},
        "HF_TOKEN": {"name": "gateway-keys", "key": "HF_TOKEN", "optional": True},
    }


def test_the_chart_secret_holds_the_given_keys_and_env_refers_to_it():
    import base64

    rendered = render(load_set("hub-allow"))
    secret = rendered.one("Secret")
    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert data == {"admin-key": "sk-test-admin-key", "api-key": "sk-test-api-key",
                    "hf-token": "hf_test_token"}
    variables = env(gateway(rendered))
    for name in KEY_VARIABLES:
        assert variables[name]["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"]


def test_without_keys_in_values_the_secret_holds_only_a_generated_admin_key():
    # An empty key would make `loragw serve` refuse to start, so absent keys stay absent.
    import base64

    secret = render().one("Secret")
    assert set(secret["data"]) == {"admin-key"}
    assert re.fullmatch(r"[A-Za-z0-9]{40}", base64.b64decode(secret["data"]["admin-key"]).decode())
    off = render({"auth": {"generateAdminKey": False}}).one("Secret")
    assert off["data"] == {}


METRICS_AUTH = {"type": "Bearer", "credentials": {"name": "demo-lora-gateway-auth",
                                                  "key": "metrics-key"}}


def test_metrics_are_open_unless_a_key_is_required():
    rendered = render({"serviceMonitor": {"enabled": True}})
    assert "LORAGW_METRICS_KEY" not in env(gateway(rendered))
    assert "authorization" not in rendered.one("ServiceMonitor")["spec"]["endpoints"][0]


def test_a_required_metrics_key_comes_from_the_secret_and_the_service_monitor_sends_it():
    import base64

    rendered = render({"metrics": {"requireKey": True}, "auth": {"metricsKey": "sk-metrics"},
                       "serviceMonitor": {"enabled": True}})
    secret = rendered.one("Secret")
    assert base64.b64decode(secret["data"]["metrics-key"]).decode() == "sk-metrics"
    ref = env(gateway(rendered))["LORAGW_METRICS_KEY"]["valueFrom"]["secretKeyRef"]
    # not optional: a Secret without the key keeps the pod from starting, never /metrics open
    assert ref == {"name": secret["metadata"]["name"], "key": "metrics-key", "optional": False}
    monitor = rendered.one("ServiceMonitor")
    validate_service_monitor(monitor)
    assert monitor["spec"]["endpoints"][0]["authorization"] == METRICS_AUTH
    theirs = render({"metrics": {"requireKey": True}, "serviceMonitor": {"enabled": True},
                     "auth": {"existingSecret": "keys", "secretKeys": {"metricsKey": "SCRAPE"}}})
    ref = env(gateway(theirs))["LORAGW_METRICS_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "keys", "key": "SCRAPE", "optional": False}
    assert theirs.one("ServiceMonitor")["spec"]["endpoints"][0]["authorization"] == {
        "type": "Bearer", "credentials": {"name": "keys", "key": "SCRAPE"}}


def test_a_required_metrics_key_with_no_key_is_refused():
    require_helm()
    with pytest.raises(helm_render.RenderError, match="metrics.requireKey needs auth.metricsKey"):
        helm_render.render(CHART, {"metrics": {"requireKey": True}}, release=RELEASE)


# ---- values.yaml and values.schema.json --------------------------------------------------------
BAD_VALUES = {
    "gpu count as words": {"gpu": {"count": "two"}},
    "negative gpu count": {"gpu": {"count": -1}},
    "unknown dtype": {"model": {"dtype": "fp8"}},
    "empty model": {"model": {"name": ""}},
    "misspelt top-level key": {"replicas": 3},
    "misspelt nested key": {"engine": {"maxLora": 8}},
    "port out of range": {"service": {"port": 70000}},
    "external redis without url": {"redis": {"enabled": False}},
    "redis url without scheme": {"redis": {"enabled": False, "externalUrl": "shared-redis:6379"}},
    "pdb as words": {"pdb": {"enabled": True, "minAvailable": "half"}},
    "hub pattern list as string": {"adapters": {"hubAllow": "acme/*"}},
    "no version kept": {"adapters": {"versionsKept": 0}},
    "preload without source": {"adapters": {"preload": [{"name": "sql"}]}},
    "unknown device": {"engine": {"device": "tpu"}},
    "startup probe period zero": {"probes": {"startup": {"periodSeconds": 0}}},
    "store url over http": {"adapterStore": {"url": "http://minio:9000/adapters"}},
    "store url with an uppercase bucket": {"adapterStore": {"url": "s3://Adapters/prod"}},
    "store url without a bucket": {"adapterStore": {"url": "s3://"}},
    "store endpoint without scheme": {"adapterStore": {"endpoint": "minio.storage:9000"}},
    "store secret with a capital": {"adapterStore": {"existingSecret": "S3-Keys"}},
    "store secret key with a space": {"adapterStore": {"secretKeys": {"accessKeyId": "access key"}}},
    "misspelt store key": {"adapterStore": {"bucket": "adapters"}},
    "s3 allow pattern with scheme": {"adapters": {"s3Allow": ["s3://bucket/adapters/*"]}},
    "s3 allow list as string": {"adapters": {"s3Allow": "bucket/*"}},
    "upload timeout of zero": {"limits": {"uploadTimeoutSeconds": 0}},
    "request limit in words": {"limits": {"maxRequestMb": "16MB"}},
    "require metrics key as words": {"metrics": {"requireKey": "yes"}},
}


@pytest.mark.parametrize("values", BAD_VALUES.values(), ids=BAD_VALUES.keys())
def test_values_violating_the_schema_are_rejected(values):
    merged = helm_render.merge_values(DEFAULTS, values)
    errors = list(jsonschema.Draft7Validator(SCHEMA).iter_errors(merged))
    assert errors, "jsonschema accepted it"
    require_helm()
    with pytest.raises(helm_render.RenderError):
        helm_render.render(CHART, values, release=RELEASE)


def test_the_schema_is_a_valid_draft7_schema_that_accepts_the_defaults():
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    jsonschema.Draft7Validator(SCHEMA).validate(DEFAULTS)


def _leaf_paths(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict) and node:
        return [p for k, v in node.items() for p in _leaf_paths(v, f"{prefix}{k}.")]
    return [prefix.rstrip(".")]


def test_the_schema_describes_every_value():
    missing = []
    for path in _leaf_paths(DEFAULTS):
        node = SCHEMA
        for part in path.split("."):
            props = node.get("properties", {})
            if part not in props:
                if node.get("type") == "object" and node.get("additionalProperties") is not False:
                    break  # a free-form object (resources, securityContext...): its keys are Kubernetes'
                missing.append(path)
                break
            node = props[part]
    assert not missing, f"values.yaml keys with no schema: {missing}"


def _undocumented(lines: list[str], node: yaml.MappingNode, prefix: str = "") -> list[str]:
    """helm-docs' rule: a key is documented by a `# --` comment block right above it; a key
    without one must be a non-empty map whose keys are all documented."""
    missing = []
    for key, value in node.value:
        row, column = key.start_mark.line, key.start_mark.column
        block = []
        above = row - 1
        while above >= 0 and lines[above].strip().startswith("#"):
            block.insert(0, lines[above])
            above -= 1
        documented = any(re.match(rf"^ {{{column}}}# -- \S", line) for line in block)
        path = prefix + key.value
        if documented:
            continue
        if isinstance(value, yaml.MappingNode) and value.value:
            missing += _undocumented(lines, value, path + ".")
        else:
            missing.append(path)
    return missing


def test_every_value_in_values_yaml_has_a_doc_comment():
    text = (CHART / "values.yaml").read_text()
    root = yaml.compose(text)
    assert isinstance(root, yaml.MappingNode)
    assert _undocumented(text.splitlines(), root) == []


def test_the_doc_comment_check_catches_an_undocumented_value():
    text = "# -- documented\na: 1\nsection:\n  # -- documented\n  b: 2\n  c: 3\n"
    assert _undocumented(text.splitlines(), yaml.compose(text)) == ["section.c"]


# ---- NOTES.txt and the CLI agreeing with the SDK -----------------------------------------------
def render_notes(values: dict[str, Any] | None = None) -> str:
    """NOTES.txt as `helm install` prints it (Helm's SDK: `helm template` does not render it)."""
    try:
        import helm_python
    except ImportError:
        pytest.fail(helm_render.INSTALL_HINT, pytrace=False)
    with helm_python.Chart.load(CHART) as chart:
        files = chart.render(values or {}, name=RELEASE, namespace=NAMESPACE)
    return next(v for k, v in files.items() if k.endswith("NOTES.txt"))


def test_notes_show_how_to_port_forward_and_send_an_openai_request():
    notes = render_notes()
    assert f"kubectl -n {NAMESPACE} port-forward svc/demo-lora-gateway 8000:8000" in notes
    assert "/v1/chat/completions" in notes and '"model": "Qwen/Qwen2.5-1.5B-Instruct"' in notes
    assert "from openai import OpenAI" in notes


NO_STORE_WARNING = "WARNING: up to"


def test_notes_warn_that_uploads_stay_on_one_pod_when_several_replicas_have_no_store():
    three = render_notes({"replicaCount": 3})
    assert "WARNING: up to 3 replicas and no adapterStore.url" in three
    assert "lost with that pod" in three and "Set adapterStore.url" in three
    scaled = render_notes({"autoscaling": {"enabled": True, "maxReplicas": 5}})
    assert "WARNING: up to 5 replicas and no adapterStore.url" in scaled


def test_notes_do_not_warn_with_a_store_or_a_single_replica():
    assert NO_STORE_WARNING not in render_notes()
    one_at_most = {"autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 1}}
    assert NO_STORE_WARNING not in render_notes(one_at_most)
    stored = render_notes(load_set("adapter-store"))
    assert NO_STORE_WARNING not in stored
    assert ("Adapter store: s3://lora-adapters/gateway at http://minio.storage.svc:9000, keys from "
            "Secret adapter-store-credentials.") in stored
    assert "Adapter store:" not in render_notes()
    irsa = render_notes(load_set("all-features"))
    assert NO_STORE_WARNING not in irsa
    assert ("Adapter store: s3://acme-lora-adapters/gateway, keys from the AWS credential "
            "chain.") in irsa


@pytest.mark.skipif(shutil.which("helm") is None,
                    reason="helm binary not on PATH: every other test rendered with Helm's Go SDK")
def test_the_helm_binary_and_the_sdk_render_the_same_objects(monkeypatch):
    def objects(backend: str) -> list[tuple[str, str, Any]]:
        monkeypatch.setenv("LORAGW_HELM_BACKEND", backend)
        rendered = helm_render.render(CHART, load_set("all-features"), release=RELEASE,
                                      namespace=NAMESPACE)
        out = []
        for m in rendered.manifests:
            obj = json.loads(json.dumps(m.obj))
            if m.kind == "Secret":
                obj.pop("data", None)  # the generated admin key differs between renders
            if m.kind == "Deployment":
                obj["spec"]["template"]["metadata"]["annotations"].pop("checksum/auth", None)
            out.append((m.kind, m.name, obj))
        return sorted(out, key=lambda t: (t[0], t[1]))

    assert objects("cli") == objects("sdk")


HELM_TEMPLATE_OUTPUT = """\
---
# Source: lora-gateway/templates/serviceaccount.yaml
apiVersion: v1
kind: ServiceAccount
metadata:
  name: demo-lora-gateway
---
# Source: lora-gateway/templates/service.yaml
apiVersion: v1
kind: Service
metadata:
  name: demo-lora-gateway
spec:
  ports:
    - name: http
      port: 8000
---
# Source: lora-gateway/templates/redis.yaml
apiVersion: v1
kind: Service
metadata:
  name: demo-lora-gateway-redis
"""


def test_the_cli_backend_reads_helm_template_output(tmp_path, monkeypatch):
    # A stand-in `helm` printing what `helm template` prints, so the parsing of the binary's
    # output is checked even where the binary is not installed.
    fake = tmp_path / "helm"
    (tmp_path / "out.yaml").write_text(HELM_TEMPLATE_OUTPUT)
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/argv\ncat {tmp_path}/out.yaml\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setenv("LORAGW_HELM_BACKEND", "cli")
    rendered = helm_render.render(CHART, {"gpu": {"count": 2}}, release="demo", namespace="llm")
    assert rendered.backend == "cli"
    assert [(m.source, m.kind, m.name) for m in rendered.manifests] == [
        ("lora-gateway/templates/serviceaccount.yaml", "ServiceAccount", "demo-lora-gateway"),
        ("lora-gateway/templates/service.yaml", "Service", "demo-lora-gateway"),
        ("lora-gateway/templates/redis.yaml", "Service", "demo-lora-gateway-redis"),
    ]
    argv = (tmp_path / "argv").read_text().split()
    assert argv[:3] == ["template", "demo", str(CHART)]
    assert argv[argv.index("--namespace") + 1] == "llm" and "--values" in argv


def test_no_helm_engine_at_all_fails_with_install_instructions(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("LORAGW_HELM_BACKEND", "cli")
    with pytest.raises(helm_render.HelmUnavailable, match="pip install 'helm-python-sdk"):
        helm_render.render(CHART)


# ---- the ServiceMonitor CRD, checked against the part of its schema the chart uses -------------
_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?"
                                          r"(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"],
                     "properties": {"name": {"type": "string"}, "namespace": {"type": "string"},
                                    "labels": _LABELS, "annotations": _LABELS}},
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {"type": "object", "additionalProperties": False,
                             "properties": {"matchLabels": _LABELS,
                                            "matchExpressions": {"type": "array"}}},
                "namespaceSelector": {"type": "object", "additionalProperties": False,
                                      "properties": {"any": {"type": "boolean"},
                                                     "matchNames": {"type": "array",
                                                                    "items": {"type": "string"}}}},
                "jobLabel": {"type": "string"},
                "endpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False,
                    "properties": {
                        "port": {"type": "string"}, "targetPort": {},
                        "path": {"type": "string", "pattern": "^/"},
                        "scheme": {"enum": ["http", "https"]},
                        "interval": _DURATION, "scrapeTimeout": _DURATION,
                        "honorLabels": {"type": "boolean"},
                        "authorization": {
                            "type": "object", "additionalProperties": False,
                            "properties": {"type": {"type": "string"}, "credentials": {
                                "type": "object", "required": ["name", "key"],
                                "additionalProperties": False,
                                "properties": {"name": {"type": "string"},
                                               "key": {"type": "string"},
                                               "optional": {"type": "boolean"}}}}},
                        "relabelings": {"type": "array", "items": {"type": "object"}},
                        "metricRelabelings": {"type": "array", "items": {"type": "object"}},
                    }}},
            },
        },
    },
}


def validate_service_monitor(obj: dict[str, Any]) -> None:
    jsonschema.Draft7Validator(SERVICE_MONITOR_SCHEMA).validate(obj)
    # the port it scrapes must be one the gateway Service exposes
    assert obj["spec"]["endpoints"][0]["port"] == "http"


def test_tenant_key_cache_seconds_pass_to_the_server():
    assert flag(gateway(render()), "--tenant-key-cache-s") == ["3600"]
    rendered = render({"auth": {"tenantKeyCacheSeconds": 600}})
    assert flag(gateway(rendered), "--tenant-key-cache-s") == ["600"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(SCHEMA).validate({"auth": {"tenantKeyCacheSeconds": 0}})
