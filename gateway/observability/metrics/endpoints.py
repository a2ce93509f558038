"""The HTTP side of metrics: ``install`` wires a ``SluiceMetrics`` into an app and serves
``/metrics`` (the exposition, content type negotiated) and ``/metrics/replicas`` (Prometheus HTTP
service discovery of the replicas, built by ``replica_targets``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from aiohttp import web

from gateway.keys import OUTCOME_LISTENERS, PREDICTION_SERVICE, REGISTRY, SCRAPER, STORE
from gateway.observability.metrics import METRICS, SluiceMetrics
from gateway.observability.metrics.multiprocess import SNAPSHOT_INTERVAL_S, LiveSnapshots
from gateway.tasks import running

if TYPE_CHECKING:
    from gateway.replicas.registry import Replica

__all__ = ["install", "replica_targets"]

log = logging.getLogger("sluice.metrics")


def replica_targets(replicas: Iterable[Replica]) -> list[dict[str, object]]:
    """Prometheus HTTP service-discovery groups: one per replica, ``replica`` and ``backend`` labels.

    The replica's URL gives ``__address__`` (host:port), ``__scheme__`` and ``__metrics_path__``
    (its path prefix + ``/metrics``), so Prometheus scrapes exactly what Sluice routes to.
    """
    groups: list[dict[str, object]] = []
    for replica in replicas:
        url = urlsplit(replica.base_url)
        port = url.port or (443 if url.scheme == "https" else 80)
        host = url.hostname or ""
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        labels = {
            "__scheme__": url.scheme,
            "__metrics_path__": url.path.rstrip("/") + "/metrics",
            "replica": replica.name,
            "backend": replica.settings.backend,
        }
        groups.append({"targets": [address], "labels": labels})
    return groups


def _snapshots(live: LiveSnapshots) -> Callable[[web.Application], AsyncIterator[None]]:
    """A ``cleanup_ctx`` writing this worker's scrape-time snapshot every ``SNAPSHOT_INTERVAL_S``
    while the app runs, so that any worker's ``/metrics`` shows it."""

    async def loop() -> None:
        while True:
            await asyncio.sleep(SNAPSHOT_INTERVAL_S)
            try:
                live.write()
            except OSError:
                log.exception("could not write this worker's metrics snapshot")

    async def ctx(_app: web.Application) -> AsyncIterator[None]:
        async with running(loop(), name="sluice-metrics-snapshot"):
            yield

    return ctx


def install(
    app: web.Application,
    metrics: SluiceMetrics | None = None,
    *,
    serve_on: web.Application | None = None,
) -> SluiceMetrics:
    """Add ``/metrics`` and ``/metrics/replicas`` to ``serve_on`` (default ``app``; the admin
    listener's application when ``admin.port`` is set, see ``gateway.http.admin``) and feed ``metrics``
    from ``app``.

    Call at the end of ``build_app`` (or after it), before the app starts. Wires what the app
    already has: ``app[STORE]`` (label limits follow every reload), ``app[OUTCOME_LISTENERS]``
    (``observe_outcome``) and, at startup, ``app[REGISTRY]`` (``track_replicas``),
    ``app[PREDICTION_SERVICE].report`` (``track_step_models``), its ``corrections.state``
    (``track_corrections``) and ``app[SCRAPER]``
    (``observe_snapshot`` on every scrape, ``observe_parse`` on every parse). Returns the metrics
    (also at ``app[METRICS]``) for the producers that are not in the app yet (queue, limiter,
    reloader: see ``SluiceMetrics``).
    """
    store = app[STORE]
    in_memory = store.current.limits.backend == "memory"
    chosen = metrics if metrics is not None else SluiceMetrics(budgets_per_worker=in_memory)
    app[METRICS] = chosen
    chosen.follow_settings(store.current)
    store.subscribe(lambda _old, new: chosen.follow_settings(new))
    app[OUTCOME_LISTENERS].append(chosen.observe_outcome)

    async def bind(app: web.Application) -> None:
        # on_startup runs after every cleanup_ctx has set up, so these objects exist by now.
        chosen.track_replicas(app[REGISTRY])
        chosen.track_step_models(app[PREDICTION_SERVICE].report)
        chosen.track_corrections(app[PREDICTION_SERVICE].corrections.state)
        app[SCRAPER].subscribe(chosen.observe_snapshot)
        app[SCRAPER].on_parse(chosen.observe_parse)

    async def metrics_handler(request: web.Request) -> web.Response:
        body, content_type = chosen.exposition(request.headers.get("Accept"))
        # Content-Type carries its own charset/version parameters: set the header raw.
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def targets_handler(request: web.Request) -> web.Response:
        # ``app``, not ``request.app``: the request may have come in on the admin listener.
        registry = app.get(REGISTRY)
        replicas = [] if registry is None else registry.replicas()
        return web.json_response(replica_targets(replicas))

    app.on_startup.append(bind)
    if chosen.live is not None:
        app.cleanup_ctx.append(_snapshots(chosen.live))
    routes = (app if serve_on is None else serve_on).router
    routes.add_get("/metrics", metrics_handler)
    routes.add_get("/metrics/replicas", targets_handler)
    return chosen
