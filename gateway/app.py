"""The aiohttp application: routes, middlewares, and the lifecycle of everything it owns.

``build_app(store)`` is the composition root: each long-lived resource (the upstream session,
emulators, replica registry and health checks, scraper and predictions, admission, the proxy)
is a ``cleanup_ctx`` generator, torn down in reverse order, and reached through a typed
``AppKey`` (``gateway.keys`` or the plugin's own module: no plugin imports this one; only
``gateway.serve`` does, to run it). A request passes ``gateway_middleware`` (request id, access
line, JSON errors, body timeout, admin guard) and then the tenants'. On shutdown the proxy ends
what still runs shortly before the grace is over. The map is in docs/architecture.md.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from aiohttp import web

from gateway.admission.live import ADMISSION, LiveAdmission
from gateway.api.openai import ENGINE_MODELS
from gateway.api.responses import models_list
from gateway.config.store import SettingsStore
from gateway.http.admin import ADMIN_LISTENER, AdminGate, install_admin
from gateway.http.middleware import gateway_middleware
from gateway.http.openapi import install_openapi
from gateway.http.server_header import server_header_hook
from gateway.keys import (
    EMULATORS,
    HEALTH,
    OUTCOME_LISTENERS,
    PREDICTION_SERVICE,
    PREDICTIONS,
    REGISTRY,
    SCRAPER,
    SESSION,
    SHUTDOWN_GRACE,
    STORE,
)
from gateway.ledger.live import LEDGER, install_ledger
from gateway.observability.logs import add_request_id_header, flush_logs
from gateway.observability.metrics import METRICS
from gateway.observability.metrics.endpoints import install as install_metrics
from gateway.prediction.live import LivePredictions, add_prediction_headers, follow_correction
from gateway.prediction.service import PredictionService
from gateway.prediction.service_config import PredictionConfig
from gateway.proxy.disconnects import DISCONNECTS, DisconnectMonitor
from gateway.proxy.forward import PROXY, Proxy
from gateway.replicas.auth import replica_auth
from gateway.replicas.emulators import start_emulators, stop_emulators
from gateway.replicas.health import HealthChecker
from gateway.replicas.registry import ReplicaRegistry
from gateway.replicas.scraper import MetricsScraper
from gateway.tasks import running
from gateway.tenants.admin_api import install_tenants_admin
from gateway.tenants.keys_api import install_keys_api
from gateway.tenants.live import TENANCY, install_tenancy
from gateway.tokens.live import PROMPT_TOKENIZERS, PromptTokenizers

#: Upper bound of pooled connections to one replica; generous, admission control bounds load.
CONNECTIONS_PER_REPLICA = 4096
#: Seconds an idle keep-alive connection to a replica stays in the pool.
KEEPALIVE_S = 60.0
#: The live gateway's prediction knobs: it learns each replica's dispatch overhead (the HTTP hop
#: and the replica server's own work, which its TTFTs hold and no step model prices). The
#: virtual-time replay (``replay``) keeps ``PredictionConfig``'s default (off): it has
#: no transport. See docs/predictor-accuracy.md, "Live".
LIVE_PREDICTION = PredictionConfig(learn_dispatch_overhead=True)


def build_app(store: SettingsStore, *, spawn_emulators: bool = True) -> web.Application:
    """The gateway application for ``store``'s settings; nothing starts until it is run.

    ``spawn_emulators=False`` skips starting ``emulators:`` (their replicas are still routed to,
    e.g. when a test or another process runs them). The body limit aiohttp enforces
    (``client_max_size``) is ``server.max_body_bytes`` at build time; a smaller value after a
    reload is enforced as well, a larger one only after a restart.
    """
    settings = store.current
    admin_gate = AdminGate.public(store)
    app = web.Application(
        client_max_size=settings.server.max_body_bytes,
        middlewares=[gateway_middleware(store, admin_gate)],
    )
    app[STORE] = store
    app[OUTCOME_LISTENERS] = []
    app[DISCONNECTS] = DisconnectMonitor()
    app[EMULATORS] = []
    # Pure and synchronous: built here so that it exists (and can be inspected) before startup.
    app[PREDICTION_SERVICE] = PredictionService(config=LIVE_PREDICTION)
    app.on_response_prepare.append(server_header_hook(store))
    app.on_response_prepare.append(add_request_id_header)
    app.on_response_prepare.append(add_prediction_headers)
    app.on_shutdown.append(_end_requests_within_the_grace)
    app.on_cleanup.append(_flush_logs)
    app.cleanup_ctx.append(_client_session)
    if spawn_emulators and settings.emulators:
        app.cleanup_ctx.append(_emulators)
    app.cleanup_ctx.append(_replicas)
    app.cleanup_ctx.append(_predictions)
    # Before install_tenancy: the admin guard (in gateway_middleware) runs ahead of the tenants'.
    admin_app = install_admin(app, store, gate=admin_gate)
    admin_app.router.add_get("/sluice/v1/replicas", _replicas_view(app))
    install_metrics(app, serve_on=admin_app)
    # Before admission: its limiter and budget start before admission and close after it.
    tenancy = install_tenancy(app)
    install_keys_api(app, admin_app, install_tenants_admin(app, admin_app, tenancy), tenancy)
    app.cleanup_ctx.append(_admission)
    install_ledger(app)  # with ledger.enabled: after admission, whose views it feeds
    app.cleanup_ctx.append(_proxy)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_post("/v1/completions", _completions)
    # TGI's native API, served by the replicas whose engine is TGI (see gateway/api/tgi.py).
    app.router.add_post("/generate", _generate)
    app.router.add_post("/generate_stream", _generate_stream)
    app.router.add_post("/", _generate)
    app.router.add_get("/v1/models", _models)
    # Always public, never guarded: load balancers probe them without credentials.
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz_view(admin_gate))
    install_openapi(app)
    listener = app.get(ADMIN_LISTENER)
    if listener is not None:
        # Last: it serves once everything it reads is up, and stops first.
        app.cleanup_ctx.append(listener.lifecycle)
    return app


async def _flush_logs(_app: web.Application) -> None:
    """``on_cleanup``: the buffered access lines are written before the loop can stop."""
    flush_logs()


async def _client_session(app: web.Application) -> AsyncIterator[None]:
    """The one upstream session: proxied requests, health checks, model lists, scrapes. Its
    middleware adds a replica's own API key (``replicas[].api_key_env``) to the requests that are
    not proxied; the proxy sets it itself and skips the middleware (``gateway.proxy.forward.Proxy._send``)."""
    connector = aiohttp.TCPConnector(
        limit=0, limit_per_host=CONNECTIONS_PER_REPLICA, keepalive_timeout=KEEPALIVE_S
    )
    # Per-request timeouts come from the settings at request time; none at session level.
    # No cookie jar: the session is shared by every client's requests, so a replica's Set-Cookie
    # (relayed to the client it answered) must never be stored and sent for anyone else; the
    # client's own Cookie header is forwarded as it came.
    async with aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None),
        trust_env=False,
        cookie_jar=aiohttp.DummyCookieJar(),
        middlewares=(replica_auth(app[STORE]),),
    ) as session:
        app[SESSION] = session
        yield


async def _emulators(app: web.Application) -> AsyncIterator[None]:
    processes = await start_emulators(app[STORE].current.emulators, app[SESSION])
    app[EMULATORS] = processes
    try:
        yield
    finally:
        await stop_emulators(processes)


async def _replicas(app: web.Application) -> AsyncIterator[None]:
    store = app[STORE]
    registry = ReplicaRegistry(store)
    checker = HealthChecker(store, registry, app[SESSION])
    app[REGISTRY], app[HEALTH] = registry, checker
    app[ENGINE_MODELS] = registry.engine_models
    tokenizers = app[PROMPT_TOKENIZERS] = PromptTokenizers(store, registry)
    await checker.check_all()  # serve with known replica states from the first request on
    try:
        async with running(checker.run(), name="sluice-health"):
            yield
    finally:
        tokenizers.close()
        registry.close()


async def _predictions(app: web.Application) -> AsyncIterator[None]:
    """Scrape every replica's ``/metrics`` into the prediction service, following reloads.

    ``scrape:`` is read once here (restart required). The scraper's tasks start at once and run
    beside request handling: a slow or failing scrape marks a snapshot stale, never a request.
    """
    scrape = app[STORE].current.scrape
    scraper = MetricsScraper(
        app[SESSION], interval_s=scrape.interval_s, timeout_s=scrape.timeout_s, window_s=scrape.window_s
    )
    service = app[PREDICTION_SERVICE]
    follow_correction(service, app[STORE])
    predictions = LivePredictions(app[REGISTRY], scraper, service)
    scraper.subscribe(service.on_snapshot)
    app[REGISTRY].on_reconcile(lambda _: predictions.sync())
    app[HEALTH].on_models(predictions.on_models)
    predictions.sync()
    app[SCRAPER], app[PREDICTIONS] = scraper, predictions
    await scraper.start()
    try:
        yield
    finally:
        predictions.close()
        await scraper.stop()


async def _admission(app: web.Application) -> AsyncIterator[None]:
    """Admission over the registry, the prediction service and the tenants' budgets
    (``Tenancy.budget``); every scrape re-evaluates its queue."""
    tenancy = app.get(TENANCY)
    budget = None if tenancy is None else tenancy.budget
    admission = LiveAdmission(app[STORE], app[REGISTRY], app[PREDICTIONS], budget=budget)
    if tenancy is not None:
        # Fair shares are shares of what budgets charge: one set of token weights.
        admission.token_weights = tenancy.weights
    app[ADMISSION] = admission
    unsubscribe = app[SCRAPER].subscribe(admission.on_snapshot)
    # A replica back (or gone) changes who can take what waits: re-evaluate at once, not at the
    # queue's next timer tick.
    unwatch = app[HEALTH].on_state(lambda _replica: admission.changed())
    metrics = app.get(METRICS)
    if metrics is not None:
        metrics.track_queue(admission.queue_lengths)
        metrics.track_attainment(admission.attainment)
        metrics.track_size_shares(admission.size_share_rows)
    try:
        yield
    finally:
        unsubscribe()
        unwatch()
        admission.close()


async def _proxy(app: web.Application) -> AsyncIterator[None]:
    monitor = app[DISCONNECTS]
    app[PROXY] = Proxy(
        store=app[STORE],
        registry=app[REGISTRY],
        session=app[SESSION],
        disconnects=monitor,
        listeners=app[OUTCOME_LISTENERS],
        on_replica_failure=app[HEALTH].poke,
        predictions=app[PREDICTIONS],
        admission=app[ADMISSION],
    )
    async with running(monitor.run(), name="sluice-disconnects"):
        yield


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await request.app[PROXY].handle(request, "chat")


async def _completions(request: web.Request) -> web.StreamResponse:
    return await request.app[PROXY].handle(request, "completions")


async def _generate(request: web.Request) -> web.StreamResponse:
    """TGI's ``/generate`` and compat ``/`` (a stream when the body says ``"stream": true``)."""
    return await request.app[PROXY].handle(request, "generate")


async def _generate_stream(request: web.Request) -> web.StreamResponse:
    return await request.app[PROXY].handle(request, "generate_stream")


async def _models(request: web.Request) -> web.Response:
    """The union of the healthy replicas' models (see ``gateway.api.responses.models_list``)."""
    return web.json_response(models_list(request.app[REGISTRY].healthy_models()))


async def _healthz(request: web.Request) -> web.Response:
    """Liveness: 200 while the process serves HTTP at all."""
    return web.json_response({"status": "ok"})


def _readyz_view(gate: AdminGate) -> Callable[[web.Request], Awaitable[web.Response]]:
    """``GET /readyz`` on the listener whose admin paths ``gate`` guards."""

    async def readyz(request: web.Request) -> web.Response:
        """Readiness: 200 when at least one replica is healthy, else 503; draining after SIGTERM
        (``server.drain_s``): 503. The body is ``{"ready", "draining"}``, plus every replica's state
        (URL, in-flight requests, last error) only for a caller who may read the admin routes here
        (the admin token when one is configured; nobody while a separate admin listener serves
        them): the public probe tells load balancers what they need and nobody the fleet."""
        registry = request.app[REGISTRY]
        proxy = request.app.get(PROXY)
        draining = proxy is not None and proxy.draining
        ready = bool(registry.healthy()) and not draining
        body: dict[str, object] = {"ready": ready, "draining": draining}
        if gate.serve_admin and gate.guard.allowed(request.headers.get("Authorization")):
            body["replicas"] = registry.describe()
        return web.json_response(body, status=200 if ready else 503)

    return readyz


async def _end_requests_within_the_grace(app: web.Application) -> None:
    """``on_shutdown`` (the listener is closed; aiohttp now gives handlers the grace): shortly
    before the grace ends, end what still runs, so that every stream gets an error event and every
    reservation is settled before aiohttp cancels handlers (which would cut streams bare)."""
    proxy = app.get(PROXY)
    if proxy is None:
        return
    proxy.draining = True
    grace = app.get(SHUTDOWN_GRACE, app[STORE].current.server.shutdown_grace_s)
    # Leave the handlers a moment (at most 1 s, a fifth of the grace) to write and settle.
    delay = max(0.0, grace - min(1.0, grace * 0.2))
    asyncio.get_running_loop().call_later(delay, proxy.stop_all)


def _replicas_view(app: web.Application) -> Callable[[web.Request], Awaitable[web.Response]]:
    """Admin ``GET /sluice/v1/replicas`` for ``app`` (served on ``app`` or on the admin listener)."""

    async def handler(request: web.Request) -> web.Response:
        """Every replica's state, in-flight requests, last snapshot summary, the prediction
        service's per-replica facts, fitted parameters and fit error, and the attainment
        controller's margin and attainment per class and replica (``admission.attainment``),
        each class's admission by prompt-size quartile (``admission.size_shares``), each
        replica's prefix index (``admission.prefix_cache``) and, with ``ledger.enabled``, the
        other gateways' in-flight requests this one counts per replica (``ledger``)."""
        body = app[PREDICTIONS].describe()
        admission = app.get(ADMISSION)
        if admission is not None:
            body["admission"] = {
                "attainment": [s.as_json() for s in admission.attainment()],
                "size_shares": admission.size_shares(),
                "prefix_cache": admission.prefix_caches(),
            }
        ledger = app.get(LEDGER)
        if ledger is not None:
            body["ledger"] = ledger.describe()
        return web.json_response(body)

    return handler
