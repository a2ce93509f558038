"""The overhead bench's ``floor`` proxy does the work its row claims: it checks the API key, takes
the request's cost from a real Redis token bucket before forwarding, refuses with an OpenAI-style
429 when the bucket cannot pay, gives back what the answer did not use, counts and logs.

Real parts: the bench's fake backend and the floor on aiohttp test servers (real sockets), a real
``redis-server`` on a free port; both Redis paths (Sluice's pipelined calls and redis-py's).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as redis
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer

from bench.overhead import backend, floor
from tests.support.redis import RedisServer, redis_server

KEY = "sk-floor-test"
DIGEST = hashlib.sha256(KEY.encode()).hexdigest()
BUCKET = "floor:" + DIGEST
CAPACITY = 1000.0


@pytest.fixture(scope="module")
def redis_proc() -> Iterator[RedisServer]:
    with redis_server(name="floor") as server:
        yield server


@pytest.fixture(params=["pipelined", "redis-py"])
async def floor_url(request: pytest.FixtureRequest, redis_proc: RedisServer) -> AsyncIterator[str]:
    client = redis.Redis.from_url(redis_proc.url)
    await client.delete(BUCKET)
    await client.aclose()
    upstream = TestServer(backend.build_app(token_delay_s=0.001))
    await upstream.start_server()
    app = floor.build_app(
        str(upstream.make_url("")).rstrip("/"),
        redis_proc.url,
        frozenset({DIGEST}),
        pipelined=request.param == "pipelined",
        tokens_per_minute=0.0,  # no refill: every level is exact
        capacity=CAPACITY,
    )
    proxy = TestServer(app)
    await proxy.start_server()
    try:
        yield str(proxy.make_url("")).rstrip("/")
    finally:
        await proxy.close()
        await upstream.close()


async def _level(url: str, want: float) -> float:
    """The bucket's level once it reads ``want`` (a settle runs after the answer), else the last read."""
    client = redis.Redis.from_url(url)
    try:
        level = float("nan")
        for _ in range(200):
            raw = await client.hget(BUCKET, "level")
            level = float(raw) if raw is not None else float("nan")
            if level == want:
                break
            await asyncio.sleep(0.01)
        return level
    finally:
        await client.aclose()


async def test_floor_checks_keys_charges_the_bucket_and_refuses_when_it_is_empty(
    floor_url: str, redis_proc: RedisServer
) -> None:
    chat = {"model": backend.MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
    async with ClientSession() as http:
        for auth in ({}, {"Authorization": "Bearer sk-wrong"}):
            async with http.post(floor_url + "/v1/chat/completions", json=chat, headers=auth) as r:
                assert r.status == 401
                assert (await r.json())["error"]["type"] == "invalid_request_error"
        headers = {"Authorization": f"Bearer {KEY}"}
        async with http.post(floor_url + "/v1/chat/completions", json=chat, headers=headers) as r:
            assert r.status == 200
            used = (await r.json())["usage"]["total_tokens"]
        # Charged what the answer used, not what was reserved (the body's bytes / 4 + 16).
        assert await _level(redis_proc.url, CAPACITY - used) == CAPACITY - used

        streamed = {**chat, "stream": True, "stream_options": {"include_usage": True}}
        async with http.post(floor_url + "/v1/chat/completions", json=streamed, headers=headers) as r:
            assert r.status == 200
            text = await r.text()
        assert text.rstrip().endswith("data: [DONE]")
        usage = [json.loads(line[6:])["usage"] for line in text.splitlines() if '"usage"' in line]
        after_stream = CAPACITY - used - usage[-1]["total_tokens"]
        assert await _level(redis_proc.url, after_stream) == after_stream

        too_big = {**chat, "max_tokens": int(CAPACITY)}
        async with http.post(floor_url + "/v1/chat/completions", json=too_big, headers=headers) as r:
            assert r.status == 429
            assert (await r.json())["error"]["type"] == "rate_limit_error"
        assert await _level(redis_proc.url, after_stream) == after_stream  # a refusal takes nothing

        async with http.get(floor_url + "/metrics") as r:
            exposition = await r.text()
        assert f'floor_requests_total{{status="200",tenant="{DIGEST}"}} 2.0' in exposition
        assert f'floor_requests_total{{status="429",tenant="{DIGEST}"}} 1.0' in exposition


async def _bucket_level(url: str) -> float | None:
    client = redis.Redis.from_url(url)
    try:
        raw = await client.hget(BUCKET, "level")
        return None if raw is None else float(raw)
    finally:
        await client.aclose()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (json.dumps({"model": backend.MODEL, "max_tokens": -1_000_000}).encode(), "max_tokens"),
        (json.dumps({"model": backend.MODEL, "max_tokens": 0}).encode(), "max_tokens"),
        (json.dumps({"model": backend.MODEL, "max_tokens": True}).encode(), "max_tokens"),
        (json.dumps({"model": backend.MODEL, "max_tokens": "16"}).encode(), "max_tokens"),
        (json.dumps({"model": backend.MODEL, "max_tokens": 1.5}).encode(), "max_tokens"),
    ],
)
async def test_floor_answers_bad_bodies_400_without_touching_the_bucket(
    floor_url: str, redis_proc: RedisServer, body: bytes, param: str | None
) -> None:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    async with ClientSession() as http:
        async with http.post(floor_url + "/v1/chat/completions", data=body, headers=headers) as r:
            assert r.status == 400
            error = (await r.json())["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] == param
        # A negative max_tokens once made a negative cost, which raised the level past capacity.
        assert await _bucket_level(redis_proc.url) is None
        async with http.get(floor_url + "/metrics") as r:
            assert f'floor_requests_total{{status="400",tenant="{DIGEST}"}} 1.0' in await r.text()


async def test_floor_answers_502_and_gives_everything_back_when_the_upstream_is_down(
    redis_proc: RedisServer,
) -> None:
    client = redis.Redis.from_url(redis_proc.url)
    await client.delete(BUCKET)
    await client.aclose()
    gone = TestServer(backend.build_app(token_delay_s=0.001))
    await gone.start_server()
    dead_url = str(gone.make_url("")).rstrip("/")
    await gone.close()  # nothing listens there any more: a refused connection, not a fake
    proxy = TestServer(
        floor.build_app(
            dead_url, redis_proc.url, frozenset({DIGEST}), tokens_per_minute=0.0, capacity=CAPACITY
        )
    )
    await proxy.start_server()
    chat = {"model": backend.MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
    try:
        async with ClientSession() as http:
            url = str(proxy.make_url("/v1/chat/completions"))
            async with http.post(url, json=chat, headers={"Authorization": f"Bearer {KEY}"}) as r:
                assert r.status == 502
                assert r.content_type == "application/json"
                assert (await r.json())["error"]["type"] == "upstream_error"
        # The reservation was taken (the bucket exists) and all of it given back.
        assert await _level(redis_proc.url, CAPACITY) == CAPACITY
    finally:
        await proxy.close()
