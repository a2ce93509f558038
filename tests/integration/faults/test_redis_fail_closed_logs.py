"""Redis stopped under ``fail_closed``: the log stays readable and service returns promptly.

A real ``sluice serve`` (``logging.repeat_window_s: 1``) in front of an emulator, with the test's
own ``redis-server``, killed, then restarted on its port:

* hundreds of 503s write one ``request ... failed: 503 rate_limit_unavailable`` line, then one
  line per window counting the rest (``and N more like it in the last 1 s``): the first line
  plus the counts is exactly the number of 503s the clients got;
* with no traffic during the outage, the first request after Redis answers again is served
  within a second (scaled for a slow machine): the gateway's background PING found it.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import aiohttp
import pytest

from tests.integration.faults.rig import call, emulators, gateway, gateway_config
from tests.support.procs import free_port
from tests.support.redis import RedisServer
from tests.support.speed import scaled

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

#: One log line about the 503s, with its count of more like it when it is the window's summary.
FAILED = re.compile(
    r"request \S+ failed: 503 rate_limit_unavailable: [^\n]*?"
    r"(?: \(and (\d+) more like it in the last [^)\n]*\))?$",
    re.MULTILINE,
)
REFUSALS = 300


def _reported_503s(log: str) -> tuple[int, int]:
    """(lines logged for the 503s, 503s they account for: a plain line one, a summary its count)."""
    lines = FAILED.findall(log)
    return len(lines), sum(int(count) if count else 1 for count in lines)


async def test_a_503_flood_logs_two_lines_and_service_returns_within_a_second(
    tmp_path: Path, redis_proc: RedisServer
) -> None:
    with emulators("a") as (a,):
        config = gateway_config(
            free_port(),
            {"a": a.url},
            redis_proc.url,
            limits={"redis": {"url": redis_proc.url, "timeout_s": 0.2}},
        )
        config["logging"]["repeat_window_s"] = 1.0
        async with gateway(tmp_path, config) as gw, aiohttp.ClientSession() as session:
            assert (await call(session, gw.url, max_tokens=2, stream=False)).status == 200
            await asyncio.to_thread(redis_proc.kill)
            statuses: list[int | None] = []
            for _ in range(REFUSALS // 10):
                batch = await asyncio.gather(
                    *(call(session, gw.url, max_tokens=2, stream=False) for _ in range(10))
                )
                statuses.extend(c.status for c in batch)
            assert statuses == [503] * REFUSALS

            # The window closes on the gateway's timer: the count comes without more traffic.
            for _ in range(int(scaled(100.0))):  # 10 s at most, scaled
                if _reported_503s(gw.log())[1] >= REFUSALS:
                    break
                await asyncio.sleep(0.1)
            lines, reported = _reported_503s(gw.log())
            assert reported == REFUSALS, gw.log()[-3000:]
            assert lines <= 2 + int(scaled(10.0)), "one line, then one per window of the flood"

            await asyncio.sleep(1.0)  # down a while, no traffic: only the probe asks Redis
            await asyncio.to_thread(redis_proc.start)  # returns once it answers PING
            answered_at = time.monotonic()
            while (await call(session, gw.url, max_tokens=2, stream=False)).status != 200:
                assert time.monotonic() - answered_at < scaled(1.0), "not served within 1 s of Redis"
            log = gw.log()
            assert "rate-limit storage redis unavailable" in log
            assert "rate-limit storage redis available again" in log
            assert "Traceback" not in log
