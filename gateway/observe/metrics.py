"""Prometheus metrics, one CollectorRegistry per app (tests run several apps in one process).

Per-adapter series (requests, tokens, TTFT, TPOT, end-to-end latency) are labelled by adapter
and version for the `--metrics-max-adapters` busiest adapters, the rest summed under "other"
(gateway/observe/adapter_series.py states the rule). gateway/observe/vllm_series.py adds, under vLLM's
names, what the Gateway API Inference Extension's endpoint picker and llm-d's router scrape.

Counters and histograms are recorded as requests finish; gauges (queue depth, running
sequences, KV blocks, device slots) and the engine's adapter counters (loads, evictions, hits
per tier) are read from an `EngineSnapshot` (engine/snapshot.py) taken on the engine thread at scrape time, so they
are live and never torn mid-step. Events outside the engine (Hub downloads to the disk tier)
are counted in `TierStats` by the adapter manager.

Request counters are labelled with the HTTP status, or CLIENT_CLOSED_REQUEST (499, nginx's
"client closed request") for a request whose client went away before its response ended: a
stream it abandoned, or a whole response it stopped waiting for; or STREAM_FAILED (500) for a
stream that failed after its 200 went out (the engine died mid-way: an in-band error event).
"""

from __future__ import annotations

from collections import Counter as Tally
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from loragw.engine.api import EngineInfo, EngineSnapshot, LoadTimes
from loragw.gateway.observe.adapter_series import AdapterLabels, Family
from loragw.gateway.observe.vllm_series import TIERS, load_seconds, residency_gauge, vllm_families

DEFAULT_MAX_ADAPTERS = 50  # --metrics-max-adapters
CLIENT_CLOSED_REQUEST = 499  # the status label of a request its client abandoned
STREAM_FAILED = 500  # the status label of a stream that failed after its 200 went out
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass
class TierStats:
    """Adapter events the gateway side counts (e.g. Hub downloads to disk), added to the
    engine's own counts; the adapter manager increments these."""

    loads: Tally = field(default_factory=Tally)
    evictions: Tally = field(default_factory=Tally)
    hits: Tally = field(default_factory=Tally)
    load_seconds: dict[str, LoadTimes] = field(default_factory=dict)


class Metrics:
    def __init__(self, max_adapters: int = DEFAULT_MAX_ADAPTERS, model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.model_name = model_name  # the model_name label of the vLLM-named series
        self.http_requests = Counter("loragw_http_requests", "HTTP requests by route and status",
                                     ["route", "status"], registry=r)
        # per adapter and version, capped (gateway/observe/adapter_series.py)
        self.requests = Family("loragw_requests", "Generation requests by adapter, version and "
                               "status (errors: status >= 400)", ("status",))
        self.prompt_tokens = Family("loragw_prompt_tokens", "Prompt tokens by adapter")
        self.completion_tokens = Family("loragw_completion_tokens", "Generated tokens by adapter")
        self.ttft = Family("loragw_time_to_first_token_seconds", "Arrival to first token",
                           bounds=LATENCY_BUCKETS)
        self.tpot = Family("loragw_time_per_output_token_seconds", "Mean time between output "
                           "tokens after the first", bounds=TOKEN_LATENCY_BUCKETS)
        self.e2e = Family("loragw_e2e_request_latency_seconds", "Arrival to last token",
                          bounds=LATENCY_BUCKETS)
        self.adapter_families = [self.requests, self.prompt_tokens, self.completion_tokens,
                                 self.ttft, self.tpot, self.e2e]
        self.labels = AdapterLabels(max_adapters, self.adapter_families)
        # by tenant ("operator": the static keys), never by key: the label set stays bounded
        self.tenant_requests = Counter("loragw_tenant_requests", "Requests answered here, by "
                                       "the caller's tenant and status", ["tenant", "status"],
                                       registry=r)
        self.tenant_tokens = Counter("loragw_tenant_tokens", "Prompt and generated tokens by "
                                     "tenant", ["tenant", "kind"], registry=r)
        self.tenant_rate_limited = Counter("loragw_tenant_rate_limited", "Requests refused "
                                           "with 429 by a key's limit, by tenant and limit",
                                           ["tenant", "limit"], registry=r)
        # the fleet's placement plan as this replica holds it (gateway/fleet/placing.py): the
        # copies of its --metrics-max-adapters busiest adapters, and the moves it made
        self.adapter_copies = Gauge("loragw_adapter_copies", "Replicas the placement plan "
                                    "assigns each adapter", ["adapter"], registry=r)
        self.placement_moves = Counter("loragw_placement_moves", "New (adapter, replica) pairs "
                                       "in the placement plans this replica computed", registry=r)
        self.tiers = TierStats()
        self.snapshot: EngineSnapshot | None = None  # set by the /metrics handler per scrape
        self.residency: dict[str, str] = {}  # adapter -> tier here, set with the snapshot
        self.info: EngineInfo | None = None  # set by Services once the engine is up
        self.gateway_inflight = 0  # sequences admitted by the gateway, set per scrape
        self.gateway_capacity = 0
        r.register(_LiveCollector(self))

    # Adapters are ids (None: the base model) with the catalog version that served them.
    def resolved(self, adapter: str | None) -> None:
        """A request's model resolved to `adapter` here: its rank among the busiest."""
        if adapter is not None:
            self.labels.count(adapter)

    def count_request(self, adapter: str | None, version: int | None, status: int) -> None:
        self.requests.inc((*self.labels.key(adapter, version), str(status)), 1)

    def count_prompt(self, adapter: str | None, version: int | None, tokens: int) -> None:
        self.prompt_tokens.inc(self.labels.key(adapter, version), tokens)

    def count_completion(self, adapter: str | None, version: int | None, tokens: int) -> None:
        self.completion_tokens.inc(self.labels.key(adapter, version), tokens)

    def observe_sequence(self, adapter: str | None, version: int | None, ttft: float | None,
                         e2e: float, num_output_tokens: int) -> None:
        """One finished choice: latency histograms and its generated tokens."""
        key = self.labels.key(adapter, version)
        if ttft is not None:
            self.ttft.observe(key, ttft)
            if num_output_tokens > 1:
                self.tpot.observe(key, (e2e - ttft) / (num_output_tokens - 1))
        self.e2e.observe(key, e2e)
        self.completion_tokens.inc(key, num_output_tokens)

    def observe_load(self, tier: str, seconds: float) -> None:
        """A load into `tier` the gateway made (the engine counts and times its own)."""
        self.tiers.loads[tier] += 1
        self.tiers.load_seconds.setdefault(tier, LoadTimes()).observe(seconds)

    def scraped(self, snapshot: EngineSnapshot | None, residency: dict[str, str]) -> None:
        """What the /metrics handler read for this scrape: the engine's snapshot and where
        each adapter is on this replica (device / host / disk)."""
        self.snapshot, self.residency = snapshot, residency

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _LiveCollector(Collector):
    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self):
        m, snap = self.metrics, self.metrics.snapshot
        for family in m.adapter_families:
            yield family.collect()
        yield from vllm_families(snap, m.model_name)
        yield residency_gauge(m.residency, m.labels)
        yield load_seconds(snap.load_seconds if snap is not None else {}, m.tiers.load_seconds)
        yield _gauge("loragw_gateway_inflight_sequences",
                     "Sequences the gateway has admitted (running or queued)", m.gateway_inflight)
        yield _gauge("loragw_gateway_capacity_sequences",
                     "Sequences admitted before 429 (max_num_seqs + max_waiting)",
                     m.gateway_capacity)
        if m.info is not None:
            params = GaugeMetricFamily("loragw_model_parameters", "Base model parameters: all, "
                                       "and those one token multiplies by (MoE: top_k of E "
                                       "experts; dense: all)", labels=["kind"])
            params.add_metric(["total"], m.info.total_parameters)
            params.add_metric(["active"], m.info.active_parameters)
            yield params
            weights = GaugeMetricFamily("loragw_model_weight_bytes", "Bytes of the base's weights "
                                        "one rank holds, as stored (quantized: packed, with "
                                        "scales)", labels=["quantization"])
            weights.add_metric([m.info.quantization], m.info.weight_bytes)
            yield weights
        if snap is not None:
            yield _gauge("loragw_num_requests_waiting", "Sequences queued in the engine",
                         snap.num_waiting)
            yield _gauge("loragw_num_requests_running", "Sequences running in the engine",
                         snap.num_running)
            yield _gauge("loragw_kv_blocks_used", "KV-cache blocks in use", snap.kv_blocks_used)
            yield _gauge("loragw_kv_blocks_total", "KV-cache blocks", snap.kv_blocks_total)
            yield _gauge("loragw_lora_slots_used", "Device adapter slots held by running "
                         "sequences", snap.slots_in_use)
            yield _gauge("loragw_lora_slots_resident", "Device adapter slots holding an "
                         "adapter", len(snap.resident))
            yield _gauge("loragw_lora_slots_total", "Device adapter slots", snap.slots_total)
            pools = GaugeMetricFamily("loragw_lora_device_bytes", "Device memory of the adapter "
                                      "slot pools (vocab pools and full modules only once an "
                                      "adapter needs them)", labels=["pool"])
            for pool, nbytes in sorted(snap.lora_device_bytes.items()):
                pools.add_metric([pool], nbytes)
            yield pools
            adapters = GaugeMetricFamily("loragw_adapters", "Registered adapters per tier",
                                         labels=["tier"])
            for tier in TIERS:
                adapters.add_metric([tier], sum(t == tier for t in snap.residency.values()))
            yield adapters
            for name, doc, value in (("preemptions", "Sequences preempted", snap.preemptions),
                                     ("engine_step_errors", "Engine steps that failed",
                                      snap.step_errors),
                                     ("prefix_cache_queries", "Tokens looked up in the prefix "
                                      "cache when sequences were admitted",
                                      snap.prefix_cache_queries),
                                     ("prefix_cache_hits", "Tokens found in the prefix cache "
                                      "(their prefill skipped)", snap.prefix_cache_hits)):
                family = CounterMetricFamily(f"loragw_{name}", doc)
                family.add_metric([], value)
                yield family
        if snap is not None and snap.spec_choices:
            yield from _spec_decode(snap, m.labels)
        for name in ("loads", "evictions", "hits"):
            family = CounterMetricFamily(f"loragw_adapter_{name}", f"Adapter {name} per tier",
                                         labels=["tier"])
            engine_counts = getattr(snap, name) if snap is not None else {}
            ours = getattr(m.tiers, name)
            for tier in TIERS:
                family.add_metric([tier], engine_counts.get(tier, 0) + ours[tier])
            yield family


def _spec_decode(snap: EngineSnapshot, labels: AdapterLabels):
    """Speculative decoding per adapter, as vLLM's spec_decode metrics: verifications, drafted
    and accepted tokens, the acceptance rate (accepted / drafted) and the mean draft length
    chosen (engine/spec/goodput.py). Adapters without a label
    of their own are summed under "other", as in the per-adapter families."""
    def by_label(counts: dict[str, int]) -> Tally:
        out: Tally = Tally()
        for adapter, value in counts.items():  # "" is the base
            out[labels.key(adapter or None, None)[0]] += value
        return out

    drafted, accepted = by_label(snap.spec_draft_tokens), by_label(snap.spec_accepted_tokens)
    for name, doc, counts in (
            ("num_drafts", "Verifications of proposed tokens (one per sequence and step)",
             by_label(snap.spec_drafts)),
            ("num_draft_tokens", "Tokens proposed", drafted),
            ("num_accepted_tokens", "Proposed tokens accepted", accepted)):
        family = CounterMetricFamily(f"loragw_spec_decode_{name}", doc, labels=["adapter"])
        for label, value in sorted(counts.items()):
            family.add_metric([label], value)
        yield family
    rate = GaugeMetricFamily("loragw_spec_decode_acceptance_rate", "Proposed tokens accepted "
                             "over proposed tokens, since start", labels=["adapter"])
    for label, tokens in sorted(drafted.items()):
        rate.add_metric([label], accepted[label] / max(tokens, 1))
    yield rate
    choices, chosen = by_label(snap.spec_choices), by_label(snap.spec_chosen_tokens)
    length = GaugeMetricFamily("loragw_spec_decode_mean_draft_length", "Drafts chosen per "
                               "decoding row and step by the goodput model (0 included), since "
                               "start", labels=["adapter"])
    for label, rows in sorted(choices.items()):
        length.add_metric([label], chosen[label] / max(rows, 1))
    yield length


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)
