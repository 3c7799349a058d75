"""How many sequences this replica runs at once (--max-num-seqs + --max-waiting): a request's
admission takes its sequences with `admit`, its job's close gives them back with `release`
(counting its tenant's tokens and closing its limits' reservation)."""

from __future__ import annotations

from loragw.gateway.common.errors import APIError
from loragw.gateway.http.jobs import GenerationJob
from loragw.gateway.observe.metrics import Metrics
from loragw.gateway.residency.demand import DemandWindow
from loragw.gateway.tenants.service import Tenants


class Capacity:
    def __init__(self, capacity: int, metrics: Metrics, tenants: Tenants,
                 demand: DemandWindow | None = None):
        self.capacity, self.metrics, self.tenants = capacity, metrics, tenants
        self.demand = demand or DemandWindow()  # each adapter's requests and tokens served
        self.inflight = 0  # sequences admitted and not yet released
        self.jobs: set[GenerationJob] = set()
        metrics.gateway_capacity = capacity

    def admit(self, job: GenerationJob) -> None:
        """Count `job`'s sequences in: 400 if they could never fit, 429 if they do not fit
        now. `release` (the job's on_close) counts them out."""
        count = len(job.choices)
        if count > self.capacity:
            raise APIError.bad_request(f"the request asks for {count} sequences (prompts x n) "
                                       f"but this server runs at most {self.capacity} at once; "
                                       "lower n or send fewer prompts", param="n")
        if self.inflight + count > self.capacity:
            raise APIError.overloaded(self.capacity)
        self.inflight += count
        self.metrics.gateway_inflight = self.inflight
        self.jobs.add(job)

    def release(self, job: GenerationJob) -> None:
        counts = job.counts
        self.tenants.finish(job.tenant, counts.prompt, counts.completion, job.reservation)
        if job.adapter is not None:
            self.demand.record(job.adapter, counts.prompt + counts.completion)
        self.inflight -= len(job.choices)
        self.metrics.gateway_inflight = self.inflight
        self.jobs.discard(job)
        assert self.inflight >= 0, "released more sequences than were admitted"

    def abort(self, adapter: str | None = None) -> None:
        """End the jobs in flight (those of `adapter` only, when given) with finish_reason
        "abort": their clients get an ending, not a hang."""
        for job in list(self.jobs):
            if adapter is None or job.adapter == adapter:
                job.abort()
