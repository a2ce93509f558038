"""The buffered access log: lines formatted straight from the outcome when ``configure_logging``'s
handler alone prints them, written together once per event-loop iteration, never lost or
reordered; and the gateway's single middleware layer keeps every layer's behaviour."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import math
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from http import HTTPStatus
from typing import Any

import pytest

from gateway.config.settings import LoggingSettings, ServerSettings
from gateway.observability import logs
from gateway.observability.log_format import JsonFormatter, TextFormatter
from gateway.observability.logs import SluiceLogHandler, configure_logging, flush_logs, log_access
from gateway.observability.outcome import ACCESS_LOGGER, RequestOutcome, access_fields
from tests.unit.gateway.conftest import StartGateway, StartReplica
from tests.unit.gateway.fakes import MODEL, FakeReplica, gateway_settings

ADMITTED = RequestOutcome(
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
    tenant="team-a",
    request_class="interactive",
    decision="admitted",
    queue_wait_s=0.0123,
    predicted_ttft_s=0.0421,
    predicted_tpot_s=0.0987,
    tokens_streamed=3,
)
REJECTED = RequestOutcome(
    request_id="rid-2",
    method="POST",
    path="/v1/chat/completions",
    received_at=10.0,
    status=429,
    request_class="batch",
    decision="rejected",
    reason="deadline_exceeded",
    retry_after_s=0.734,
    predicted_ttft_s=0.3,
    finished_at=10.002,
    error="deadline_exceeded",
)
ACCESS_MARK = f" {ACCESS_LOGGER} access "


class Sink(io.StringIO):
    """A text stream that counts its ``write`` calls."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        return super().write(text)

    def lines(self) -> list[str]:
        return self.getvalue().splitlines()


@contextmanager
def sluice_logging(stream: Sink, *, json_format: bool = False) -> Iterator[SluiceLogHandler]:
    """``configure_logging`` to ``stream`` with its handler the root's only one (as in
    ``sluice serve``), pytest's own handlers set aside meanwhile; all restored after."""
    root = logging.getLogger()
    saved, level, installed = list(root.handlers), root.level, logs._INSTALLED[0]
    for other in saved:
        root.removeHandler(other)
    try:
        configure_logging(LoggingSettings(json_format=json_format), stream=stream)
        handler = logs._INSTALLED[0]
        assert handler is not None
        yield handler
    finally:
        for ours in list(root.handlers):
            root.removeHandler(ours)
            ours.flush()
        for other in saved:
            root.addHandler(other)
        root.setLevel(level)
        logs._INSTALLED[0] = installed


@pytest.fixture
def no_records(monkeypatch: pytest.MonkeyPatch) -> None:
    """The access logger must not make a ``LogRecord`` (the direct path formats the line)."""

    def refuse(*args: Any, **kwargs: Any) -> logging.LogRecord:
        raise AssertionError("an access LogRecord was made")

    monkeypatch.setattr(logs.access_log, "makeRecord", refuse)


def _record(outcome: RequestOutcome, created: float) -> logging.LogRecord:
    record = logging.LogRecord(ACCESS_LOGGER, logging.INFO, __file__, 0, "access", (), None)
    record.created, record.msecs = created, int((created - int(created)) * 1000) + 0.0
    record.fields = access_fields(outcome)
    return record


def _odd_outcomes() -> list[RequestOutcome]:
    """Outcomes with every kind of value a field can hold: spaces and quotes, empty and non-ASCII
    text, integers and NaN for durations, an ``IntEnum`` status, booleans."""
    rng = random.Random(7)
    texts = [None, "", "a b", 'say "hi"', "模型", "tab\there", "plain", "x" * 200]
    numbers: list[Any] = [None, 0, 3, 0.0, 1e-7, 0.12345, 12.0, math.nan, math.inf]
    found = [ADMITTED, REJECTED]
    for _ in range(200):
        found.append(
            RequestOutcome(
                request_id=rng.choice(["rid", "0" * 32, "a:b/c"]),
                method=rng.choice(["POST", "GET"]),
                path=rng.choice(["/v1/completions", "/a b", "/%"]),
                received_at=rng.choice([0.0, 10.0, 1e9]),
                model=rng.choice(texts),
                stream=rng.choice([True, False]),
                replica=rng.choice(texts),
                status=rng.choice([None, 200, 429, HTTPStatus.TOO_MANY_REQUESTS]),
                prompt_tokens=rng.choice([None, 0, 7]),
                completion_tokens=rng.choice([None, 1, 3]),
                dispatched_at=rng.choice([None, 10.001]),
                first_token_at=rng.choice([None, 10.05]),
                finished_at=rng.choice([None, 10.25]),
                error=rng.choice(texts),
                request_class=rng.choice(texts),
                tenant=rng.choice(texts),
                decision=rng.choice(texts),
                reason=rng.choice(texts),
                queue_wait_s=rng.choice(numbers),
                retry_after_s=rng.choice(numbers),
                predicted_ttft_s=rng.choice(numbers),
                predicted_tpot_s=rng.choice(numbers),
                tokens_streamed=rng.choice([0, 5]),
                prompt_weight=rng.choice([None, 1.0]),
                output_weight=rng.choice([None, 1.0, 2.5]),
            )
        )
    return found


@pytest.mark.parametrize("formatter", [TextFormatter(), JsonFormatter()], ids=["text", "json"])
def test_the_direct_line_is_the_formatters_line(formatter: TextFormatter | JsonFormatter) -> None:
    """Byte for byte what the formatter prints for the record ``log_access`` would have made."""
    for outcome in _odd_outcomes():
        for created in (1796057555.293452, 1796057555.0, 17.0005, 1.9999):
            assert formatter.access_line(outcome, created) == formatter.format(_record(outcome, created))


@pytest.mark.usefixtures("no_records")
async def test_lines_are_written_together_after_the_loop_iteration() -> None:
    sink = Sink()
    with sluice_logging(sink) as handler:
        sink.writes = 0
        for request_id in ("a1", "a2", "a3"):
            log_access(replace(REJECTED, request_id=request_id))
        assert sink.getvalue() == ""  # not yet: at the end of this iteration of the loop
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        lines = sink.lines()
        assert sink.writes == 1
        assert [line.split("request_id=")[1].split()[0] for line in lines] == ["a1", "a2", "a3"]
        assert all(ACCESS_MARK in line for line in lines)
        expected = handler.access_line(replace(REJECTED, request_id="a1"), 0.0)
        assert expected is not None
        assert lines[0].split(" ", 2)[2] == expected.split(" ", 2)[2]  # all but the time


@pytest.mark.usefixtures("no_records")
async def test_lines_after_a_write_wait_for_the_flush_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    """A flood's lines go out in batches: after a write, the next lines are written one
    ``ACCESS_FLUSH_INTERVAL_S`` after it (here 0.3 s), together, not at the end of each iteration."""
    interval = 0.3
    monkeypatch.setattr(logs, "ACCESS_FLUSH_INTERVAL_S", interval)
    sink = Sink()
    with sluice_logging(sink):
        sink.writes = 0
        log_access(replace(REJECTED, request_id="b1"))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert sink.writes == 1  # the first line after a quiet spell: at the end of the iteration
        written = time.monotonic()
        for request_id in ("b2", "b3"):
            log_access(replace(REJECTED, request_id=request_id))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        if time.monotonic() - written < interval:  # (a machine stalled for the whole interval: moot)
            assert sink.writes == 1, sink.lines()
        for _ in range(500):
            if sink.writes >= 2:
                break
            await asyncio.sleep(0.01)
        assert time.monotonic() - written >= interval * 0.9  # (call_later's clock granularity)
        assert sink.writes == 2
        assert [line.split("request_id=")[1].split()[0] for line in sink.lines()] == ["b1", "b2", "b3"]


@pytest.mark.usefixtures("no_records")
async def test_json_lines_too() -> None:
    sink = Sink()
    with sluice_logging(sink, json_format=True):
        log_access(REJECTED)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        (line,) = sink.lines()
    assert json.loads(line) | {"ts": 0} == {
        "ts": 0,
        "level": "INFO",
        "logger": ACCESS_LOGGER,
        "msg": "access",
        **access_fields(REJECTED),
    }


@pytest.mark.usefixtures("no_records")
async def test_another_record_is_written_at_once_after_the_buffered_lines() -> None:
    sink = Sink()
    with sluice_logging(sink):
        log_access(REJECTED)
        logging.getLogger("sluice.test").warning("after the access line")
        lines = sink.lines()  # the loop has not iterated: the warning wrote both
    assert len(lines) == 2
    assert ACCESS_MARK in lines[0]
    assert lines[1].endswith("WARNING sluice.test after the access line")


@pytest.mark.usefixtures("no_records")
async def test_info_records_wait_with_the_access_lines_in_order() -> None:
    sink = Sink()
    with sluice_logging(sink):
        logging.getLogger("sluice.test").info("before")
        log_access(REJECTED)
        logging.getLogger("sluice.test").info("after")
        assert sink.getvalue() == ""
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        lines = sink.lines()
    assert len(lines) == 3
    assert lines[0].endswith("INFO sluice.test before")
    assert ACCESS_MARK in lines[1]
    assert lines[2].endswith("INFO sluice.test after")


@pytest.mark.usefixtures("no_records")
def test_without_a_running_loop_each_line_is_written_at_once() -> None:
    sink = Sink()
    with sluice_logging(sink):
        log_access(REJECTED)
        assert len(sink.lines()) == 1
        log_access(ADMITTED)
        assert len(sink.lines()) == 2


@pytest.mark.usefixtures("no_records")
async def test_a_full_buffer_is_written_without_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    sink = Sink()
    with sluice_logging(sink) as handler:
        line = handler.access_line(REJECTED, 1e9)
        assert line is not None
        one = len(line)
        monkeypatch.setattr(logs, "ACCESS_BUFFER_CHARS", one * 3 + 1)
        for _ in range(3):
            log_access(REJECTED)
        assert sink.getvalue() == ""
        log_access(REJECTED)  # past the limit: all four at once
        assert len(sink.lines()) == 4
        await asyncio.sleep(0)
        assert len(sink.lines()) == 4


@pytest.mark.usefixtures("no_records")
async def test_flush_and_reconfiguration_lose_no_line() -> None:
    first, second = Sink(), Sink()
    with sluice_logging(first):
        log_access(REJECTED)
        flush_logs()
        assert len(first.lines()) == 1
        log_access(ADMITTED)
        configure_logging(LoggingSettings(), stream=second)  # the old handler writes its line first
        assert len(first.lines()) == 2
        log_access(REJECTED)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert len(second.lines()) == 1
        assert len(first.lines()) == 2


@pytest.mark.usefixtures("no_records")
def test_lines_left_by_a_loop_that_stopped_are_written_later() -> None:
    """The loop stopped (and closed) before its flush ran: the next loop's flush, or the next
    ``flush`` (``logging.shutdown`` at exit), writes them."""
    sink = Sink()
    with sluice_logging(sink):
        for then_flush in (False, True):
            loop = asyncio.new_event_loop()

            def log_and_stop(loop: asyncio.AbstractEventLoop = loop) -> None:
                log_access(REJECTED)
                loop.stop()

            loop.call_soon(log_and_stop)
            loop.run_forever()
            loop.close()
            before = len(sink.lines())
            if then_flush:
                flush_logs()
                assert len(sink.lines()) == before + 1
            else:
                assert before == 0

                async def another() -> None:
                    log_access(ADMITTED)
                    await asyncio.sleep(0)
                    await asyncio.sleep(0)

                asyncio.run(another())
                lines = sink.lines()
                assert [("rid-2" in lines[0]), ("rid-1" in lines[1])] == [True, True]


async def test_with_another_handler_both_get_the_record() -> None:
    """A handler of one's own on the root (or pytest's): the record path, as before."""
    sink, seen = Sink(), []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    with sluice_logging(sink) as handler:
        logging.getLogger().addHandler(Keep())
        log_access(REJECTED)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        (line,) = sink.lines()
    (record,) = seen
    assert record.fields == access_fields(REJECTED)  # type: ignore[attr-defined]
    assert line == handler.format(record)


async def test_the_gateway_writes_one_line_per_request_without_records(
    start_replica: StartReplica, start_gateway: StartGateway, no_records: None
) -> None:
    _, url = await start_replica(FakeReplica())
    sink = Sink()
    with sluice_logging(sink):
        gw = await start_gateway({"r1": url})
        resp = await gw.client.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True},
        )
        await resp.read()
        missing = await gw.client.get("/missing")
        assert missing.status == 404
        lines: list[str] = []
        for _ in range(200):
            lines = [line for line in sink.lines() if ACCESS_MARK in line]
            if len(lines) == 2:
                break
            await asyncio.sleep(0.01)
    first, second = lines
    assert f"request_id={resp.headers['x-request-id']} " in first
    assert " status=200 " in first
    assert " replica=r1 " in first
    assert " prompt_tokens=7 " in first
    assert f"request_id={missing.headers['x-request-id']} " in second
    assert " path=/missing status=404 " in second


# -- the single middleware layer (gateway.http.middleware.gateway_middleware) -----------------------


async def test_a_body_too_slow_is_a_408_that_closes_the_connection(
    start_replica: StartReplica, start_gateway: StartGateway, caplog: pytest.LogCaptureFixture
) -> None:
    _, url = await start_replica(FakeReplica())
    settings = gateway_settings({"r1": url}, server=ServerSettings(port=0, client_read_timeout_s=0.2))
    gw = await start_gateway(settings=settings)
    assert gw.client.server.port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.client.server.port)
    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"x-request-id: slow-1\r\nContent-Length: 100\r\n\r\n{"
        )
        await writer.drain()
        # The answer, not the close: aiohttp's lingering close waits up to 10 s for the client.
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=15)
        length = next(
            int(h.split(b":")[1]) for h in head.lower().split(b"\r\n") if h.startswith(b"content-length:")
        )
        body = await asyncio.wait_for(reader.readexactly(length), timeout=5)
        await asyncio.sleep(0.05)  # the access line, once the handler is done
    writer.close()
    assert head.split(b" ", 2)[1] == b"408"
    assert b"connection: close" in head.lower()
    assert b"x-request-id: slow-1" in head.lower()
    assert json.loads(body)["error"]["code"] == "request_timeout"
    (record,) = [r for r in caplog.records if r.name == ACCESS_LOGGER]
    fields = record.fields  # type: ignore[attr-defined]
    assert (fields["request_id"], fields["status"], fields["error"]) == ("slow-1", 408, "request_timeout")


async def test_errors_ids_and_the_admin_guard_in_one_layer(
    start_replica: StartReplica, start_gateway: StartGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """Each former layer's answer: an aiohttp 405 as JSON with ``Allow``, a bad body as a 400, a
    request id echoed (or made), the access status of each."""
    _, url = await start_replica(FakeReplica())
    gw = await start_gateway({"r1": url})
    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
        wrong = await gw.client.get("/v1/chat/completions", headers={"x-request-id": "mine-1"})
        bad = await gw.client.post(
            "/v1/chat/completions", data=b"{not json", headers={"Content-Type": "application/json"}
        )
    assert wrong.status == 405
    assert wrong.headers["Allow"] == "POST"
    assert wrong.headers["x-request-id"] == "mine-1"
    assert (await wrong.json())["error"]["code"] == "method_not_allowed"
    assert bad.status == 400
    assert (await bad.json())["error"]["type"] == "invalid_request_error"
    assert len(bad.headers["x-request-id"]) == 32
    statuses = [r.fields["status"] for r in caplog.records if r.name == ACCESS_LOGGER]  # type: ignore[attr-defined]
    assert statuses == [405, 400]
