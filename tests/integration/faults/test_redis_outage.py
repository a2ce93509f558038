"""Redis killed and restarted under load: what ``tests/integration/tenancy/test_redis_failure.py``
does not check yet.

That test already shows, for a real ``sluice serve`` and the test's own ``redis-server``: under
``fail_open`` every request is answered 200 through the outage, one log line per transition, not
degraded at the end; under ``fail_closed`` 503 ``rate_limit_unavailable`` only after the kill and
200 again after the restart, with no gateway restart. This file adds, for both policies:

* streams admitted before the kill are not cut by it: they finish with ``[DONE]`` and usage;
* ``fail_closed``'s 503 is OpenAI's whole error body (type ``service_unavailable_error``) with
  ``Retry-After`` and ``retry-after-ms`` = ``limits.retry_backoff_s``;
* after the recovery the restarted Redis keeps the books exactly: a batch of streamed and plain
  requests moves the tenant's bucket by exactly its usage, every lease is released, and
  ``sluice_tenant_tokens_settled_total`` moves by the same amount (each settle counted once).
"""

from __future__ import annotations

import asyncio
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
    assert_openai_error,
    call,
    emulators,
    gateway,
    gateway_config,
    settled_metric,
    total_charge,
)
from tests.support.procs import free_port
from tests.support.redis import RedisServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

#: ~3 s of decoding: the streams span the whole outage.
STREAM_TOKENS = 400
BACKOFF_S = 0.2


async def _recovered(gw: Gateway, session: aiohttp.ClientSession, timeout_s: float = 20.0) -> None:
    """Send requests until one is answered 200 with Redis marked up again (the probe succeeded)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        answer = await call(session, gw.url, max_tokens=4, stream=False)
        if answer.status == 200 and (await gw.metrics())["sluice_redis_degraded"] == 0.0:
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"the gateway did not recover from the Redis outage:\n{gw.log()[-3000:]}")


async def _quiet_settled_metric(gw: Gateway) -> float:
    """The tenant's settled-tokens counter once it has stopped moving (three equal reads)."""
    reads = [await settled_metric(gw)]
    while len(reads) < 3 or len(set(reads[-3:])) > 1:
        await asyncio.sleep(0.2)
        reads.append(await settled_metric(gw))
        assert len(reads) < 100, reads
    return reads[-1]


@pytest.mark.parametrize("mode", ["fail_open", "fail_closed"])
async def test_redis_outage_spares_streams_in_flight_and_the_books_recover(
    tmp_path: Path, redis_proc: RedisServer, ledger: Ledger, mode: str
) -> None:
    limits = {
        "redis": {"url": redis_proc.url, "timeout_s": 0.2},
        "on_storage_error": mode,
        "retry_backoff_s": BACKOFF_S,
    }
    with emulators("a") as (a,):
        config = gateway_config(free_port(), {"a": a.url}, redis_proc.url, limits=limits)
        async with gateway(tmp_path, config) as gw:
            batch: list[Call] = []
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
                started = [asyncio.Event() for _ in range(4)]
                streams = [
                    asyncio.create_task(
                        call(session, gw.url, max_tokens=STREAM_TOKENS, stream=True, started=e)
                    )
                    for e in started
                ]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
                await asyncio.to_thread(redis_proc.kill)
                during = await asyncio.gather(
                    *(call(session, gw.url, max_tokens=8, stream=False) for _ in range(6))
                )
                await asyncio.to_thread(redis_proc.start)  # same port, empty
                through = await asyncio.gather(*streams)
                await _recovered(gw, session)

                base, base_metric = await ledger.settled(), await _quiet_settled_metric(gw)
                await asyncio.gather(
                    *(call(session, gw.url, max_tokens=24, stream=i % 2 == 0, calls=batch) for i in range(8))
                )
            state = await ledger.settled()
            metric = await settled_metric(gw, base_metric + total_charge(batch))

            for c in through:  # admitted before the kill: the outage does not touch them
                assert c.done, c
                assert c.error is None
                assert c.usage == (PROMPT_TOKENS, STREAM_TOKENS)
            if mode == "fail_open":
                assert [c.status for c in during] == [200] * len(during)
            else:
                for c in during:
                    assert c.status == 503, c
                    error = assert_openai_error(c.error, "rate_limit_unavailable")
                    assert error["type"] == "service_unavailable_error"
                    assert c.headers["retry-after"] == "1"  # whole seconds, rounded up
                    assert c.headers["retry-after-ms"] == str(round(BACKOFF_S * 1000))
            assert [c.status for c in batch] == [200] * len(batch)
            expected = total_charge(batch)
            assert abs((state.charged - base.charged) - expected) <= LEDGER_TOLERANCE, (base, state, expected)
            assert abs((metric - base_metric) - expected) <= LEDGER_TOLERANCE
            log = gw.log()
            assert "rate-limit storage redis unavailable" in log
            assert "rate-limit storage redis available again" in log
            assert "Traceback" not in log
