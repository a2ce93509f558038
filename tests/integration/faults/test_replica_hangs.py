"""A replica that hangs: it accepts connections and never answers, or stops halfway through a stream.

A real emulator cannot be made to hang on cue, so these tests put ``rig.FaultyFront`` (a
deliberate fake: a pass-through proxy in the test process) in front of a real one and switch it
to the fault once the gateway has seen the replica healthy.

What Sluice promises (``docs/operations.md``, "A replica hangs"): after
``server.upstream_read_timeout_s`` of silence the request fails cleanly (502 ``upstream_error``
before the headers, an SSE error event after them), the charge is the prompt plus what was
streamed, and a replica whose ``/health`` hangs too leaves the rotation after
``health.unhealthy_after`` failed checks, so requests stop piling up on it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from tests.integration.faults.rig import (
    LEDGER_TOLERANCE,
    Call,
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

#: server.upstream_read_timeout_s in these tests: short, so a hang costs seconds, not minutes.
READ_TIMEOUT_S = 2.0


async def test_hung_replica_times_out_and_leaves_the_rotation(
    tmp_path: Path, redis_proc: RedisServer, ledger: Ledger
) -> None:
    with emulators("good", "behind") as (good, behind):
        async with faulty_front(behind.url) as front:
            replicas = {"good": good.url, "stuck": front.url}
            config = gateway_config(
                free_port(), replicas, redis_proc.url, server={"upstream_read_timeout_s": READ_TIMEOUT_S}
            )
            async with gateway(tmp_path, config) as gw:
                await gw.wait_state("stuck", "healthy")
                calls: list[Call] = []
                front.health = front.completions = "hang"
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
                    first = await asyncio.gather(
                        *(
                            call(session, gw.url, max_tokens=16, stream=i % 2 == 0, calls=calls)
                            for i in range(12)
                        )
                    )
                    await gw.wait_state("stuck", "unhealthy", timeout_s=20)
                    reached = front.completion_requests
                    later = await asyncio.gather(
                        *(
                            call(session, gw.url, max_tokens=16, stream=i % 2 == 0, calls=calls)
                            for i in range(12)
                        )
                    )

                # The hung replica got some of the first burst; each of those timed out cleanly.
                assert reached >= 1, "no request reached the hung replica: nothing was tested"
                timed_out = [c for c in first if c.status == 502]
                assert len(timed_out) == reached, [(c.status, c.replica) for c in first]
                for c in timed_out:
                    error = assert_openai_error(c.error, "upstream_error")
                    assert "timed out" in error["message"]
                assert all(c.status == 200 and c.replica == "good" for c in first if c.status != 502)
                # Once its health checks time out it is out of the rotation: nothing more piles up.
                assert [(c.status, c.replica) for c in later] == [(200, "good")] * len(later)
                assert front.completion_requests == reached

                state = await ledger.settled()
                expected = total_charge(calls)
                assert abs(state.charged - expected) <= LEDGER_TOLERANCE, (state, expected)
                assert abs(await settled_metric(gw, expected) - expected) <= LEDGER_TOLERANCE
                assert "Traceback" not in gw.log()


async def test_stream_that_stalls_ends_with_an_error_event_after_the_read_timeout(
    tmp_path: Path, redis_proc: RedisServer, ledger: Ledger
) -> None:
    with emulators("behind") as (behind,):
        async with faulty_front(behind.url) as front:
            config = gateway_config(
                free_port(),
                {"stalls": front.url},
                redis_proc.url,
                server={"upstream_read_timeout_s": READ_TIMEOUT_S},
                # Not about ejection (the next test is): a request that reaches the gateway late on
                # a loaded machine must still find the replica in the rotation.
                health={"eject_after_timeouts": 100},
            )
            async with gateway(tmp_path, config) as gw:
                front.completions, front.after_events = "stall", 3
                calls: list[Call] = []
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
                    stalled = await asyncio.gather(
                        *(call(session, gw.url, max_tokens=200, stream=True, calls=calls) for _ in range(3))
                    )
                for c in stalled:
                    assert c.status == 200
                    assert c.cut, c  # an error event, never [DONE]
                    error = assert_openai_error(c.error, "upstream_error")
                    assert "timed out mid-stream" in error["message"]
                    assert c.tokens == 3
                    assert c.events_after_error == 0
                    assert c.exception is None

                # Every reservation is settled to what it cost: the prompt plus the 3 tokens each
                # stream relayed, in Redis (one atomic snapshot, ``Ledger.read``) and in the
                # gateway's settled-tokens counter.
                state = await ledger.settled()
                expected = total_charge(calls)
                assert abs(state.charged - expected) <= LEDGER_TOLERANCE, (state, expected)
                assert abs(await settled_metric(gw, expected) - expected) <= LEDGER_TOLERANCE
                assert "Traceback" not in gw.log()


async def test_replica_that_stalls_every_stream_leaves_the_rotation(
    tmp_path: Path, redis_proc: RedisServer
) -> None:
    with emulators("good", "behind") as (good, behind):
        async with faulty_front(behind.url) as front:
            replicas = {"good": good.url, "stalls": front.url}
            config = gateway_config(
                free_port(),
                replicas,
                redis_proc.url,
                server={"upstream_read_timeout_s": READ_TIMEOUT_S},
                # Three good checks to come back: a replica taken out stays out for about a second.
                health={"unhealthy_after": 2, "healthy_after": 3},
            )
            async with gateway(tmp_path, config) as gw:
                await gw.wait_state("stalls", "healthy")
                front.completions, front.after_events = "stall", 1
                stalled = 0
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
                    for _ in range(6):  # until unhealthy_after streams timed out on it
                        burst = await asyncio.gather(
                            *(call(session, gw.url, max_tokens=32, stream=True) for _ in range(4))
                        )
                        stalled += sum(c.cut for c in burst)
                        if stalled >= 2:
                            break
                    state = (await gw.replica_states())["stalls"]
                assert stalled >= 2, "the stalling replica got too few requests: nothing was tested"
                # Wanted: like a refused connection, each timeout counts as a failed check.
                assert state != "healthy", "the replica whose streams all timed out is still in the rotation"
