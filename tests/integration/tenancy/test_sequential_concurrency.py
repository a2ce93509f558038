"""A tenant allowed one request at a time is never refused while it waits for each answer.

``max_concurrent: 1`` and a client that sends its next request only once the previous answer has
fully arrived: the slot of the finished request must be free when the next one is reserved, or the
client gets a 429 it did nothing to earn. The settle runs after the answer was sent (it is off the
client's path), so this holds only because it reaches the limiter before the next request's
reserve can: on the in-process limiter and on Redis, whose two calls share one pipelined
connection and are answered in order. Real processes: an emulated vLLM replica, ``sluice serve``,
a ``redis-server`` of the test's own; answers streamed and not, back to back with no pause.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.integration.tenancy.fleet import BODY, KEY, emulator, gateway_config, gateways, model_of
from tests.support.procs import free_port
from tests.support.redis import RedisNotInstalled, redis_server

pytestmark = pytest.mark.timeout(180)

#: Requests the one client sends, alternating streamed and not.
REQUESTS = 120


@pytest.fixture(scope="module")
def replica() -> Iterator[str]:
    with emulator(seed=3) as url:
        yield url


async def _one_at_a_time(url: str) -> Counter[str]:
    """``REQUESTS`` requests, each sent as soon as the previous answer (and its stream) ended;
    returns how many ended how (``200`` or the status and error code)."""
    model = await model_of(url)
    headers = {"Authorization": f"Bearer {KEY}"}
    seen: Counter[str] = Counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        for index in range(REQUESTS):
            body: dict[str, Any] = {**BODY, "model": model, "stream": index % 2 == 1}
            async with session.post(url + "/v1/completions", json=body, headers=headers) as resp:
                text = await resp.text()
                if resp.status == 200:
                    seen["200"] += 1
                else:
                    seen[f"{resp.status} #{index} {text[:120]}"] += 1
    return seen


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_a_one_at_a_time_client_is_never_refused_for_concurrency(
    tmp_path: Path, replica: str, backend: str
) -> None:
    tenant_limits = {"tokens_per_minute": 1.0e9, "requests_per_minute": 1.0e6, "max_concurrent": 1}
    try:
        with redis_server(name="redis-one-at-a-time") as server:
            limits: dict[str, Any] = {"backend": "memory"}
            if backend == "redis":
                # fail_closed: a Redis call that fails is a 503 here, never a silent local bucket.
                limits = {
                    "backend": "redis",
                    "redis": {"url": server.url, "timeout_s": 2.0},
                    "on_storage_error": "fail_closed",
                }
            config = gateway_config(replica, free_port(), limits=limits, tenant_limits=tenant_limits)
            with gateways(tmp_path, [config]) as (gateway,):
                seen = await _one_at_a_time(gateway.url)
                assert gateway.alive()
    except RedisNotInstalled as exc:
        pytest.fail(str(exc))

    assert seen == Counter({"200": REQUESTS}), seen
