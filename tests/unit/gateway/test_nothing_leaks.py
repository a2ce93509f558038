"""Nothing leaks: the ``Server`` header names no versions, ``/readyz`` tells the public only
whether the gateway is ready, errors carry fixed messages, echoed values are clipped. A real
gateway in front of fake replicas (real HTTP) and the real ``openai`` SDK."""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from gateway.config.settings import AdminSettings, ServerSettings, Settings
from gateway.http.admin import ADMIN_LISTENER
from gateway.http.echo import ECHO_LIMIT, clip
from gateway.observability.outcome import ACCESS_LOGGER
from tests.unit.gateway.conftest import StartGateway, StartReplica
from tests.unit.gateway.fakes import MODEL, FakeReplica, chat_chunk, gateway_settings, sse

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


def _dies_mid_stream() -> Any:
    """A replica handler that sends one chunk of a stream, then drops the connection."""

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(sse(chat_chunk("Hel")))
        assert request.transport is not None
        request.transport.close()
        return response

    return handler


async def test_a_cut_stream_tells_the_openai_sdk_a_fixed_message_and_the_log_the_cause(
    start_replica: StartReplica, start_gateway: StartGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """The SSE error event names the replica and what happened, never aiohttp's exception text;
    the operator's log line has it."""
    _, url = await start_replica(FakeReplica(handler=_dies_mid_stream()))
    gw = await start_gateway({"r1": url})
    client = openai.AsyncOpenAI(api_key="unused", base_url=str(gw.client.make_url("/v1")), max_retries=0)

    async def read_all() -> None:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
        )
        async for _ in stream:
            pass

    with caplog.at_level(logging.WARNING, logger="sluice.errors"), pytest.raises(openai.APIError) as caught:
        await read_all()

    assert caught.value.message == "replica r1 failed mid-stream"
    assert caught.value.body == {
        "message": "replica r1 failed mid-stream",
        "type": "upstream_error",
        "param": None,
        "code": "upstream_error",
    }
    (line,) = [r.getMessage() for r in caplog.records if "failed mid-stream" in r.getMessage()]
    assert "replica r1 failed mid-stream (Client" in line


async def test_a_huge_model_name_is_clipped_in_the_404_and_in_the_logs(
    start_gateway: StartGateway, replica_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A 1 MB model name: the 404 quotes its first 256 characters with a marker; no log line or
    access field holds more."""
    gw = await start_gateway({"r1": replica_url})
    client = openai.AsyncOpenAI(api_key="unused", base_url=str(gw.client.make_url("/v1")), max_retries=0)
    name = "m" * 1_000_000

    with caplog.at_level(logging.DEBUG), pytest.raises(openai.NotFoundError) as caught:
        await client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}])

    body = caught.value.body
    assert isinstance(body, dict)
    message = body["message"]
    assert message == f"the model `{'m' * ECHO_LIMIT}…[+{1_000_000 - ECHO_LIMIT} chars]` does not exist"
    assert caught.value.param == "model"
    (access,) = [r for r in caplog.records if r.name == ACCESS_LOGGER]
    assert access.fields["model"] == clip(name)  # type: ignore[attr-defined]
    assert max(len(r.getMessage()) for r in caplog.records if r.name.startswith("sluice")) < 4 * ECHO_LIMIT


@pytest.mark.parametrize(
    ("value", "limit", "clipped"),
    [
        pytest.param("abc", 3, "abc", id="at-the-limit"),
        pytest.param("abcd", 3, "abc…[+1 chars]", id="one-over"),
        pytest.param("", 3, "", id="empty"),
    ],
)
def test_clip(value: str, limit: int, clipped: str) -> None:
    assert clip(value, limit) == clipped


async def test_a_long_path_is_clipped_in_the_access_line(
    start_gateway: StartGateway, replica_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    gw = await start_gateway({"r1": replica_url})
    path = "/" + "p" * 5000

    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
        resp = await gw.client.get(path)

    assert resp.status == 404
    assert (await resp.json())["error"]["message"] == "no such route"
    (access,) = [r for r in caplog.records if r.name == ACCESS_LOGGER]
    assert access.fields["path"] == clip(path)  # type: ignore[attr-defined]
