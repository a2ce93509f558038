"""Thirty ``openai`` SDK clients against a tenant allowed four requests at a time: the 429s spread them.

Real processes: an emulated vLLM replica (its hardware configured, so admission forecasts each
stream) and ``sluice serve`` (a tenant with ``max_concurrent: 4`` and no other budget). Thirty
``openai.AsyncOpenAI`` clients, default retries (the SDK sends a request up to three times,
waiting what ``retry-after-ms`` says), each stream one completion at the same instant. Four are
served at once; every concurrency 429 says when the tenant's earliest running stream is
predicted to end, jittered, so the refused clients come back spread over a window instead of
together.

What must hold: every client is served or raises ``openai.RateLimitError`` whose message names
the concurrency limit; the refusals' ``retry-after-ms`` are not all equal and cover a window at
least a fifth as wide as the smallest of them; the first four are served. How many were served
in all is printed (``-s``). No wall-clock bound but the test's own timeout (scaled to the host).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.integration.tenancy.fleet import KEY, PROMPT_TOKENS, emulator, gateway_config, gateways, model_of
from tests.support.procs import free_port
from tests.support.speed import scaled

pytestmark = pytest.mark.timeout(scaled(240))

#: Clients, and the tenant's concurrency limit.
CLIENTS = 30
MAX_CONCURRENT = 4
#: What the emulated replica is (its profile ``llama3-8b-h100``), for the forecast's prior.
HARDWARE = {"gpu": "H100-SXM", "model": "Llama-3-8B", "max_num_seqs": 1024, "max_num_batched_tokens": 8192}
#: Output of each stream, tokens: long enough that a stream outlives a burst of refusals.
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def replica() -> Iterator[str]:
    with emulator(seed=11) as url:
        yield url


@dataclass
class Seen:
    """What the clients saw: the ``retry-after-ms`` of every 429 (each try, retries included) and
    how each client ended (``served`` or the error's class and code)."""

    retry_after_ms: list[int] = field(default_factory=list)
    endings: Counter[str] = field(default_factory=Counter)
    messages: list[str] = field(default_factory=list)
    tokens: int = 0


async def _client(url: str, model: str, start: asyncio.Event, seen: Seen) -> None:
    async def on_response(response: Any) -> None:  # the SDK's HTTP client's response
        if response.status_code == 429:
            seen.retry_after_ms.append(int(response.headers["retry-after-ms"]))

    http = openai.DefaultAsyncHttpxClient(event_hooks={"response": [on_response]})
    sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, http_client=http)
    try:
        await start.wait()
        stream = await sdk.completions.create(
            model=model, prompt=[11] * PROMPT_TOKENS, max_tokens=MAX_TOKENS, stream=True
        )
        async for chunk in stream:
            seen.tokens += sum(1 for c in chunk.choices if c.text)
        seen.endings["served"] += 1
    except openai.RateLimitError as exc:
        seen.endings[f"RateLimitError {exc.code}"] += 1
        seen.messages.append(exc.message)
    finally:
        await sdk.close()


async def test_thirty_sdk_clients_against_four_slots_come_back_spread(tmp_path: Path, replica: str) -> None:
    config = gateway_config(
        replica, free_port(), limits={"backend": "memory"}, tenant_limits={"max_concurrent": MAX_CONCURRENT}
    )
    # The emulated profile's hardware: admission forecasts each stream from the first request on.
    config["replicas"][0]["hardware"] = HARDWARE
    seen = Seen()
    with gateways(tmp_path, [config]) as (gateway,):
        model = await model_of(gateway.url)
        start = asyncio.Event()
        clients = [asyncio.create_task(_client(gateway.url, model, start, seen)) for _ in range(CLIENTS)]
        await asyncio.sleep(0)
        start.set()
        await asyncio.gather(*clients)
        assert gateway.alive()

    served = seen.endings["served"]
    waits = sorted(seen.retry_after_ms)
    print(
        f"\n{CLIENTS} clients, max_concurrent {MAX_CONCURRENT}: served {served}, "
        f"refused {CLIENTS - served}; {len(waits)} 429s, retry-after-ms "
        f"min {waits[0] if waits else None} max {waits[-1] if waits else None} "
        f"distinct {len(set(waits))}; endings {dict(seen.endings)}; waits {waits}"
    )
    # Every client is served, or told why it was not: the concurrency limit, by name.
    assert set(seen.endings) <= {"served", "RateLimitError rate_limit_exceeded"}, seen.endings
    assert sum(seen.endings.values()) == CLIENTS
    for message in seen.messages:
        assert f"concurrent requests: Limit {MAX_CONCURRENT}" in message, message
    # The first four at least (how many retries find a freed slot depends on how fast the host
    # runs the streams: printed, not bounded).
    assert served >= MAX_CONCURRENT, seen.endings
    assert seen.tokens > 0
    # The refusals spread the clients: not one wait for all, and a window that is no rounding.
    assert len(waits) >= CLIENTS - MAX_CONCURRENT
    assert len(set(waits)) > len(waits) // 2, waits
    assert waits[-1] - waits[0] >= 0.2 * waits[0], waits
