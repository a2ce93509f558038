"""The structured access log: one line per request, text or JSON, with the request's outcome."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import replace
from typing import Any

import pytest

from gateway.config.settings import LoggingSettings
from gateway.observability.log_format import JsonFormatter, TextFormatter
from gateway.observability.logs import configure_logging
from gateway.observability.outcome import RequestOutcome, access_fields
from tests.unit.gateway.conftest import StartGateway, StartReplica
from tests.unit.gateway.fakes import MODEL, FakeReplica, gateway_settings

OUTCOME = RequestOutcome(
    request_id="rid-1",
    method="POST",
    path="/v1/chat/completions",
    received_at=10.0,
    model=MODEL,
    stream=True,
    replica="r1",
    status=200,
    prompt_tokens=7,
    completion_tokens=3,
    dispatched_at=10.001,
    first_token_at=10.051,
    finished_at=10.2504,
)


def record_with(fields: dict[str, Any]) -> logging.LogRecord:
    record = logging.LogRecord("sluice.access", logging.INFO, __file__, 1, "access", None, None)
    record.fields = fields
    return record


def test_access_fields() -> None:
    assert access_fields(OUTCOME) == {
        "request_id": "rid-1",
        "method": "POST",
        "path": "/v1/chat/completions",
        "status": 200,
        "tenant": None,
        "class": None,
        "decision": None,
        "reason": None,
        "replica": "r1",
        "model": MODEL,
        "stream": True,
        "duration_ms": 250.4,
        "queue_wait_ms": None,
        "retry_after_ms": None,
        "predicted_ttft_ms": None,
        "ttft_ms": 50.0,
        "predicted_tpot_ms": None,
        # (10.2504 - 10.051) / (3 - 1) s
        "tpot_ms": 99.7,
        "prompt_tokens": 7,
        "completion_tokens": 3,
        "expected_cached_tokens": None,
        "cached_tokens": None,
        "tokens_streamed": 0,
        "prompt_weight": None,
        "output_weight": None,
        "error": None,
    }


def test_access_fields_carry_the_admission_decision() -> None:
    admitted = replace(
        OUTCOME,
        tenant="team-a",
        request_class="interactive",
        decision="admitted",
        queue_wait_s=0.0123,
        predicted_ttft_s=0.0421,
        predicted_tpot_s=0.0987,
        tokens_streamed=3,
    )
    rejected = RequestOutcome(
        request_id="rid-2",
        method="POST",
        path="/v1/chat/completions",
        received_at=10.0,
        status=429,
        tenant="team-b",
        request_class="batch",
        decision="rejected",
        reason="slo_unattainable",
        retry_after_s=1.75,
        predicted_ttft_s=2.5,
        finished_at=10.002,
    )

    got = access_fields(admitted)
    assert (got["tenant"], got["class"], got["decision"], got["reason"]) == (
        "team-a",
        "interactive",
        "admitted",
        None,
    )
    assert (got["queue_wait_ms"], got["predicted_ttft_ms"], got["predicted_tpot_ms"]) == (12.3, 42.1, 98.7)
    assert (got["tokens_streamed"], got["tpot_ms"]) == (3, 99.7)
    got = access_fields(rejected)
    assert (got["status"], got["decision"], got["reason"], got["retry_after_ms"]) == (
        429,
        "rejected",
        "slo_unattainable",
        1750.0,
    )
    assert (got["replica"], got["ttft_ms"], got["tpot_ms"], got["predicted_ttft_ms"]) == (
        None,
        None,
        None,
        2500.0,
    )


@pytest.mark.parametrize(
    ("change", "why"),
    [
        pytest.param({"error": "client_disconnected"}, "a cut stream", id="error"),
        pytest.param({"completion_tokens": 1}, "one token has no gap", id="one-token"),
        pytest.param({"completion_tokens": None}, "no usage reported", id="no-usage"),
        pytest.param({"first_token_at": None}, "not a stream", id="no-first-token"),
    ],
)
def test_no_tpot_without_a_complete_stream(change: dict[str, Any], why: str) -> None:
    assert replace(OUTCOME, **change).tpot_s is None, why


@pytest.mark.parametrize(
    ("formatter", "check"),
    [
        pytest.param(
            TextFormatter(),
            lambda line: (
                "request_id=rid-1" in line
                and "status=200" in line
                and "stream=true" in line
                and "error=-" in line
                and "prompt_tokens=7" in line
            ),
            id="text",
        ),
        pytest.param(
            JsonFormatter(),
            lambda line: (
                json.loads(line)["request_id"] == "rid-1"
                and json.loads(line)["duration_ms"] == 250.4
                and json.loads(line)["msg"] == "access"
            ),
            id="json",
        ),
    ],
)
def test_formatters(formatter: logging.Formatter, check: Any) -> None:
    line = formatter.format(record_with(access_fields(OUTCOME)))
    assert "\n" not in line
    assert check(line)


@pytest.mark.parametrize("access_log", [pytest.param(True, id="on"), pytest.param(False, id="off")])
async def test_one_access_line_per_request(
    start_replica: StartReplica,
    start_gateway: StartGateway,
    caplog: pytest.LogCaptureFixture,
    access_log: bool,
) -> None:
    """Fake replica only so that the gateway has a healthy replica to answer."""
    _, url = await start_replica(FakeReplica())
    settings = gateway_settings({"r1": url}).model_copy(
        update={"logging": LoggingSettings(access_log=access_log)}
    )
    gw = await start_gateway(settings=settings)

    with caplog.at_level(logging.INFO, logger="sluice.access"):
        resp = await gw.client.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True},
        )
        await resp.read()
        await gw.client.get("/missing")

    lines = [r for r in caplog.records if r.name == "sluice.access"]
    if not access_log:
        assert lines == []
        return
    first, second = (r.fields for r in lines)  # type: ignore[attr-defined]
    assert first["request_id"] == resp.headers["x-request-id"]
    assert (first["status"], first["replica"], first["model"], first["stream"]) == (200, "r1", MODEL, True)
    assert (first["prompt_tokens"], first["completion_tokens"]) == (7, 3)
    assert first["duration_ms"] >= 0
    assert (second["path"], second["status"], second["replica"]) == ("/missing", 404, None)


def test_configure_logging_replaces_its_own_handler_only() -> None:
    root = logging.getLogger()
    before = list(root.handlers)
    level = root.level
    try:
        configure_logging(LoggingSettings(json_format=True, level="WARNING"))
        configure_logging(LoggingSettings(json_format=False, level="DEBUG"))
        added = [h for h in root.handlers if h not in before]
        assert len(added) == 1
        assert isinstance(added[0].formatter, TextFormatter)
        assert root.level == logging.DEBUG
    finally:
        for handler in [h for h in root.handlers if h not in before]:
            root.removeHandler(handler)
        root.setLevel(level)


async def test_malformed_request_is_logged_without_its_bytes(
    start_replica: StartReplica, start_gateway: StartGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """A header aiohttp cannot parse (a NUL in it) must not put the key it carries in the logs."""
    configure_logging(LoggingSettings())
    _, url = await start_replica(FakeReplica())
    gw = await start_gateway({"r1": url})
    secret = "sk-never-log-me-8c1f"
    assert gw.client.server.port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.client.server.port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        + f"Authorization: Bearer {secret}\x00\r\n".encode()
        + b"Content-Length: 0\r\n\r\n"
    )
    await writer.drain()
    with caplog.at_level(logging.DEBUG):
        answer = await asyncio.wait_for(reader.read(), timeout=5)
    writer.close()

    # aiohttp answers its own plain-text 400 (quoting the bad line back to the one client that sent
    # it; that body never reaches a log).
    assert answer.split(b" ", 2)[1] == b"400"
    refused = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert refused, "aiohttp logged the refusal"
    assert all(r.levelno == logging.INFO and r.exc_info is None for r in refused)
    logged = "\n".join(TextFormatter().format(r) for r in caplog.records)
    assert secret not in logged
