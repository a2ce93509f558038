"""Nothing leaks: the ``Server`` header names no versions, ``/readyz`` tells the public only
whether the gateway is ready, errors carry fixed messages, echoed values are clipped. A real
gateway in front of fake replicas (real HTTP) and the real ``openai`` SDK."""

from __future__ import annotations

import hashlib
from typing import Any

import aiohttp
import pytest

from gateway.config.settings import AdminSettings, ServerSettings, Settings
from gateway.http.admin import ADMIN_LISTENER
from tests.unit.gateway.conftest import StartGateway, StartReplica
from tests.unit.gateway.fakes import FakeReplica, gateway_settings

TOKEN = "sluice-admin-token-leaks-0123"
TOKEN_HEX = hashlib.sha256(TOKEN.encode()).hexdigest()


def with_admin(settings: Settings, **admin: Any) -> Settings:
    return settings.model_copy(update={"admin": AdminSettings(**admin)})


@pytest.fixture
async def replica_url(start_replica: StartReplica) -> str:
    return (await start_replica(FakeReplica()))[1]


async def test_every_response_says_the_configured_server_name(
    start_gateway: StartGateway, replica_url: str
) -> None:
    """Success, the gateway's own errors (a refusal, an unknown route, a wrong method) and the admin
    listener: never aiohttp's ``Python/3.x aiohttp/3.x``; a reload changes the name at once."""
    gw = await start_gateway(settings=with_admin(gateway_settings({"r1": replica_url}), port=0))
    listener = gw.app[ADMIN_LISTENER]
    chat = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "stream": False}

    answers = [
        await gw.client.get("/healthz"),
        await gw.client.post("/v1/chat/completions", json=chat),
        await gw.client.post("/v1/chat/completions", json={"model": "nope", "messages": []}),
        await gw.client.get("/no/such/route"),
        await gw.client.get("/v1/chat/completions"),
    ]
    async with aiohttp.ClientSession() as session, session.get(listener.url + "/metrics") as admin:
        admin_server = admin.headers["Server"]
    gw.store.swap(
        gw.store.current.model_copy(
            update={"server": gw.store.current.server.model_copy(update={"server_header": "edge proxy"})}
        )
    )
    renamed = await gw.client.get("/healthz")

    assert [r.status for r in answers] == [200, 200, 400, 404, 405]
    assert [r.headers["Server"] for r in answers] == ["sluice"] * 5
    assert admin_server == "sluice"
    assert renamed.headers["Server"] == "edge proxy"


async def _readyz(gw: Any, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    resp = await gw.client.get("/readyz", headers=headers or {})
    return resp.status, await resp.json()


async def test_readyz_shows_the_replicas_only_with_the_admin_token(
    start_gateway: StartGateway, replica_url: str
) -> None:
    settings = with_admin(gateway_settings({"r1": replica_url}), token_sha256=TOKEN_HEX)
    gw = await start_gateway(settings=settings)

    public = await _readyz(gw)
    wrong = await _readyz(gw, {"Authorization": "Bearer not-the-token"})
    admin = await _readyz(gw, {"Authorization": f"Bearer {TOKEN}"})

    assert public == (200, {"ready": True, "draining": False})
    assert wrong == public
    assert admin[0] == 200
    (replica,) = admin[1]["replicas"]
    assert (replica["name"], replica["url"], replica["state"]) == ("r1", replica_url, "healthy")


async def test_readyz_on_the_public_listener_of_a_separate_admin_listener_is_minimal(
    start_gateway: StartGateway, start_replica: StartReplica
) -> None:
    """The admin routes live elsewhere: the public ``/readyz`` never lists replicas, token or not."""
    _, url = await start_replica(FakeReplica(health_status=503))
    settings = with_admin(gateway_settings({"r1": url}), port=0, token_sha256=TOKEN_HEX)
    gw = await start_gateway(settings=settings)

    minimal = (503, {"ready": False, "draining": False})
    assert await _readyz(gw) == minimal
    assert await _readyz(gw, {"Authorization": f"Bearer {TOKEN}"}) == minimal


def test_server_header_setting_defaults_to_sluice() -> None:
    assert ServerSettings().server_header == "sluice"
