"""The gateway in front of a real vLLM, driven by the real ``openai`` SDK.

The gateway runs in this test's event loop (aiohttp ``AppRunner`` on a free port) with one static
replica: the session's vLLM server. Both a plain and a streamed chat completion must arrive intact,
with ``ignore_eos`` passed through so the usage counts exactly ``max_tokens`` tokens.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import openai
import pytest
from aiohttp import web

from gateway.app import build_app
from gateway.config.settings import ServerSettings, Settings
from gateway.config.store import SettingsStore
from gateway.replicas.config import HealthSettings, ReplicaSettings
from tests.e2e.vllm_cpu import SERVED_MODEL

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120, func_only=True)]

MAX_TOKENS = 16
#: Seconds for the gateway's health checker to find the replica and list its model.
GATEWAY_READY_TIMEOUT_S = 30.0


@pytest.fixture
async def gateway_url(vllm_base_url: str) -> AsyncIterator[str]:
    """``http://127.0.0.1:<port>`` of a gateway whose only replica is the real vLLM."""
    settings = Settings(
        server=ServerSettings(host="127.0.0.1", port=0),
        replicas=[ReplicaSettings(name="vllm-cpu", url=vllm_base_url)],
        health=HealthSettings(interval_s=0.5, timeout_s=0.5),
    )
    app: web.Application = build_app(SettingsStore(settings), spawn_emulators=False)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


@pytest.fixture
async def client(gateway_url: str) -> AsyncIterator[openai.AsyncOpenAI]:
    """An SDK client pointed at the gateway, returned once the gateway lists the served model."""
    sdk = openai.AsyncOpenAI(base_url=gateway_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    deadline = time.monotonic() + GATEWAY_READY_TIMEOUT_S
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if SERVED_MODEL in [m.id async for m in sdk.models.list()]:
                break
        except openai.APIError as exc:
            last_error = exc
        await asyncio.sleep(0.2)
    else:
        pytest.fail(f"gateway never listed {SERVED_MODEL!r} within {GATEWAY_READY_TIMEOUT_S} s: {last_error}")
    try:
        yield sdk
    finally:
        await sdk.close()


async def test_chat_completion_through_gateway(client: openai.AsyncOpenAI) -> None:
    reply = await client.chat.completions.create(
        model=SERVED_MODEL,
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=MAX_TOKENS,
        extra_body={"ignore_eos": True},
    )
    assert reply.usage is not None
    assert reply.usage.completion_tokens == MAX_TOKENS
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.content


async def test_streamed_chat_completion_through_gateway(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model=SERVED_MODEL,
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text: list[str] = []
    finish_reasons: list[str] = []
    usage_chunks = []
    async for chunk in stream:
        if chunk.usage is not None:
            usage_chunks.append(chunk)
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            if choice.finish_reason is not None:
                finish_reasons.append(choice.finish_reason)
    assert finish_reasons == ["length"]
    assert "".join(text)
    (last,) = usage_chunks
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.completion_tokens == MAX_TOKENS
