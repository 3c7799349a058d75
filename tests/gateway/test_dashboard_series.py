"""The chart's Grafana dashboard (helm/dashboards/lora-gateway.json) against what a live gateway
exports: every series a panel or variable queries, and every label it filters or groups by, is
on this server's /metrics (parsed by prometheus_client's parser) after traffic on the base model
and an adapter, with speculative decoding on so its series exist. Prometheus adds the target
labels (pod, namespace, ...) itself when it scrapes through the chart's ServiceMonitor.

The chart renders the same file into its ConfigMap (tests/helm/test_observability_chart.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loragw.gateway.app import create_app
from loragw.gateway.common.config import ServerConfig
from loragw.gateway.server import BackgroundServer

DASHBOARD = Path(__file__).resolve().parents[2] / "helm" / "dashboards" / "lora-gateway.json"
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}
PROMPT = "the red fox and the red fox and the red fox and the red"
# What Prometheus attaches to every sample of a ServiceMonitor target.
TARGET_LABELS = {"instance", "job", "namespace", "pod", "service", "container", "endpoint"}
# PromQL words that look like names but are neither series nor labels.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
            "unless", "offset", "inf", "nan"}


@dataclass
class Query:
    """One PromQL expression: the series it selects with the labels each matcher names, and the
    labels it groups or matches by."""

    selectors: list[tuple[str, set[str]]] = field(default_factory=list)
    grouping: set[str] = field(default_factory=set)


def parse(expr: str) -> Query:
    query = Query()
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values, $variables in them
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges: [5m], [$__rate_interval]
    for clause in re.finditer(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", text):
        query.grouping |= {name.strip() for name in clause.group(1).split(",") if name.strip()}
    text = re.sub(r"\b(?:by|without|on|ignoring)\s*\([^)]*\)", " ", text)
    for m in re.finditer(r"(?<![\w.:])([A-Za-z_:][\w:]*)\s*(\{[^}]*\})?\s*(\()?", text):
        name, matchers, call = m.groups()
        if call or name in KEYWORDS:
            continue  # a function or an aggregation
        labels = set(re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", matchers or ""))
        query.selectors.append((name, labels))
    return query


def test_the_parser_finds_series_matchers_and_grouping():
    q = parse('histogram_quantile(0.99, sum by (adapter, le) (rate(a_bucket{adapter=~"$x", '
              's="5.."}[$__rate_interval]))) / on (pod) max(vllm:b) > bool 0')
    assert q.selectors == [("a_bucket", {"adapter", "s"}), ("vllm:b", set())]
    assert q.grouping == {"adapter", "le", "pod"}


@pytest.fixture(scope="module")
def scrape(server_config, tmp_path_factory) -> dict[str, set[str]]:
    """{sample name: its label names} of a live gateway's /metrics after traffic."""
    config = ServerConfig(**{**server_config.__dict__,
                             "adapter_dir": str(tmp_path_factory.mktemp("dashboard-store")),
                             "speculative_config": json.dumps(SPEC)})
    app = create_app(config)
    with BackgroundServer(app) as server:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                               timeout=120)
        for model in ("demo-base", "lora-1", "lora-2"):
            client.completions.create(model=model, prompt=PROMPT, max_tokens=16,
                                      temperature=0.0, extra_body={"ignore_eos": True})
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="no-such-adapter", prompt=PROMPT, max_tokens=2)
        text = httpx.get(server.url + "/metrics", timeout=60).text
    exported: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            exported.setdefault(sample.name, set()).update(sample.labels)
    return exported


def dashboard_queries() -> dict[str, str]:
    """{where: PromQL} of every panel target and query variable."""
    board = json.loads(DASHBOARD.read_text())
    out = {}
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            out[f"panel {panel['title']!r} {target['refId']}"] = target["expr"]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["query"]["query"])
            assert m, variable["query"]["query"]
            out[f"variable {variable['name']}"] = f"max by ({m.group(2)}) ({m.group(1)})"
    return out


QUERIES = dashboard_queries()


@pytest.mark.parametrize("expr", QUERIES.values(), ids=QUERIES.keys())
def test_every_dashboard_query_names_exported_series_and_their_labels(scrape, expr):
    query = parse(expr)
    assert query.selectors, f"no series in {expr}"
    offered = set(TARGET_LABELS)
    for name, labels in query.selectors:
        assert name in scrape, (f"{name} is not on /metrics; it has "
                                f"{sorted(n for n in scrape if n.startswith(name.split('_')[0]))}")
        assert labels <= scrape[name] | TARGET_LABELS, f"{name} has no {labels - scrape[name]}"
        offered |= scrape[name]
    assert query.grouping <= offered, f"{expr}: no series has {query.grouping - offered}"
