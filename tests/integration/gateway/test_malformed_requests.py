"""Requests aiohttp's HTTP parser refuses, sent on raw sockets to a real `sluice serve` process.

A control character or a NUL in an ``Authorization: Bearer <the tenant's key>`` header, a header
or request line over aiohttp's 8190 bytes, a bad method, a bare LF, too many headers: each is
answered with Sluice's OpenAI-style JSON error (``gateway.http.parse_errors``) with aiohttp's status
(400), the connection is closed, neither the body nor the gateway's log nor ``/metrics`` holds
the key, and the gateway goes on serving. The admin listener answers the same way.
"""

from __future__ import annotations

import hashlib
import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import aiohttp
import pytest
import yaml
from aiohttp.web_protocol import RequestHandler

from gateway.http.parse_errors import HANDLE_ERROR_PARAMETERS, MALFORMED_REQUEST, hook_supported
from gateway.tenants import hash_api_key
from tests.integration.stack.conftest import _sluice
from tests.support.procs import Proc, free_port

pytestmark = pytest.mark.timeout(180)

#: The tenant's key: what a malformed header must never echo.
KEY = "sk-h9-malformed-tenant-6b1d93e0f2"
ADMIN_TOKEN = "sluice-admin-malformed-token-4c8a"
#: Seconds a raw exchange may take before the test fails (a hang, or a connection left open).
TIMEOUT_S = 20.0
#: The gateway's INFO line for a request aiohttp could not parse (``RedactMalformedRequests``).
REFUSED_LINE = "malformed HTTP request refused"


@dataclass(frozen=True)
class Served:
    public_port: int
    admin_port: int
    gateway: Proc


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("malformed")
    public_port, admin_port, emulator_port = free_port(), free_port(), free_port()
    config = {
        "server": {"host": "127.0.0.1", "port": public_port},
        "admin": {
            "host": "127.0.0.1",
            "port": admin_port,
            "token_sha256": hashlib.sha256(ADMIN_TOKEN.encode()).hexdigest(),
        },
        "emulators": [{"name": "emu-0", "port": emulator_port, "seed": 1}],
        "tenants": {"tenants": {"team": {"api_keys": [hash_api_key(KEY)]}}},
    }
    config_path = tmp / "sluice.yaml"
    config_path.write_text(yaml.safe_dump(config))
    gateway = Proc([*_sluice(), "serve", "--config", str(config_path)], name="gateway-malformed")
    try:
        gateway.wait_http(f"http://127.0.0.1:{public_port}/readyz")
        yield Served(public_port, admin_port, gateway)
    finally:
        gateway.stop()


def exchange(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``request`` raw, read until the gateway closes the connection: status, headers (lower
    case names), body. A connection left open fails with ``TimeoutError``."""
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock:
        sock.sendall(request)
        received = bytearray()
        while chunk := sock.recv(65536):
            received += chunk
    head, _, body = bytes(received).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split(" ")[1]), headers, body


def get(url: str, token: str) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def chat(header_lines: bytes, *, request_line: bytes = b"POST /v1/chat/completions HTTP/1.1") -> bytes:
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    return (
        request_line
        + b"\r\nHost: sluice\r\n"
        + header_lines
        + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
        + body
    )


BEARER = b"Authorization: Bearer " + KEY.encode()

CASES = [
    pytest.param(chat(BEARER + b"\x01\r\n"), "Invalid header value char", id="control-char-in-key"),
    pytest.param(
        chat(b"Authorization: Bearer sk-h9\x00" + KEY.encode() + b"\r\n"),
        "Invalid header value char",
        id="nul-in-key",
    ),
    pytest.param(
        chat(BEARER + b"\nX-Injected: 1\r\n"),
        "Missing expected CR after header value",
        id="bare-lf-after-key",
    ),
    pytest.param(
        chat(BEARER + b"k" * 9000 + b"\r\n"), "request line or header too long", id="over-long-key-header"
    ),
    pytest.param(
        chat(BEARER + b"\r\n", request_line=b"P\x01ST /v1/chat/completions HTTP/1.1"),
        "Invalid method encountered",
        id="bad-method",
    ),
    pytest.param(
        chat(BEARER + b"\r\n", request_line=KEY.encode() + b" garbage"),
        "Invalid method encountered",
        id="key-as-request-line",
    ),
    pytest.param(
        chat(BEARER + b"\r\n", request_line=b"GET /" + b"a" * 9000 + b" HTTP/1.1"),
        "request line or header too long",
        id="over-long-request-line",
    ),
    pytest.param(
        chat(BEARER + b"\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(200))),
        "Too many headers received",
        id="too-many-headers",
    ),
    pytest.param(
        chat(BEARER + b"\r\nContent-Length: 1" + KEY.encode() + b"\r\n"),
        "Invalid character in Content-Length",
        id="key-in-content-length",
    ),
]


def assert_malformed_answer(answer: tuple[int, dict[str, str], bytes], reason: str) -> None:
    status, headers, body = answer
    assert status == 400, body
    assert headers["content-type"] == "application/json"
    assert headers["server"] == "sluice"  # never aiohttp's, which names its and Python's versions
    assert json.loads(body) == {
        "error": {
            "message": f"malformed HTTP request: {reason}",
            "type": "invalid_request_error",
            "param": None,
            "code": MALFORMED_REQUEST,
        }
    }
    assert KEY.encode() not in body
    assert b"sk-h9" not in body


@pytest.mark.parametrize(("request_bytes", "reason"), CASES)
def test_public_listener_answers_json_without_the_key_and_keeps_serving(
    served: Served, request_bytes: bytes, reason: str
) -> None:
    answer = exchange(served.public_port, request_bytes)

    assert_malformed_answer(answer, reason)
    assert "x-injected" not in answer[1]
    log = served.gateway.output_with(REFUSED_LINE)
    assert KEY not in log
    assert "sk-h9" not in log
    assert get(f"http://127.0.0.1:{served.public_port}/v1/models", KEY)[0] == 200


def test_admin_listener_answers_json_without_the_token(served: Served) -> None:
    request = b"GET /metrics HTTP/1.1\r\nHost: sluice\r\nAuthorization: Bearer " + ADMIN_TOKEN.encode()

    refused_before = served.gateway.output().count(REFUSED_LINE)
    answer = exchange(served.admin_port, request + b"\x7f\r\n\r\n")

    assert_malformed_answer(answer, "Invalid header value char")
    assert ADMIN_TOKEN.encode() not in answer[2]
    # Its own refusal line is written (buffered: polled), and the token is in no line.
    assert ADMIN_TOKEN not in served.gateway.output_with(REFUSED_LINE, count=refused_before + 1)
    status, metrics = get(f"http://127.0.0.1:{served.admin_port}/metrics", ADMIN_TOKEN)
    assert status == 200
    assert KEY.encode() not in metrics
    assert b"sk-h9" not in metrics


def test_this_aiohttp_has_the_method_gateway_parse_errors_replaces() -> None:
    """Fails when an aiohttp release renames or reshapes ``RequestHandler.handle_error``: then
    ``gateway.http.parse_errors.install`` leaves aiohttp's echoing 400 in place (with a warning)."""
    assert aiohttp.__version__.startswith("3.14."), aiohttp.__version__
    assert tuple(RequestHandler.__dict__["handle_error"].__code__.co_varnames[:5]) == HANDLE_ERROR_PARAMETERS
    assert hook_supported()
