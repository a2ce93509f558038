"""The scrape loop: ``GET {replica}/metrics`` every ``interval_s``, one task per replica.

Each task fetches with a ``timeout_s`` limit, parses off the event loop, feeds a
``SnapshotBuilder`` and publishes the ``ReplicaSnapshot`` (``latest(name)``, and to every
subscriber). Any failure yields a stale snapshot with a reason and keeps the last good window;
nothing raises out of the loop, and only good/stale transitions are logged. ``backend: auto``
detects the dialect at the first scrape that tells (``engine(name)``). The aiohttp session belongs
to the caller; timestamps come from the injected monotonic ``clock``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp

from gateway.replicas.dialects import AUTO, INFO_PATHS, Samples, detect, engine_from_info, get_dialect
from gateway.replicas.exposition import ExpositionError, ExpositionParser
from gateway.replicas.scrape import DEFAULT_WINDOW_S, SnapshotBuilder
from gateway.replicas.snapshot import InFlight, ReplicaSnapshot

log = logging.getLogger("sluice.scraper")

InFlightSource = Callable[[], Sequence[InFlight]]
SnapshotCallback = Callable[[ReplicaSnapshot], None]
EngineCallback = Callable[[str], None]
#: ``(replica, cpu_s, kept_layout)`` for every scrape parsed: the parse's CPU seconds (its worker
#: thread's, ``time.thread_time``) and whether it read the values only, with the replica's kept
#: layout (``ExpositionParser``), or went to prometheus_client's parser.
ParseCallback = Callable[[str, float, bool], None]


@dataclass(eq=False)
class _Target:
    name: str
    base_url: str
    metrics_url: str
    #: ``None`` while the engine of an ``auto`` replica is not known yet.
    builder: SnapshotBuilder | None
    in_flight: InFlightSource | None
    #: Called once with the engine an ``auto`` replica was detected to run.
    on_engine: EngineCallback | None = None
    #: Scrapes of one replica never overlap (the loop and ``scrape_once`` share it).
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    task: asyncio.Task[None] | None = None
    #: ``None`` before the first snapshot; then whether the latest one was stale.
    stale: bool | None = None
    #: This replica's scrapes, parsed (used under ``lock``: one at a time).
    parser: ExpositionParser = field(default_factory=ExpositionParser)


class MetricsScraper:
    """Scrapes every added replica's ``/metrics`` on an interval and publishes ``ReplicaSnapshot``s.

    ``interval_s``: seconds from the start of one scrape of a replica to the start of the next.
    ``timeout_s``: limit on one whole request (connect + body). ``window_s``: seconds of scrapes
    kept for rates and histogram statistics. ``clock``: monotonic seconds for snapshot times.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        interval_s: float = 1.0,
        timeout_s: float = 1.0,
        window_s: float = DEFAULT_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for label, value in (("interval_s", interval_s), ("timeout_s", timeout_s), ("window_s", window_s)):
            if not value > 0:
                raise ValueError(f"{label} must be > 0, got {value}")
        self._session = session
        self._interval_s = interval_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._timeout_s = timeout_s
        self._window_s = window_s
        self._clock = clock
        self._targets: dict[str, _Target] = {}
        self._latest: dict[str, ReplicaSnapshot] = {}
        self._subscribers: list[SnapshotCallback] = []
        self._parse_listeners: list[ParseCallback] = []
        self._retiring: set[asyncio.Task[None]] = set()
        self._running = False

    # -- replicas ---------------------------------------------------------------------------------

    def add_replica(
        self,
        name: str,
        base_url: str,
        dialect: str = "vllm",
        in_flight: InFlightSource | None = None,
        on_engine: EngineCallback | None = None,
    ) -> None:
        """Start scraping ``{base_url}/metrics`` as replica ``name`` (at once if started).

        Adding a name again replaces it with a fresh window (its URL or dialect may have changed).
        ``dialect`` is a dialect name or ``"auto"`` (detect it); ``ValueError`` for an unknown one.
        ``in_flight`` is called at each scrape. ``on_engine`` is called once, in the event loop,
        with the engine an ``auto`` replica turned out to run (e.g. to set the registry's
        ``Replica.detected_engine``); an exception it raises is logged and ignored.
        """
        builder = None if dialect == AUTO else self._builder(name, dialect)
        if name in self._targets:
            self.remove_replica(name)
        target = _Target(
            name=name,
            base_url=base_url.rstrip("/"),
            metrics_url=base_url.rstrip("/") + "/metrics",
            builder=builder,
            in_flight=in_flight,
            on_engine=on_engine,
        )
        self._targets[name] = target
        if self._running:
            self._start_task(target)

    def remove_replica(self, name: str) -> None:
        """Stop scraping ``name`` and forget its snapshots; unknown names are ignored."""
        target = self._targets.pop(name, None)
        self._latest.pop(name, None)
        if target is not None and target.task is not None:
            target.task.cancel()
            # Cancelled tasks are awaited in ``stop``; until then keep a strong reference.
            self._retiring.add(target.task)
            target.task.add_done_callback(self._retiring.discard)

    def _builder(self, name: str, dialect: str) -> SnapshotBuilder:
        return SnapshotBuilder(name, get_dialect(dialect), window_s=self._window_s)

    def engine(self, name: str) -> str | None:
        """The dialect replica ``name`` is read with: configured, or detected (``None`` while an
        ``auto`` replica's engine is unknown, or for an unknown name)."""
        target = self._targets.get(name)
        return None if target is None or target.builder is None else target.builder.dialect.name

    def replicas(self) -> list[str]:
        """Names being scraped, in the order they were added."""
        return list(self._targets)

    # -- results ----------------------------------------------------------------------------------

    def latest(self, name: str) -> ReplicaSnapshot | None:
        """The newest snapshot of ``name``; ``None`` before its first scrape ended or if unknown."""
        return self._latest.get(name)

    def subscribe(self, callback: SnapshotCallback) -> Callable[[], None]:
        """Call ``callback(snapshot)`` on every new snapshot, in the event loop, in order.

        Returns a function that unsubscribes. A callback that raises is logged and skipped; it
        does not stop the loop or the other subscribers.
        """
        self._subscribers.append(callback)

        def unsubscribe() -> None:
            with contextlib.suppress(ValueError):
                self._subscribers.remove(callback)

        return unsubscribe

    def on_parse(self, callback: ParseCallback) -> None:
        """Call ``callback(replica, cpu_s, kept_layout)`` after every scrape parsed without error
        (``ParseCallback``), in the event loop; an exception it raises is logged and ignored."""
        self._parse_listeners.append(callback)

    # -- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start one scrape task per replica; the first scrapes begin at once."""
        if self._running:
            return
        self._running = True
        for target in self._targets.values():
            self._start_task(target)

    async def stop(self) -> None:
        """Cancel every scrape task and wait for them to end. The session is left open."""
        self._running = False
        tasks = [t.task for t in self._targets.values() if t.task is not None]
        tasks += list(self._retiring)
        for target in self._targets.values():
            target.task = None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._retiring.clear()

    def _start_task(self, target: _Target) -> None:
        target.task = asyncio.create_task(self._run(target), name=f"sluice-scrape-{target.name}")

    async def _run(self, target: _Target) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await self._scrape(target)
            await asyncio.sleep(max(self._interval_s - (loop.time() - started), 0.0))

    # -- one scrape -------------------------------------------------------------------------------

    async def scrape_once(self, name: str) -> ReplicaSnapshot:
        """Scrape ``name`` now (outside the interval), publish and return the snapshot.

        ``KeyError`` if ``name`` was not added. Useful at startup and in tests.
        """
        return await self._scrape(self._targets[name])

    async def _scrape(self, target: _Target) -> ReplicaSnapshot:
        async with target.lock:
            try:
                snapshot = await self._observe(target)
            except Exception as exc:  # a bug here must not end the replica's loop (cancel still does)
                log.exception("scraping replica %s failed unexpectedly", target.name)
                snapshot = self._fail(
                    target,
                    f"internal error: {exc.__class__.__name__}",
                    self._clock(),
                    self._in_flight(target),
                )
            self._publish(target, snapshot)
            return snapshot

    async def _observe(self, target: _Target) -> ReplicaSnapshot:
        body = await self._fetch(target.metrics_url)
        now = self._clock()
        in_flight = self._in_flight(target)
        samples: Samples | None = None
        failure = ""
        if isinstance(body, _Failure):
            if target.builder is not None:
                return target.builder.fail(body.reason, now, in_flight)
            failure = body.reason
        else:
            try:
                samples, cpu_s, kept = await asyncio.to_thread(_timed_parse, target.parser, body)
            except ExpositionError as exc:
                failure = str(exc)
            else:
                self._parsed(target.name, cpu_s, kept)
        builder = target.builder
        if builder is None:
            # SGLang without --enable-metrics has no /metrics: its info endpoint still tells.
            builder, why = await self._detect(target, samples)
            if builder is None:
                reason = why if samples is not None else f"{failure}; {why}"
                return self._fail(target, reason, self._clock(), in_flight)
        if samples is None:
            return builder.fail(failure, now, in_flight)
        return builder.observe(samples, now, in_flight)

    def _parsed(self, name: str, cpu_s: float, kept: bool) -> None:
        for callback in self._parse_listeners:
            try:
                callback(name, cpu_s, kept)
            except Exception:
                log.exception("parse listener %r failed", callback)

    async def _detect(self, target: _Target, samples: Samples | None) -> tuple[SnapshotBuilder | None, str]:
        """Detect an ``auto`` replica's engine and give the target its builder; ``(None, why)``
        when it cannot tell yet (the replica stays stale and the next scrape tries again)."""
        found, source = (detect(samples), "/metrics") if samples is not None else (None, "")
        if found is None:
            for engine, path in INFO_PATHS:
                if engine_from_info(engine, await self._fetch_json(target.base_url + path)):
                    found, source = engine, f"GET {path}"
                    break
        if found is None:
            why = "engine not detected yet: no vllm:/tgi_/sglang: metric, TGI /info, SGLang /get_server_info"
            return None, why
        target.builder = self._builder(target.name, found)
        log.info("replica %s: detected engine %s from %s", target.name, found, source)
        if target.on_engine is not None and self._targets.get(target.name) is target:
            try:
                target.on_engine(found)
            except Exception:
                log.exception("on_engine callback of replica %s failed", target.name)
        return target.builder, ""

    async def _fetch_json(self, url: str) -> object:
        """The JSON body of ``GET url``; ``None`` on any failure or a non-200 answer."""
        try:
            async with self._session.get(url, timeout=self._timeout) as resp:
                if resp.status != 200:
                    return None
                return await resp.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return None

    def _fail(
        self, target: _Target, reason: str, now: float, in_flight: Sequence[InFlight]
    ) -> ReplicaSnapshot:
        if target.builder is not None:
            return target.builder.fail(reason, now, in_flight)
        return ReplicaSnapshot(
            name=target.name, taken_at=now, stale=True, stale_reason=reason, in_flight=tuple(in_flight)
        )

    async def _fetch(self, url: str) -> str | _Failure:
        """The body of ``GET url`` as text, or why there is none (one line)."""
        try:
            async with self._session.get(url, timeout=self._timeout) as resp:
                if resp.status != 200:
                    return _Failure(f"GET /metrics answered {resp.status}")
                raw = await resp.read()
        except TimeoutError:
            return _Failure(f"GET /metrics timed out after {self._timeout_s:g} s")
        except aiohttp.ClientError as exc:
            return _Failure(f"GET /metrics failed: {exc.__class__.__name__}: {exc}")
        # The exposition format is UTF-8; a stray byte must not fail the whole scrape here, the
        # parser decides whether the text is usable.
        return raw.decode("utf-8", errors="replace")

    def _in_flight(self, target: _Target) -> tuple[InFlight, ...]:
        if target.in_flight is None:
            return ()
        try:
            return tuple(target.in_flight())
        except Exception:
            log.exception("in_flight source of replica %s failed; using none", target.name)
            return ()

    def _publish(self, target: _Target, snapshot: ReplicaSnapshot) -> None:
        if self._targets.get(target.name) is not target:
            return  # removed or replaced while this scrape ran
        self._log_transition(target, snapshot)
        self._latest[target.name] = snapshot
        for callback in list(self._subscribers):
            try:
                callback(snapshot)
            except Exception:
                log.exception("snapshot subscriber %r failed for replica %s", callback, target.name)

    @staticmethod
    def _log_transition(target: _Target, snapshot: ReplicaSnapshot) -> None:
        if snapshot.stale == target.stale:
            return
        if snapshot.stale:
            log.warning("metrics of replica %s are stale: %s", target.name, snapshot.stale_reason)
        elif target.stale is None:
            log.info("metrics of replica %s: scraping %s", target.name, target.metrics_url)
        else:
            log.info("metrics of replica %s are fresh again", target.name)
        target.stale = snapshot.stale


def _timed_parse(parser: ExpositionParser, text: str) -> tuple[Samples, float, bool]:
    """``parser.parse(text)``, its CPU seconds (this thread's) and whether the kept layout read it."""
    started, hits = time.thread_time(), parser.hits
    samples = parser.parse(text)
    return samples, time.thread_time() - started, parser.hits > hits


@dataclass(frozen=True, slots=True)
class _Failure:
    reason: str
