"""build_app() served in-process on a real port: HTTP details, and the disconnect fallbacks.

The runner here keeps aiohttp's default ``handler_cancellation=False`` (aiohttp's own test server
turns it on), so a vanished client is noticed only by the emulator's own means: a failed SSE write
or the transport watcher. ``main`` turns cancellation on as well; the subprocess tests cover that.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from yarl import URL

from simulator import tokens
from simulator.profile import load_profile
from simulator.replica import REPLICA, VLLM_VERSION, Replica
from simulator.server import build_app

pytestmark = pytest.mark.timeout(60)

MAX_MODEL_LEN = 512
DEADLINE_S = 30.0


class Client:
    def __init__(self, app: web.Application, base_url: str, session: aiohttp.ClientSession) -> None:
        self.app = app
        self.base_url = URL(base_url)
        self.session = session

    def url(self, path: str) -> URL:
        return self.base_url.with_path(path)

    @property
    def replica(self) -> Replica:
        return self.app[REPLICA]

    async def post(
        self, path: str, body: Any = None, *, raw: bytes | None = None, content_type: str = "application/json"
    ) -> tuple[int, Any]:
        kwargs: dict[str, Any] = {"json": body}
        if raw is not None:
            kwargs = {"data": raw, "headers": {"Content-Type": content_type}}
        async with self.session.post(self.url(path), **kwargs) as resp:
            text = await resp.text()
            if resp.content_type == "application/json":
                return resp.status, await resp.json()
            return resp.status, text


@pytest.fixture
async def client() -> AsyncIterator[Client]:
    profile = load_profile("llama3-8b-h100").with_engine(max_model_len=MAX_MODEL_LEN)
    app = build_app(profile, seed=3)
    runner = web.AppRunner(app, handler_cancellation=False)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        async with aiohttp.ClientSession() as session:
            yield Client(app, f"http://{host}:{port}", session)
    finally:
        await runner.cleanup()


def vllm_error(status: int, err_type: str, param: str | None) -> dict[str, Any]:
    return {"status": status, "type": err_type, "param": param, "code": status}


@pytest.mark.parametrize(
    ("path", "body", "raw", "expected"),
    [
        pytest.param(
            # FastAPI's RequestValidationError through vLLM's handler: param is where decoding failed.
            "/v1/completions", None, b"{oops", vllm_error(400, "Bad Request", "body.1"), id="invalid-json"
        ),
        pytest.param(
            "/v1/completions", {"max_tokens": 3}, None, vllm_error(400, "BadRequestError", "prompt"),
            id="missing-prompt",
        ),
        pytest.param(
            "/v1/chat/completions", {"model": "x", "messages": []}, None,
            vllm_error(404, "NotFoundError", "model"), id="unknown-model",
        ),
        pytest.param(
            "/v1/chat/completions", {"max_tokens": 3}, None, vllm_error(400, "Bad Request", "body.messages"),
            id="missing-messages",
        ),
        pytest.param(
            # As in vLLM (FastAPI validates the body before the model is looked up): 400 wins.
            "/v1/chat/completions", {"model": "x"}, None, vllm_error(400, "Bad Request", "body.messages"),
            id="invalid-body-before-unknown-model",
        ),
        pytest.param(
            "/v1/completions", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN + 1}, None,
            vllm_error(400, "BadRequestError", "max_tokens"), id="max-tokens-over-max-model-len",
        ),
        pytest.param(
            "/v1/completions", {"prompt": [1] * (MAX_MODEL_LEN + 1), "max_tokens": 3}, None,
            vllm_error(400, "BadRequestError", "input_tokens"), id="prompt-over-max-model-len",
        ),
        pytest.param(
            "/v1/completions", {"prompt": "hi", "n": 3}, None, vllm_error(400, "BadRequestError", "n"),
            id="n-above-one",
        ),
    ],
)  # fmt: skip
async def test_error_bodies(
    client: Client, path: str, body: Any, raw: bytes | None, expected: dict[str, Any]
) -> None:
    status, payload = await client.post(path, body, raw=raw)
    assert status == expected["status"]
    assert set(payload) == {"error"}
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == (
        expected["type"],
        expected["param"],
        expected["code"],
    )
    assert error["message"]


async def test_generation_body_must_be_typed_json(client: Client) -> None:
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    status, payload = await client.post("/v1/completions", raw=body, content_type="text/plain")
    assert status == 400
    assert payload["error"]["type"] == "Bad Request"
    assert payload["error"]["param"] is None
    assert "Only 'application/json' is allowed" in payload["error"]["message"]


async def test_body_that_is_not_utf8_gets_fastapis_detail(client: Client) -> None:
    status, payload = await client.post("/v1/completions", raw=b'{"prompt": "\xff\xfe"}')
    assert (status, payload) == (400, {"detail": "There was an error parsing the body"})


async def test_prompt_plus_max_tokens_over_context_is_capped_not_rejected(client: Client) -> None:
    # vLLM 0.32 answers 200 and stops the output where the context ends.
    prompt = [1] * (MAX_MODEL_LEN - 6)
    status, payload = await client.post("/v1/completions", {"prompt": prompt, "max_tokens": MAX_MODEL_LEN})
    assert status == 200
    assert payload["usage"] == {
        "prompt_tokens": MAX_MODEL_LEN - 6,
        "total_tokens": MAX_MODEL_LEN,
        "completion_tokens": 6,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    assert payload["choices"][0]["finish_reason"] == "length"


async def test_routing_errors_look_like_fastapi(client: Client) -> None:
    async with client.session.get(client.url("/v2/nothing")) as resp:
        assert (resp.status, await resp.json()) == (404, {"detail": "Not Found"})
    async with client.session.get(client.url("/v1/completions")) as resp:
        assert (resp.status, await resp.json()) == (405, {"detail": "Method Not Allowed"})


async def test_info_endpoints(client: Client) -> None:
    async with client.session.get(client.url("/health")) as resp:
        assert resp.status == 200
        assert await resp.read() == b""
    async with client.session.get(client.url("/version")) as resp:
        assert await resp.json() == {"version": VLLM_VERSION}
    async with client.session.get(client.url("/load")) as resp:
        assert await resp.json() == {"server_load": 0}
    async with client.session.get(client.url("/v1/models")) as resp:
        models = await resp.json()
    assert models["object"] == "list"
    (card,) = models["data"]
    assert set(card) == {
        "id",
        "object",
        "created",
        "owned_by",
        "root",
        "parent",
        "max_model_len",
        "permission",
    }
    assert (card["object"], card["owned_by"], card["parent"], card["max_model_len"]) == (
        "model",
        "vllm",
        None,
        MAX_MODEL_LEN,
    )
    assert card["permission"][0]["object"] == "model_permission"


@pytest.mark.parametrize(
    ("tokenize_body", "generate_path", "generate_body"),
    [
        pytest.param(
            {"prompt": "Hello, big world!"}, "/v1/completions", {"prompt": "Hello, big world!"}, id="prompt"
        ),
        pytest.param(
            {"messages": [{"role": "user", "content": "Hello there"}]},
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hello there"}]},
            id="messages",
        ),
    ],
)
async def test_tokenize_count_equals_usage_prompt_tokens(
    client: Client, tokenize_body: dict[str, Any], generate_path: str, generate_body: dict[str, Any]
) -> None:
    status, tokenized = await client.post("/tokenize", tokenize_body)
    assert status == 200
    assert tokenized["count"] == len(tokenized["tokens"])
    assert tokenized["max_model_len"] == MAX_MODEL_LEN
    status, generated = await client.post(generate_path, {**generate_body, "max_tokens": 2})
    assert status == 200
    assert generated["usage"]["prompt_tokens"] == tokenized["count"]


async def test_sse_wire_format(client: Client) -> None:
    body = {"prompt": "x", "max_tokens": 3, "ignore_eos": True, "stream": True, "stream_options": {}}
    async with client.session.post(client.url("/v1/completions"), json=body) as resp:
        assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
        raw = await resp.read()
    events = raw.split(b"\n\n")
    assert events[-1] == b""
    assert events[-2] == b"data: [DONE]"
    assert all(e.startswith(b"data: {") for e in events[:-2])
    assert b'"choices":[]' in events[-3]  # include_usage defaults to true in stream_options


async def test_same_prompt_same_text(client: Client) -> None:
    body = {"prompt": "repeatable", "max_tokens": 6, "ignore_eos": True}
    _, first = await client.post("/v1/completions", body)
    _, second = await client.post("/v1/completions", body)
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    assert tokens.count_text_tokens(first["choices"][0]["text"]) == 6


async def wait_until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        if check():
            return
        await asyncio.sleep(0.01)
    pytest.fail(f"timed out waiting for {what}")


async def wait_for_abort(client: Client) -> None:
    replica = client.replica

    def aborted_and_freed() -> bool:
        counted = replica.engine.stats.finished_by_reason["abort"] == 1
        return counted and replica.engine.num_running == 0 and replica.num_inflight == 0

    await wait_until(aborted_and_freed, "the disconnected request to be aborted")


async def test_watcher_aborts_a_non_streaming_request_whose_client_left(client: Client) -> None:
    body = {"prompt": "x", "max_tokens": 400, "ignore_eos": True}
    async with aiohttp.ClientSession() as leaver:
        pending = asyncio.ensure_future(leaver.post(client.url("/v1/completions"), json=body))
        await wait_until(lambda: client.replica.engine.num_running == 1, "the request to run")
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
    await wait_for_abort(client)


async def test_stream_client_leaving_aborts(client: Client) -> None:
    body = {"prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as leaver:
        resp = await leaver.post(client.url("/v1/completions"), json=body)
        await resp.content.readline()
        resp.close()
    await wait_for_abort(client)


async def test_dead_engine_fails_requests_and_health(client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_complete(plan: object, now: float) -> None:
        raise RuntimeError("injected engine failure")

    monkeypatch.setattr(client.replica.engine, "complete", broken_complete)
    status, payload = await client.post("/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 500
    assert payload["error"]["type"] == "InternalServerError"
    async with client.session.get(client.url("/health")) as resp:
        assert resp.status == 503
    status, payload = await client.post(
        "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}
    )
    assert status == 500


@pytest.mark.parametrize("stream", [pytest.param(False, id="json"), pytest.param(True, id="sse")])
async def test_shutdown_tells_connected_clients_503(stream: bool) -> None:
    app = build_app(load_profile("llama3-8b-h100"), seed=5)
    runner = web.AppRunner(app, handler_cancellation=False, shutdown_timeout=10.0)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    body = {"prompt": "x", "max_tokens": 4000, "ignore_eos": True, "stream": stream}
    async with aiohttp.ClientSession() as session:
        pending = asyncio.ensure_future(session.post(f"http://{host}:{port}/v1/completions", json=body))
        await wait_until(lambda: app[REPLICA].engine.num_running == 1, "the request to run")
        # Were the request drained instead of aborted, aiohttp would cancel its handler after
        # shutdown_timeout (the 4000 tokens take about 30 s) and the client would see no 503.
        await runner.cleanup()
        resp = await pending
        if stream:
            assert resp.status == 200
            events = (await resp.read()).split(b"\n\n")
            assert events[-2:] == [b"data: [DONE]", b""]
            assert json.loads(events[-3].removeprefix(b"data: "))["error"]["code"] == 503
        else:
            assert resp.status == 503
            assert (await resp.json())["error"]["type"] == "ServiceUnavailableError"
