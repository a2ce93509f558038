"""Every error a client can see: status, OpenAI-style JSON body, headers, request id, one log line.

Where a fake replica is used, it is because the fault (refused connection, a body cut mid-way, a
400 or 500 answer) cannot be produced on demand by the emulator.
"""

from __future__ import annotations

import gzip
import json
import logging
import math
import random
import zlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from multidict import CIMultiDict

from gateway.admission.retry_after import RefusalReason, retry_after
from gateway.config.settings import ServerSettings
from gateway.http.errors import (
    BodyTooLarge,
    GatewayError,
    InvalidRequest,
    Refused,
    error_response,
    refusal_headers,
    sse_error_event,
)
from gateway.keys import REGISTRY
from gateway.replicas.config import HealthSettings
from gateway.replicas.registry import ReplicaState
from tests.unit.gateway.conftest import StartGateway, StartReplica
from tests.unit.gateway.fakes import MODEL, FakeReplica, gateway_settings, wait_for

CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def assert_error_body(body: dict[str, Any], *, error_type: str, code: str | None = None) -> None:
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == error_type
    assert isinstance(error["message"], str)
    assert error["message"]
    if code is not None:
        assert error["code"] == code


@pytest.mark.parametrize(
    ("retry_after_s", "header", "millis"),
    [
        pytest.param(2.0, "2", "2000", id="whole-seconds"),
        pytest.param(2.5, "3", "2500", id="rounded-up"),
        pytest.param(0.2, "1", "200", id="at-least-one-second"),
        pytest.param(60.0, "60", "60000", id="sixty-seconds"),
        pytest.param(60.4, "60", "60000", id="capped-at-sixty-seconds"),
        pytest.param(300.0, "60", "60000", id="a-wait-of-minutes-says-sixty"),
    ],
)
def test_retry_after_headers(retry_after_s: float, header: str, millis: str) -> None:
    """An exact wait (the budget store's next probe) as headers: whole seconds rounded up, at
    most 60."""
    retry = retry_after(RefusalReason.LIMITER_UNAVAILABLE, retry_after_s)
    assert refusal_headers(retry) == {"Retry-After": header, "retry-after-ms": millis}


@pytest.mark.parametrize(
    ("err", "status", "error_type"),
    [
        pytest.param(InvalidRequest("bad", param="model"), 400, "invalid_request_error", id="invalid"),
        pytest.param(BodyTooLarge("big"), 413, "invalid_request_error", id="too-large"),
        pytest.param(
            Refused(
                RefusalReason.NO_HEALTHY_REPLICA,
                "none",
                retry_after=retry_after(RefusalReason.NO_HEALTHY_REPLICA, 1.0, rng=random.Random(0)),
            ),
            503,
            "service_unavailable_error",
            id="no-replica",
        ),
    ],
)
def test_error_response_and_sse_event_share_one_body(err: GatewayError, status: int, error_type: str) -> None:
    response = error_response(err)
    assert response.status == status
    assert response.content_type == "application/json"
    assert sse_error_event(err).startswith(b"data: {")
    assert sse_error_event(err).endswith(b"\n\n")
    assert_error_body(err.body(), error_type=error_type)


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        pytest.param("/v1/chat/completions", b"{not json", None, id="malformed-json"),
        pytest.param("/v1/chat/completions", b"[1, 2]", None, id="not-an-object"),
        pytest.param(
            "/v1/chat/completions", b'{"messages": [{"role": "user"}]}', "model", id="chat-no-model"
        ),
        pytest.param("/v1/chat/completions", b'{"model": "m"}', "messages", id="chat-no-messages"),
        pytest.param("/v1/chat/completions", b'{"model": "m", "messages": []}', "messages", id="chat-empty"),
        pytest.param("/v1/chat/completions", b'{"model": 1, "messages": [{}]}', "model", id="model-not-str"),
        pytest.param(
            "/v1/chat/completions",
            b'{"model": "m", "messages": [{}], "stream": "yes"}',
            "stream",
            id="stream-str",
        ),
        pytest.param(
            "/v1/chat/completions",
            b'{"model": "m", "messages": [{}], "max_tokens": "10"}',
            "max_tokens",
            id="max-tokens-str",
        ),
        pytest.param("/v1/completions", b'{"model": "m"}', "prompt", id="completion-no-prompt"),
        pytest.param("/v1/completions", b'{"model": "m", "prompt": {"a": 1}}', "prompt", id="prompt-object"),
    ],
)
async def test_malformed_requests_get_400(
    start_replica: StartReplica, start_gateway: StartGateway, path: str, raw: bytes, param: str | None
) -> None:
    """Fake replica only so that the gateway has a healthy replica; it must never be called."""
    replica = FakeReplica()
    _, url = await start_replica(replica)
    gw = await start_gateway({"r1": url})

    resp = await gw.client.post(path, data=raw, headers={"Content-Type": "application/json"})

    assert resp.status == 400
    body = await resp.json()
    assert_error_body(body, error_type="invalid_request_error")
    assert body["error"]["param"] == param
    assert resp.headers["x-request-id"]
    assert replica.seen == []


async def _chunks(total: int) -> AsyncIterator[bytes]:
    sent = 0
    while sent < total:
        yield b" " * 256
        sent += 256


@pytest.mark.parametrize(
    "chunked",
    [pytest.param(False, id="content-length-over-limit"), pytest.param(True, id="chunked-aiohttp-limit")],
)
async def test_body_over_the_limit_gets_413_in_our_format(
    start_replica: StartReplica, start_gateway: StartGateway, chunked: bool
) -> None:
    """Fake replica only so that the gateway has a healthy replica."""
    _, url = await start_replica(FakeReplica())
    settings = gateway_settings({"r1": url}, server=ServerSettings(port=0, max_body_bytes=1024))
    gw = await start_gateway(settings=settings)

    data: Any = _chunks(4096) if chunked else b" " * 4096
    resp = await gw.client.post("/v1/chat/completions", data=data)

    assert resp.status == 413
    assert_error_body(await resp.json(), error_type="invalid_request_error", code="request_too_large")
    assert resp.headers["x-request-id"]


async def test_a_smaller_body_limit_after_reload_applies(
    start_replica: StartReplica, start_gateway: StartGateway
) -> None:
    """Fake replica only so that the gateway has a healthy replica."""
    _, url = await start_replica(FakeReplica())
    gw = await start_gateway({"r1": url})
    smaller = gw.store.current.model_copy(update={"server": ServerSettings(port=0, max_body_bytes=64)})
    gw.store.swap(smaller)

    resp = await gw.client.post("/v1/chat/completions", json={**CHAT, "padding": "x" * 100})

    assert resp.status == 413


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        pytest.param("GET", "/nope", 404, "not_found", id="unknown-route"),
        pytest.param("POST", "/v1/embeddings", 404, "not_found", id="unsupported-endpoint"),
        pytest.param("GET", "/v1/chat/completions", 405, "method_not_allowed", id="get-on-chat"),
        pytest.param("DELETE", "/v1/models", 405, "method_not_allowed", id="delete-models"),
    ],
)
async def test_unknown_route_and_wrong_method_in_our_format(
    start_replica: StartReplica, start_gateway: StartGateway, method: str, path: str, status: int, code: str
) -> None:
    """Fake replica only so that the gateway has a healthy replica."""
    _, url = await start_replica(FakeReplica())
    gw = await start_gateway({"r1": url})

    resp = await gw.client.request(method, path)

    assert resp.status == status
    assert_error_body(await resp.json(), error_type="invalid_request_error", code=code)
    assert resp.headers["x-request-id"]
    if status == 405:
        assert resp.headers["Allow"]


async def test_unknown_model_gets_404_model_not_found(
    start_replica: StartReplica, start_gateway: StartGateway
) -> None:
    """Fake replica serving only ``test-model``."""
    _, url = await start_replica(FakeReplica())
    gw = await start_gateway({"r1": url})

    resp = await gw.client.post("/v1/chat/completions", json={**CHAT, "model": "no-such-model"})

    assert resp.status == 404
    body = await resp.json()
    assert_error_body(body, error_type="invalid_request_error", code="model_not_found")
    assert body["error"]["param"] == "model"


async def test_replica_refusing_connections_gets_502_and_counts_as_failure(
    start_replica: StartReplica, start_gateway: StartGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """Fake replica that is healthy at startup and then stops listening (a crashed process)."""
    server, url = await start_replica(FakeReplica())
    gw = await start_gateway({"r1": url})
    await server.close()

    with caplog.at_level(logging.INFO):
        resp = await gw.client.post("/v1/chat/completions", json=CHAT)

    assert resp.status == 502
    assert_error_body(await resp.json(), error_type="upstream_error", code="upstream_error")
    replica = gw.app[REGISTRY].get("r1")
    assert replica is not None
    assert replica.consecutive_failures >= 1
    assert replica.outstanding == 0
    # The failure also triggered an immediate health check, which finds it down (2 failures).
    await wait_for(lambda: replica.state == ReplicaState.UNHEALTHY)
    request_id = resp.headers["x-request-id"]
    error_logs = [r for r in caplog.records if r.name == "sluice.errors" and request_id in r.getMessage()]
    assert len(error_logs) == 1, "every error is logged exactly once"


def _die_before_headers() -> Any:
    async def handler(request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        request.transport.close()
        return web.Response()

    return handler


def _die_mid_body() -> Any:
    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.content_length = 1000
        await response.prepare(request)
        await response.write(b'{"id": "chatcmpl-1", "choi')
        assert request.transport is not None
        request.transport.close()
        return response

    return handler


@pytest.mark.parametrize(
    "handler",
    [pytest.param(_die_before_headers(), id="before-headers"), pytest.param(_die_mid_body(), id="mid-body")],
)
async def test_replica_dying_mid_request_gets_502(
    start_replica: StartReplica, start_gateway: StartGateway, handler: Any
) -> None:
    """Fake replica whose process 'dies' (drops the connection) while answering."""
    _, url = await start_replica(FakeReplica(handler=handler))
    gw = await start_gateway({"r1": url})

    resp = await gw.client.post("/v1/chat/completions", json=CHAT)

    assert resp.status == 502
    assert_error_body(await resp.json(), error_type="upstream_error")
    assert resp.headers["x-request-id"]
    assert gw.outcomes[0].error == "upstream_error"


@pytest.mark.parametrize("stream", [pytest.param(False, id="plain"), pytest.param(True, id="stream")])
async def test_replica_4xx_passes_through_unchanged(
    start_replica: StartReplica, start_gateway: StartGateway, stream: bool
) -> None:
    """Fake replica answering vLLM's 400 for a parameter it refuses."""
    vllm_error = {
        "object": "error",
        "message": "temperature must be non-negative, got -1.0.",
        "type": "BadRequestError",
        "param": "temperature",
        "code": 400,
    }

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response(vllm_error, status=400)

    _, url = await start_replica(FakeReplica(handler=handler))
    gw = await start_gateway({"r1": url})

    resp = await gw.client.post("/v1/chat/completions", json={**CHAT, "stream": stream})

    assert resp.status == 400
    assert await resp.json() == vllm_error
    assert resp.headers["x-request-id"]


@pytest.mark.parametrize(
    ("message", "param"),
    [
        pytest.param(
            "This model's maximum context length is 4096 tokens. However, your prompt contains at least "
            "4097 input tokens, which exceeds this limit even without any output tokens. Please reduce the "
            "length of the input prompt. (parameter=input_tokens, value=4097)",
            "messages",
            id="vllm-prompt",
        ),
        pytest.param(
            "max_tokens=9000 cannot be greater than max_model_len=4096. Please request fewer output "
            "tokens. (parameter=max_tokens, value=9000)",
            "max_tokens",
            id="vllm-max-tokens",
        ),
        pytest.param(
            "The input (5000 tokens) is longer than the model's context length (4096 tokens).",
            "messages",
            id="sglang",
        ),
    ],
)
@pytest.mark.parametrize("stream", [pytest.param(False, id="plain"), pytest.param(True, id="stream")])
async def test_a_replicas_too_long_refusal_is_context_length_exceeded(
    start_replica: StartReplica, start_gateway: StartGateway, message: str, param: str, stream: bool
) -> None:
    """A replica's own refusal of a request longer than its context is relayed as OpenAI's
    ``context_length_exceeded``, in the replica's words (which name the context length)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        error = {"message": message, "type": "BadRequestError", "param": None, "code": 400}
        return web.json_response({"error": error}, status=400)

    _, url = await start_replica(FakeReplica(handler=handler))
    gw = await start_gateway({"r1": url})

    resp = await gw.client.post("/v1/chat/completions", json={**CHAT, "stream": stream})

    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error == {
        "message": message.split(" (parameter=")[0],
        "type": "invalid_request_error",
        "param": param,
        "code": "context_length_exceeded",
    }
    assert "4096" in error["message"]


async def test_replica_5xx_becomes_502(
    start_replica: StartReplica, start_gateway: StartGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """Fake replica answering 500 (an engine crash inside vLLM). The client is told which replica
    and its status; what the replica said (an engine's internals) goes to the log only."""

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response({"message": "engine dead"}, status=500)

    _, url = await start_replica(FakeReplica(handler=handler))
    gw = await start_gateway({"r1": url})

    with caplog.at_level(logging.WARNING, logger="sluice.errors"):
        resp = await gw.client.post("/v1/chat/completions", json=CHAT)

    assert resp.status == 502
    body = await resp.json()
    assert_error_body(body, error_type="upstream_error")
    assert body["error"]["message"] == "replica r1 answered 500"
    assert "replica r1 answered 500 (engine dead)" in caplog.text


@pytest.mark.parametrize(
    "health_status",
    [pytest.param(500, id="health-failing"), pytest.param(None, id="connection-refused")],
)
async def test_no_healthy_replica_gets_503_with_retry_after(
    start_replica: StartReplica, start_gateway: StartGateway, health_status: int | None
) -> None:
    """Fake replica whose /health fails (or that is not running at all). The delay is admission's
    ``retry_after.no_replica_s`` (2 s), spread by up to ``jitter_fraction`` (50 %)."""
    server, url = await start_replica(FakeReplica(health_status=health_status or 200))
    if health_status is None:
        await server.close()
    health = HealthSettings(interval_s=2.5, timeout_s=1.0)
    gw = await start_gateway(settings=gateway_settings({"r1": url}, health=health))

    resp = await gw.client.post("/v1/chat/completions", json=CHAT)

    assert resp.status == 503
    millis = int(resp.headers["retry-after-ms"])
    assert 2000 <= millis <= 3000
    assert resp.headers["Retry-After"] == str(math.ceil(millis / 1000))
    assert_error_body(await resp.json(), error_type="service_unavailable_error", code="no_healthy_replica")


async def test_unexpected_exception_becomes_generic_500_without_traceback(
    start_replica: StartReplica, start_gateway: StartGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """A handler bug (a route added for the test) must not leak its traceback to the client; the
    fake replica is there only so that the gateway starts with a healthy replica."""
    from tests.unit.gateway.fakes import make_app

    _, url = await start_replica(FakeReplica())
    app, _, _ = make_app(gateway_settings({"r1": url}))

    async def boom(request: web.Request) -> web.Response:
        raise RuntimeError("secret internals")

    app.router.add_get("/boom", boom)
    from aiohttp.test_utils import TestClient, TestServer

    async with TestClient(TestServer(app)) as client:
        with caplog.at_level(logging.INFO):
            resp = await client.get("/boom")
        text = await resp.text()

    assert resp.status == 500
    assert "secret" not in text
    assert "Traceback" not in text
    assert_error_body(await resp.json(), error_type="server_error", code="internal_error")
    logged = [r for r in caplog.records if r.name == "sluice.errors"]
    assert len(logged) == 1
    assert logged[0].exc_info is not None


@pytest.mark.parametrize(
    ("incoming", "honoured"),
    [
        pytest.param("abc-123", True, id="sane-id-kept"),
        pytest.param("req:7f/2+x=@y.z_", True, id="punctuation-kept"),
        pytest.param("has space", False, id="space-replaced"),
        pytest.param("x" * 129, False, id="too-long-replaced"),
        pytest.param(None, False, id="absent-generated"),
    ],
)
async def test_request_id_is_honoured_when_sane_and_forwarded_upstream(
    start_replica: StartReplica, start_gateway: StartGateway, incoming: str | None, honoured: bool
) -> None:
    """Fake replica records the headers it received."""
    replica = FakeReplica()
    _, url = await start_replica(replica)
    gw = await start_gateway({"r1": url})
    headers = {"x-request-id": incoming} if incoming is not None else {}

    resp = await gw.client.post("/v1/chat/completions", json=CHAT, headers=headers)

    assert resp.status == 200
    request_id = resp.headers["x-request-id"]
    assert (request_id == incoming) is honoured
    assert len(request_id) <= 128
    assert " " not in request_id
    assert replica.seen[0].headers["x-request-id"] == request_id
    assert gw.outcomes[0].request_id == request_id


@pytest.mark.parametrize(
    ("method", "path"),
    [
        pytest.param("GET", "/healthz", id="healthz"),
        pytest.param("GET", "/readyz", id="readyz"),
        pytest.param("GET", "/v1/models", id="models"),
        pytest.param("GET", "/missing", id="404"),
    ],
)
async def test_every_response_carries_a_request_id(
    start_replica: StartReplica, start_gateway: StartGateway, method: str, path: str
) -> None:
    """Fake replica only so that the gateway has a healthy replica."""
    _, url = await start_replica(FakeReplica())
    gw = await start_gateway({"r1": url})

    resp = await gw.client.request(method, path)

    assert len(resp.headers["x-request-id"]) == 32


async def test_hop_by_hop_headers_are_not_forwarded_but_authorization_is(
    start_replica: StartReplica, start_gateway: StartGateway
) -> None:
    """Fake replica records the headers it received."""
    replica = FakeReplica()
    _, url = await start_replica(replica)
    gw = await start_gateway({"r1": url})

    await gw.client.post(
        "/v1/chat/completions",
        json=CHAT,
        headers={
            "Authorization": "Bearer k",
            "Connection": "keep-alive, x-private",
            "x-private": "1",
            "TE": "x",
            "Expect": "100-continue",
        },
    )

    seen = {k.lower(): v for k, v in replica.seen[0].headers.items()}
    assert seen["authorization"] == "Bearer k"
    assert "x-private" not in seen
    assert "te" not in seen
    assert "expect" not in seen  # answered by the gateway, which sends the body whole
    assert seen["content-type"] == "application/json"


async def test_the_client_is_named_to_the_replica_in_x_forwarded_headers(
    start_replica: StartReplica, start_gateway: StartGateway
) -> None:
    """As nginx and Envoy do: the client's address is appended to the X-Forwarded-For chain it
    sent (several headers joined in order), and X-Forwarded-Proto is the client's scheme unless a
    proxy in front set it. Fake replica records the headers it received."""
    replica = FakeReplica()
    _, url = await start_replica(replica)
    gw = await start_gateway({"r1": url})

    await gw.client.post("/v1/chat/completions", json=CHAT)
    chained = [
        ("X-Forwarded-For", "203.0.113.7"),
        ("X-Forwarded-For", "10.0.0.2"),
        ("X-Forwarded-Proto", "https"),
    ]
    await gw.client.post("/v1/chat/completions", json=CHAT, headers=CIMultiDict(chained))

    first, second = (seen.headers for seen in replica.seen)
    assert first["x-forwarded-for"] == "127.0.0.1"
    assert first["x-forwarded-proto"] == "http"
    assert second["x-forwarded-for"] == "203.0.113.7, 10.0.0.2, 127.0.0.1"
    assert second["x-forwarded-proto"] == "https"


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_compressed_request_body_reaches_the_replica_as_plain_json(
    start_replica: StartReplica, start_gateway: StartGateway, encoding: str
) -> None:
    """aiohttp's server inflates the client's body; the replica gets Sluice's plain JSON, so it
    must not also get the client's ``Content-Encoding`` (it answered 500 trying to inflate plain
    JSON, and the client got a 502 for a valid request). Fake replica records what it received."""
    replica = FakeReplica()
    _, url = await start_replica(replica)
    gw = await start_gateway({"r1": url})
    plain = json.dumps({**CHAT, "max_tokens": 7}).encode()
    body = gzip.compress(plain) if encoding == "gzip" else zlib.compress(plain)

    resp = await gw.client.post(
        "/v1/chat/completions",
        data=body,
        headers={"Content-Encoding": encoding, "Content-Type": "application/json"},
    )

    assert resp.status == 200, await resp.text()
    (seen,) = replica.seen
    assert "content-encoding" not in seen.headers
    assert seen.body["max_tokens"] == 7
