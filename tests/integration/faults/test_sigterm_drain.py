"""SIGTERM on the gateway under load: a graceful drain.

What Sluice promises (``docs/operations.md``, "The gateway is stopped"): on SIGTERM it closes
its listening socket at once, so a new connection is refused (that is what "refused" means
today; ``/readyz`` does not turn 503 first: behind a Kubernetes Service, give the pod a
``preStop`` sleep so the endpoint is removed before the signal comes); requests in flight go on
for up to ``server.shutdown_grace_s`` seconds and finish normally; then the process exits 0, and
every reservation is settled before the limiter closes (the tenant's leases in Redis are all
gone and its bucket holds exactly what the clients used). A stream still running when the grace
ends gets an SSE error event (``server_shutting_down``) within the grace and is settled with what
it streamed. With ``server.drain_s``, SIGTERM first drains: ``/readyz`` answers 503 and new
requests get a 503 with Retry-After while the listener still accepts, then the above.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import aiohttp
import pytest

from tests.integration.faults.rig import (
    LEDGER_TOLERANCE,
    PROMPT_TOKENS,
    Call,
    Gateway,
    Ledger,
    call,
    emulators,
    gateway,
    gateway_config,
    total_charge,
)
from tests.support import speed
from tests.support.procs import free_port, port_is_open
from tests.support.redis import RedisServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

#: ~2.5 s of decoding: well inside the grace below, well past the moment of the signal.
STREAM_TOKENS = 300
GRACE_S = 15.0


async def _listener_closed(port: int, timeout_s: float = 20.0) -> None:
    """Return once nothing accepts connections on ``port`` (the gateway closed its listener)."""
    deadline = time.monotonic() + timeout_s
    while await asyncio.to_thread(port_is_open, port):
        assert time.monotonic() < deadline, (
            f"port {port} still accepts connections {timeout_s}s after SIGTERM"
        )
        await asyncio.sleep(0.05)


async def _exit_code(gw: Gateway, timeout_s: float) -> int:
    """The gateway's exit status, once it has exited (within ``timeout_s`` seconds)."""
    return int(await asyncio.to_thread(gw.proc.popen.wait, timeout_s))


async def test_sigterm_drains_in_flight_requests_and_refuses_new_ones(
    tmp_path: Path, redis_proc: RedisServer, ledger: Ledger
) -> None:
    with emulators("a") as (a,):
        config = gateway_config(
            free_port(), {"a": a.url}, redis_proc.url, server={"shutdown_grace_s": GRACE_S}
        )
        async with gateway(tmp_path, config) as gw:
            calls: list[Call] = []
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
                started = [asyncio.Event() for _ in range(4)]
                streams = [
                    asyncio.create_task(
                        call(session, gw.url, max_tokens=STREAM_TOKENS, stream=True, started=e, calls=calls)
                    )
                    for e in started
                ]
                plain = [
                    asyncio.create_task(
                        call(session, gw.url, max_tokens=STREAM_TOKENS, stream=False, calls=calls)
                    )
                    for _ in range(2)
                ]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
                gw.signal(signal.SIGTERM)
                await _listener_closed(config["server"]["port"])
                # New connections after the signal: refused (the listener is closed).
                async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as fresh:
                    late = [await call(fresh, gw.url, max_tokens=8, stream=False) for _ in range(3)]
                finished = await asyncio.gather(*streams, *plain)
            code = await _exit_code(gw, GRACE_S + 30)

            assert code == 0, gw.log()
            for c in late:
                assert c.status is None, c  # no answer at all
                assert c.exception == "ClientConnectorError", c
            for c in finished:
                assert c.status == 200, c
                assert c.error is None
                assert c.usage == (PROMPT_TOKENS, STREAM_TOKENS)
                assert c.done or not c.stream
            state = await ledger.settled(timeout_s=1.0)  # the gateway is gone: nothing is pending
            expected = total_charge(calls)
            assert abs(state.charged - expected) <= LEDGER_TOLERANCE, (state, expected)
            assert "Traceback" not in gw.log()


async def _cut_by_the_end_of_the_grace(
    tmp_path: Path, redis_proc: RedisServer, grace_s: float
) -> tuple[list[Call], Gateway, float]:
    """Two ~30 s streams, then SIGTERM; returns what their clients saw, the gateway, and the
    seconds from the signal to the end of the last stream."""
    with emulators("a") as (a,):
        config = gateway_config(
            free_port(), {"a": a.url}, redis_proc.url, server={"shutdown_grace_s": grace_s}
        )
        async with gateway(tmp_path, config) as gw:
            calls: list[Call] = []
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
                started = [asyncio.Event() for _ in range(2)]
                streams = [
                    asyncio.create_task(
                        call(session, gw.url, max_tokens=4000, stream=True, started=e, calls=calls)
                    )
                    for e in started
                ]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
                gw.signal(signal.SIGTERM)
                signalled = time.monotonic()
                await asyncio.gather(*streams)
                cut_after_s = time.monotonic() - signalled
            assert await _exit_code(gw, 30) == 0, gw.log()
            return calls, gw, cut_after_s


async def test_stream_still_running_when_the_grace_ends_is_cut_and_settled(
    tmp_path: Path, redis_proc: RedisServer, ledger: Ledger
) -> None:
    cut, gw, _ = await _cut_by_the_end_of_the_grace(tmp_path, redis_proc, grace_s=1.0)
    for c in cut:
        assert c.status == 200
        assert not c.done  # never a fake [DONE]
        assert c.tokens >= 3
    state = await ledger.settled(timeout_s=1.0)
    expected = total_charge(cut)  # the prompt + what each one streamed
    assert abs(state.charged - expected) <= LEDGER_TOLERANCE, (state, expected)
    assert "Traceback" not in gw.log()


async def test_stream_cut_by_the_end_of_the_grace_gets_an_error_event_in_time(
    tmp_path: Path, redis_proc: RedisServer
) -> None:
    grace_s = 3.0
    cut, _, cut_after_s = await _cut_by_the_end_of_the_grace(tmp_path, redis_proc, grace_s=grace_s)
    for c in cut:
        assert c.exception is None, c.exception
        assert c.error is not None
    # The gateway ends streams at grace_s - min(1 s, grace_s / 5) (gateway.app, 2.4 s here), so
    # they end within the grace; 2 s more (stretched by the host-speed factor) is slack for a
    # loaded machine: 5 s in all on an idle one.
    assert cut_after_s < grace_s + speed.scaled(2.0), cut_after_s


async def test_drain_turns_readyz_and_new_requests_503_before_the_listener_closes(
    tmp_path: Path, redis_proc: RedisServer, ledger: Ledger
) -> None:
    drain_s = 4.0
    with emulators("a") as (a,):
        config = gateway_config(
            free_port(),
            {"a": a.url},
            redis_proc.url,
            server={"shutdown_grace_s": GRACE_S, "drain_s": drain_s},
        )
        async with gateway(tmp_path, config) as gw:
            calls: list[Call] = []
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
                started = asyncio.Event()
                stream = asyncio.create_task(
                    call(session, gw.url, max_tokens=STREAM_TOKENS, stream=True, started=started, calls=calls)
                )
                await asyncio.wait_for(started.wait(), 30)
                gw.signal(signal.SIGTERM)
                signalled = time.monotonic()
                ready = None
                while time.monotonic() - signalled < drain_s / 2:  # the drain has begun
                    async with session.get(gw.url + "/readyz") as resp:
                        ready = resp.status, (await resp.json())["draining"]
                    if ready == (503, True):
                        break
                    await asyncio.sleep(0.05)
                refused = await call(session, gw.url, max_tokens=8, stream=False, calls=calls)
                still_open = time.monotonic() - signalled < drain_s
                finished = await stream
            code = await _exit_code(gw, drain_s + GRACE_S + 30)

            assert code == 0, gw.log()
            assert ready == (503, True)
            assert still_open, "the refused request was answered while the listener still accepted"
            assert refused.status == 503, refused
            assert refused.error is not None
            assert refused.error["code"] == "server_shutting_down"
            assert int(refused.headers["retry-after"]) >= 1
            assert (finished.status, finished.error, finished.done) == (200, None, True)
            assert finished.usage == (PROMPT_TOKENS, STREAM_TOKENS)
            state = await ledger.settled(timeout_s=1.0)
            expected = total_charge(calls)
            assert abs(state.charged - expected) <= LEDGER_TOLERANCE, (state, expected)
            assert "Traceback" not in gw.log()
