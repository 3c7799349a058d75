"""Operations routes: /health (alive) and /ready (can serve), open to everyone; /metrics, behind
--metrics-key when one is set."""

from __future__ import annotations

from typing import Annotated

from litestar import Controller, Response, get
from litestar.params import Dependency
from prometheus_client import CONTENT_TYPE_LATEST

from loragw.engine.api import EngineSnapshot
from loragw.gateway.http.auth import require_metrics_key
from loragw.gateway.http.error_handlers import error_responses
from loragw.gateway.http.response_bodies import Health
from loragw.gateway.observe.health import Readiness
from loragw.gateway.observe.metrics import Metrics

# The engine's snapshot and each adapter's tier, read at the scrape (None, {} before the
# engine is up)
Residencies = Annotated[tuple[EngineSnapshot | None, dict[str, str]],
                        Dependency(skip_validation=True)]


class OpsController(Controller):
    path = "/"
    tags = ["Operations"]

    @get("/health", responses=error_responses(
        503, e503="the engine is gone (its process, or a tensor-parallel rank, died; the server "
                  "is exiting) or has not answered a ping within --health-timeout-s: the "
                  "message says which"))
    async def health(self, readiness: Readiness) -> Health:
        """Liveness: 200 while the server runs and its engine answers (or is still loading);
        503 once the engine has died or been silent past --health-timeout-s (a wedged pod that
        a liveness probe should restart)."""
        readiness.check_alive()
        return Health(status="ok")

    @get("/ready", responses=error_responses(
        503, e503="not ready: loading, or the engine loop does not answer"))
    async def ready(self, readiness: Readiness) -> Health:
        """200 once the model and start-up adapters are loaded and the engine loop answers;
        503 otherwise (a readiness and startup probe)."""
        await readiness.probe()
        return Health(status="ready")

    @get("/metrics", media_type=CONTENT_TYPE_LATEST, guards=[require_metrics_key],
         responses=error_responses(401))
    async def metrics(self, metrics: Metrics, residencies: Residencies) -> Response[bytes]:
        """Prometheus text format; engine gauges are read live at each scrape."""
        metrics.scraped(*residencies)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)
