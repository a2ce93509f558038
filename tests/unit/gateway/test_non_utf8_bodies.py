"""A body that is not UTF-8 text, sent as ``application/json``: a 400 with OpenAI's error shape on
every route that takes a body, never a codec's message or a traceback, and nothing forwarded.
Through a real gateway (real HTTP) in front of a fake vLLM replica for the OpenAI routes and the
in-process TGI emulator for TGI's native ones (they need a TGI replica to name the model)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config.settings import Settings
from gateway.replicas.config import ReplicaSettings
from simulator.profile import load_profile
from simulator.server import build_app as build_emulator
from tests.unit.gateway.conftest import StartGateway, StartReplica
from tests.unit.gateway.fakes import FakeReplica, Gateway, gateway_settings, url_of

#: The 400's body, exactly (``gateway.api.json_body.load_object``).
NOT_UTF8 = {
    "error": {
        "message": "request body is not valid JSON: it is not UTF-8 text",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
}

#: Bytes no UTF-8 text holds, each put inside a string field of an otherwise valid body.
BAD_BYTES = [
    pytest.param(b"\xff", id="byte-ff"),
    pytest.param(b"caf\xe9", id="latin-1"),
    pytest.param(b"\xe2\x82", id="truncated-sequence"),
    pytest.param(b"\xc0\xaf", id="overlong-slash"),
    pytest.param(b"\xed\xa0\x80", id="encoded-surrogate"),
]

OPENAI_ROUTES = [
    pytest.param(
        "/v1/chat/completions",
        b'{"model": "test-model", "messages": [{"role": "user", "content": "%s"}]}',
        id="chat",
    ),
    pytest.param(
        "/v1/completions", b'{"model": "test-model", "prompt": "%s", "max_tokens": 4}', id="completions"
    ),
]
GENERATE = b'{"inputs": "%s", "parameters": {"max_new_tokens": 4}}'
TGI_ROUTES = ["/generate", "/generate_stream", "/"]


def _refused(resp: Any, body: Any, gw: Gateway) -> None:
    assert resp.status == 400
    assert resp.headers["Content-Type"].startswith("application/json")
    assert body == NOT_UTF8
    assert gw.outcomes[-1].status == 400


@pytest.mark.parametrize("bad", BAD_BYTES)
@pytest.mark.parametrize(("path", "template"), OPENAI_ROUTES)
async def test_an_openai_body_that_is_not_utf8_is_a_400(
    start_replica: StartReplica, start_gateway: StartGateway, path: str, template: bytes, bad: bytes
) -> None:
    replica = FakeReplica()
    _, url = await start_replica(replica)
    gw = await start_gateway({"r1": url})

    resp = await gw.client.post(path, data=template % bad, headers={"Content-Type": "application/json"})

    _refused(resp, await resp.json(), gw)
    assert replica.seen == []


@pytest.fixture
async def tgi_gateway(aiohttp_server: Any, start_gateway: StartGateway) -> Gateway:
    """A gateway in front of one emulated TGI replica."""
    server = await aiohttp_server(build_emulator(load_profile("llama3-8b-h100"), seed=1, engine="tgi"))
    base = gateway_settings({"t1": await url_of(server)})
    replica = ReplicaSettings(name="t1", url=base.replicas[0].url, backend="tgi")
    settings = Settings(replicas=[replica], health=base.health, server=base.server, scrape=base.scrape)
    return await start_gateway(settings=settings)


@pytest.mark.parametrize("bad", BAD_BYTES)
async def test_a_tgi_body_that_is_not_utf8_is_a_400(tgi_gateway: Gateway, bad: bytes) -> None:
    for path in TGI_ROUTES:
        resp = await tgi_gateway.client.post(
            path, data=GENERATE % bad, headers={"Content-Type": "application/json"}
        )
        _refused(resp, await resp.json(), tgi_gateway)
    assert all(outcome.replica is None for outcome in tgi_gateway.outcomes)  # none forwarded


async def test_the_same_bodies_in_utf8_are_served(
    start_replica: StartReplica, start_gateway: StartGateway, tgi_gateway: Gateway
) -> None:
    """The control: the latin-1 case's text, written in UTF-8, is served on both kinds of route."""
    replica = FakeReplica()
    _, url = await start_replica(replica)
    gw = await start_gateway({"r1": url})
    json_type = {"Content-Type": "application/json"}

    completion = await gw.client.post("/v1/completions", data=OPENAI_BODY, headers=json_type)
    generated = await tgi_gateway.client.post("/generate", data=GENERATE % "café".encode(), headers=json_type)

    assert completion.status == 200, await completion.text()
    assert replica.seen[0].body["prompt"] == "café"
    assert generated.status == 200, await generated.text()


OPENAI_BODY = b'{"model": "test-model", "prompt": "%s", "max_tokens": 4}' % "café".encode()
