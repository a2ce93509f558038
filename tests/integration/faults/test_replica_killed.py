"""A replica killed mid-stream (SIGKILL of its emulator while streams are open).

What Sluice promises (``docs/operations.md``, "A replica dies"): the clients of the killed
replica get one SSE error event (``upstream_error``) and the connection closes, never a fake
``[DONE]``; the streams on the other replica finish untouched; the cut streams are charged the
prompt plus the tokens they streamed; new traffic goes to the surviving replica; the killed one
is taken back once it answers its health checks again on the same port, without a gateway
restart. Real processes only: two emulators, ``redis-server``, ``sluice serve``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from tests.integration.faults.rig import (
    LEDGER_TOLERANCE,
    PROMPT_TOKENS,
    Call,
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

#: Long enough (~5 s of decoding each) that every stream is still running when the kill comes.
STREAM_TOKENS = 600
STREAMS = 8


async def test_killed_replica_cuts_its_streams_cleanly_and_comes_back(
    tmp_path: Path, redis_proc: RedisServer, ledger: Ledger
) -> None:
    with emulators("a", "b") as (a, b):
        config = gateway_config(free_port(), {"a": a.url, "b": b.url}, redis_proc.url)
        async with gateway(tmp_path, config) as gw:
            calls: list[Call] = []
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=90)) as session:
                started = [asyncio.Event() for _ in range(STREAMS)]
                streams = [
                    asyncio.create_task(
                        call(session, gw.url, max_tokens=STREAM_TOKENS, stream=True, started=e, calls=calls)
                    )
                    for e in started
                ]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
                placed = {c.replica for c in calls}
                assert placed == {"a", "b"}, f"admission put the streams on {placed}; the test needs both"
                await asyncio.to_thread(a.kill)
                await asyncio.gather(*streams)

                on_a = [c for c in calls if c.replica == "a"]
                on_b = [c for c in calls if c.replica == "b"]
                for cut in on_a:
                    assert cut.status == 200
                    assert cut.cut, cut  # an error event, and no [DONE]
                    assert_openai_error(cut.error, "upstream_error")
                    assert cut.events_after_error == 0  # the error event is the last one
                    assert cut.exception is None, cut.exception  # and the body ends cleanly
                    assert cut.tokens >= 3
                for whole in on_b:
                    assert whole.done, whole
                    assert whole.error is None
                    assert whole.usage == (PROMPT_TOKENS, STREAM_TOKENS)

                # The proxy's connection errors count as failed checks: "a" leaves the rotation.
                await gw.wait_state("a", "unhealthy", timeout_s=20)
                after = await asyncio.gather(
                    *(call(session, gw.url, max_tokens=8, stream=False, calls=calls) for _ in range(6))
                )
                assert [(c.status, c.replica) for c in after] == [(200, "b")] * 6

                # Restarted on the same port: its health checks pass and it is routed to again.
                await asyncio.to_thread(a.start)
                await gw.wait_state("a", "healthy", timeout_s=30)
                back = False
                for _ in range(10):
                    burst = await asyncio.gather(
                        *(call(session, gw.url, max_tokens=32, stream=True, calls=calls) for _ in range(4))
                    )
                    assert all(c.done for c in burst), burst
                    if any(c.replica == "a" for c in burst):
                        back = True
                        break
                assert back, "the restarted replica never got a request"

            # Every reservation settled exactly once, to what the clients saw.
            state = await ledger.settled()
            expected = total_charge(calls)
            assert abs(state.charged - expected) <= LEDGER_TOLERANCE, (state, expected)
            assert abs(await settled_metric(gw, expected) - expected) <= LEDGER_TOLERANCE
            log = gw.log()
            assert "Traceback" not in log
            assert "replica a failed mid-stream" in log
