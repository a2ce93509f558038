"""Sluice counts prompts as the real vLLM does, and tells a too-long one as OpenAI does.

A gateway in front of the session's real vLLM on CPU (the tiny model, context 1,024 tokens), with
the model's folder as the replica's ``tokenizer`` (its ``tokenizer.json`` and
``chat_template.jinja``). What Sluice counted is read back from the tenant's fresh token bucket
(weights pinned: prompt 1, output 2, so a reservation is ``prompt + 2 x max_tokens``) and compared
with the ``usage.prompt_tokens`` vLLM reports for the same request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from aiohttp import web

from gateway.app import build_app
from gateway.config.settings import Settings
from gateway.config.store import SettingsStore
from gateway.tenants import hash_api_key
from tests.e2e.vllm_cpu import MAX_MODEL_LEN, MODEL_DIR, SERVED_MODEL

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120, func_only=True)]

KEY = "sk-e2e-prompt-tokens-4b9e"
BURST = 1_000_000
MAX_TOKENS = 4
PROSE = "The replica admits each request whose forecast meets its targets, or queues it. "


def settings(vllm_base_url: str, *, tokenizer: bool) -> Settings:
    replica: dict[str, Any] = {"name": "vllm-cpu", "url": vllm_base_url}
    if tokenizer:
        replica["tokenizer"] = str(MODEL_DIR)
    return Settings.model_validate(
        {
            "server": {"host": "127.0.0.1", "port": 0},
            "replicas": [replica],
            "health": {"interval_s": 0.5, "timeout_s": 0.5},
            "reload": {"watch": False},
            "tenants": {
                "tenants": {
                    "acme": {
                        "api_keys": [hash_api_key(KEY)],
                        "limits": {"tokens_per_minute": float(BURST), "token_burst": float(BURST)},
                    }
                }
            },
            "limits": {"backend": "memory", "token_weights": {"prompt": 1.0, "output": 2.0}},
        }
    )


async def _client(vllm_base_url: str, *, tokenizer: bool) -> AsyncIterator[openai.AsyncOpenAI]:
    runner = web.AppRunner(build_app(SettingsStore(settings(vllm_base_url, tokenizer=tokenizer))))
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        sdk = openai.AsyncOpenAI(base_url=f"http://{host}:{port}/v1", api_key=KEY, max_retries=0, timeout=60)
        deadline = time.monotonic() + 30.0
        while SERVED_MODEL not in [m.id async for m in sdk.models.list()]:
            assert time.monotonic() < deadline, "the gateway never listed the model"
            await asyncio.sleep(0.2)
        yield sdk
        await sdk.close()
    finally:
        await runner.cleanup()


@pytest.fixture
async def counting(vllm_base_url: str) -> AsyncIterator[openai.AsyncOpenAI]:
    async for sdk in _client(vllm_base_url, tokenizer=True):
        yield sdk


@pytest.fixture
async def estimating(vllm_base_url: str) -> AsyncIterator[openai.AsyncOpenAI]:
    async for sdk in _client(vllm_base_url, tokenizer=False):
        yield sdk


def reserved_prompt(headers: Any) -> int:
    return BURST - int(headers["x-ratelimit-remaining-tokens"]) - 2 * MAX_TOKENS


async def test_a_completion_is_counted_as_vllm_counts_it(counting: openai.AsyncOpenAI) -> None:
    raw = await counting.completions.with_raw_response.create(
        model=SERVED_MODEL, prompt=PROSE * 3, max_tokens=MAX_TOKENS
    )
    reply = raw.parse()
    assert reply.usage is not None
    assert reserved_prompt(raw.headers) == reply.usage.prompt_tokens


async def test_a_chat_is_counted_as_vllm_counts_it(counting: openai.AsyncOpenAI) -> None:
    raw = await counting.chat.completions.with_raw_response.create(
        model=SERVED_MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROSE * 2}],
        max_tokens=MAX_TOKENS,
    )
    reply = raw.parse()
    assert reply.usage is not None
    assert reserved_prompt(raw.headers) == reply.usage.prompt_tokens


async def test_a_counted_prompt_over_the_context_is_refused_by_sluice(counting: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await counting.chat.completions.create(
            model=SERVED_MODEL, messages=[{"role": "user", "content": PROSE * 20}], max_tokens=MAX_TOKENS
        )
    error = caught.value
    assert (error.code, error.param) == ("context_length_exceeded", "messages")
    assert f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, your messages" in (
        error.message
    )


async def test_vllms_own_refusal_is_relayed_as_context_length_exceeded(
    estimating: openai.AsyncOpenAI,
) -> None:
    # About 1,600 characters: estimated at 4 a token it fits, so Sluice forwards it; vLLM counts
    # more than 1,024 tokens with this model's small vocabulary and refuses.
    with pytest.raises(openai.BadRequestError) as caught:
        await estimating.completions.create(model=SERVED_MODEL, prompt=PROSE * 20, max_tokens=MAX_TOKENS)
    error = caught.value
    assert (error.code, error.param) == ("context_length_exceeded", "prompt")
    assert f"This model's maximum context length is {MAX_MODEL_LEN} tokens." in error.message
    assert "parameter=" not in error.message
