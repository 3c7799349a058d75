"""/metrics as the routers in front of a fleet read it: vLLM's names and labels (the Gateway
API Inference Extension's endpoint picker, llm-d's router), running and waiting adapters from
their own queues, per-version labels, the residency gauge, and a label set that stays bounded
however many adapters are used."""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import replace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loragw.gateway.app import create_app
from loragw.gateway.observe.adapter_series import PROMOTION_MARGIN, overtakes
from loragw.gateway.observe.metrics import Metrics
from loragw.gateway.server import BackgroundServer

MAX_LORAS = 4  # conftest's --max-loras
LONG = 480  # tokens a held request would generate (context 512): it outlives the test's reads
PER_ADAPTER = ("loragw_requests", "loragw_prompt_tokens", "loragw_completion_tokens",
               "loragw_time_to_first_token_seconds", "loragw_time_per_output_token_seconds",
               "loragw_e2e_request_latency_seconds")


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def adapter_values(family) -> set[str]:
    return {s.labels["adapter"] for s in family.samples if "adapter" in s.labels}


def total(family, suffix: str = "_total") -> float:
    return sum(s.value for s in family.samples if s.name == family.name + suffix)


# ---- the cap, at unit level --------------------------------------------------------------
def drive(metrics: Metrics, adapter: str, requests: int) -> None:
    """`requests` whole requests for `adapter`, recorded as a server records them."""
    for _ in range(requests):
        metrics.resolved(adapter)
        metrics.count_prompt(adapter, 2, 10)
        metrics.observe_sequence(adapter, 2, 0.05, 0.2, 4)
        metrics.count_request(adapter, 2, 200)


def test_200_adapters_leave_at_most_n_plus_2_adapter_labels_and_the_busiest_keep_theirs():
    n = 10
    metrics = Metrics(max_adapters=n, model_name="m")
    busy = [f"busy-{i}" for i in range(n)]
    # 190 quiet adapters first (they take every label), then the busy ones arrive and must win
    # the labels; interleaved, so each promotion happens mid-traffic
    for i in range(190):
        drive(metrics, f"quiet-{i}", 1 + i % 3)
    for round_ in range(12):
        for i, name in enumerate(busy):
            drive(metrics, name, 1 + i % 2)
        drive(metrics, f"quiet-{round_}", 1)
    for _ in range(3):
        drive(metrics, None, 1)  # the base model
    parsed = families(metrics.render().decode())
    requests_made = sum(metrics.labels.requests.values()) + 3
    for name in PER_ADAPTER:
        values = adapter_values(parsed[name])
        assert len(values) <= n + 2, (name, sorted(values))
        assert set(busy) <= values, (name, sorted(set(busy) - values))
        assert {"base", "other"} <= values
    # folding a label into `other` loses nothing: every request and token is still counted
    assert total(parsed["loragw_requests"]) == requests_made
    assert total(parsed["loragw_prompt_tokens"]) == 10 * requests_made
    assert total(parsed["loragw_e2e_request_latency_seconds"], "_count") == requests_made
    for sample in parsed["loragw_requests"].samples:
        expected = {"base": "", "other": ""}.get(sample.labels["adapter"], "2")
        assert sample.labels["version"] == expected, sample


def test_two_adapters_as_busy_as_each_other_do_not_trade_one_label_on_every_request():
    metrics = Metrics(max_adapters=1)
    for _ in range(50):
        drive(metrics, "a", 1)
        drive(metrics, "b", 1)
    assert metrics.labels.holders == {"a"}  # b never got PROMOTION_MARGIN ahead
    drive(metrics, "b", int(50 * PROMOTION_MARGIN))
    assert metrics.labels.holders == {"b"}
    assert overtakes(13, 10) and not overtakes(12, 10)


def test_the_residency_gauge_is_capped_and_counts_the_rest_per_tier():
    n = 5
    metrics = Metrics(max_adapters=n)
    for i in range(n):
        drive(metrics, f"hot-{i}", 3)
    tiers = ("device", "host", "disk")
    residency = {f"a-{i}": tiers[i % 3] for i in range(200)}
    residency |= {f"hot-{i}": "device" for i in range(n)}
    residency["far"] = "remote"  # not on this replica: not in the gauge
    metrics.scraped(None, residency)
    gauge = families(metrics.render().decode())["loragw_adapter_residency"]
    assert adapter_values(gauge) == {f"hot-{i}" for i in range(n)} | {"other"}
    for sample in gauge.samples:
        assert set(sample.labels) == {"adapter", "tier"}
        if sample.labels["adapter"] != "other":
            assert sample.value == (sample.labels["tier"] == "device")
    other = {s.labels["tier"]: s.value for s in gauge.samples if s.labels["adapter"] == "other"}
    assert other == {tier: sum(t == tier for t in list(residency.values())[:200])
                     for tier in tiers}


# ---- a live server ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def one_seq_server(server_config, tmp_path_factory):
    """The demo gateway running one sequence at a time: the rest wait in the engine's queue."""
    config = replace(server_config, max_num_seqs=1, metrics_max_adapters=3,
                     adapter_dir=str(tmp_path_factory.mktemp("metrics-protocol-store")))
    app = create_app(config)
    with BackgroundServer(app) as background:
        background.services = app.state.services
        background.wait_ready()
        yield background


def hold(url: str, model: str, started: threading.Event, stop: threading.Event) -> None:
    """Stream a long completion until `stop`, then hang up (the server aborts it)."""
    body = {"model": model, "prompt": "tell me a long story", "max_tokens": LONG,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/completions",
                                                 json=body) as r:
        assert r.status_code == 200
        started.set()
        for _ in r.iter_lines():
            if stop.is_set():
                return


def scrape(url: str) -> dict:
    r = httpx.get(url + "/metrics", timeout=30)
    assert r.status_code == 200
    return families(r.text)


def gauge(parsed: dict, name: str) -> float:
    (sample,) = parsed[name].samples
    return sample.value


def test_running_and_waiting_adapters_come_from_their_own_queues(one_seq_server, base_name,
                                                                 wait_idle):
    url, stop = one_seq_server.url, threading.Event()
    threads = []
    try:
        for model in ("lora-1", "lora-2", base_name):
            started = threading.Event()
            thread = threading.Thread(target=hold, args=(url, model, started, stop))
            thread.start()
            threads.append(thread)
            if model == "lora-1":  # running before the others queue behind it
                assert started.wait(60)
        deadline = time.monotonic() + 30
        while gauge(parsed := scrape(url), "vllm:num_requests_waiting") < 2:
            assert time.monotonic() < deadline, "the two held requests never queued"
            time.sleep(0.05)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert gauge(parsed, "vllm:num_requests_running") == 1
    (info,) = parsed["vllm:lora_requests_info"].samples
    assert set(info.labels) == {"running_lora_adapters", "waiting_lora_adapters", "max_lora"}
    assert info.labels == {"running_lora_adapters": "lora-1", "waiting_lora_adapters": "lora-2",
                           "max_lora": str(MAX_LORAS)}  # the base is in neither list
    assert abs(info.value - time.time()) < 60  # a timestamp, as vLLM's
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc"):
        (sample,) = parsed[name].samples
        assert sample.labels == {"model_name": base_name, "engine": "0"}, name
    assert 0 < gauge(parsed, "vllm:kv_cache_usage_perc") <= 1
    wait_idle(one_seq_server.services)
    idle = scrape(url)
    assert gauge(idle, "vllm:num_requests_running") == gauge(idle, "vllm:kv_cache_usage_perc") == 0
    assert idle["vllm:lora_requests_info"].samples[0].labels["running_lora_adapters"] == ""


def test_series_name_the_adapter_version_that_served_them(one_seq_server, base_name):
    url = one_seq_server.url
    version = httpx.get(url + "/admin/adapters/lora-3", timeout=30).json()["version"]
    for model in ("lora-3", base_name):
        r = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": model, "prompt": "hi", "max_tokens": 4, "temperature": 0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
    assert httpx.post(url + "/v1/completions", timeout=60, json={
        "model": "lora-3", "prompt": [1] * 600, "max_tokens": 4}).status_code == 400
    parsed = scrape(url)
    for name in PER_ADAPTER:
        labels = [s.labels for s in parsed[name].samples]
        assert {"adapter": "lora-3", "version": str(version)}.items() <= \
            next(x for x in labels if x["adapter"] == "lora-3").items(), name
        assert any(x["adapter"] == "base" and x["version"] == "" for x in labels), name
    statuses = {s.labels["status"]: s.value for s in parsed["loragw_requests"].samples
                if s.name == "loragw_requests_total" and s.labels["adapter"] == "lora-3"}
    assert statuses["200"] >= 1 and statuses["400"] >= 1  # errors: the 4xx and 5xx statuses
    # residency: lora-3 just ran, so it holds a device slot; every tier's loads have seconds
    residency = {s.labels["tier"]: s.value for s in parsed["loragw_adapter_residency"].samples
                 if s.labels["adapter"] == "lora-3"}
    assert residency == {"device": 1, "host": 0, "disk": 0}
    loads = {s.labels["tier"]: s.value for s in parsed["loragw_adapter_loads"].samples}
    timed = {s.labels["tier"]: s.value for s in parsed["loragw_adapter_load_seconds"].samples
             if s.name == "loragw_adapter_load_seconds_count"}
    assert loads == timed and loads["device"] >= 1 and loads["host"] >= 1


def test_the_adapter_label_values_stay_within_the_cap_on_a_live_server(one_seq_server,
                                                                       adapter_names):
    url = one_seq_server.url  # --metrics-max-adapters 3, 8 adapters
    for name in adapter_names:
        r = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": name, "prompt": "hi", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
    parsed = scrape(url)
    for name in (*PER_ADAPTER, "loragw_adapter_residency"):
        values = adapter_values(parsed[name])
        assert len(values) <= 3 + 2 and "other" in values, (name, values)
    counted = Counter(s.labels["adapter"] for s in parsed["loragw_requests"].samples)
    assert counted["other"] >= 1
