"""Real ``openai`` SDK clients that get a 429 come back after its Retry-After, and then succeed.

The gateway runs in this process (so its outcomes can be read), in front of one emulated replica
that takes 4 sequences at a time (its own process). Four long streams fill the replica; then
``CLIENTS`` SDK clients (``openai.AsyncOpenAI``, default ``max_retries`` 2) ask for a short
completion in a class whose TTFT target cannot be met while the replica is full and that does not
queue: each is refused with a 429 ``slo_unattainable`` whose Retry-After is the forecast drain
time, jittered. The SDK waits exactly ``retry-after-ms`` and retries with the same
``x-request-id``, so the gateway's outcomes pair every retry with the rejection before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator

import aiohttp
import openai
import pytest
from aiohttp import web

from bench.admission_load import Result, chat_body, send
from gateway.app import build_app
from gateway.config.settings import Settings
from gateway.config.store import SettingsStore
from gateway.keys import OUTCOME_LISTENERS
from gateway.observability.outcome import RequestOutcome
from tests.integration.admission.conftest import MODEL, Running, gateway_config, start_emulator
from tests.support.procs import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

CLIENTS = 3
#: Tokens each of the four streams that fill the replica generates (~1.2 s at ~8 ms a token).
LONG_TOKENS = 150
ADMISSION = {
    "classes": {"interactive": {"ttft_target_s": 0.5, "tpot_target_s": 0.05, "max_queue_wait_s": 0.0}},
}


@pytest.fixture(scope="module")
def emulator() -> Iterator[Running]:
    running = start_emulator()
    try:
        yield running
    finally:
        running.proc.stop()


@contextlib.asynccontextmanager
async def gateway(replica_url: str) -> AsyncIterator[tuple[str, list[RequestOutcome]]]:
    config = gateway_config(replica_url, ADMISSION)
    config["server"]["port"] = free_port()
    settings = Settings.model_validate(config)
    app = build_app(SettingsStore(settings), spawn_emulators=False)
    outcomes: list[RequestOutcome] = []
    app[OUTCOME_LISTENERS].append(outcomes.append)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", settings.server.port)
    await site.start()
    try:
        yield f"http://127.0.0.1:{settings.server.port}", outcomes
    finally:
        await runner.cleanup()


async def _fill(session: aiohttp.ClientSession, url: str) -> list[asyncio.Task[Result]]:
    """Four long streams; returns once each has its first token (the replica is full)."""
    rng = random.Random(3)
    results = [Result("fill", time.monotonic()) for _ in range(4)]
    tasks = [
        asyncio.create_task(send(session, url, chat_body(MODEL, 50, LONG_TOKENS, rng), r)) for r in results
    ]
    deadline = time.monotonic() + 20.0
    while not all(r.first_token_at for r in results):
        assert time.monotonic() < deadline, "the long streams did not start"
        await asyncio.sleep(0.02)
    return tasks


async def _sdk_call(url: str, request_id: str) -> str:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=2, timeout=30.0)
    try:
        reply = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=8,
            extra_headers={"x-request-id": request_id},
            extra_body={"ignore_eos": True},
        )
        return reply.choices[0].message.content or ""
    finally:
        await client.close()


async def test_sdk_clients_come_back_after_retry_after_and_succeed(emulator: Running) -> None:
    ids = [f"sdk-client-{i}" for i in range(CLIENTS)]
    async with gateway(emulator.url) as (url, outcomes), aiohttp.ClientSession() as session:
        fillers = await _fill(session, url)
        answers = await asyncio.gather(*(_sdk_call(url, i) for i in ids))
        filled = await asyncio.gather(*fillers)

    assert [r.status for r in filled] == [200] * 4

    assert all(answers), answers
    attempts: dict[str, list[RequestOutcome]] = defaultdict(list)
    for outcome in outcomes:
        if outcome.request_id in ids:
            attempts[outcome.request_id].append(outcome)
    rejected_total = 0
    for request_id in ids:
        tries = sorted(attempts[request_id], key=lambda o: o.received_at)
        print(request_id, [(o.status, o.reason, o.retry_after_s) for o in tries])
        assert tries[-1].status == 200, tries
        assert all(o.status == 429 for o in tries[:-1]), tries
        for refused, retry in itertools.pairwise(tries):
            rejected_total += 1
            assert refused.retry_after_s is not None
            assert refused.finished_at is not None
            # The SDK waited the whole Retry-After (it sleeps after reading the answer, which the
            # gateway finished sending at finished_at): never earlier.
            assert retry.received_at - refused.finished_at >= refused.retry_after_s
    # Every client met a full replica first and was told when to come back.
    assert rejected_total >= CLIENTS
    delays = [o.retry_after_s for o in outcomes if o.status == 429 and o.retry_after_s is not None]
    assert len(set(delays)) == len(delays), "clients rejected together got the same delay"
