"""Bounded bodies: ``check_shape`` refuses a body nesting too deep or holding too many values
from its raw bytes, before it is decoded, and the gateway answers that 400 with the setting named;
big bodies are parsed off the event loop."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from gateway.api import json_body
from gateway.api import openai as openai_api
from gateway.api.json_body import DEFAULT_LIMITS, JsonLimits, check_shape, load_object
from gateway.config.settings import ServerSettings
from gateway.http.errors import InvalidRequest
from tests.unit.gateway.conftest import StartGateway, StartReplica
from tests.unit.gateway.fakes import MODEL, FakeReplica, gateway_settings

SMALL = JsonLimits(max_depth=4, max_items=10)


def _refusal(raw: bytes, limits: JsonLimits = SMALL) -> str:
    with pytest.raises(InvalidRequest) as caught:
        check_shape(raw, limits)
    err = caught.value
    assert (err.status, err.param, err.code) == (400, None, "request_too_complex")
    return err.message


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b'{"a": [[{"b": 1}]]}', id="depth-4"),
        pytest.param(b'{"a": [1, 2, 3, 4, 5, 6, 7, 8]}', id="10-values"),
        pytest.param(b'{"a": "[[[[[[,,,,,,,,,,,,{{{{{"}', id="brackets-and-commas-in-a-string"),
        pytest.param(b'{"a": "\\"[[[[[,,,,,,,,,,\\\\", "b": "\\\\\\"{{{{{{{{"}', id="escaped-quotes"),
        pytest.param('{"a": "é[[[[[[[[[", "b": ["ü"]}'.encode(), id="utf-8"),
        pytest.param('{"a": "\u0122[[[[[[[["}'.encode("utf-16-le"), id="utf-16-quote-byte"),
        pytest.param(b"", id="empty"),
    ],
)
def test_bodies_within_the_limits_pass(raw: bytes) -> None:
    check_shape(raw, SMALL)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        pytest.param(
            b'{"a": [[[{"b": 1}]]]}', "nests deeper than 4 levels (server.max_json_depth)", id="depth-5"
        ),
        pytest.param(b'{"a": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]}', "holds more than 10 values", id="11-values"),
        pytest.param(
            b'{"a": [{}, {}, {}, {}, {}, {}, {}, {}, {}]}', "holds more than 10", id="empty-objects"
        ),
        pytest.param(
            b'{"a": "\\\\", "b": [[[["x"]]]]}', "nests deeper than 4", id="after-an-escaped-backslash"
        ),
        pytest.param('{"a": [[[[["é"]]]]]}'.encode("utf-16"), "nests deeper than 4", id="utf-16"),
        pytest.param(b"[" * 100_000 + b"]" * 100_000, "holds more than 10", id="deep-counts-as-many"),
    ],
)
def test_bodies_over_the_limits_are_refused_naming_the_setting(raw: bytes, message: str) -> None:
    assert message in _refusal(raw)


def test_load_object_checks_the_shape_before_decoding() -> None:
    deep = b'{"a": ' + b"[" * 65 + b"]" * 65 + b"}"
    with pytest.raises(InvalidRequest, match="nests deeper than 64 levels"):
        load_object(deep)
    assert load_object(deep, JsonLimits(max_depth=66)) == json.loads(deep)


def test_the_defaults_take_99_000_token_ids_and_deep_tool_schemas() -> None:
    server = ServerSettings()
    assert (server.max_json_depth, server.max_json_items) == (
        DEFAULT_LIMITS.max_depth,
        DEFAULT_LIMITS.max_items,
    )
    tokens = json.dumps({"model": MODEL, "prompt": list(range(99_000))}).encode()
    check_shape(tokens, DEFAULT_LIMITS)
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(14):
        schema = {"type": "object", "properties": {"x": schema}}
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    check_shape(json.dumps({"model": MODEL, "messages": [], "tools": [tool]}).encode(), DEFAULT_LIMITS)


async def _post(gw: Any, raw: bytes) -> Any:
    return await gw.client.post(
        "/v1/chat/completions", data=raw, headers={"Content-Type": "application/json"}
    )


@pytest.mark.parametrize("padding", [0, openai_api.OFF_LOOP_BYTES], ids=["on-the-loop", "on-a-thread"])
async def test_the_gateway_refuses_an_over_complex_body_before_any_replica_sees_it(
    start_replica: StartReplica, start_gateway: StartGateway, padding: int
) -> None:
    replica = FakeReplica()
    _, url = await start_replica(replica)
    settings = gateway_settings({"r1": url})
    settings = settings.model_copy(
        update={"server": settings.server.model_copy(update={"max_json_depth": 8, "max_json_items": 100})}
    )
    gw = await start_gateway(settings=settings)
    pad = " " * padding

    items = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}] * 101, "pad": pad}
    resp = await _post(gw, json.dumps(items).encode())
    assert resp.status == 400
    assert await resp.json() == {
        "error": {
            "message": "request body holds more than 100 values (server.max_json_items)",
            "type": "invalid_request_error",
            "param": None,
            "code": "request_too_complex",
        }
    }
    deep = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": [[[[[[["x"]]]]]]]}], "pad": pad}
    )
    resp = await _post(gw, deep.encode())
    assert resp.status == 400
    assert (await resp.json())["error"][
        "message"
    ] == "request body nests deeper than 8 levels (server.max_json_depth)"
    assert replica.seen == []

    fine = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "pad": pad}
    resp = await _post(gw, json.dumps(fine).encode())
    assert resp.status == 200
    assert len(replica.seen) == 1


def _reference(value: object, level: int = 1) -> tuple[int, int]:
    """(values as ``check_shape`` counts them, depth) from the decoded body: each array or
    object counts its length, at least 1."""
    if isinstance(value, dict):
        children: list[object] = list(value.values())
    elif isinstance(value, list):
        children = list(value)
    else:
        return 0, level - 1
    items, depth = max(len(children), 1), level
    for child in children:
        sub_items, sub_depth = _reference(child, level + 1)
        items, depth = items + sub_items, max(depth, sub_depth)
    return items, depth


_TRICKY = ["", "]]]]", "[[{{", ',,"', "\\", '\\"]', "\\\\", "é[", '}}]]\\\\\\"[[']


def _random_value(rng: random.Random, level: int) -> object:
    kind = rng.randrange(5 if level < 12 else 2)
    if kind == 0:
        return rng.choice(_TRICKY) * rng.randrange(1, 4)
    if kind == 1:
        return rng.randrange(100)
    if kind in (2, 3):
        return [_random_value(rng, level + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(_TRICKY) + str(i): _random_value(rng, level + 1) for i in range(rng.randrange(4))}


@pytest.mark.parametrize("segment", [3, 7, 64 * 1024])
def test_the_scan_agrees_with_the_decoded_body_across_segments(
    monkeypatch: pytest.MonkeyPatch, segment: int
) -> None:
    """Strings full of brackets, commas, escaped quotes and backslashes, cut anywhere by small
    segments: the limits refuse exactly the bodies the decoded values go over."""
    monkeypatch.setattr(json_body, "_SEGMENT", segment)
    rng = random.Random(segment)
    for _ in range(300):
        body = {"model": MODEL, "x": _random_value(rng, 2)}
        raw = json.dumps(body, ensure_ascii=rng.random() < 0.5).encode()
        items, depth = _reference(body)
        check_shape(raw, JsonLimits(max_depth=depth, max_items=items))
        with pytest.raises(InvalidRequest, match=r"server\.max_json_items"):
            check_shape(raw, JsonLimits(max_depth=depth, max_items=items - 1))
        if depth > 2:
            with pytest.raises(InvalidRequest, match=r"server\.max_json_depth"):
                check_shape(raw, JsonLimits(max_depth=depth - 1, max_items=items))


def test_closing_brackets_in_a_string_do_not_hide_deep_nesting() -> None:
    raw = b'{"a": "' + b"]" * 100 + b'", "b": ' + b"[" * 80 + b"]" * 80 + b"}"
    assert "nests deeper than 64" in _refusal(raw, DEFAULT_LIMITS)
