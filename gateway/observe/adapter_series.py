"""Per-adapter, per-version series with a bounded label set (`--metrics-max-adapters N`).

The rule, in full: the base model is `adapter="base", version=""`. An adapter gets its own
`adapter` label (and one `version` label per version it served) as long as it is among the N
busiest, busiest meaning most requests since the server started. While fewer than N adapters
hold a label, the first request of a new adapter gets one. Once N hold one, an adapter without
a label takes the label of the least busy holder when its requests exceed that holder's by
PROMOTION_MARGIN (so two adapters about as busy do not swap labels on every request). Everything
else is `adapter="other", version=""`. So the exposition has at most N + 2 adapter values.

A holder that loses its label has its series folded into `other` (summed, per status) and they
vanish from the exposition: `other` only ever grows, so every counter stays monotonic, and a
label won back starts its series again from zero (Prometheus reads that as a new series).

The series are kept here rather than in prometheus_client's labelled children because a fold
moves a histogram's buckets, which prometheus_client has no public way to read or remove.
"""

from __future__ import annotations

import bisect
from collections import Counter as Tally
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

BASE_LABEL = "base"  # the adapter label of requests for the base model
OTHER_LABEL = "other"  # the adapter label of every adapter beyond the N busiest
PROMOTION_MARGIN = 1.25  # requests an unlabelled adapter needs, over the least busy holder's


def overtakes(requests: int, holder_requests: int) -> bool:
    """Whether an adapter with `requests` takes the label of a holder with `holder_requests`."""
    return requests > holder_requests * PROMOTION_MARGIN


@dataclass(slots=True)
class HistogramSeries:
    """One histogram series: a count per bucket (not cumulative; the last is +Inf), and sum."""

    counts: list[int]
    total: float = 0.0

    def observe(self, bounds: tuple[float, ...], value: float) -> None:
        self.counts[bisect.bisect_left(bounds, value)] += 1
        self.total += value

    def add(self, other: HistogramSeries) -> None:
        self.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        self.total += other.total

    def buckets(self, bounds: tuple[float, ...]) -> list[tuple[str, int]]:
        """Cumulative (le, count) pairs, +Inf last, as Prometheus wants them."""
        out, running = [], 0
        for bound, count in zip((*bounds, float("inf")), self.counts, strict=True):
            running += count
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
        return out


@dataclass(slots=True)
class Family:
    """One metric family labelled (adapter, version, *extra), kept as plain numbers."""

    name: str  # without `_total` for a counter, as prometheus_client names them
    documentation: str
    extra: tuple[str, ...] = ()  # label names after adapter and version
    bounds: tuple[float, ...] | None = None  # a histogram's buckets; None: a counter
    series: dict[tuple[str, ...], float | HistogramSeries] = field(default_factory=dict)

    def inc(self, key: tuple[str, ...], amount: float) -> None:
        assert self.bounds is None, f"{self.name} is a histogram"
        self.series[key] = self.series.get(key, 0) + amount

    def observe(self, key: tuple[str, ...], value: float) -> None:
        assert self.bounds is not None, f"{self.name} is a counter"
        series = self.series.get(key)
        if series is None:
            series = self.series[key] = HistogramSeries([0] * (len(self.bounds) + 1))
        series.observe(self.bounds, value)

    def fold(self, adapter: str) -> None:
        """Every series of `adapter` summed into `other`'s and removed."""
        for key in [k for k in self.series if k[0] == adapter]:
            value, into = self.series.pop(key), (OTHER_LABEL, "", *key[2:])
            if isinstance(value, HistogramSeries):
                self.series.setdefault(into, HistogramSeries([0] * len(value.counts))).add(value)
            else:
                self.series[into] = self.series.get(into, 0) + value

    def collect(self):
        labels = ["adapter", "version", *self.extra]
        if self.bounds is None:
            family = CounterMetricFamily(self.name, self.documentation, labels=labels)
            for key, value in sorted(self.series.items()):
                family.add_metric(list(key), value)
            return family
        family = HistogramMetricFamily(self.name, self.documentation, labels=labels)
        for key, series in sorted(self.series.items()):
            family.add_metric(list(key), series.buckets(self.bounds), series.total)
        return family


class AdapterLabels:
    """Which (adapter, version) labels a request's series get: the rule in the module doc."""

    def __init__(self, max_adapters: int, families: list[Family]):
        assert max_adapters >= 0, "--metrics-max-adapters is checked by ServerConfig"
        self.max_adapters = max_adapters
        self.families = families  # folded when a holder loses its label
        self.requests: Tally[str] = Tally()  # per adapter since start, labelled or not
        self.holders: set[str] = set()

    def count(self, adapter: str) -> None:
        """One request for `adapter` (an id, never the base): it may win a label now."""
        self.requests[adapter] += 1
        if adapter in self.holders:
            return
        if len(self.holders) < self.max_adapters:
            self.holders.add(adapter)
            return
        if not self.holders:
            return  # --metrics-max-adapters 0: every adapter is `other`
        least = min(self.holders, key=lambda name: (self.requests[name], name))
        if overtakes(self.requests[adapter], self.requests[least]):
            self.holders.remove(least)
            for family in self.families:
                family.fold(least)
            self.holders.add(adapter)

    def key(self, adapter: str | None, version: int | None) -> tuple[str, str]:
        """The (adapter, version) labels of a series of `adapter` (None: the base model)."""
        if adapter is None:
            return BASE_LABEL, ""
        if adapter not in self.holders:
            return OTHER_LABEL, ""
        return adapter, "" if version is None else str(version)

    def ranked(self, adapters: list[str]) -> list[str]:
        """`adapters` busiest first: holders, then by requests, then by name."""
        return sorted(adapters, key=lambda a: (a not in self.holders, -self.requests[a], a))


def collect(families: list[Family]) -> Iterator:
    for family in families:
        yield family.collect()
