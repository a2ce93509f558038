"""Strict where the engines are strict: non-finite numbers, bodies not sent as JSON, and lists of
prompts, through a real gateway in front of a fake replica (real HTTP, the real ``openai`` SDK)."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from gateway.api.json_body import JSON_TOO_COMPLEX, NOT_AN_OBJECT, load_object
from gateway.http.errors import InvalidRequest
from tests.unit.gateway.conftest import StartGateway, StartReplica
from tests.unit.gateway.fakes import MODEL, FakeReplica, Gateway

CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize(
    ("raw", "message", "param"),
    [
        pytest.param(b'{"temperature": NaN}', "temperature: must be", "temperature", id="nan"),
        pytest.param(b'{"top_p": Infinity}', "top_p: must be a finite number", "top_p", id="infinity"),
        pytest.param(b'{"a": 1, "b": -Infinity}', "b: must be a finite number", "b", id="minus-infinity"),
        pytest.param(b'{"top_p": 1e999}', "top_p: must be a finite number", "top_p", id="overflow-1e999"),
        pytest.param(
            b'{"logit_bias": {"50256": 1.5, "7": NaN}}',
            "logit_bias.7: must be a finite number",
            "logit_bias",
            id="nested-object",
        ),
        pytest.param(
            b'{"messages": [{"content": "x"}, {"content": [0.5, Infinity]}]}',
            "messages.1.content.1: must be a finite number",
            "messages",
            id="nested-list",
        ),
        pytest.param(b"NaN", NOT_AN_OBJECT, None, id="bare-nan"),
        pytest.param(
            b'{"": Infinity\x00}',
            "request body is not valid JSON (line 1, column 14)",
            None,
            id="nan-then-junk",
        ),
        pytest.param(b"[1, 2]", NOT_AN_OBJECT, None, id="not-an-object"),
        pytest.param(b'{"a": 1', "request body is not valid JSON (line 1, column 8)", None, id="truncated"),
        pytest.param(b"", "request body is not valid JSON (line 1, column 1)", None, id="empty"),
        pytest.param(b'{"a": "\xff"}', "request body is not valid JSON: it is not", None, id="not-utf8"),
        pytest.param(b'{"a": ' + b"1" * 5000 + b"}", JSON_TOO_COMPLEX, None, id="integer-too-long"),
        pytest.param(b"[" * 100_000 + b"]" * 100_000, "request body nests deeper than", None, id="too-deep"),
    ],
)
def test_load_object_refuses_with_a_fixed_message(raw: bytes, message: str, param: str | None) -> None:
    with pytest.raises(InvalidRequest) as caught:
        load_object(raw)
    assert caught.value.message.startswith(message)
    assert (caught.value.status, caught.value.param) == (400, param)


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b'{"temperature": 0.5, "n": 2, "x": [1e308, -2.5e-3]}', id="finite-floats"),
        pytest.param(b'{"text": "NaN Infinity"}', id="words-in-strings"),
        pytest.param('{"a": "é"}'.encode("utf-16"), id="utf-16"),
    ],
)
def test_load_object_reads_what_json_loads_reads(raw: bytes) -> None:
    assert load_object(raw) == json.loads(raw)


async def _post(gw: Gateway, raw: bytes, content_type: str | None, path: str = "/v1/chat/completions") -> Any:
    headers = {} if content_type is None else {"Content-Type": content_type}
    # skip_auto_headers: aiohttp would add ``application/octet-stream`` to a bytes body.
    return await gw.client.post(path, data=raw, headers=headers, skip_auto_headers={"Content-Type"})


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        pytest.param(
            "/v1/chat/completions",
            b'{"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
            "temperature",
            id="chat-nan",
        ),
        pytest.param(
            "/v1/completions",
            b'{"model": "test-model", "prompt": "hi", "top_p": Infinity}',
            "top_p",
            id="completions-infinity",
        ),
    ],
)
async def test_a_non_finite_number_is_a_400_naming_the_field(
    start_replica: StartReplica, start_gateway: StartGateway, path: str, raw: bytes, param: str
) -> None:
    """Python's ``json`` (and so a hand-made body) writes ``NaN``; the ``openai`` SDK refuses to.
    The gateway refuses it before any budget, admission or replica sees it."""
    replica = FakeReplica()
    _, url = await start_replica(replica)
    gw = await start_gateway({"r1": url})

    resp = await _post(gw, raw, "application/json", path)

    assert resp.status == 400
    assert await resp.json() == {
        "error": {
            "message": f"{param}: must be a finite number (NaN and Infinity are not JSON)",
            "type": "invalid_request_error",
            "param": param,
            "code": None,
        }
    }
    assert replica.seen == []


@pytest.mark.parametrize(
    "content_type",
    [
        pytest.param("text/plain", id="text-plain"),
        pytest.param(None, id="none"),
        pytest.param("application/x-www-form-urlencoded", id="form-curl-d"),
        pytest.param("application/octet-stream", id="octet-stream"),
        pytest.param("application/jsonx", id="lookalike"),
    ],
)
async def test_a_body_not_sent_as_json_is_refused_whatever_it_holds(
    start_replica: StartReplica, start_gateway: StartGateway, content_type: str | None
) -> None:
    """vLLM and SGLang refuse every media type but ``application/json`` (TGI answers 415): a
    JSON-looking body sent as anything else is refused, never forwarded."""
    replica = FakeReplica()
    _, url = await start_replica(replica)
    gw = await start_gateway({"r1": url})

    resp = await _post(gw, json.dumps(CHAT).encode(), content_type)

    assert resp.status == 415
    assert await resp.json() == {
        "error": {
            "message": "the request body must be sent with Content-Type: application/json",
            "type": "invalid_request_error",
            "param": "content-type",
            "code": "unsupported_media_type",
        }
    }
    assert replica.seen == []
    assert gw.outcomes[-1].status == 415


@pytest.mark.parametrize(
    "content_type",
    [
        pytest.param("application/json", id="plain"),
        pytest.param("Application/JSON; charset=utf-8", id="any-case-with-charset"),
    ],
)
async def test_json_media_types_pass(
    start_replica: StartReplica, start_gateway: StartGateway, content_type: str
) -> None:
    replica = FakeReplica()
    _, url = await start_replica(replica)
    gw = await start_gateway({"r1": url})

    resp = await _post(gw, json.dumps({**CHAT, "stream": False}).encode(), content_type)

    assert resp.status == 200, await resp.text()
    assert len(replica.seen) == 1


async def test_the_openai_sdk_sends_a_list_of_prompts_as_several_sequences(
    start_replica: StartReplica, start_gateway: StartGateway
) -> None:
    """The SDK's ``prompt=[...]`` reaches the replica unchanged; its sizing is
    ``tests/unit/tenancy/test_middleware.py``'s (one reservation per prompt and choice)."""
    replica = FakeReplica()
    _, url = await start_replica(replica)
    gw = await start_gateway({"r1": url})
    client = openai.AsyncOpenAI(api_key="unused", base_url=str(gw.client.make_url("/v1")), max_retries=0)

    stream = await client.completions.create(model=MODEL, prompt=["a", "b", "c"], n=2, stream=True)
    async for _ in stream:
        pass

    assert replica.seen[0].body["prompt"] == ["a", "b", "c"]
    assert replica.seen[0].body["n"] == 2


@pytest.mark.parametrize(
    ("prompt", "status"),
    [
        # Four prompts of 3,000 tokens on a 4,096-token context: each sequence fits.
        pytest.param([[7] * 3000] * 4, 200, id="each-fits"),
        # One of them is 5,000 tokens alone: no replica can ever hold that sequence.
        pytest.param([[7] * 3000, [7] * 5000], 400, id="one-too-long"),
    ],
)
async def test_each_prompt_of_a_list_must_fit_the_context_alone(
    start_replica: StartReplica, start_gateway: StartGateway, prompt: list[list[int]], status: int
) -> None:
    """vLLM decodes one sequence per prompt: the context limit applies to each, not to their sum."""
    replica = FakeReplica()  # max_model_len 4096
    _, url = await start_replica(replica)
    gw = await start_gateway({"r1": url})

    resp = await gw.client.post(
        "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 16, "stream": False}
    )

    assert resp.status == status, await resp.text()
    if status == 400:
        error = (await resp.json())["error"]
        assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt")
        assert "maximum context length is 4096 tokens" in error["message"]
        assert replica.seen == []
