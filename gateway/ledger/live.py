"""The live replica ledger: this gateway's dispatches published, the others' applied
(docs/deployment.md, "Several gateways").

``LiveLedger`` runs four tasks on the event loop: a **flusher** that sends what admission
dispatched or finished (``Outbox``) as soon as the loop is free (one pipeline per batch); a
**ticker** that queues progress (first token at once, later tokens at most every
``progress_interval_s``); a **subscriber** applying the other gateways' messages as they come
(``RemoteLedger``); and a **heartbeat** every ``heartbeat_s`` that renews this gateway's key,
drops the entries of gateways whose key expired (and deletes them from Redis), and re-reads every
replica's entries to repair missed messages. Any failed call marks the ledger down: the other
gateways' entries are forgotten (no finish would be heard), admission widens every class's
margin by ``unavailable_margin``, one line is logged; the heartbeat probes until Redis answers,
then this gateway's entries are written again whole and the others' re-read (one line logged).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import redis.asyncio
from aiohttp import web

from gateway.admission.live import ADMISSION
from gateway.admission.shares import StreamingRequest
from gateway.keys import PREDICTIONS, REGISTRY, STORE
from gateway.ledger.config import LedgerSettings
from gateway.ledger.redis_io import LedgerRedis, LedgerUnavailable
from gateway.ledger.state import Outbox, RemoteLedger, Saturation, TrackedSource, decode_message, widen
from gateway.ledger.unseen import UnseenDispatches
from gateway.limits.config import RedisSettings
from gateway.limits.redis import connect
from gateway.observability.metrics import METRICS
from gateway.replicas.snapshot import InFlight

__all__ = ["LEDGER", "LedgerStats", "LiveLedger", "install_ledger"]

log = logging.getLogger("sluice.ledger")

#: How often progress is looked for, seconds (at most ``progress_interval_s``).
TICK_S: Final = 0.05
#: While the ledger is down, Redis is probed this often at least, seconds.
PROBE_S: Final = 0.25
#: Longest ``start`` waits for the subscription to the other gateways' messages, seconds.
SUBSCRIBE_WAIT_S: Final = 2.0
#: Longest ``stop`` waits for its tasks to end, and then for the connections to close, seconds.
STOP_WAIT_S: Final = 2.0


@dataclass(slots=True)
class LedgerStats:
    """What the ledger counted since start (``sluice_ledger_*``)."""

    #: 1 while Redis answers (or the ledger has not failed yet).
    up: bool = True
    #: Changes between up and down, both ways.
    transitions_total: int = 0
    #: Redis calls that failed or timed out.
    errors_total: int = 0
    #: Entry changes (put, delete) this gateway published, and the pipelines they took.
    published_total: int = 0
    publish_calls_total: int = 0
    #: Seconds the publish pipelines took, summed (round trips included).
    publish_seconds_total: float = 0.0
    #: Entry changes of other gateways applied (from messages and re-reads).
    applied_total: int = 0
    #: Other gateways' entries not kept (the per-replica cap), and own ones not published.
    dropped_total: int = 0
    unpublished_total: int = 0
    #: Gateways whose heartbeat expired while they held entries here.
    expired_gateways_total: int = 0


class LiveLedger:
    """The ledger of one gateway process (event loop only; see the module).

    ``settings``: the ``ledger`` section; ``redis``: ``limits.redis`` (URL, cluster, prefix,
    timeout). ``replicas()``: the configured replica names (re-read at every heartbeat).
    ``on_change(replica, freed)``: the other gateways' entries on ``replica`` changed (``freed``:
    some ended), or, with ``replica`` ``None``, every replica's view must be rebuilt (a margin
    change). ``on_saturated(replica, back_off_s, gateway)``: another gateway met ``replica``'s
    overload refusal. ``io``: the Redis calls (tests pass their own).
    """

    def __init__(
        self,
        settings: LedgerSettings,
        redis_settings: RedisSettings,
        *,
        replicas: Callable[[], Sequence[str]],
        on_change: Callable[[str | None, bool], None] = lambda replica, freed: None,
        on_saturated: Callable[[str, float, str], None] = lambda replica, back_off_s, gateway: None,
        gateway_id: str | None = None,
        io: LedgerRedis | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.gateway = gateway_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._replicas = replicas
        self.on_change = on_change
        self.on_saturated = on_saturated
        self._clock = clock
        self._wall = wall
        self.stats = LedgerStats()
        cap = settings.max_entries_per_replica
        self.outbox = Outbox(
            self.gateway, progress_interval_s=settings.progress_interval_s, max_entries_per_replica=cap
        )
        self.remote = RemoteLedger(self.gateway, max_entries_per_replica=cap)
        self.unseen = UnseenDispatches()
        if io is None:
            client = connect(
                redis_settings.url, cluster=redis_settings.cluster, timeout_s=redis_settings.timeout_s
            )
            # Pub/sub over one plain connection: in a Cluster, every node's subscribers get every message.
            subscriber = redis.asyncio.Redis.from_url(
                redis_settings.url, socket_connect_timeout=redis_settings.timeout_s, max_connections=2
            )
            io = LedgerRedis(
                client,
                subscriber,
                prefix=redis_settings.key_prefix,
                timeout_s=redis_settings.timeout_s,
            )
        self.io = io
        self._saturations: list[Saturation] = []
        self._wake = asyncio.Event()
        self._subscribed = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._need_rewrite = True
        self._closed = False

    # -- what admission tells it ------------------------------------------------------------------
    def tracked(self, replica: str, entry: object, stream: TrackedSource) -> None:
        """Admission sent ``entry`` (tracked as ``stream``) to ``replica``: published at once."""
        now = self._clock()
        self.outbox.dispatched(replica, entry, stream, now=now, offset=self._wall() - now)
        self._wake.set()

    def forgotten(self, replica: str, entry: object) -> None:
        """``entry`` on ``replica`` ended: its deletion is published at once."""
        self.outbox.finished(entry)
        self._wake.set()

    def saturated(self, replica: str, back_off_s: float) -> None:
        """``replica`` refused a request as overloaded: every gateway backs off ``back_off_s``."""
        self._saturations.append((replica, back_off_s))
        self._wake.set()

    # -- what admission reads ---------------------------------------------------------------------
    def in_flight(self, replica: str) -> tuple[InFlight, ...]:
        """The other gateways' in-flight requests on ``replica`` (monotonic times of this clock),
        with stand-ins for those dispatched but not heard of yet (``UnseenDispatches``)."""
        now = self._clock()
        offset = self._wall() - now
        return self.unseen.in_flight(replica, self.remote.in_flight(replica, offset), now, offset)

    def streams(self, replica: str) -> tuple[StreamingRequest, ...]:
        """The other gateways' streams on ``replica`` that admission protects (``RemoteLedger.streams``),
        with the stand-ins' (``in_flight``)."""
        now = self._clock()
        return self.unseen.streams(replica, self.remote.streams(replica), now, self._wall() - now)

    def extra_margin(self) -> float:
        """The margin added while the ledger is down (``unavailable_margin``), else 0."""
        return 0.0 if self.stats.up else self.settings.unavailable_margin

    def describe(self) -> dict[str, Any]:
        """JSON-ready: this gateway's id, up or down, its own entries, and the other gateways'
        per replica (total and per gateway)."""
        counts = self.remote.counts()
        return {
            "gateway": self.gateway,
            "up": self.stats.up,
            "own_entries": len(self.outbox),
            "replicas": {
                name: {"in_flight": n, "gateways": self.remote.by_gateway(name)}
                for name, n in sorted(counts.items())
            },
        }

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        """Announce this gateway (its heartbeat), read the others' entries, start the tasks and
        wait (at most ``SUBSCRIBE_WAIT_S``) until the others' messages are heard. Redis down at
        start is the down state, never an error."""
        await self._beat()
        for name, run in (
            ("flusher", self._flusher),
            ("ticker", self._ticker),
            ("subscriber", self._subscriber),
            ("heartbeat", self._heartbeats),
        ):
            self._tasks.append(asyncio.create_task(run(), name=f"sluice-ledger-{name}"))
        if self.stats.up:
            # Messages published before the subscription holds would be missed (refusals are
            # not repaired by the heartbeat's re-read): wait for it, briefly.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._subscribed.wait(), timeout=SUBSCRIBE_WAIT_S)

    async def stop(self) -> None:
        """Stop the tasks, delete this gateway's entries and heartbeat (best effort), close.

        Returns within about three ``STOP_WAIT_S`` whatever Redis and its client do: a task that
        has not ended by then (a cancellation the client turned into an error it retries, or a
        connection teardown it shields from cancellation) is left behind, logged."""
        self._closed = True
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            done, pending = await asyncio.wait(self._tasks, timeout=STOP_WAIT_S)
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    log.warning("ledger: task %s ended with %r", task.get_name(), task.exception())
            for task in pending:
                log.warning("ledger: task %s did not stop in %g s; left behind", task.get_name(), STOP_WAIT_S)
        with contextlib.suppress(LedgerUnavailable):
            gone = [("del", e) for e in self.outbox.entries()]
            if gone:
                await self.io.publish(self.gateway, gone)  # type: ignore[arg-type]
        closing = asyncio.ensure_future(self.io.aclose())
        done, _ = await asyncio.wait({closing}, timeout=STOP_WAIT_S)
        if not done:
            closing.cancel()
            log.warning("ledger: closing its Redis connections took over %g s; left behind", STOP_WAIT_S)
        elif not closing.cancelled():
            closing.result()  # its error, if any

    # -- the tasks --------------------------------------------------------------------------------
    async def _flusher(self) -> None:
        while not self._closed:
            await self._wake.wait()
            self._wake.clear()
            if not self.stats.up:
                continue  # the heartbeat's probe brings it back and wakes this
            try:
                await self.flush()
            except Exception as exc:  # a bug must not end the task: counted as a failure
                log.exception("ledger publish failed")
                self._down(exc)

    async def flush(self) -> None:
        """Publish what is pending now (one pipeline); on failure it stays pending."""
        ops = self.outbox.drain(self._clock())
        sats, self._saturations = self._saturations, []
        if not ops and not sats:
            return
        started = time.perf_counter()
        try:
            await self.io.publish(self.gateway, ops, sats)
        except LedgerUnavailable as exc:
            self.outbox.requeue(ops)
            self._down(exc)
            return
        self.stats.publish_seconds_total += time.perf_counter() - started
        self.stats.publish_calls_total += 1
        self.stats.published_total += len(ops)
        self.stats.unpublished_total = self.outbox.unpublished

    async def _ticker(self) -> None:
        interval = min(TICK_S, self.settings.progress_interval_s)
        while not self._closed:
            await asyncio.sleep(interval)
            now = self._clock()
            self.outbox.tick(now, self._wall() - now)
            if self.outbox.pending:
                self._wake.set()

    async def _subscriber(self) -> None:
        # Each loop ends once ``stop`` closed the ledger, not only on its cancellation: a Redis
        # client may turn a cancellation into one of its own errors.
        while not self._closed:
            try:
                async for data in self.io.messages(self._subscribed.set):
                    self.apply_message(data)
            except LedgerUnavailable as exc:
                self._down(exc)
            except Exception as exc:  # a bug must not end the task: counted as a failure
                log.exception("ledger subscription failed")
                self._down(exc)
            await asyncio.sleep(PROBE_S)

    def apply_message(self, data: str | bytes) -> None:
        """Apply one message of another gateway (malformed ones are skipped)."""
        message = decode_message(data)
        if message is None or message.gateway == self.gateway or not self.stats.up:
            return
        now = self._clock()
        changed: dict[str, bool] = {}
        offset = self._wall() - now
        for kind, entry in message.ops:
            if kind == "put":
                if self.settings.count_unseen and not self.remote.knows(entry):
                    self.unseen.arrived(entry, now, offset)
                hit = self.remote.put(entry, now)
            else:
                hit = self.remote.remove(entry.replica, entry.key, now)
            if hit:
                self.stats.applied_total += 1
                changed[entry.replica] = changed.get(entry.replica, False) or kind == "del"
        self.stats.dropped_total = self.remote.dropped
        for replica, freed in changed.items():
            self.on_change(replica, freed)
        for replica, back_off_s in message.saturations:
            self.on_saturated(replica, back_off_s, message.gateway)

    async def _heartbeats(self) -> None:
        while not self._closed:
            await asyncio.sleep(
                self.settings.heartbeat_s if self.stats.up else min(PROBE_S, self.settings.heartbeat_s)
            )
            try:
                await self._beat()
            except Exception as exc:  # a bug must not end the task: counted as a failure
                log.exception("ledger heartbeat failed")
                self._down(exc)

    async def _beat(self) -> None:
        """One heartbeat: renew this gateway's key (write its entries again if it had expired),
        expire dead gateways, re-read every replica's entries."""
        try:
            expired = await self.io.heartbeat(self.gateway, self.settings.expiry_s)
            if expired or self._need_rewrite:
                await self.io.rewrite(self.outbox.entries())
                self._need_rewrite = False
            names = list(self._replicas())
            asked_at = self._clock()
            read = await self.io.read(names)
            gateways = self.remote.gateways() | {e.gateway for es in read.values() for e in es}
            gateways.discard(self.gateway)
            alive = await self.io.alive(sorted(gateways))
            alive.add(self.gateway)
        except LedgerUnavailable as exc:
            self._down(exc)
            return
        was_down = not self.stats.up
        self._up()
        now = self._clock()
        dead = gateways - alive
        if dead:
            self.stats.expired_gateways_total += len(dead & self.remote.gateways())
            log.warning(
                "ledger: gateway(s) %s stopped renewing their heartbeat; their entries are dropped",
                sorted(dead),
            )
        changed = set(self.remote.expire(alive, now))
        for replica, entries in read.items():
            live = [e for e in entries if e.gateway in alive]
            if self.remote.reconcile(replica, live, asked_at=asked_at, now=now):
                changed.add(replica)
        self.stats.dropped_total = self.remote.dropped
        for replica in changed:
            self.on_change(replica, True)
        purge = {r: [e.key for e in es if e.gateway in dead] for r, es in read.items()}
        if any(purge.values()):
            with contextlib.suppress(LedgerUnavailable):
                await self.io.purge(purge)
        if was_down or self.outbox.pending:
            self._wake.set()

    # -- up and down ------------------------------------------------------------------------------
    def _down(self, exc: Exception) -> None:
        self.stats.errors_total += 1
        if not self.stats.up or self._closed:
            return
        self.stats.up = False
        self.stats.transitions_total += 1
        self._need_rewrite = True
        log.warning(
            "ledger unreachable (%s): admission counts this gateway's requests and the scrapes only, "
            "margins +%.0f %%",
            exc,
            self.settings.unavailable_margin * 100,
        )
        self.unseen.forget()
        for replica in self.remote.clear():
            self.on_change(replica, True)
        self.on_change(None, True)

    def _up(self) -> None:
        if self.stats.up:
            return
        self.stats.up = True
        self.stats.transitions_total += 1
        log.info("ledger reachable again: other gateways' in-flight requests count again")
        self.on_change(None, True)


#: The application's ledger (absent unless ``ledger.enabled``).
LEDGER = web.AppKey("ledger", LiveLedger)


def install_ledger(app: web.Application) -> None:
    """With ``ledger.enabled``, append the ledger's cleanup context to ``app`` (after admission's:
    it hooks into admission's views, the scrapes' in-flight source and the metrics)."""
    settings = app[STORE].current
    if not settings.ledger.enabled or settings.limits.redis is None:
        return

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        admission, registry = app[ADMISSION], app[REGISTRY]

        def on_change(replica: str | None, freed: bool) -> None:
            if replica is None:
                admission.engine.view_cache.changed()
            elif freed:
                admission.on_load(replica)
            else:
                admission.engine.view_cache.touch(replica)

        def on_saturated(replica: str, back_off_s: float, gateway: str) -> None:
            target = registry.get(replica)
            if target is not None:
                registry.saturate(target, time.monotonic(), back_off_s, f"refused at gateway {gateway}")

        ledger = LiveLedger(
            settings.ledger,
            settings.limits.redis,  # type: ignore[arg-type]  # checked above
            replicas=lambda: [r.name for r in registry.replicas()],
            on_change=on_change,
            on_saturated=on_saturated,
        )
        app[LEDGER] = ledger
        cache = admission.engine.view_cache
        cache.remote = ledger.in_flight
        cache.remote_streams = ledger.streams
        cache.listener = ledger
        engine = admission.engine
        cache.margins = widen(
            cache.margins,
            lambda: engine.settings.classes.keys(),
            lambda: engine.settings.forecast_margin,
            ledger.extra_margin,
        )
        admission.replica_source.on_saturate = ledger.saturated
        app[PREDICTIONS].remote_in_flight = ledger.in_flight
        metrics = app.get(METRICS)
        if metrics is not None:
            metrics.track_ledger(ledger.stats, ledger.remote.counts)
        await ledger.start()
        try:
            yield
        finally:
            cache.remote = None
            cache.remote_streams = None
            cache.listener = None
            app[PREDICTIONS].remote_in_flight = None
            await ledger.stop()

    app.cleanup_ctx.append(lifecycle)
