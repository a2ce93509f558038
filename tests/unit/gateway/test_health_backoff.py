"""Health checks of an unhealthy replica back off; an ejected one is not probed (real sockets).

The replica is a port nothing listens on (connection refused: a dead replica), checked through a
real ``aiohttp`` session.
"""

from __future__ import annotations

import time

import aiohttp
from aiohttp import web

from gateway.config.settings import Settings
from gateway.config.store import SettingsStore
from gateway.replicas.config import HealthSettings, ReplicaSettings
from gateway.replicas.health import HealthChecker
from gateway.replicas.registry import ReplicaRegistry, ReplicaState
from tests.support.procs import free_port


async def test_checks_of_a_dead_replica_back_off_up_to_the_cap() -> None:
    health = HealthSettings(interval_s=1.0, timeout_s=0.5, unhealthy_after=1, max_backoff_s=4.0)
    url = f"http://127.0.0.1:{free_port()}"
    store = SettingsStore(Settings(replicas=[ReplicaSettings(name="dead", url=url)], health=health))
    registry = ReplicaRegistry(store)
    (dead,) = registry.replicas()
    waits = []
    async with aiohttp.ClientSession() as session:
        checker = HealthChecker(store, registry, session)
        for _ in range(5):
            await checker.check(dead)
            waits.append(dead.next_check_at - time.monotonic())
        assert dead.state == ReplicaState.UNHEALTHY
        # Not due: a round skips it.
        before = dead.consecutive_failures
        await checker.check_due()
        assert dead.consecutive_failures == before
        dead.next_check_at = 0.0
        await checker.check_due()
        assert dead.consecutive_failures == before + 1

    # interval x 2^(failures beyond unhealthy_after), capped at max_backoff_s.
    # (The time since each check, well under a second, is all that separates them.)
    expected = [1.0, 2.0, 4.0, 4.0, 4.0]
    assert all(e - 1.0 < w <= e for w, e in zip(waits, expected, strict=True)), waits


async def test_an_ejected_replica_is_not_probed_until_its_ejection_ends() -> None:
    health = HealthSettings(interval_s=1.0, timeout_s=0.5)
    url = f"http://127.0.0.1:{free_port()}"
    store = SettingsStore(Settings(replicas=[ReplicaSettings(name="r", url=url)], health=health))
    registry = ReplicaRegistry(store)
    (replica,) = registry.replicas()
    replica.ejected_until = time.monotonic() + 60.0
    async with aiohttp.ClientSession() as session:
        await HealthChecker(store, registry, session).check_due()

    assert (replica.consecutive_failures, replica.state) == (0, ReplicaState.UNKNOWN)


async def test_state_listeners_hear_each_transition_once_and_stop_when_asked() -> None:
    """Down once after ``unhealthy_after`` failures, up once when it answers again (admission
    re-evaluates its queue on each); repeated failures say nothing more; an unsubscribed listener
    hears nothing."""
    health = HealthSettings(interval_s=1.0, timeout_s=0.5, unhealthy_after=2, healthy_after=1)
    port = free_port()
    store = SettingsStore(
        Settings(replicas=[ReplicaSettings(name="r", url=f"http://127.0.0.1:{port}")], health=health)
    )
    registry = ReplicaRegistry(store)
    (replica,) = registry.replicas()
    heard: list[tuple[str, ReplicaState]] = []
    stopped: list[str] = []
    async with aiohttp.ClientSession() as session:
        checker = HealthChecker(store, registry, session)
        checker.on_state(lambda r: heard.append((r.name, r.state)))
        stop = checker.on_state(lambda r: stopped.append(r.name))
        stop()
        for _ in range(4):  # nothing listens on the port: refused
            await checker.check(replica)
        assert heard == [("r", ReplicaState.UNHEALTHY)]

        async def ok(_: web.Request) -> web.Response:
            return web.Response(text="ok")

        async def models(_: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

        app = web.Application()
        app.router.add_get("/health", ok)
        app.router.add_get("/v1/models", models)
        runner = web.AppRunner(app)
        await runner.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", port).start()
            await checker.check(replica)
            await checker.check(replica)
        finally:
            await runner.cleanup()
    assert heard == [("r", ReplicaState.UNHEALTHY), ("r", ReplicaState.HEALTHY)]
    assert stopped == []
