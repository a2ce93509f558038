"""The gateway as a process: ``run_gateway(store)`` serves ``gateway.app.build_app``'s app.

It adds what only a served process has: SIGINT/SIGTERM handlers (a drain first with
``server.drain_s``, then aiohttp's graceful exit, in-flight requests given
``server.shutdown_grace_s``), in a worker (``gateway.workers``) a watch that stops it once its
supervisor is gone, the config reloader, a quiet cycle collector once everything is started,
logging that follows reloads, and the event loop (uvloop when asked for). It returns after a
graceful shutdown. It imports ``gateway.app``; nothing of the app imports it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from aiohttp import web

from gateway.app import build_app
from gateway.config.settings import Settings
from gateway.config.store import SettingsStore
from gateway.http.admin import ADMIN_LISTENER
from gateway.http.parse_errors import install as install_parse_errors
from gateway.keys import SHUTDOWN_GRACE, STORE
from gateway.observability.logs import configure_logging, flush_logs
from gateway.observability.metrics import METRICS
from gateway.proxy.forward import PROXY
from gateway.tasks import running
from gateway.workers import supervisor_pid, worker_index

# The banner and the lifecycle's lines keep the name they always had.
log = logging.getLogger("sluice.app")


class Reloader(Protocol):
    """What ``run_gateway`` needs of a config reloader (``gateway.config.reload.ConfigReloader``)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


#: ``factory(store, on_result)``: ``on_result(ok)`` is told each reload attempt's outcome (metrics).
ReloaderFactory = Callable[[SettingsStore, Callable[[bool], None]], Reloader]


def _install_signal_handlers(app: web.Application) -> None:
    """SIGTERM and SIGINT start the shutdown: with ``server.drain_s`` > 0, first a drain (``/readyz``
    503, new completions 503 with Retry-After, requests in flight go on), then aiohttp's graceful
    exit (listener closed, ``server.shutdown_grace_s`` for what still runs). A second signal during
    the drain exits at once."""
    loop = asyncio.get_running_loop()

    def on_signal(signum: signal.Signals) -> None:
        proxy = app.get(PROXY)
        drain_s = app[STORE].current.server.drain_s
        if drain_s <= 0 or proxy is None or proxy.draining:
            raise web.GracefulExit()
        proxy.draining = True
        log.info(
            "%s: draining for %.1f s (readyz 503, new requests 503), then stopping", signum.name, drain_s
        )
        loop.call_later(drain_s, _graceful_exit)

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)


def _graceful_exit() -> None:
    """Raised from a loop callback, aiohttp's ``GracefulExit`` ends ``run_app``'s loop gracefully."""
    raise web.GracefulExit()


#: The cycle collector's thresholds while serving (``gc.set_threshold``): generation 0 is
#: collected after this many more container allocations than deallocations (CPython's default is
#: 700). A request in flight holds a few dozen containers, so at 32 concurrent requests the default
#: ran a young collection every few requests, each visiting every object of every request in
#: flight and finding nothing: the request path frees its objects by reference counting (no
#: reference cycles: ``tests/integration/gateway/test_no_request_cycles.py``).
GC_THRESHOLD = (10_000, 10, 10)


async def _quiet_gc(app: web.Application) -> None:
    """Once everything is started: collect, then move every object alive now (modules, classes,
    settings, metrics, the app) to the permanent generation (``gc.freeze``), and raise the
    young generation's threshold (``GC_THRESHOLD``).

    Without it a full collection visited all of them, some 80,000 objects: 45-60 ms with the
    event loop stopped, every few seconds under load, the p99 of every request served meanwhile
    (``docs/benchmarks.md``, "The cycle collector"). Objects made later (a reload's settings) are
    collected as usual; a frozen object that became garbage later is never freed by the cycle
    collector (by reference counting it still is), which for what lives from start-up on is
    nothing.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)


#: How long a thread holds the GIL before one that waits for it may take it, seconds
#: (``sys.setswitchinterval``; CPython's default is 5 ms). The event loop shares the GIL with the
#: body-parsing, token-counting and scrape-parsing threads: while one of them works, every wake-up
#: of the loop (a ``/healthz``, a token to relay) waits up to this long for it, several times per
#: request. The cost, paid only while two threads want the GIL, is a switch per millisecond.
GIL_SWITCH_INTERVAL_S = 0.001


#: Seconds between two checks, in a worker, that its supervisor is still there.
SUPERVISOR_POLL_S = 1.0


async def _supervisor_watch(app: web.Application) -> AsyncIterator[None]:
    """In a worker: once the supervisor is gone (killed outright, so it passed no signal on),
    stop as on SIGTERM, draining, so that no worker outlives it."""
    parent = supervisor_pid()

    async def watch() -> None:
        while os.getppid() == parent:  # noqa: ASYNC110 (no event tells a process its parent died)
            await asyncio.sleep(SUPERVISOR_POLL_S)
        log.warning("supervisor %s is gone: stopping", parent)
        os.kill(os.getpid(), signal.SIGTERM)

    async with running(watch(), name="sluice-supervisor-watch"):
        yield


async def _signals_ctx(app: web.Application) -> AsyncIterator[None]:
    _install_signal_handlers(app)
    yield


def _reloader_ctx(
    factory: ReloaderFactory, store: SettingsStore
) -> Callable[[web.Application], AsyncIterator[None]]:
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        metrics = app.get(METRICS)
        reloader = factory(store, metrics.observe_reload if metrics is not None else _ignore_result)
        await reloader.start()
        try:
            yield
        finally:
            await reloader.stop()

    return ctx


def _ignore_result(ok: bool) -> None:
    """A reload outcome nobody counts."""


def _follow_logging(old: Settings, new: Settings) -> None:
    if old.logging != new.logging:
        configure_logging(new.logging)


def _new_event_loop(use_uvloop: bool) -> asyncio.AbstractEventLoop:
    """uvloop's loop when asked for and installed, else asyncio's default."""
    if use_uvloop:
        try:
            import uvloop
        except ImportError:
            log.info("uvloop is not installed; using the asyncio event loop")
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def _log_banner(message: object) -> None:
    """aiohttp's "======== Running on URL ========" banner as one log line."""
    log.info("%s", " ".join(str(message).replace("=", " ").split()))


def run_gateway(store: SettingsStore, *, reloader_factory: ReloaderFactory | None = None) -> None:
    """Serve the gateway until SIGINT or SIGTERM; returns after a graceful shutdown.

    ``reloader_factory(store, on_result)`` (e.g. ``lambda s, r: ConfigReloader(path, s, on_result=r)``,
    ``on_result`` feeding the reload metrics) is started after the
    replicas are up and stopped first on shutdown. Logging must already be configured
    (``configure_logging``); it is reconfigured when a reload changes ``logging:``.
    Raises ``EmulatorStartError`` when an emulator does not come up.
    """
    settings = store.current
    worker = worker_index()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    # A worker of several (gateway.workers): the supervisor runs the emulators once for all.
    app = build_app(store, spawn_emulators=worker is None)
    app[SHUTDOWN_GRACE] = settings.server.shutdown_grace_s
    app.cleanup_ctx.append(_signals_ctx)
    if worker is not None:
        listener = app.get(ADMIN_LISTENER)
        if listener is not None:
            listener.reuse_port = True
        app.cleanup_ctx.append(_supervisor_watch)
    if reloader_factory is not None:
        app.cleanup_ctx.append(_reloader_ctx(reloader_factory, store))
    app.on_startup.append(_quiet_gc)  # after every cleanup context above has started
    store.subscribe(_follow_logging)
    # Requests aiohttp cannot parse: OpenAI-style JSON, never aiohttp's body quoting their bytes.
    install_parse_errors(lambda: store.current.server.server_header)
    web.run_app(
        app,
        host=settings.server.host,
        port=settings.server.port,
        shutdown_timeout=settings.server.shutdown_grace_s,
        access_log=None,  # our own access line, with replica and token counts
        print=_log_banner,
        loop=_new_event_loop(settings.server.uvloop),
        handle_signals=False,  # ours: a drain first (server.drain_s), see _install_signal_handlers
        reuse_port=True if worker is not None else None,  # the workers share the port
    )
    flush_logs()  # the last access lines, whatever stopped the loop
