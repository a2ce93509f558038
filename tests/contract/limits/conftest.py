"""One limiter suite, every backend: fixtures that hand each test the same ``Backend`` face.

``backend`` runs a test against the memory limiter (fake clock, exact numbers) and against a real
``redis-server`` this session starts on a free port (Redis ``TIME``: numbers checked within the
time that really passed). ``backend_or_cluster`` adds a three-master Redis Cluster. A missing
``redis-server``/``redis-cli`` fails these fixtures with the install command: CI must run them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from gateway.limits.base import Limiter, LimiterStats, TenantLimits
from gateway.limits.memory import MemoryLimiter
from gateway.limits.redis import RedisLimiter, connect
from tests.support.redis import RedisClusterNodes, RedisNotInstalled, RedisServer, redis_cluster, redis_server
from tests.unit.limits.fakes import FakeClock

#: Generous per-call timeout for the contract suite: a loaded 2-core CI machine must not flake.
CONTRACT_TIMEOUT_S = 30.0


@dataclass
class Backend:
    """What a contract test needs from a backend, whatever it is.

    ``elapsed()`` is the time passed on the backend's clock since the fixture started (the fake
    clock's for memory, the wall clock's for Redis), so a test bounds refill by
    ``rate * elapsed()``: exactly zero for memory. ``advance`` lets time pass (fake or real).
    ``short_lease_s`` is a lease TTL the test can afford to wait out.
    """

    kind: str
    limiter: Limiter
    stats: LimiterStats
    advance: Callable[[float], Awaitable[None]]
    elapsed: Callable[[], float]
    make: Callable[..., Limiter]
    short_lease_s: float
    exact: bool
    _made: list[Limiter] = field(default_factory=list)

    def new(self, **kwargs: Any) -> Limiter:
        """Another limiter of this kind on the same storage (closed at teardown)."""
        limiter = self.make(**kwargs)
        self._made.append(limiter)
        return limiter

    async def close(self) -> None:
        for limiter in [self.limiter, *self._made]:
            await limiter.close()


@pytest.fixture(scope="session")
def redis_server_proc() -> Iterator[RedisServer]:
    try:
        with redis_server(name="redis-contract") as server:
            yield server
    except RedisNotInstalled as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="session")
def redis_cluster_procs() -> Iterator[RedisClusterNodes]:
    try:
        with redis_cluster(3) as cluster:
            yield cluster
    except RedisNotInstalled as exc:
        pytest.fail(str(exc))


def memory_backend() -> Backend:
    clock = FakeClock()
    stats = LimiterStats()

    def make(**kwargs: Any) -> Limiter:
        return MemoryLimiter(clock=clock, stats=stats, **kwargs)

    async def advance(seconds: float) -> None:
        clock.advance(seconds)

    start = clock()
    return Backend(
        kind="memory",
        limiter=make(),
        stats=stats,
        advance=advance,
        elapsed=lambda: clock() - start,
        make=make,
        short_lease_s=10.0,
        exact=True,
    )


def redis_backend(kind: str, url: str, *, cluster: bool) -> Backend:
    stats = LimiterStats()

    def make(**kwargs: Any) -> Limiter:
        client = connect(url, cluster=cluster, timeout_s=CONTRACT_TIMEOUT_S)
        return RedisLimiter(client, timeout_s=CONTRACT_TIMEOUT_S, stats=stats, **kwargs)

    start = time.monotonic()
    return Backend(
        kind=kind,
        limiter=make(),
        stats=stats,
        advance=asyncio.sleep,
        elapsed=lambda: time.monotonic() - start,
        make=make,
        short_lease_s=1.0,
        exact=False,
    )


def flush(nodes: list[RedisServer]) -> None:
    for node in nodes:
        with node.client() as client:
            client.flushall()


async def _backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    kind = request.param
    if kind == "memory":
        backend = memory_backend()
    elif kind == "redis":
        server: RedisServer = request.getfixturevalue("redis_server_proc")
        flush([server])
        backend = redis_backend(kind, server.url, cluster=False)
    else:
        cluster: RedisClusterNodes = request.getfixturevalue("redis_cluster_procs")
        flush(cluster.nodes)
        backend = redis_backend(kind, cluster.url, cluster=True)
    try:
        yield backend
    finally:
        await backend.close()


@pytest.fixture(params=["memory", "redis"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    """The memory limiter, then a real Redis."""
    async for value in _backend(request):
        yield value


@pytest.fixture(params=["memory", "redis", "cluster"])
async def backend_or_cluster(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    """The memory limiter, a real Redis, then a real three-master Redis Cluster."""
    async for value in _backend(request):
        yield value


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A redis-server of this test's own, free to be killed, paused and restarted on its port."""
    try:
        with redis_server(name="redis-own") as server:
            yield server
    except RedisNotInstalled as exc:
        pytest.fail(str(exc))


async def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    """Poll ``condition`` every 10 ms until it holds; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.01)


#: A tenant allowed one request at a time (and tokens enough for any test).
ONE_AT_A_TIME = TenantLimits(tokens_per_minute=6_000_000, max_concurrent=1)


async def one_at_a_time_rounds(limiter: Limiter, label: str, rounds: int = 3) -> None:
    """``rounds`` times: a reserve of an ``ONE_AT_A_TIME`` tenant, then its settle and the next
    reserve sent in the same event-loop iteration, in that order (a client whose next request
    follows its answer at once). The next reserve must be allowed: the settle reached storage
    first, not a load and a round trip later."""
    for n in range(rounds):
        first = await limiter.reserve("acme", cost_tokens=1.0, limits=ONE_AT_A_TIME, request_id=f"{label}{n}")
        assert first.allowed
        settle = asyncio.ensure_future(limiter.settle(first, actual_cost_tokens=1.0))
        after = asyncio.ensure_future(
            limiter.reserve("acme", cost_tokens=1.0, limits=ONE_AT_A_TIME, request_id=f"{label}{n}b")
        )
        await settle
        assert (await after).allowed, (label, n)
        await limiter.settle(await after, actual_cost_tokens=1.0)
