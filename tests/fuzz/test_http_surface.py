"""Hostile input against the whole HTTP surface of a real gateway (real port, real replicas).

Two parts:

* **schemathesis**, driven by the OpenAPI document the gateway itself serves at
  ``/openapi.json`` (``gateway.http.openapi``): for every operation, schema-conforming (positive) and
  schema-violating (negative) requests, with any ``x-request-id``, class and deadline headers,
  with a valid, a missing or a garbage API key. Every answer must be below 500 (the replicas stay
  healthy, so any 5xx would be Sluice's), conform to the document (status, content type, headers,
  body schema: errors have the OpenAI shape) and carry a sane ``x-request-id``;
* **hand-written cases** for what a schema cannot express: bodies over ``server.max_body_bytes``
  (with and without a ``Content-Length``), headers over aiohttp's 8190-byte limit, invalid UTF-8,
  JSON nested 1000 and 100000 deep, integers of 5000 digits, ``max_tokens`` negative or huge,
  ``n`` > 1, unknown fields, every prompt shape, CR/LF, NUL, non-ASCII and oversized values in
  ``x-request-id`` and ``Authorization`` (sent on a raw socket, since HTTP clients refuse them),
  a body cut short, wrong methods and routes.

Requests malformed at the HTTP layer (a bare CR or LF, a NUL, a folded or oversized header) never
reach Sluice: aiohttp's parser answers them with its own plain-text 400 and closes the connection.
They are checked to be a 400 or 431, never a 500, and never to echo the injected header.

Bounded and deterministic: ``derandomize=True``, no example database, ``deadline=None``; every
request has a timeout (``TIMEOUT_S``), so a hang fails the test instead of stalling it.
"""

from __future__ import annotations

import gzip
import json
import re
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from gateway.api.openai import MAX_TOKENS_LIMIT
from gateway.config.settings import ServerSettings
from gateway.http.openapi import OPENAPI_PATH, openapi_spec
from tests.fuzz.live import ADMIN_TOKEN, API_KEY, MAX_BODY_BYTES, MODEL, LiveGateway, serve_gateway

#: Seconds one request may take (connect and read); beyond it the test fails: a hang.
TIMEOUT_S = 20.0
#: Output cap of the native cases the TGI emulator answers (TGI's default, 100, when absent).
NATIVE_MAX_NEW_TOKENS = 8
#: Schemathesis examples per operation and generation mode.
FUZZ_EXAMPLES = 30
ERROR_KEYS = {"message", "type", "param", "code"}
GENERATED_ID = re.compile(r"[0-9a-f]{32}")
SANE_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")
OPERATIONS = [f"{method.upper()} {path}" for path, item in openapi_spec()["paths"].items() for method in item]
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
FUZZ_SETTINGS = settings(
    max_examples=FUZZ_EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def live() -> Iterator[LiveGateway]:
    with serve_gateway() as gateway:
        yield gateway


@pytest.fixture
def session() -> Iterator[requests.Session]:
    with requests.Session() as opened:
        yield opened


def auth(key: str = API_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def header(response: Any, name: str) -> str | None:
    """A response header, case-insensitively (schemathesis keeps lists, requests strings)."""
    for key, value in response.headers.items():
        if key.lower() == name.lower():
            return str(value[0] if isinstance(value, list) else value)
    return None


def assert_request_id(response: Any, sent: str | None) -> None:
    """The response carries the client's id when it was sane, else a generated one."""
    got = header(response, "x-request-id")
    assert got is not None, "no x-request-id"
    if sent is not None and SANE_ID.fullmatch(sent):
        assert got == sent
    else:
        assert GENERATED_ID.fullmatch(got), got


def assert_openai_error(response: requests.Response, status: int, param: str | None = None) -> dict[str, Any]:
    """``response`` is ``status`` with ``{"error": {"message", "type", "param", "code"}}``."""
    assert response.status_code == status, response.text
    assert response.headers["Content-Type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS
    assert isinstance(error["message"], str)
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    assert_request_id(response, None)
    return dict(error)


# -- schemathesis over the served OpenAPI document -----------------------------------------------------


@pytest.fixture(scope="module")
def schema(live: LiveGateway) -> Any:
    return schemathesis.openapi.from_url(live.url + OPENAPI_PATH)


def test_served_document_is_the_generated_one(live: LiveGateway, session: requests.Session) -> None:
    response = session.get(live.url + OPENAPI_PATH, timeout=TIMEOUT_S)

    assert response.status_code == 200
    assert response.json() == openapi_spec()
    assert_request_id(response, None)


#: The fuzz gateway's one tenant (``tests/fuzz/live.py``).
FUZZ_TENANT = "fuzz"
#: Mostly a valid key, so that most cases get past authentication to the parser and the replica.
CREDENTIALS = st.sampled_from(["valid", "valid", "valid", "missing", "garbage", "admin"])


#: (operation, mode): negative cases only where there is a body to break (a GET takes nothing
#: but free-form string headers, which no request can violate).
#: The key changes: no body to break, and no 2xx to expect here (the fuzz gateway has no keys
#: file to issue into, and no key id a fuzzer could guess); tests/unit/tenancy/test_keys_api.py.
KEY_CHANGES = frozenset({"POST /sluice/v1/tenants/{id}/keys", "DELETE /sluice/v1/tenants/{id}/keys/{key_id}"})
FUZZ_CASES = [
    pytest.param(label, mode, id=f"{label}-{mode}")
    for label in OPERATIONS
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    if mode is GenerationMode.POSITIVE or (label.startswith("POST ") and label not in KEY_CHANGES)
]


@pytest.mark.parametrize(("label", "mode"), FUZZ_CASES)
def test_schemathesis_fuzz(
    live: LiveGateway, schema: Any, session: requests.Session, label: str, mode: GenerationMode
) -> None:
    """Every generated request gets a documented answer below 500 with a sane request id."""
    method, path = label.split(" ", 1)
    assert live.routes(method, path), f"{label} is in the served OpenAPI document but not routed"
    strategy = schema[path][method].as_strategy(generation_mode=mode)
    statuses: dict[int, int] = {}

    @FUZZ_SETTINGS
    @given(case=strategy, credentials=CREDENTIALS, served_model=st.sampled_from([True, True, False]))
    def run(case: Any, credentials: str, served_model: bool) -> None:
        if mode is GenerationMode.POSITIVE and isinstance(case.body, dict):
            if served_model and "inputs" not in case.body:
                case.body["model"] = MODEL  # reach the replica, not only the 404 of an unknown model
            parameters = case.body.get("parameters")
            if isinstance(parameters, dict):  # the TGI emulator generates in real time: keep it short
                parameters["max_new_tokens"] = NATIVE_MAX_NEW_TOKENS
        if case.path_parameters and "id" in case.path_parameters:
            case.path_parameters["id"] = FUZZ_TENANT  # a tenant that exists, to reach the handler
        headers = {
            "valid": auth(),
            "missing": {},
            "garbage": auth("sk-not-a-key-of-anyone"),
            "admin": auth(ADMIN_TOKEN),
        }[credentials]
        response = case.call(base_url=live.url, session=session, headers=headers, timeout=TIMEOUT_S)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        checks = CHECKS if mode is GenerationMode.POSITIVE else [*CHECKS, negative_data_rejection]
        case.validate_response(response, checks=checks, headers=headers)
        assert response.status_code < 500, response.text
        assert_request_id(response, (case.headers or {}).get("x-request-id"))

    run()
    if label in KEY_CHANGES:
        assert all(status < 500 for status in statuses), statuses
    elif mode is GenerationMode.POSITIVE:
        assert statuses.get(200, 0) > 0, statuses  # the cases reached the handler and the replica
    else:
        # Schemathesis' own ``negative_data_rejection`` check (above) judges each case it really
        # broke; a mutation it could not make stick (its case is then valid after all) may pass on
        # to the replica, whose 2xx or own 4xx (TGI's 422) is a documented answer. Which mutations
        # stick varies with how long generation takes on a loaded machine.
        assert statuses.get(400, 0) > 0, statuses  # the parser refused broken bodies
        assert all(status < 500 for status in statuses), statuses


# -- raw bytes through the real parser ------------------------------------------------------------------

PROXIED_PATHS = ["/v1/chat/completions", "/v1/completions", "/generate", "/generate_stream", "/"]


@pytest.mark.parametrize("path", PROXIED_PATHS)
def test_any_bytes_are_answered_below_500(live: LiveGateway, session: requests.Session, path: str) -> None:
    assert live.routes("POST", path), f"POST {path} is not routed"

    @settings(FUZZ_SETTINGS, max_examples=40)
    @given(raw=st.binary(max_size=256) | st.text(max_size=64).map(str.encode))
    def run(raw: bytes) -> None:
        response = session.post(live.url + path, data=raw, headers=auth(), timeout=TIMEOUT_S)
        assert response.status_code < 500, response.text
        if response.status_code >= 400:
            assert_openai_error(response, response.status_code)

    run()


# -- hand-written hostile bodies -------------------------------------------------------------------------


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


def post(
    live: LiveGateway,
    session: requests.Session,
    body: bytes | dict[str, Any],
    path: str = "/v1/chat/completions",
) -> requests.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return session.post(
        live.url + path,
        data=data,
        headers={**auth(), "Content-Type": "application/json"},
        timeout=TIMEOUT_S,
    )


def test_body_over_the_limit_is_413(live: LiveGateway, session: requests.Session) -> None:
    body = json.dumps(chat(padding="x" * MAX_BODY_BYTES)).encode()

    error = assert_openai_error(post(live, session, body), 413)

    assert error["code"] == "request_too_large"


def test_chunked_body_over_the_limit_is_413(live: LiveGateway, session: requests.Session) -> None:
    """No ``Content-Length``: the limit holds while reading."""

    def chunks() -> Iterator[bytes]:
        for _ in range(2 * MAX_BODY_BYTES // 1024):
            yield b"x" * 1024

    response = session.post(
        live.url + "/v1/chat/completions", data=chunks(), headers=auth(), timeout=TIMEOUT_S
    )

    assert_openai_error(response, 413)


def test_header_over_aiohttps_limit_is_a_400_not_a_500(live: LiveGateway, session: requests.Session) -> None:
    response = session.post(
        live.url + "/v1/chat/completions",
        json=chat(),
        headers={**auth(), "x-padding": "a" * 10_000},
        timeout=TIMEOUT_S,
    )

    assert response.status_code in (400, 431)


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b'{"model": "test-model", "messages": [{"content": "\xff\xfe"}]}', id="invalid-utf8"),
        pytest.param(b'{"model": "test-\xc3', id="truncated-utf8"),
        pytest.param(b"", id="empty"),
        pytest.param(b"null", id="null"),
        pytest.param(b"[" * 1000 + b"]" * 1000, id="nested-1000-arrays"),
        pytest.param(b'{"a":' * 1000 + b"1" + b"}" * 1000, id="nested-1000-objects"),
        pytest.param(b"[" * 30_000 + b"]" * 30_000, id="nested-30000"),
        pytest.param(
            b'{"model": "test-model", "messages": [{"content": "x"}], "max_tokens": ' + b"9" * 5000 + b"}",
            id="5000-digit-max-tokens",
        ),
        pytest.param(
            b'{"model": "test-model", "messages": [{"content": "x"}], "x": '
            + b"[" * 1000
            + b"]" * 1000
            + b"}",
            id="nested-1000-in-extra-field",
        ),
    ],
)
def test_malformed_bodies_are_400(live: LiveGateway, session: requests.Session, raw: bytes) -> None:
    assert_openai_error(post(live, session, raw), 400)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        pytest.param({"max_tokens": 0}, "max_tokens", id="zero-max-tokens"),
        pytest.param({"max_tokens": -1}, "max_tokens", id="negative-max-tokens"),
        pytest.param({"max_tokens": MAX_TOKENS_LIMIT + 1}, "max_tokens", id="huge-max-tokens"),
        pytest.param({"max_tokens": 10**400}, "max_tokens", id="400-digit-max-tokens"),
        pytest.param({"max_completion_tokens": -(10**30)}, "max_completion_tokens", id="negative-mct"),
        pytest.param({"max_tokens": 1.5}, "max_tokens", id="float-max-tokens"),
        pytest.param({"max_tokens": "10"}, "max_tokens", id="string-max-tokens"),
        pytest.param({"stream": "yes"}, "stream", id="string-stream"),
        pytest.param({"stream_options": {"include_usage": 1}}, "stream_options", id="int-include-usage"),
        pytest.param({"model": ""}, "model", id="empty-model"),
        pytest.param({"model": ["a"]}, "model", id="list-model"),
        pytest.param({"messages": []}, "messages", id="no-messages"),
        pytest.param({"messages": "hi"}, "messages", id="string-messages"),
    ],
)
def test_wrong_types_are_400_naming_the_field(
    live: LiveGateway, session: requests.Session, fields: dict[str, Any], param: str
) -> None:
    assert_openai_error(post(live, session, chat(**fields)), 400, param)


def test_deep_nesting_around_the_depth_limit_streams(live: LiveGateway, session: requests.Session) -> None:
    """A stream body is re-encoded (usage asked for): nesting up to ``server.max_json_depth`` must
    decode and encode again; deeper is a 400 before it is decoded."""
    limit = ServerSettings().max_json_depth
    statuses = set()
    # The body's own object is level 1 and "x" its child: ``depth`` brackets reach depth + 1.
    for depth in range(limit - 8, limit + 8):
        raw = json.dumps(chat(stream=True)).encode()[:-1] + b', "x": ' + b"[" * depth + b"]" * depth + b"}"
        response = post(live, session, raw)
        statuses.add(response.status_code)
        assert response.status_code in (200, 400), response.text
        assert response.status_code == (200 if depth + 1 <= limit else 400), (depth, response.text)

    assert statuses == {200, 400}


@pytest.mark.parametrize("stream", [False, True])
def test_lone_surrogates_reach_the_replica_escaped(
    live: LiveGateway, session: requests.Session, stream: bool
) -> None:
    """``"\\ud800"`` is valid JSON that UTF-8 cannot hold; a stream is re-encoded by Sluice."""
    raw = json.dumps(chat(stream=stream, messages=[{"role": "user", "content": "a\ud800"}])).encode()

    response = post(live, session, raw)

    assert response.status_code == 200, response.text
    assert live.replica.seen[-1].body["messages"][0]["content"] == "a\ud800"


@pytest.mark.parametrize(
    "prompt",
    [
        pytest.param("text", id="string"),
        pytest.param(["a", "b"], id="strings"),
        pytest.param([1, 2, 3], id="token-ids"),
        pytest.param([[1, 2], [3]], id="lists-of-token-ids"),
        pytest.param([], id="empty-list"),
    ],
)
def test_prompt_arrays_are_relayed(live: LiveGateway, session: requests.Session, prompt: Any) -> None:
    response = post(live, session, {"model": MODEL, "prompt": prompt}, path="/v1/completions")

    assert response.status_code == 200, response.text
    assert live.replica.seen[-1].body["prompt"] == prompt


@pytest.mark.parametrize(
    "prompt",
    [
        pytest.param([1, "a"], id="mixed"),
        pytest.param(3, id="int"),
        pytest.param([[1], "a"], id="nested-mix"),
    ],
)
def test_bad_prompt_shapes_are_400(live: LiveGateway, session: requests.Session, prompt: Any) -> None:
    assert_openai_error(
        post(live, session, {"model": MODEL, "prompt": prompt}, path="/v1/completions"), 400, "prompt"
    )


def test_unknown_fields_pass_through_untouched(live: LiveGateway, session: requests.Session) -> None:
    extra = {"frobnicate": {"deep": [1, None, "x"]}, "top_k": 5, "logit_bias": {"42": -100}}

    response = post(live, session, chat(**extra))

    assert response.status_code == 200, response.text
    seen = live.replica.seen[-1].body
    assert {key: seen[key] for key in extra} == extra


def test_n_above_one_is_the_replicas_call(live: LiveGateway, session: requests.Session) -> None:
    """Sluice forwards ``n`` untouched (and budgets the request as one sequence): a replica that
    serves it answers (the fake here), one that refuses it (the emulator, as a vLLM that cannot)
    answers 400, which reaches the client unchanged: OpenAI-shaped, ``param`` ``n``."""
    served = post(live, session, chat(n=2))
    assert served.status_code == 200, served.text
    assert live.replica.seen[-1].body["n"] == 2

    refused = post(live, session, chat(n=2, model=live.emulated_model, max_tokens=2))

    assert refused.status_code == 400
    error = refused.json()["error"]
    assert set(error) == ERROR_KEYS
    assert error["param"] == "n"
    assert_request_id(refused, None)


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        pytest.param("GET", "/v1/chat/completions", 405, id="get-completions"),
        pytest.param("DELETE", "/v1/models", 405, id="delete-models"),
        pytest.param("POST", "/v1/nothing", 404, id="unknown-route"),
        pytest.param("GET", "/v1/chat/completions/../../etc/passwd", 404, id="traversal"),
    ],
)
def test_wrong_routes_and_methods(
    live: LiveGateway, session: requests.Session, method: str, path: str, status: int
) -> None:
    response = session.request(method, live.url + path, headers=auth(), timeout=TIMEOUT_S)

    assert_openai_error(response, status)


# -- hostile headers, on a raw socket -------------------------------------------------------------------


def raw_exchange(live: LiveGateway, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``request`` as is (``Connection: close``), read until the server closes; (status,
    headers, body). The write side stays open: a half-closed client may get no answer at all."""
    with socket.create_connection((live.host, live.port), timeout=TIMEOUT_S) as sock:
        sock.sendall(request)
        received = bytearray()
        while chunk := sock.recv(65536):
            received += chunk
    head, _, body = bytes(received).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, body


def raw_chat(extra_headers: bytes, *, with_key: bool = True) -> bytes:
    body = json.dumps(chat()).encode()
    key = b"Authorization: Bearer " + API_KEY.encode() + b"\r\n" if with_key else b""
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: sluice\r\nConnection: close\r\n"
        + key
        + extra_headers
        + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
        + body
    )


@pytest.mark.parametrize(
    "line",
    [
        pytest.param(b"X-Request-Id: abc\nX-Injected: 1\r\n", id="bare-lf"),
        pytest.param(b"X-Request-Id: abc\rX-Injected: 1\r\n", id="bare-cr"),
        pytest.param(b"X-Request-Id: abc\r\n X-Injected: 1\r\n", id="folded"),
        pytest.param(b"X-Request-Id: ab\x00c\r\n", id="nul"),
        pytest.param(b"X-Request-Id: abc\n\r\n", id="trailing-lf"),
        pytest.param(b"Authorization: Bearer a\x01b\r\nX-Injected: 1\r\n", id="control-in-key"),
    ],
)
def test_malformed_header_lines_are_a_400_and_never_echoed(live: LiveGateway, line: bytes) -> None:
    status, headers, body = raw_exchange(live, raw_chat(line))

    assert status == 400
    assert "x-injected" not in headers
    assert headers.get("x-request-id", "") != "abc"
    # Sluice's JSON error (gateway.http.parse_errors, installed by the harness as by `sluice serve`),
    # never aiohttp's plain text, which quotes the offending line back: the API key included.
    assert headers["content-type"].startswith("application/json")
    assert json.loads(body)["error"]["code"] == "malformed_request"
    assert API_KEY.encode() not in body
    assert b"X-Injected" not in body


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("été-☃".encode(), id="non-ascii-utf8"),
        pytest.param(b"\xff\xfe\xfd", id="invalid-utf8"),
        pytest.param(b"a" * 129, id="129-chars"),
        pytest.param(b"a" * 8000, id="8000-chars"),
        pytest.param(b"id with spaces", id="spaces"),
        pytest.param(b"<script>alert(1)</script>", id="markup"),
        pytest.param(b"%0d%0aX-Injected: 1", id="url-encoded-crlf"),
    ],
)
def test_insane_request_ids_are_replaced_not_echoed(live: LiveGateway, value: bytes) -> None:
    status, headers, body = raw_exchange(live, raw_chat(b"X-Request-Id: " + value + b"\r\n"))

    assert status == 200, body
    assert GENERATED_ID.fullmatch(headers["x-request-id"])
    assert "x-injected" not in headers


def test_sane_request_id_is_echoed(live: LiveGateway) -> None:
    status, headers, _ = raw_exchange(live, raw_chat(b"X-Request-Id: req-42.a:b/c+d=e@f\r\n"))

    assert (status, headers["x-request-id"]) == (200, "req-42.a:b/c+d=e@f")


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("Bearer é".encode(), id="non-ascii"),
        pytest.param(b"Bearer \xff\xfe", id="invalid-utf8"),
        pytest.param(b"Bearer " + b"k" * 8000, id="8000-char-key"),
        pytest.param(b"Bearer", id="scheme-only"),
        pytest.param(b"Bearer a b", id="two-words"),
        pytest.param(b"Basic " + API_KEY.encode(), id="basic"),
        pytest.param(b"Bearer " + API_KEY.encode() + b"%0d%0aX-Tenant: other", id="url-encoded-crlf"),
    ],
)
def test_hostile_authorization_is_401_without_echoing_it(live: LiveGateway, value: bytes) -> None:
    status, headers, body = raw_exchange(live, raw_chat(b"Authorization: " + value + b"\r\n", with_key=False))

    assert status == 401, body
    assert headers["www-authenticate"].startswith("Bearer")
    error = json.loads(body)["error"]
    assert set(error) == ERROR_KEYS
    presented = value.partition(b" ")[2]
    assert not presented or presented not in body
    assert GENERATED_ID.fullmatch(headers["x-request-id"])


def test_body_cut_short_is_closed_not_hung(live: LiveGateway, session: requests.Session) -> None:
    """A client announcing 100 bytes and sending 8 before hanging up: the gateway closes the
    connection (no hang, nothing to answer) and keeps serving."""
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: sluice\r\nAuthorization: Bearer "
        + API_KEY.encode()
        + b'\r\nContent-Length: 100\r\n\r\n{"model"'
    )
    with socket.create_connection((live.host, live.port), timeout=TIMEOUT_S) as sock:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        assert sock.recv(65536) == b""

    assert post(live, session, chat()).status_code == 200


def raw_request(
    extra_headers: bytes = b"",
    body: bytes | None = None,
    *,
    method: bytes = b"POST",
    path: bytes = b"/v1/chat/completions",
    content_length: bool = True,
) -> bytes:
    """A request with the tenant's key, ``Connection: close``, a JSON body's ``Content-Type`` and
    ``extra_headers`` as given."""
    payload = json.dumps(chat()).encode() if body is None else body
    length = b"Content-Length: %d\r\n" % len(payload) if content_length else b""
    return (
        method
        + b" "
        + path
        + b" HTTP/1.1\r\nHost: sluice\r\nConnection: close\r\nAuthorization: Bearer "
        + API_KEY.encode()
        + b"\r\nContent-Type: application/json\r\n"
        + extra_headers
        + length
        + b"\r\n"
        + payload
    )


@pytest.mark.parametrize(
    ("encoding", "body"),
    [
        pytest.param(b"gzip", b"not gzip at all", id="gzip"),
        pytest.param(b"deflate", b"\x00\x01 not deflate", id="deflate"),
        pytest.param(b"gzip", gzip.compress(b"{}")[:-6], id="gzip-truncated"),
    ],
)
def test_undecodable_content_encoding_is_400(live: LiveGateway, encoding: bytes, body: bytes) -> None:
    """aiohttp decodes the body while the handler reads it; a corrupt one used to be a 500."""
    status, headers, answer = raw_exchange(
        live, raw_request(b"Content-Encoding: " + encoding + b"\r\n", body)
    )

    assert status == 400, answer
    assert set(json.loads(answer)["error"]) == ERROR_KEYS
    assert GENERATED_ID.fullmatch(headers["x-request-id"])


def test_compressed_body_over_the_limit_is_413(live: LiveGateway) -> None:
    """The limit holds for the decoded size: 5 MB of JSON that gzip makes a few KiB."""
    bomb = gzip.compress(json.dumps(chat(padding="a" * 5_000_000)).encode())
    assert len(bomb) < MAX_BODY_BYTES

    status, _, answer = raw_exchange(live, raw_request(b"Content-Encoding: gzip\r\n", bomb))

    assert status == 413, answer
    assert json.loads(answer)["error"]["code"] == "request_too_large"


@pytest.mark.parametrize(
    "request_bytes",
    [
        pytest.param(
            raw_request(b"Content-Length: 99999999999999999999999\r\n", content_length=False),
            id="cl-overflow",
        ),
        pytest.param(raw_request(b"Transfer-Encoding: chunked\r\n"), id="cl-and-te"),
        pytest.param(
            raw_request(b"Transfer-Encoding: chunked\r\n", b"zz\r\nabc\r\n0\r\n\r\n", content_length=False),
            id="bad-chunk-size",
        ),
        pytest.param(raw_request(path=b"/" + b"a" * 9000), id="request-line-too-long"),
        pytest.param(raw_request(b"".join(b"X-H%d: v\r\n" % i for i in range(200))), id="too-many-headers"),
        pytest.param(raw_request(b"Expect: 999-nope\r\n"), id="unknown-expect"),
        pytest.param(raw_request(b"Content-Encoding: br\r\n", b"\x00garbage"), id="brotli-not-installed"),
    ],
)
def test_http_layer_garbage_is_4xx(live: LiveGateway, request_bytes: bytes) -> None:
    """Refused by aiohttp's parser before any middleware (plain-text 400/417, connection closed)."""
    status, _, answer = raw_exchange(live, request_bytes)

    assert 400 <= status < 500, answer


@pytest.mark.parametrize(
    ("value", "status"),
    [
        pytest.param(b"1e309", 400, id="exponent"),
        pytest.param(b"-1", 400, id="negative"),
        pytest.param(b"nan", 400, id="nan"),
        pytest.param(b"inf", 400, id="inf"),
        pytest.param(b"9" * 13, 400, id="13-digits"),
        pytest.param(b"999999999999.999999", 200, id="largest"),
        pytest.param(b"60000", 200, id="plain"),
    ],
)
def test_hostile_deadlines(live: LiveGateway, value: bytes, status: int) -> None:
    got, _, answer = raw_exchange(live, raw_request(b"x-sluice-deadline-ms: " + value + b"\r\n"))

    assert got == status, answer
    if status == 400:
        assert json.loads(answer)["error"]["param"] == "x-sluice-deadline-ms"


@pytest.mark.parametrize(
    ("first", "second", "status"),
    [
        pytest.param(API_KEY, "sk-nope", 200, id="valid-first"),
        pytest.param("sk-nope", API_KEY, 401, id="valid-second"),
    ],
)
def test_repeated_authorization_uses_the_first(
    live: LiveGateway, first: str, second: str, status: int
) -> None:
    """Two ``Authorization`` headers: the first one decides (a second cannot switch tenant)."""
    body = json.dumps(chat()).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: sluice\r\nConnection: close\r\n"
        + f"Authorization: Bearer {first}\r\nAuthorization: Bearer {second}\r\n".encode()
        + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
        + body
    )

    got, _, answer = raw_exchange(live, request)

    assert got == status, answer
