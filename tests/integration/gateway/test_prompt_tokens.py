"""Prompt sizes you can trust: counted with the model's tokenizer when Sluice has it, else
estimated and never refused on the estimate alone; too long is OpenAI's context_length_exceeded.

One emulated vLLM replica (``simulator.server.build_app``, ``meta-llama/Meta-Llama-3-8B-Instruct``,
context 8,192 tokens) behind a real gateway on a real socket; a real ``tokenizer.json`` trained
offline (``tests.support.tokenizer``: the e2e tiny model's BPE), configured on the replica or
found in a temporary Hugging Face cache. What Sluice counted is read back from the tenant's
bucket: a reservation is ``prompt + 2 x max_tokens`` per sequence with the weights pinned (prompt
1, output 2), and ``x-ratelimit-remaining-tokens`` of a fresh bucket says it.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.app import build_app
from gateway.config.settings import Settings
from gateway.config.store import SettingsStore
from gateway.tenants import hash_api_key
from simulator.profile import load_profile
from simulator.server import build_app as build_emulator
from tests.support.tokenizer import tokenizer, write_hub_snapshot, write_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"
CONTEXT = 8192
KEY = "sk-prompt-tokens-7c1d"
#: A token bucket far larger than any one reservation: its first answer says what was reserved.
BURST = 1_000_000
MAX_TOKENS = 8
PROSE = "The replica admits each request whose forecast meets its targets, or queues it. "


def text(chars: int) -> str:
    return (PROSE * (chars // len(PROSE) + 1))[:chars]


def config(replica_url: str, tokenizer_path: Path | None) -> dict[str, Any]:
    replica: dict[str, Any] = {"name": "emu", "url": replica_url, "hardware": {"model": "Llama-3-8B"}}
    if tokenizer_path is not None:
        replica["tokenizer"] = str(tokenizer_path)
    return {
        "server": {"host": "127.0.0.1", "port": 0},
        "replicas": [replica],
        "health": {"interval_s": 1.0, "timeout_s": 1.0},
        "reload": {"watch": False},
        "logging": {"access_log": False},
        "admission": {
            "classes": {"plain": {"ttft_target_s": 60.0, "tpot_target_s": 5.0}},
            "default_class": "plain",
        },
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


@asynccontextmanager
async def gateway(aiohttp_server: Any, tokenizer_path: Path | None = None) -> AsyncIterator[str]:
    """A gateway in front of a fresh emulator, served on a free port, its model listed; its URL."""
    emulator: TestServer = await aiohttp_server(build_emulator(load_profile("llama3-8b-h100"), seed=3))
    settings = Settings.model_validate(config(str(emulator.make_url("")).rstrip("/"), tokenizer_path))
    runner = web.AppRunner(build_app(SettingsStore(settings), spawn_emulators=False))
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        async with aiohttp.ClientSession() as session, asyncio.timeout(30.0):
            while True:
                async with session.get(url + "/v1/models", headers=_auth()) as resp:
                    if (await resp.json())["data"]:
                        break
                await asyncio.sleep(0.1)
        yield url
    finally:
        await runner.cleanup()


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


async def reserved(url: str, route: str, body: dict[str, Any]) -> tuple[int, int, dict[str, Any]]:
    """(status, weighted tokens reserved, answer) of the tenant's first request."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + route, json={"model": MODEL, **body}, headers=_auth()) as resp,
    ):
        remaining = int(resp.headers.get("x-ratelimit-remaining-tokens", BURST))
        return resp.status, BURST - remaining, await resp.json()


def tokens(content: str, *, special: bool) -> int:
    return len(tokenizer().encode(content, add_special_tokens=special).ids)


async def test_a_configured_tokenizer_counts_completions_exactly(aiohttp_server: Any, tmp_path: Path) -> None:
    prompt = text(3_000)
    async with gateway(aiohttp_server, write_tokenizer(tmp_path / "tiny")) as url:
        status, cost, answer = await reserved(
            url, "/v1/completions", {"prompt": prompt, "max_tokens": MAX_TOKENS}
        )
    assert status == 200, answer
    assert cost == tokens(prompt, special=True) + 2 * MAX_TOKENS


async def test_a_tokenizer_in_the_hugging_face_cache_counts_chats(
    aiohttp_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_hub_snapshot(tmp_path / "hub", MODEL)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    content = text(5_000)
    messages = [{"role": "user", "content": content}]
    async with gateway(aiohttp_server) as url:
        status, cost, answer = await reserved(
            url, "/v1/chat/completions", {"messages": messages, "max_tokens": MAX_TOKENS}
        )
    assert status == 200, answer
    # Rendered with the snapshot's chat template (tokenizer_config.json), as vLLM renders it.
    counted = tokens(f"<|user|>\n{content}\n<|assistant|>\n", special=False)
    assert cost == counted + 2 * MAX_TOKENS
    assert counted != len(content) // 4  # not the 4-characters-a-token prior


async def test_a_prompt_counted_over_the_context_is_refused_as_openai_does(
    aiohttp_server: Any, tmp_path: Path
) -> None:
    path = write_tokenizer(tmp_path / "tiny")
    prompt = text(24_000)
    counted = tokens(prompt, special=True)
    assert counted > CONTEXT  # while its characters at 16 a token, the estimate's fewest, fit
    async with gateway(aiohttp_server, path) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS)
        await client.close()
    error = caught.value
    assert (error.code, error.param) == ("context_length_exceeded", "prompt")
    assert error.response.headers["x-should-retry"] == "false"
    assert (
        f"maximum context length is {CONTEXT} tokens. However, your prompt resulted in {counted} tokens"
        in (error.message)
    )


async def test_without_a_tokenizer_the_replicas_refusal_is_relayed_as_context_length_exceeded(
    aiohttp_server: Any,
) -> None:
    # 9,000 marks: the emulator counts each a token (over 8,192), while the estimate's fewest
    # plausible count (16 characters a token) fits: Sluice forwards it, the replica refuses.
    async with gateway(aiohttp_server) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "!" * 9_000}], max_tokens=MAX_TOKENS
            )
        await client.close()
    error = caught.value
    assert (error.code, error.param) == ("context_length_exceeded", "messages")
    assert f"This model's maximum context length is {CONTEXT} tokens." in error.message
    assert "parameter=" not in error.message


async def test_max_tokens_beyond_the_context_is_blamed_on_max_tokens(aiohttp_server: Any) -> None:
    async with gateway(aiohttp_server) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hello!"}], max_tokens=100_000
            )
        await client.close()
    error = caught.value
    assert (error.code, error.param) == ("context_length_exceeded", "max_tokens")
    assert f"This model's maximum context length is {CONTEXT} tokens. However, you requested" in error.message
    assert "100000 in the completion" in error.message
