"""No tenant's traffic changes how another tenant's prompts are sized, reserved or refused.

One emulated vLLM replica (``simulator.server.build_app``, context 8,192 tokens) behind a real
gateway served on a real socket, three tenants with keys and token budgets (weights pinned:
prompt 1, output 2, so that a reservation is ``prompt estimate + 2 x max_tokens``, read back from
``x-ratelimit-remaining-tokens`` of a fresh bucket). The "hi" attack: tenant ``attacker``
sends 120 chat "hi" (2 characters, 9 tokens with the template: 0.2 characters a token, which a
ratio learned per model from everyone's traffic turned into a 24,000-token estimate of a
12,000-character prompt and a 400). A victim's first long prompt after the attack is admitted
and reserved as the same prompt of another tenant was before it.

And an estimate alone never refuses a prompt as too long: a tenant whose own prompts were dense
(1 character a token) has its next 12,000-character prompt estimated over the context; it is
forwarded and answered, since even its fewest plausible tokens fit.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.app import build_app
from gateway.config.settings import Settings
from gateway.config.store import SettingsStore
from gateway.keys import PREDICTION_SERVICE
from gateway.tenants import hash_api_key
from simulator.profile import load_profile
from simulator.server import build_app as build_emulator
from simulator.tokens import count_chat_prompt

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

PROFILE = "llama3-8b-h100"
TENANTS = ("attacker", "victim", "dense")
#: A token bucket far larger than any one reservation: its first answer says what was reserved.
BURST = 1_000_000
MAX_TOKENS = 16
#: The victim's prompt: 12,000 characters of prose (the emulator counts a word or a mark a token).
PROSE = "The replica admits each request whose forecast meets its targets, or queues it. "
LONG = (PROSE * (12_000 // len(PROSE) + 1))[:12_000]
HI_REQUESTS = 120


def key(tenant: str) -> str:
    return f"sk-cross-tenant-{tenant}-5e2a"


def config(replica_url: str) -> dict[str, Any]:
    return {
        "server": {"host": "127.0.0.1", "port": 0},
        "replicas": [
            {
                "name": "emu",
                "url": replica_url,
                "hardware": {
                    "gpu": "H100-SXM",
                    "model": "Llama-3-8B",
                    "max_num_seqs": 256,
                    "max_num_batched_tokens": 8192,
                },
            }
        ],
        "health": {"interval_s": 1.0, "timeout_s": 1.0},
        "reload": {"watch": False},
        "logging": {"access_log": False},
        "admission": {
            "classes": {"plain": {"ttft_target_s": 60.0, "tpot_target_s": 5.0}},
            "default_class": "plain",
        },
        "tenants": {
            "tenants": {
                name: {
                    "api_keys": [hash_api_key(key(name))],
                    "limits": {"tokens_per_minute": float(BURST), "token_burst": float(BURST)},
                }
                for name in TENANTS
            }
        },
        "limits": {"backend": "memory", "token_weights": {"prompt": 1.0, "output": 2.0}},
    }


@asynccontextmanager
async def serve(app: web.Application) -> AsyncIterator[str]:
    """Serve ``app`` on a free port as ``web.run_app`` does; yields its URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        await runner.cleanup()


class Client:
    """Chat completions to the gateway at ``url`` as one tenant or another."""

    def __init__(self, session: aiohttp.ClientSession, url: str, model: str) -> None:
        self.session, self.url, self.model = session, url, model

    async def chat(self, tenant: str, content: str) -> tuple[int, dict[str, str], dict[str, Any]]:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": MAX_TOKENS,
        }
        headers = {"Authorization": f"Bearer {key(tenant)}"}
        async with self.session.post(self.url + "/v1/chat/completions", json=body, headers=headers) as resp:
            return resp.status, dict(resp.headers), await resp.json(content_type=None)

    async def reserved(self, tenant: str, content: str) -> tuple[int, int, dict[str, Any]]:
        """(status, weighted tokens reserved, body) of ``tenant``'s first request."""
        status, headers, body = await self.chat(tenant, content)
        remaining = int(headers.get("x-ratelimit-remaining-tokens", BURST))
        return status, BURST - remaining, body


async def emulator_url(aiohttp_server: Any) -> str:
    emulator: TestServer = await aiohttp_server(build_emulator(load_profile(PROFILE), seed=5))
    return str(emulator.make_url("")).rstrip("/")


def gateway(replica_url: str) -> web.Application:
    return build_app(SettingsStore(Settings.model_validate(config(replica_url))), spawn_emulators=False)


async def model_of(session: aiohttp.ClientSession, url: str) -> str:
    async with asyncio.timeout(30.0):
        while True:
            async with session.get(
                url + "/v1/models", headers={"Authorization": f"Bearer {key('victim')}"}
            ) as r:
                data = (await r.json())["data"]
            if data:
                return str(data[0]["id"])
            await asyncio.sleep(0.1)


async def learned(app: web.Application, model: str, tenant: str, reports: int) -> None:
    """Wait until the prediction service learned ``reports`` of ``tenant``'s prompts (a request is
    learned from just after its answer reaches the client)."""
    service = app[PREDICTION_SERVICE]
    async with asyncio.timeout(30.0):
        while service.prompt_estimate(model, 1, tenant).samples < reports:  # noqa: ASYNC110 (no event to wait on)
            await asyncio.sleep(0.05)


async def victims_first_reservation(replica_url: str, *, attack: bool) -> tuple[int, int, dict[str, Any]]:
    """(status, weighted tokens reserved, answer) of the victim's first long prompt on a fresh
    gateway, after ``HI_REQUESTS`` chat "hi" of the attacker when ``attack``."""
    app = gateway(replica_url)
    async with serve(app) as url, aiohttp.ClientSession() as session:
        client = Client(session, url, await model_of(session, url))
        if attack:
            sem = asyncio.Semaphore(8)

            async def hi() -> int:
                async with sem:
                    return (await client.chat("attacker", "hi"))[0]

            statuses = await asyncio.gather(*(hi() for _ in range(HI_REQUESTS)))
            assert statuses == [200] * HI_REQUESTS
            await learned(app, client.model, "attacker", HI_REQUESTS)
        return await client.reserved("victim", LONG)


async def test_the_hi_attack_leaves_another_tenants_prompt_size_alone(aiohttp_server: Any) -> None:
    replica = await emulator_url(aiohttp_server)
    real_tokens = count_chat_prompt([{"role": "user", "content": LONG}])
    assert 2_000 < real_tokens < 2_400  # its real 2,186 tokens, give or take the emulator's count

    status, calm, answer = await victims_first_reservation(replica, attack=False)
    assert status == 200, answer
    assert answer["usage"]["prompt_tokens"] == real_tokens
    status, attacked, answer = await victims_first_reservation(replica, attack=True)
    assert status == 200, answer
    # Sized as without the attack: 12,000 characters at the prior's 4 a token, both times (the
    # attack made it 24,000 tokens and a 400), within 1.5x of its real 2,186 tokens.
    assert calm - 2 * MAX_TOKENS == 12_000 // 4
    assert 0.9 * calm <= attacked <= 1.1 * calm, (calm, attacked)
    assert attacked - 2 * MAX_TOKENS <= 1.5 * real_tokens


async def test_an_estimate_over_the_context_is_forwarded_not_refused(aiohttp_server: Any) -> None:
    app = gateway(await emulator_url(aiohttp_server))
    dense = "!" * 6_000  # 6,000 tokens of marks: 1 character a token
    async with serve(app) as url, aiohttp.ClientSession() as session:
        client = Client(session, url, await model_of(session, url))
        for _ in range(4):
            status, _, answer = await client.chat("dense", dense)
            assert status == 200, answer
        await learned(app, client.model, "dense", 4)
        # Its own ratio now sizes its 12,000 characters of prose over the 8,192-token context;
        # even at 16 characters a token they would fit.
        estimate = app[PREDICTION_SERVICE].prompt_estimate(client.model, len(LONG), "dense")
        assert estimate.tokens > 8_192 > estimate.fewest_tokens
        status, _, answer = await client.chat("dense", LONG)
    assert status == 200, answer
    assert answer["usage"]["prompt_tokens"] == count_chat_prompt([{"role": "user", "content": LONG}])
