"""Racing a nearly empty budget across gateways: parallel requests get through only as far as it goes.

Three ``sluice serve`` processes share one tenant's budgets in one real ``redis-server``. Each
test first spends the budget down with a few requests, one at a time, until it holds exactly
``LEFT`` more requests, then fires ``BURST`` requests at once, spread over the three gateways,
and counts what got through: a tenant cannot exceed its limits through concurrency races.

The bound is computed from the limits, never measured: refill is so slow (one request's worth in
hours) that the test's duration cannot matter, so the burst may admit at most
``floor(left + refill over the whole test)`` = ``LEFT`` requests. It must also admit exactly that
many (a budget lost to the race would be a bug too), and every other request must get a proper 429
(OpenAI's error body, ``rate_limit_exceeded``, a ``Retry-After``).

Every request is ``/v1/completions`` with ``PROMPT_TOKENS`` token ids and ``ignore_eos``, so it
costs exactly ``RESERVED`` weighted tokens at admission and at settle (no refund can free room
during the burst). The replica is a real emulator behind ``FaultyFront`` (the fault tests'
pass-through proxy), which in the concurrency test holds admitted requests open until every burst
request has been answered, so no slot frees during the race.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.faults.rig import FaultyFront, assert_openai_error, faulty_front, gateway
from tests.integration.tenancy.fleet import KEY, PROMPT_TOKENS, emulator, gateway_config
from tests.support.procs import free_port
from tests.support.redis import RedisNotInstalled, redis_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

GATEWAYS: Final = 3
#: Requests fired at once, round-robin over the gateways.
BURST: Final = 60
#: Requests the budget holds when the burst starts.
LEFT: Final = 2
#: Requests that spend the budget down before the burst (one at a time).
PRIMING: Final = 4
MAX_TOKENS: Final = 8
#: Weighted tokens one request reserves and is charged (prompt 1, output 2: token weights pinned).
RESERVED: Final = PROMPT_TOKENS + 2 * MAX_TOKENS
#: Refill of every bucket here: one request's worth takes hours, so timing cannot matter.
TOKENS_PER_MINUTE: Final = 0.06  # 0.001 weighted tokens per second
REQUESTS_PER_MINUTE: Final = 0.006  # one request per 10,000 s
#: Token bucket: PRIMING + LEFT requests, plus half of one (never enough for a third).
TOKEN_BURST: Final = (PRIMING + LEFT + 0.5) * RESERVED
AUTH: Final = {"Authorization": f"Bearer {KEY}"}


@dataclass
class Answer:
    """One client's view: status, the error object of a non-200, its headers."""

    status: int
    error: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    usage: tuple[int, int] | None = None


@dataclass
class Fleet:
    """Three gateways in front of one ``FaultyFront``; ``model`` is the one they serve."""

    urls: list[str]
    front: FaultyFront
    model: str
    #: Before the first request: the refill bound counts from here.
    started_at: float


@pytest.fixture(scope="module")
def replica() -> Iterator[str]:
    with emulator() as url:
        yield url


@contextlib.asynccontextmanager
async def fleet(tmp_path: Path, replica_url: str, tenant_limits: dict[str, Any]) -> AsyncIterator[Fleet]:
    """A ``redis-server``, a ``FaultyFront`` before ``replica_url``, and ``GATEWAYS`` gateways."""
    with contextlib.ExitStack() as processes:
        try:
            server = processes.enter_context(redis_server(name="redis-race"))
        except RedisNotInstalled as exc:
            pytest.fail(str(exc))
        limits = {
            "backend": "redis",
            # Generous timeout and fail_closed: a slow call on a loaded machine is a 503 (which
            # fails the test loudly), never a local fallback bucket that would blur the budget.
            "redis": {"url": server.url, "timeout_s": 2.0},
            "on_storage_error": "fail_closed",
            "expected_gateways": GATEWAYS,
        }
        async with faulty_front(replica_url) as front, contextlib.AsyncExitStack() as stack:
            urls: list[str] = []
            for index in range(GATEWAYS):
                directory = tmp_path / f"gateway-{index}"
                directory.mkdir()
                config = gateway_config(front.url, free_port(), limits=limits, tenant_limits=tenant_limits)
                urls.append((await stack.enter_async_context(gateway(directory, config))).url)
            async with (
                aiohttp.ClientSession() as client,
                client.get(urls[0] + "/v1/models", headers=AUTH) as resp,
            ):
                model = str((await resp.json())["data"][0]["id"])
            yield Fleet(urls, front, model, time.monotonic())


async def post(session: aiohttp.ClientSession, url: str, model: str) -> Answer:
    """One ``/v1/completions`` request costing exactly ``RESERVED`` weighted tokens."""
    body = {"model": model, "prompt": [11] * PROMPT_TOKENS, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    async with session.post(url + "/v1/completions", json=body, headers=AUTH) as resp:
        payload = await resp.json(content_type=None)
        answer = Answer(resp.status, headers={k.lower(): v for k, v in resp.headers.items()})
    if resp.status == 200:
        usage = payload["usage"]
        answer.usage = (int(usage["prompt_tokens"]), int(usage["completion_tokens"]))
    else:
        answer.error = payload.get("error")
    return answer


def session() -> aiohttp.ClientSession:
    """A client with a connection per burst request (all of them in flight at once)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=BURST + GATEWAYS),
        timeout=aiohttp.ClientTimeout(total=120),
    )


async def prime(fleet: Fleet, client: aiohttp.ClientSession) -> None:
    """``PRIMING`` requests one at a time, over every gateway: each must be a full 200."""
    for i in range(PRIMING):
        answer = await post(client, fleet.urls[i % GATEWAYS], fleet.model)
        assert answer.status == 200, answer
        assert answer.usage == (PROMPT_TOKENS, MAX_TOKENS), answer  # cost exactly RESERVED


def burst(fleet: Fleet, client: aiohttp.ClientSession) -> list[asyncio.Task[Answer]]:
    """``BURST`` requests started at once, round-robin over the gateways."""
    return [asyncio.create_task(post(client, fleet.urls[i % GATEWAYS], fleet.model)) for i in range(BURST)]


def assert_rejections(answers: list[Answer], *, retry_after: bool) -> None:
    """Every non-200 is a 429 with OpenAI's error body, code and type ``rate_limit_exceeded``."""
    for answer in answers:
        if answer.status == 200:
            continue
        assert answer.status == 429, answer
        error = assert_openai_error(answer.error, "rate_limit_exceeded")
        assert error["type"] == "rate_limit_exceeded", error
        assert "tenant team-a" in error["message"], error
        if retry_after:
            assert int(answer.headers["retry-after"]) >= 1, answer.headers


async def tokens_reserved(client: aiohttp.ClientSession, url: str) -> float:
    """``sluice_tenant_tokens_reserved_total`` of ``team-a`` at the gateway at ``url``."""
    async with client.get(url + "/metrics") as resp:
        text = await resp.text()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "sluice_tenant_tokens_reserved_total" and sample.labels.get("tenant") == "team-a"
    )


def refill_bound(left: float, per_minute: float, cost: float, elapsed_s: float) -> int:
    """Requests of ``cost`` a bucket holding ``left`` can admit within ``elapsed_s`` seconds."""
    return math.floor((left + per_minute / 60.0 * elapsed_s) / cost)


async def test_token_bucket_race(tmp_path: Path, replica: str) -> None:
    limits = {"tokens_per_minute": TOKENS_PER_MINUTE, "token_burst": TOKEN_BURST}
    async with fleet(tmp_path, replica, limits) as f, session() as client:
        await prime(f, client)
        answers = await asyncio.gather(*burst(f, client))
        elapsed = time.monotonic() - f.started_at
        reserved = sum([await tokens_reserved(client, url) for url in f.urls])

    statuses = Counter(a.status for a in answers)
    # Each admitted request reserved exactly RESERVED (the prediction is capped by max_tokens).
    assert reserved == (PRIMING + statuses[200]) * RESERVED, reserved
    left = TOKEN_BURST - PRIMING * RESERVED
    bound = refill_bound(left, TOKENS_PER_MINUTE, RESERVED, elapsed)
    assert bound == LEFT  # the refill cannot add a request, however slow the machine
    assert statuses == {200: LEFT, 429: BURST - LEFT}, statuses
    assert all(a.usage == (PROMPT_TOKENS, MAX_TOKENS) for a in answers if a.status == 200)
    assert_rejections(answers, retry_after=True)
    # What is left is half a request's worth: the 429s say so, and that it will take hours (the
    # bucket's reset time); Retry-After says 40-60 s (the most Sluice sends, 60 s, jittered down
    # to spread the clients: the openai SDKs ignore more), so a client asks again then.
    for answer in answers:
        if answer.status == 429:
            assert int(answer.headers["x-ratelimit-remaining-tokens"]) == RESERVED // 2, answer.headers
            assert 40 <= int(answer.headers["retry-after"]) <= 60, answer.headers
            assert "h" in answer.headers["x-ratelimit-reset-tokens"], answer.headers


async def test_request_bucket_race(tmp_path: Path, replica: str) -> None:
    limits = {"requests_per_minute": REQUESTS_PER_MINUTE, "request_burst": PRIMING + LEFT}
    async with fleet(tmp_path, replica, limits) as f, session() as client:
        await prime(f, client)
        answers = await asyncio.gather(*burst(f, client))
        elapsed = time.monotonic() - f.started_at

    statuses = Counter(a.status for a in answers)
    bound = refill_bound(float(LEFT), REQUESTS_PER_MINUTE, 1.0, elapsed)
    assert bound == LEFT
    assert statuses == {200: LEFT, 429: BURST - LEFT}, statuses
    assert_rejections(answers, retry_after=True)
    for answer in answers:
        if answer.status == 429:
            assert answer.headers["x-ratelimit-remaining-requests"] == "0", answer.headers


async def test_concurrency_limit_race(tmp_path: Path, replica: str) -> None:
    # PRIMING / 2 requests hold their slots (kept open at the replica) while the burst races
    # for the LEFT slots that remain.
    holding = PRIMING // 2
    limits = {"max_concurrent": holding + LEFT}
    async with fleet(tmp_path, replica, limits) as f, session() as client:
        f.front.completions = "hold"
        held = [asyncio.create_task(post(client, f.urls[i % GATEWAYS], f.model)) for i in range(holding)]
        await wait_until(lambda: f.front.completion_requests == holding, "the held requests")
        racing = burst(f, client)
        # Admitted requests wait at the replica; all others are answered. No slot frees until
        # every burst request is accounted for, so the count cannot depend on timing.
        await wait_until(
            lambda: sum(t.done() for t in racing) + f.front.completion_requests - holding == BURST,
            "every burst request answered or held",
        )
        admitted = f.front.completion_requests - holding
        f.front.release_held()
        answers = await asyncio.gather(*racing)
        first = await asyncio.gather(*held)

    statuses = Counter(a.status for a in answers)
    assert admitted == LEFT, admitted
    assert statuses == {200: LEFT, 429: BURST - LEFT}, statuses
    assert [a.status for a in first] == [200] * holding
    assert_rejections(answers, retry_after=True)


async def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = 90.0) -> None:
    """Poll ``predicate`` every 20 ms until it is true; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {timeout_s} s")
        await asyncio.sleep(0.02)
