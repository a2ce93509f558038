"""Two in-process ledgers on a real ``redis-server``: what one dispatches the other applies within
milliseconds, progress and finishes follow, a gateway that stops heartbeating (a kill -9) loses
its entries everywhere within the expiry, and Redis going down and back is one transition each
way, with the margin widened meanwhile."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import pytest

from gateway.ledger.config import LedgerSettings
from gateway.ledger.live import LiveLedger
from gateway.limits.config import RedisSettings
from gateway.replicas.snapshot import InFlight
from tests.support.redis import RedisServer, redis_server

REPLICAS = ["r0", "r1"]
Changes = list[tuple[str | None, bool]]
Pair = tuple[LiveLedger, LiveLedger, Changes]
SETTINGS = LedgerSettings(enabled=True, heartbeat_s=0.1, expiry_s=0.3, progress_interval_s=0.05)


@dataclass
class Live:
    """A tracked request as admission's ``TrackedStream`` shows it."""

    tokens: int = 0
    first_token_at: float | None = None
    request_class: str = "interactive"
    expected_output_tokens: float = 32.0
    predicted_tpot_s: float = 0.02

    def in_flight(self, now: float) -> InFlight:
        return InFlight("req", 128, self.tokens, now, 64, first_token_at=self.first_token_at)

    __hash__ = object.__hash__


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with redis_server(name="redis-ledger") as s:
        yield s


def _ledger(server: RedisServer, gateway: str, changes: list[tuple[str | None, bool]]) -> LiveLedger:
    redis = RedisSettings(url=server.url, timeout_s=0.2)
    return LiveLedger(
        SETTINGS,
        redis,
        replicas=lambda: REPLICAS,
        on_change=lambda r, f: changes.append((r, f)),
        gateway_id=gateway,
    )


@pytest.fixture
async def pair(
    server: RedisServer,
) -> AsyncIterator[Pair]:
    with server.client() as c:
        c.flushall()
    changes: list[tuple[str | None, bool]] = []
    a, b = _ledger(server, "gw-a", []), _ledger(server, "gw-b", changes)
    await a.start()
    await b.start()
    try:
        yield a, b, changes
    finally:
        for ledger in (a, b):
            if not ledger._closed:
                await ledger.stop()


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> float:
    """Seconds until ``condition()`` held; fails past ``timeout_s``."""
    started = time.perf_counter()
    while not condition():
        assert time.perf_counter() - started < timeout_s, "condition not met in time"
        await asyncio.sleep(0.001)
    return time.perf_counter() - started


async def test_a_dispatch_reaches_the_other_gateway_within_milliseconds(pair: Pair) -> None:
    a, b, changes = pair
    lag = []
    for _ in range(20):
        live = Live()
        a.tracked("r0", live, live)
        lag.append(await until(lambda: len(b.in_flight("r0")) == 1))
        a.forgotten("r0", live)
        await until(lambda: b.in_flight("r0") == ())
    lag.sort()
    # Generous: the box is shared. Typically well under a millisecond on loopback.
    assert lag[len(lag) // 2] < 0.25
    assert ("r0", True) in changes
    assert ("r0", False) in changes
    assert a.stats.published_total >= 20
    assert b.stats.applied_total >= 20


async def test_progress_and_first_token_follow(pair: Pair) -> None:
    a, b, _ = pair
    live = Live()
    a.tracked("r1", live, live)
    await until(lambda: len(b.in_flight("r1")) == 1)
    (seen,) = b.in_flight("r1")
    assert (seen.prompt_tokens, seen.max_tokens, seen.tokens_streamed, seen.first_token_at) == (
        128,
        64,
        0,
        None,
    )
    live.tokens, live.first_token_at = 1, time.monotonic()
    await until(lambda: b.in_flight("r1")[0].tokens_streamed == 1)
    (seen,) = b.in_flight("r1")
    assert seen.first_token_at == pytest.approx(live.first_token_at, abs=0.05)
    live.tokens = 9
    await until(lambda: b.in_flight("r1")[0].tokens_streamed == 9)
    assert b.describe()["replicas"]["r1"] == {"in_flight": 1, "gateways": {"gw-a": 1}}


async def test_a_dead_gateways_entries_go_within_the_expiry(pair: Pair, server: RedisServer) -> None:
    a, b, _ = pair
    lives = [Live() for _ in range(5)]
    for live in lives:
        a.tracked("r0", live, live)
    await until(lambda: len(b.in_flight("r0")) == 5)
    # kill -9: its tasks stop, nothing is deleted, its heartbeat simply stops being renewed.
    for task in a._tasks:
        task.cancel()
    a._closed = True
    killed = time.perf_counter()
    await until(lambda: b.in_flight("r0") == (), timeout_s=10.0)
    gone_after = time.perf_counter() - killed
    assert gone_after < SETTINGS.expiry_s + SETTINGS.heartbeat_s + 1.0
    assert b.stats.expired_gateways_total == 1
    await until(lambda: _fields(server, "r0") == 0)  # and deleted from Redis
    await a.io.aclose()


def _fields(server: RedisServer, replica: str) -> int:
    with server.client() as c:
        return int(c.hlen(f"sluice:ledger:{{{replica}}}"))


async def test_a_lost_message_is_repaired_by_the_heartbeats_read(pair: Pair, server: RedisServer) -> None:
    a, b, _ = pair
    live = Live()
    a.tracked("r0", live, live)
    await until(lambda: len(b.in_flight("r0")) == 1)
    # The entry leaves Redis without a message (as if the delete's message were lost).
    with server.client() as c:
        c.delete("sluice:ledger:{r0}")
    await until(lambda: b.in_flight("r0") == (), timeout_s=3.0)


async def test_redis_down_then_up_is_one_transition_each_way(
    pair: Pair, server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    a, b, changes = pair
    live = Live()
    a.tracked("r0", live, live)
    await until(lambda: len(b.in_flight("r0")) == 1)
    assert b.extra_margin() == 0.0
    caplog.set_level("INFO", logger="sluice.ledger")
    server.kill()
    try:
        await until(lambda: not b.stats.up and not a.stats.up, timeout_s=10.0)
        # Nothing of the others counts while down (a finish would not be heard), margins widen.
        assert b.in_flight("r0") == ()
        assert b.extra_margin() == SETTINGS.unavailable_margin
        assert (None, True) in changes
        await asyncio.sleep(0.5)  # probes keep failing: still one transition
        assert b.stats.transitions_total == 1
    finally:
        server.start()
    await until(lambda: b.stats.up and a.stats.up, timeout_s=10.0)
    # Redis lost everything; a writes its entries again, b reads them back.
    await until(lambda: len(b.in_flight("r0")) == 1, timeout_s=5.0)
    assert b.stats.transitions_total == 2
    assert b.extra_margin() == 0.0
    downs = [r for r in caplog.records if r.name == "sluice.ledger" and "unreachable" in r.getMessage()]
    ups = [r for r in caplog.records if r.name == "sluice.ledger" and "reachable again" in r.getMessage()]
    assert len(downs) == 2
    assert len(ups) == 2


async def test_on_a_redis_cluster_entries_and_expiry_cross_the_nodes() -> None:
    """Replicas hash-tagged onto different nodes of a three-master Cluster: dispatches reach the
    other gateway (classic pub/sub reaches every node's subscribers), a dead gateway's entries
    are dropped and deleted on every node."""
    from tests.support.redis import redis_cluster

    replicas = [f"r{i}" for i in range(6)]
    with redis_cluster() as cluster:
        redis = RedisSettings(url=cluster.url, cluster=True, timeout_s=0.5)
        changes: Changes = []
        a = LiveLedger(SETTINGS, redis, replicas=lambda: replicas, gateway_id="gw-a")
        b = LiveLedger(
            SETTINGS,
            redis,
            replicas=lambda: replicas,
            on_change=lambda r, f: changes.append((r, f)),
            gateway_id="gw-b",
        )
        await a.start()
        await b.start()
        try:
            lives = [Live() for _ in replicas]
            for replica, live in zip(replicas, lives, strict=True):
                a.tracked(replica, live, live)
            await until(lambda: all(len(b.in_flight(r)) == 1 for r in replicas))
            assert b.stats.up
            assert a.stats.up
            a.forgotten("r0", lives[0])
            await until(lambda: b.in_flight("r0") == ())
            for task in a._tasks:  # kill -9
                task.cancel()
            a._closed = True
            await until(lambda: all(b.in_flight(r) == () for r in replicas), timeout_s=10.0)
            assert b.stats.expired_gateways_total == 1
        finally:
            await b.stop()
            await a.io.aclose()


async def test_a_replicas_refusal_makes_every_gateway_back_off(pair: Pair) -> None:
    a, b, _ = pair
    seen: list[tuple[str, float, str]] = []
    b.on_saturated = lambda replica, back_off_s, gateway: seen.append((replica, back_off_s, gateway))
    a.saturated("r1", 2.5)
    await until(lambda: bool(seen))
    assert seen == [("r1", 2.5, "gw-a")]
