"""The scrape loop against a real aiohttp server on a free port whose answer the test controls."""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.replicas.scraper import MetricsScraper
from gateway.replicas.snapshot import InFlight, ReplicaSnapshot
from tests.unit.scrape.scrapes import REAL_032, ScrapeText
from tests.unit.scrape.test_window import LATER

BASE_TEXT = ScrapeText.fixture(REAL_032).render()
LATER_TEXT = LATER.render()
WAIT_S = 15.0  # generous: the loop scrapes every 20 ms when all is well
INTERVAL_S = 0.02

Respond = Callable[[], Awaitable[web.StreamResponse]]


class FakeReplica:
    """``GET /metrics`` answers with ``bodies`` in turn (the last one repeats) until ``respond`` is set."""

    def __init__(self, *bodies: str) -> None:
        self.bodies = list(bodies) or [BASE_TEXT]
        self.hits = 0
        self.respond: Respond | None = None
        #: Set at teardown so a deliberately hanging answer ends.
        self.release = asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        if self.respond is not None:
            return await self.respond()
        body = self.bodies[min(self.hits - 1, len(self.bodies) - 1)]
        return web.Response(text=body, content_type="text/plain")

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self.handle)
        return app

    async def hang(self) -> web.StreamResponse:
        await self.release.wait()
        return web.Response(text=BASE_TEXT)


def answer(status: int = 200, text: str = "") -> Respond:
    async def respond() -> web.StreamResponse:
        return web.Response(status=status, text=text, content_type="text/plain")

    return respond


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def serve(aiohttp_server, replica: FakeReplica) -> tuple[TestServer, str]:
    server: TestServer = await aiohttp_server(replica.app())
    return server, str(server.make_url("/")).rstrip("/")


class Collector:
    """Subscribes to a scraper and hands out its snapshots in order."""

    def __init__(self, scraper: MetricsScraper) -> None:
        self.queue: asyncio.Queue[ReplicaSnapshot] = asyncio.Queue()
        scraper.subscribe(self.queue.put_nowait)

    async def next(self, predicate: Callable[[ReplicaSnapshot], bool] = lambda s: True) -> ReplicaSnapshot:
        async def wait() -> ReplicaSnapshot:
            while True:
                snapshot = await self.queue.get()
                if predicate(snapshot):
                    return snapshot

        return await asyncio.wait_for(wait(), WAIT_S)


def fake_clock(step_s: float = 5.0) -> Callable[[], float]:
    """A monotonic clock that advances ``step_s`` at every reading (one reading per scrape)."""
    ticks = itertools.count()
    return lambda: next(ticks) * step_s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


async def test_loop_publishes_windowed_snapshots_with_in_flight(aiohttp_server, session) -> None:
    _, url = await serve(aiohttp_server, FakeReplica(BASE_TEXT, LATER_TEXT))
    in_flight = [InFlight("req-1", prompt_tokens=300, tokens_streamed=12, started_at=0.5, max_tokens=100)]
    scraper = MetricsScraper(session, interval_s=INTERVAL_S, timeout_s=5.0, clock=fake_clock())
    scraper.add_replica("r1", url, in_flight=lambda: in_flight)
    collector = Collector(scraper)
    parses: list[tuple[str, float, bool]] = []
    scraper.on_parse(lambda *parse: parses.append(parse))

    await scraper.start()
    try:
        first = await collector.next()
        second = await collector.next()
    finally:
        await scraper.stop()

    assert (first.taken_at, second.taken_at) == (0.0, 5.0)
    assert (first.stale, second.stale) == (False, False)
    assert (first.num_running, second.num_running) == (4, 7)
    assert second.window_s == 5.0
    assert second.generation_tokens_per_s == pytest.approx(100.0)
    assert second.itl_p90_s == pytest.approx(0.025)
    assert second.in_flight == tuple(in_flight)
    assert (second.gateway_in_flight, second.gateway_prompt_tokens_in_flight) == (1, 300)
    assert second.gateway_decode_tokens_so_far == 12
    latest = scraper.latest("r1")
    assert latest is not None
    assert latest.taken_at >= second.taken_at
    # The later scrapes (the same lines, other values) were read with the first one's layout:
    # the values above came from that path.
    parser = scraper._targets["r1"].parser
    assert parser.misses == 1
    assert parser.hits >= 1
    # Every parse reported, with its CPU time: the first by the library, the later ones with the
    # kept layout.
    assert [(name, kept) for name, _, kept in parses] == [("r1", False)] + [("r1", True)] * parser.hits
    assert all(cpu_s > 0.0 for _, cpu_s, _ in parses), parses


ONLY_PROCESS = "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 12.5\n"


@pytest.mark.parametrize(
    ("failure", "reason_part"),
    [
        pytest.param(answer(500, "engine dead"), "answered 500", id="status-500"),
        pytest.param(answer(404), "answered 404", id="status-404"),
        pytest.param(answer(200, "this is not prometheus"), "not Prometheus text", id="garbage"),
        pytest.param(answer(200, ""), "no vllm metric", id="empty"),
        pytest.param(answer(200, ONLY_PROCESS), "no vllm metric", id="no-known-metric"),
        pytest.param(None, "timed out after 1 s", id="timeout"),
    ],
)
async def test_failed_scrape_is_stale_and_keeps_the_last_good_metrics(
    aiohttp_server, session, failure: Respond | None, reason_part: str
) -> None:
    replica = FakeReplica(BASE_TEXT)
    _, url = await serve(aiohttp_server, replica)
    scraper = MetricsScraper(session, interval_s=INTERVAL_S, timeout_s=1.0)
    scraper.add_replica("r1", url)
    collector = Collector(scraper)

    await scraper.start()
    try:
        good = await collector.next(lambda s: not s.stale)
        replica.respond = failure if failure is not None else replica.hang
        stale = await collector.next(lambda s: s.stale and reason_part in (s.stale_reason or ""))
    finally:
        await scraper.stop()
        replica.release.set()

    assert stale.num_running == good.num_running == 4
    assert stale.metrics_at == good.metrics_at
    assert stale.taken_at > good.taken_at


async def test_refused_connection_is_stale(session) -> None:
    scraper = MetricsScraper(session, interval_s=INTERVAL_S, timeout_s=5.0)
    scraper.add_replica("gone", f"http://127.0.0.1:{free_port()}")

    snapshot = await asyncio.wait_for(scraper.scrape_once("gone"), WAIT_S)

    assert snapshot.stale
    assert snapshot.stale_reason is not None
    assert snapshot.stale_reason.startswith("GET /metrics failed: ClientConnectorError")
    assert snapshot.metrics_at is None
    assert scraper.latest("gone") is snapshot


async def test_replica_that_dies_goes_stale_then_fresh_and_logs_each_transition_once(
    aiohttp_server, session, caplog: pytest.LogCaptureFixture
) -> None:
    replica = FakeReplica(BASE_TEXT)
    server, url = await serve(aiohttp_server, replica)
    scraper = MetricsScraper(session, interval_s=INTERVAL_S, timeout_s=5.0)
    scraper.add_replica("r1", url)
    collector = Collector(scraper)
    caplog.set_level(logging.INFO, logger="sluice.scraper")
    revived: TestServer | None = None

    await scraper.start()
    try:
        await collector.next(lambda s: not s.stale)
        port = server.port
        await server.close()  # the replica dies: connections are refused
        refused = [await collector.next(lambda s: s.stale) for _ in range(3)]
        revived = TestServer(replica.app(), port=port)  # and comes back on its port
        await revived.start_server()
        fresh = [await collector.next(lambda s: not s.stale) for _ in range(2)]
    finally:
        await scraper.stop()
        if revived is not None:
            await revived.close()

    assert all("ClientConnectorError" in (s.stale_reason or "") for s in refused)
    assert fresh[0].num_running == 4
    messages = [r.getMessage() for r in caplog.records if r.name == "sluice.scraper"]
    assert len([m for m in messages if "are stale" in m]) == 1
    assert len([m for m in messages if "fresh again" in m]) == 1


async def test_subscriber_error_does_not_stop_the_loop(aiohttp_server, session) -> None:
    _, url = await serve(aiohttp_server, FakeReplica(BASE_TEXT))
    scraper = MetricsScraper(session, interval_s=INTERVAL_S, timeout_s=5.0)

    def broken(snapshot: ReplicaSnapshot) -> None:
        raise RuntimeError("subscriber bug")

    scraper.subscribe(broken)
    collector = Collector(scraper)
    scraper.add_replica("r1", url)

    await scraper.start()
    try:
        snapshots = [await collector.next() for _ in range(3)]
    finally:
        await scraper.stop()

    assert [s.stale for s in snapshots] == [False, False, False]


async def test_replicas_added_after_start_and_removed(aiohttp_server, session) -> None:
    late, other = FakeReplica(BASE_TEXT), FakeReplica(BASE_TEXT)
    _, late_url = await serve(aiohttp_server, late)
    _, other_url = await serve(aiohttp_server, other)
    scraper = MetricsScraper(session, interval_s=INTERVAL_S, timeout_s=5.0)
    collector = Collector(scraper)

    await scraper.start()
    try:
        scraper.add_replica("late", late_url)
        first = await collector.next()
        scraper.remove_replica("late")
        hits_at_removal = late.hits
        # The other replica's scrapes show the loop went on while "late" stayed silent.
        scraper.add_replica("other", other_url)
        after = [await collector.next(lambda s: s.name == "other") for _ in range(3)]
    finally:
        await scraper.stop()

    assert first.name == "late"
    assert [s.name for s in after] == ["other"] * 3
    assert collector.queue.empty() or all(
        collector.queue.get_nowait().name == "other" for _ in range(collector.queue.qsize())
    )
    assert scraper.latest("late") is None
    assert scraper.replicas() == ["other"]
    # At most the request already under way when it was removed.
    assert late.hits <= hits_at_removal + 1


async def test_unknown_dialect_is_rejected(session) -> None:
    scraper = MetricsScraper(session)

    with pytest.raises(ValueError, match="unknown metrics dialect 'trtllm'; known: sglang, tgi, vllm"):
        scraper.add_replica("r1", "http://127.0.0.1:1", dialect="trtllm")


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"interval_s": 0.0}, id="interval"),
        pytest.param({"timeout_s": -1.0}, id="timeout"),
        pytest.param({"window_s": 0.0}, id="window"),
    ],
)
async def test_settings_must_be_positive(session, kwargs: dict[str, float]) -> None:
    settings = {"interval_s": 1.0, "timeout_s": 1.0, "window_s": 10.0} | kwargs

    with pytest.raises(ValueError, match="must be > 0"):
        MetricsScraper(
            session,
            interval_s=settings["interval_s"],
            timeout_s=settings["timeout_s"],
            window_s=settings["window_s"],
        )
