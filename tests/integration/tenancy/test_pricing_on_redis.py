"""What a tenant's shared token bucket is charged, on a real ``redis-server``, with the real
``openai`` SDK.

Gateway A (a real aiohttp server, ``limits.backend: redis``) serves team-a's requests; gateway B
on the same Redis serves none and shows, through ``GET /sluice/v1/tenants``, the level they left.

* Default pricing (no ``limits.token_weights``): each request costs plain tokens, the prompt
  and completion tokens its replica's usage reported (settled to usage, not to the estimate
  reserved).
* ``{mode: gpu_time}``: two replica groups, an H100 serving ``model-a`` and an A100 serving
  ``model-b`` (both Llama-3-8B, no scrape: their roofline priors), each model priced at its own
  group's output weight, as ``token_weights_by_model`` shows it.

The bucket refills ``tokens_per_minute / 60`` tokens a second: a level is exact up to that
refill over the test's measured duration.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from gateway.config.settings import Settings
from gateway.keys import OUTCOME_LISTENERS
from gateway.limits.config import GpuTimeWeightSettings, LimitsSettings, RedisSettings, TenantLimitSettings
from gateway.observability.outcome import RequestOutcome
from gateway.replicas.config import HardwareSettings
from gateway.tenants.live import TENANCY
from tests.support.redis import RedisNotInstalled, RedisServer, redis_server
from tests.unit.gateway.fakes import FakeReplica, gateway_settings, make_app, url_of
from tests.unit.tenancy.conftest import KEY_A, Scripted, tenancy_settings

pytestmark = pytest.mark.timeout(120)

#: Slow refill (0.1 token a second), a bucket far larger than the test spends.
LIMITS = TenantLimitSettings(tokens_per_minute=6.0, token_burst=100_000.0)
REFILL_PER_S = 6.0 / 60.0
#: Slack for the float arithmetic of a level kept as ``full_at`` epoch seconds in Redis.
EPS = 1e-6
H100 = HardwareSettings(gpu="H100-SXM", model="Llama-3-8B")
A100 = HardwareSettings(gpu="A100-80GB-SXM", model="Llama-3-8B")


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    try:
        with redis_server(name="redis-pricing") as server:
            yield server
    except RedisNotInstalled as exc:
        pytest.fail(str(exc))


def model_card(model: str) -> dict[str, Any]:
    return {"id": model, "object": "model", "max_model_len": 4096}


def on_redis(
    settings: Settings, redis: RedisServer, prefix: str, token_weights: GpuTimeWeightSettings | None = None
) -> Settings:
    """``settings`` with the budget shared in ``redis`` under ``prefix``; ``token_weights`` as
    ``limits.token_weights`` (``None``: the key left out, the default)."""
    limits: dict[str, Any] = {
        "backend": "redis",
        "redis": RedisSettings(url=redis.url, timeout_s=2.0, key_prefix=prefix),
        "on_storage_error": "fail_closed",
    }
    if token_weights is not None:
        limits["token_weights"] = token_weights
    return settings.model_copy(update={"limits": LimitsSettings(**limits)})


class Ended:
    """The outcomes a gateway reported, to await: an outcome is reported once the request's
    settle was started (``Forwarder.handle``), so awaiting ``n`` of them, then the budget's
    ``drain``, awaits every settle of ``n`` requests."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.queue: asyncio.Queue[RequestOutcome] = asyncio.Queue()
        app[OUTCOME_LISTENERS].append(self.queue.put_nowait)

    async def settled(self, n: int) -> list[RequestOutcome]:
        """The next ``n`` outcomes, once their settles reached the limiter."""
        outcomes = [await asyncio.wait_for(self.queue.get(), timeout=10.0) for _ in range(n)]
        await self.app[TENANCY].budget.drain()
        return outcomes


async def start_pair(aiohttp_server: Any, settings: Callable[[], Settings]) -> tuple[str, str, Ended]:
    """Gateways A and B on ``settings()`` each: their URLs, and A's outcomes to await."""
    app_a = make_app(settings())[0]
    ended = Ended(app_a)
    a = await url_of(await aiohttp_server(app_a))
    b = await url_of(await aiohttp_server(make_app(settings())[0]))
    return a, b, ended


async def tenants_view(gateway: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.get(f"{gateway}/sluice/v1/tenants") as resp:
        assert resp.status == 200, await resp.text()
        listed: dict[str, Any] = await resp.json()
        return listed


def team_a_tokens(listed: dict[str, Any]) -> dict[str, Any]:
    team_a = next(t for t in listed["data"] if t["id"] == "team-a")
    assert team_a["levels_from"] == "redis"
    assert team_a["in_flight"] == 0
    tokens: dict[str, Any] = team_a["buckets"]["tokens"]
    return tokens


def assert_charged(tokens: dict[str, Any], charged: float, elapsed_s: float) -> None:
    """The bucket holds its capacity less ``charged``, plus at most its refill over
    ``elapsed_s`` seconds."""
    capacity = LIMITS.token_burst
    assert capacity is not None
    assert (tokens["capacity"], tokens["limit_per_minute"]) == (capacity, LIMITS.tokens_per_minute)
    low = capacity - charged
    assert low - EPS <= tokens["remaining"] <= low + REFILL_PER_S * elapsed_s + EPS, (
        tokens["remaining"],
        low,
        elapsed_s,
    )


async def test_default_pricing_charges_plain_prompt_and_completion_tokens(
    aiohttp_server: Any, redis: RedisServer
) -> None:
    """No ``token_weights``: each request is charged what its usage reported, prompt +
    completion tokens, whatever the estimate it reserved (a 20-token prompt, ``max_tokens``
    10) was; a stream with its usage chunk as well."""
    scripted = Scripted()
    replica = FakeReplica(handler=scripted.answer)
    replica_url = await url_of(await aiohttp_server(replica.app()))
    a, b, ended = await start_pair(
        aiohttp_server, lambda: on_redis(tenancy_settings(replica_url, limits=LIMITS), redis, "plain")
    )
    usages = [(20, 10), (23, 7), (12, 1)]
    reported: list[tuple[int, int]] = []
    started = time.monotonic()
    client = openai.AsyncOpenAI(base_url=f"{a}/v1", api_key=KEY_A, max_retries=0)
    try:
        for usage in usages:
            scripted.usage = usage
            answer = await client.completions.create(model="test-model", prompt=[7] * 20, max_tokens=10)
            assert answer.usage is not None
            reported.append((answer.usage.prompt_tokens, answer.usage.completion_tokens))
        replica.handler = scripted.stream
        scripted.usage = (20, 8)
        stream = await client.completions.create(
            model="test-model",
            prompt=[7] * 20,
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            if chunk.usage is not None:
                reported.append((chunk.usage.prompt_tokens, chunk.usage.completion_tokens))
    finally:
        await client.close()
    outcomes = await ended.settled(len(usages) + 1)

    listed = await tenants_view(b)
    elapsed = time.monotonic() - started

    assert reported == [*usages, (20, 8)]  # what the SDK saw is what the replica reported
    assert [o.status for o in outcomes] == [200] * 4
    assert listed["token_weights"] == {"input": 1.0, "output": 1.0, "request": 0.0, "context": 0.0}
    assert listed["token_weights_by_model"] == {}
    assert_charged(team_a_tokens(listed), sum(p + c for p, c in reported), elapsed)


def two_groups(h100_url: str, a100_url: str, redis: RedisServer) -> Settings:
    """team-a on Redis with GPU-time weights; replica ``h100`` (H100) and ``a100`` (A100)."""
    base = tenancy_settings(h100_url, limits=LIMITS)
    replicas = [
        r.model_copy(update={"hardware": hardware})
        for r, hardware in zip(
            gateway_settings({"h100": h100_url, "a100": a100_url}).replicas, (H100, A100), strict=True
        )
    ]
    settings = on_redis(base, redis, "gpu-time", GpuTimeWeightSettings(mode="gpu_time"))
    return settings.model_copy(update={"replicas": replicas})


async def test_gpu_time_charges_each_model_at_its_groups_output_weight(
    aiohttp_server: Any, redis: RedisServer
) -> None:
    """Two models on two replica groups get two output weights; each request is charged its
    usage's prompt + its model's ``w_out`` x its usage's completion tokens."""
    on_h100, on_a100 = Scripted(usage=(23, 7)), Scripted(usage=(18, 9))
    h100 = FakeReplica(models=[model_card("model-a")], handler=on_h100.answer)
    a100 = FakeReplica(models=[model_card("model-b")], handler=on_a100.answer)
    h100_url = await url_of(await aiohttp_server(h100.app()))
    a100_url = await url_of(await aiohttp_server(a100.app()))
    a, b, ended = await start_pair(aiohttp_server, lambda: two_groups(h100_url, a100_url, redis))
    sent = ["model-a", "model-b", "model-a", "model-b", "model-b"]
    reported: list[tuple[str, int, int]] = []
    started = time.monotonic()
    client = openai.AsyncOpenAI(base_url=f"{a}/v1", api_key=KEY_A, max_retries=0)
    try:
        for model in sent:
            answer = await client.completions.create(model=model, prompt=[7] * 20, max_tokens=10)
            assert answer.usage is not None
            reported.append((model, answer.usage.prompt_tokens, answer.usage.completion_tokens))
    finally:
        await client.close()
    outcomes = await ended.settled(len(sent))

    priced_by_a = (await tenants_view(a))["token_weights_by_model"]
    listed = await tenants_view(b)
    elapsed = time.monotonic() - started

    # Each model went to its own group's replica, whose usage the SDK saw.
    assert [o.replica for o in outcomes] == ["h100" if m == "model-a" else "a100" for m in sent]
    assert (len(h100.seen), len(a100.seen)) == (2, 3)
    assert reported == [(m, *(on_h100.usage if m == "model-a" else on_a100.usage)) for m in sent]
    weights = listed["token_weights_by_model"]
    assert weights == priced_by_a  # B prices as A did
    assert set(weights) == {"model-a", "model-b"}
    assert all((w["input"], w["request"], w["context"]) == (1.0, 0.0, 0.0) for w in weights.values())
    w_out = {model: w["output"] for model, w in weights.items()}
    # The H100 and A100 priors' w_out at the reference point (docs/tenants.md's table).
    assert w_out == {"model-a": 7.14, "model-b": 3.46}
    # The access line names the weights each request was priced with.
    assert [(o.model, o.output_weight) for o in outcomes] == [(m, w_out[m]) for m in sent]
    charged = sum(prompt + w_out[model] * completion for model, prompt, completion in reported)
    assert_charged(team_a_tokens(listed), charged, elapsed)
