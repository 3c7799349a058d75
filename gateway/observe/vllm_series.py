"""The /metrics families read from the engine's snapshot per scrape that concern adapters and
the routers in front of this server.

Under vLLM's names and labels, what the Gateway API Inference Extension's endpoint picker and
llm-d's router scrape from a model server (vllm/v1/metrics/loggers.py is the reference):
`vllm:num_requests_waiting`, `vllm:num_requests_running` and `vllm:kv_cache_usage_perc` (0..1),
labelled model_name and engine; and `vllm:lora_requests_info{running_lora_adapters,
waiting_lora_adapters, max_lora}` whose value is the scrape's unix time (vLLM sets it to the
time of its last stats update; a picker reads the labels of the newest sample). Running and
waiting adapters are read from the engine's running queue and its waiting queue separately,
so a picker's affinity (pods running the adapter first, then those queueing it) sees each.

Also the per-adapter residency gauge and the load-seconds histogram, whose engine and gateway
halves are summed here.
"""

from __future__ import annotations

import time
from collections import Counter as Tally

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

from loragw.engine.api import LOAD_SECONDS_BUCKETS, EngineSnapshot, LoadTimes
from loragw.gateway.observe.adapter_series import OTHER_LABEL, AdapterLabels, HistogramSeries

TIERS = ("device", "host", "disk")
ENGINE_INDEX = "0"  # vLLM's `engine` label: one engine per server here


def vllm_families(snap: EngineSnapshot | None, model_name: str):
    if snap is None:
        return
    labels = ["model_name", "engine"]
    for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.",
             snap.num_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             snap.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             snap.kv_blocks_used / snap.kv_blocks_total if snap.kv_blocks_total else 0.0)):
        family = GaugeMetricFamily(name, doc, labels=labels)
        family.add_metric([model_name, ENGINE_INDEX], value)
        yield family
    info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                             labels=["max_lora", "waiting_lora_adapters",
                                     "running_lora_adapters"])
    info.add_metric([str(snap.slots_total), ",".join(snap.waiting_adapters),
                     ",".join(snap.running_adapters)], time.time())
    yield info


def residency_gauge(residency: dict[str, str], labels: AdapterLabels) -> GaugeMetricFamily:
    """1 for the tier each adapter is in (0 for the others), for the adapters that hold their
    own label, else the next busiest up to the cap; the rest counted per tier under `other`."""
    family = GaugeMetricFamily("loragw_adapter_residency", "Where an adapter is on this "
                               "replica: 1 for its tier (device, host, disk); adapter=\"other\" "
                               "counts the adapters beyond --metrics-max-adapters per tier",
                               labels=["adapter", "tier"])
    ranked = labels.ranked([name for name, tier in residency.items() if tier in TIERS])
    shown, rest = ranked[:labels.max_adapters], ranked[labels.max_adapters:]
    for name in sorted(shown):
        for tier in TIERS:
            family.add_metric([name, tier], float(residency[name] == tier))
    if rest:
        others = Tally(residency[name] for name in rest)
        for tier in TIERS:
            family.add_metric([OTHER_LABEL, tier], others[tier])
    return family


def load_seconds(engine: dict[str, LoadTimes], ours: dict[str, LoadTimes]
                 ) -> HistogramMetricFamily:
    """Seconds of the loads into each tier: the engine's (device fills, host re-reads) and the
    gateway's (fetches to disk, parses into host memory) summed."""
    family = HistogramMetricFamily("loragw_adapter_load_seconds", "Time to load an adapter "
                                   "into a tier", labels=["tier"])
    for tier in TIERS:
        series = HistogramSeries([0] * (len(LOAD_SECONDS_BUCKETS) + 1))
        for times in (engine.get(tier), ours.get(tier)):
            if times is not None:
                series.add(HistogramSeries(times.counts, times.total))
        family.add_metric([tier], series.buckets(LOAD_SECONDS_BUCKETS), series.total)
    return family
