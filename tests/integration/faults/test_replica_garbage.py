"""A replica that answers garbage: unparsable ``/metrics``, a non-JSON body, a stream cut short.

A real emulator never does any of it, so ``rig.FaultyFront`` (a deliberate fake: a pass-through
proxy in the test process in front of a real emulator) injects each fault.

What Sluice promises (``docs/operations.md``, "A replica answers garbage"): garbage metrics make
the replica's snapshot stale (``sluice_replica_metrics_stale`` 1, one warning line) and the
gateway keeps serving through it; a stream that ends without ``[DONE]`` or whose connection
drops ends with one SSE error event (``upstream_error``); never a 500, never a traceback.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import openai
import pytest

from tests.integration.faults.rig import (
    KEY,
    LEDGER_TOLERANCE,
    MODEL,
    PROMPT_TOKENS,
    Call,
    Gateway,
    Ledger,
    assert_openai_error,
    call,
    emulators,
    faulty_front,
    gateway,
    gateway_config,
    settled_metric,
    total_charge,
)
from tests.support.procs import free_port
from tests.support.redis import RedisServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

STALE = 'sluice_replica_metrics_stale{replica="junk"}'


async def _wait_metric(gw: Gateway, name: str, value: float, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (await gw.metrics()).get(name) == value:
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{name} never became {value}")


async def _sdk_stream(base_url: str) -> tuple[int, openai.APIError | None]:
    """A stream through the real openai SDK: chunks received, and the error it raised (if any)."""
    received = 0
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=KEY, max_retries=0) as client:
        try:
            stream = await client.completions.create(
                model=MODEL,
                prompt=[11] * PROMPT_TOKENS,
                max_tokens=64,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            async for _ in stream:
                received += 1
        except openai.APIError as err:
            return received, err
    return received, None


async def test_garbage_metrics_mark_the_replica_stale_and_requests_still_flow(
    tmp_path: Path, redis_proc: RedisServer, ledger: Ledger
) -> None:
    with emulators("behind") as (behind,):
        async with faulty_front(behind.url) as front:
            config = gateway_config(free_port(), {"junk": front.url}, redis_proc.url)
            async with gateway(tmp_path, config) as gw:
                await _wait_metric(gw, STALE, 0.0)
                front.metrics = "garbage"
                await _wait_metric(gw, STALE, 1.0)
                calls: list[Call] = []
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
                    answered = await asyncio.gather(
                        *(
                            call(session, gw.url, max_tokens=24, stream=i % 2 == 0, calls=calls)
                            for i in range(8)
                        )
                    )
                for c in answered:
                    assert c.status == 200, c
                    assert c.usage == (PROMPT_TOKENS, 24)
                    assert c.error is None
                metrics = await gw.metrics()
                assert metrics[STALE] == 1.0
                assert metrics['sluice_replica_scrapes_total{replica="junk",result="stale"}'] >= 1
                log = gw.log()
                assert "metrics of replica junk are stale" in log
                assert "Traceback" not in log

                state = await ledger.settled()
                expected = total_charge(calls)
                assert abs(state.charged - expected) <= LEDGER_TOLERANCE, (state, expected)
                assert abs(await settled_metric(gw, expected) - expected) <= LEDGER_TOLERANCE


@pytest.mark.parametrize(
    ("mode", "message"),
    [("truncate", "ended the stream before [DONE]"), ("drop", "failed mid-stream")],
)
async def test_stream_cut_short_by_the_replica_ends_with_an_error_event(
    tmp_path: Path, redis_proc: RedisServer, ledger: Ledger, mode: str, message: str
) -> None:
    with emulators("behind") as (behind,):
        async with faulty_front(behind.url) as front:
            # A dropped connection counts as a failed check; keep the only replica in the rotation.
            config = gateway_config(
                free_port(), {"junk": front.url}, redis_proc.url, health={"unhealthy_after": 100}
            )
            async with gateway(tmp_path, config) as gw:
                front.completions, front.after_events = mode, 5
                calls: list[Call] = []
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
                    cut = await asyncio.gather(
                        *(call(session, gw.url, max_tokens=64, stream=True, calls=calls) for _ in range(3))
                    )
                for c in cut:
                    assert c.status == 200
                    assert c.cut, c  # an error event, never [DONE]
                    error = assert_openai_error(c.error, "upstream_error")
                    assert message in error["message"]
                    assert c.tokens == 5
                    assert c.events_after_error == 0
                    assert c.exception is None
                # The openai SDK raises APIError with the event's body (not a connection error).
                received, raised = await _sdk_stream(gw.url)
                assert received == 5
                assert isinstance(raised, openai.APIError)
                assert not isinstance(raised, openai.APIConnectionError)
                assert raised.code == "upstream_error"
                calls.append(Call(stream=True, status=200, tokens=received, error={"code": raised.code}))
                assert "Traceback" not in gw.log()

                state = await ledger.settled()
                expected = total_charge(calls)  # prompt + the 5 tokens each one streamed
                assert abs(state.charged - expected) <= LEDGER_TOLERANCE, (state, expected)
                assert abs(await settled_metric(gw, expected) - expected) <= LEDGER_TOLERANCE


async def test_non_json_answer_is_a_502(tmp_path: Path, redis_proc: RedisServer) -> None:
    with emulators("behind") as (behind,):
        async with faulty_front(behind.url) as front:
            config = gateway_config(free_port(), {"junk": front.url}, redis_proc.url)
            async with gateway(tmp_path, config) as gw:
                front.completions = "non_json"
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
                    answer = await call(session, gw.url, max_tokens=8, stream=False)
                assert "Traceback" not in gw.log()
                assert answer.status == 502, (answer.status, answer.raw_body[:200])
                assert_openai_error(answer.error, "upstream_error")
