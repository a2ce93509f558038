"""A configuration reload with an invalid file, under load (file watch and SIGHUP).

What Sluice promises (``docs/operations.md``, "A bad configuration is deployed"): no request
fails, the running configuration stays (here: the invalid file would also have sent traffic to a
dead replica, and it does not), each rejected attempt is logged with every problem and counted
(``sluice_config_reloads_total{result="failure"}``, ``sluice_config_last_reload_successful`` 0),
and the next valid file is applied without a restart.
"""

from __future__ import annotations

import asyncio
import copy
import signal
import time
from pathlib import Path

import aiohttp
import pytest
import yaml

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
    settled_metric,
    total_charge,
)
from tests.support.procs import free_port
from tests.support.redis import RedisServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

FAILED = 'sluice_config_reloads_total{result="failure"}'
SUCCEEDED = 'sluice_config_reloads_total{result="success"}'
LAST_OK = "sluice_config_last_reload_successful"
REJECTED = "config reload rejected, keeping the running configuration"


async def _until(gw: Gateway, name: str, at_least: float, timeout_s: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        metrics = await gw.metrics()
        if metrics.get(name, 0.0) >= at_least:
            return metrics
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{name} never reached {at_least}:\n{gw.log()[-3000:]}")


async def _load(session: aiohttp.ClientSession, url: str, calls: list[Call], stop: asyncio.Event) -> None:
    """One client: a stream, then a plain request, and again, until ``stop`` is set."""
    i = 0
    while not stop.is_set():
        await call(session, url, max_tokens=24, stream=i % 2 == 0, calls=calls)
        i += 1


async def test_invalid_reload_under_load_keeps_the_running_config(
    tmp_path: Path, redis_proc: RedisServer, ledger: Ledger
) -> None:
    with emulators("a") as (a,):
        config = gateway_config(
            free_port(), {"a": a.url}, redis_proc.url, reload={"watch": True, "poll_interval_s": 0.2}
        )
        # Each rejection's line is asserted below: none counted into a repeat summary.
        config["logging"]["repeat_window_s"] = 0
        async with gateway(tmp_path, config) as gw:
            invalid = copy.deepcopy(config)
            invalid["replicas"][0]["url"] = f"http://127.0.0.1:{free_port()}"  # nothing listens there
            invalid["server"]["no_such_key"] = 1
            invalid["health"]["interval_s"] = -1
            valid = copy.deepcopy(config)
            # A longer interval: valid whatever the rig's host-scaled timeout (<= the interval).
            valid["health"]["interval_s"] = round(config["health"]["interval_s"] + 0.1, 3)

            calls: list[Call] = []
            stop = asyncio.Event()
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
                clients = [asyncio.create_task(_load(session, gw.url, calls, stop)) for _ in range(4)]
                await asyncio.sleep(1.0)
                gw.write_config(yaml.safe_dump(invalid))  # the file watch finds it
                await _until(gw, FAILED, 1)
                gw.signal(signal.SIGHUP)  # and a SIGHUP reloads the same invalid file again
                rejected = await _until(gw, FAILED, 2)
                await asyncio.sleep(1.0)  # traffic goes on under the kept configuration
                states = await gw.replica_states()
                gw.write_config(yaml.safe_dump(valid))
                accepted = await _until(gw, SUCCEEDED, 1)
                await asyncio.sleep(0.5)
                stop.set()
                await asyncio.gather(*clients)

            assert len(calls) >= 20, "too little load to say anything"
            assert all(c.status == 200 for c in calls), {c.status for c in calls}
            assert all(c.replica == "a" for c in calls)
            assert all(c.usage == (PROMPT_TOKENS, 24) for c in calls)
            assert rejected[LAST_OK] == 0.0
            assert rejected.get(SUCCEEDED, 0.0) == 0.0
            assert states == {"a": "healthy"}  # the dead replica of the invalid file never came in
            assert accepted[LAST_OK] == 1.0
            log = gw.log()
            assert log.count(REJECTED) == 2
            assert "no_such_key" in log  # every problem is named
            assert "health.interval_s" in log
            assert "changed sections: health" in log
            assert "Traceback" not in log

            state = await ledger.settled()
            expected = total_charge(calls)
            assert abs(state.charged - expected) <= LEDGER_TOLERANCE, (state, expected)
            assert abs(await settled_metric(gw, expected) - expected) <= LEDGER_TOLERANCE
