"""Repeated log lines rate-limited with a count (``RepeatFilter``), driven by a virtual clock.

The filter sits where ``configure_logging`` puts it (on the gateway's handler); the lines a
test reads are the ones that handler wrote.
"""

from __future__ import annotations

import asyncio
import gc
import io
import json
import logging
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from gateway.config.settings import LoggingSettings
from gateway.observability import logs
from gateway.observability.logs import configure_logging, flush_logs
from gateway.observability.repeats import MAX_KEYS, RepeatFilter, repeat_key
from tests.support.speed import scaled

LOG = logging.getLogger("sluice.test.repeats")


class Clock:
    """Virtual monotonic seconds, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Lines(logging.Handler):
    """A handler keeping each message it is given (its own filters applied first)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []
        self.records: list[logging.LogRecord] = []
        #: Set at each line.
        self.wrote = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        self.records.append(record)
        self.wrote.set()


@contextmanager
def rate_limited(
    window_s: float = 10.0, clock: Callable[[], float] | None = None
) -> Iterator[tuple[Lines, RepeatFilter]]:
    """``LOG``'s records to a ``Lines`` handler behind a ``RepeatFilter`` on ``clock``."""
    handler = Lines()
    repeats = RepeatFilter(window_s, clock=clock or Clock())
    handler.addFilter(repeats)
    LOG.addHandler(handler)
    LOG.propagate, LOG.level = False, logging.DEBUG
    try:
        yield handler, repeats
    finally:
        LOG.removeHandler(handler)
        LOG.propagate, LOG.level = True, logging.NOTSET


def test_a_flood_is_one_line_per_window_with_its_count() -> None:
    """1,503 identical warnings in 15 s (100 a second), a 10 s window: the first line, one line
    for the 999 after it in the first window, one at flush for the 503 of the second."""
    clock = Clock()
    with rate_limited(clock=clock) as (handler, repeats):
        start = clock.now
        for i in range(1503):
            clock.now = start + i / 100
            LOG.warning("rate-limit storage %s is unavailable", "redis")
        assert handler.lines == [
            "rate-limit storage redis is unavailable",
            "rate-limit storage redis is unavailable (repeated 999 times in the last 10 s)",
        ]
        assert repeats.pending() == 503
        repeats.flush()
        assert (
            handler.lines[2]
            == "rate-limit storage redis is unavailable (repeated 503 times in the last 5.02 s)"
        )
        assert repeats.suppressed_total == 1502
        assert repeats.pending() == 0


def test_a_key_quiet_for_a_whole_window_passes_at_once() -> None:
    clock = Clock()
    with rate_limited(clock=clock) as (handler, _):
        LOG.warning("scrape of r1 failed")
        clock.now += 10.0
        LOG.warning("scrape of r1 failed")  # a new window: nothing was held back in the last one
        clock.now += 3.0
        LOG.warning("scrape of r1 failed")
        clock.now += 30.0  # long after: its count first, then the line itself
        LOG.warning("scrape of r1 failed")
    assert handler.lines == [
        "scrape of r1 failed",
        "scrape of r1 failed",
        "scrape of r1 failed (repeated 1 time in the last 10 s)",
        "scrape of r1 failed",
    ]


@pytest.mark.parametrize(
    ("first", "second"),
    [
        pytest.param(("r1", logging.WARNING), ("r2", logging.WARNING), id="other-message"),
        pytest.param(("r1", logging.WARNING), ("r1", logging.ERROR), id="other-level"),
    ],
)
def test_lines_that_differ_are_not_repeats(first: tuple[str, int], second: tuple[str, int]) -> None:
    with rate_limited() as (handler, repeats):
        for replica, level in (first, second, first, second):
            LOG.log(level, "replica %s is unhealthy", replica)
    assert handler.lines == [f"replica {first[0]} is unhealthy", f"replica {second[0]} is unhealthy"]
    assert repeats.pending() == 2


def test_keyed_lines_differing_by_request_id_are_repeats() -> None:
    clock = Clock()
    with rate_limited(clock=clock) as (handler, _):
        for i in range(5):
            LOG.warning("request r%d failed: 503", i, extra=repeat_key(503, "rate_limit_unavailable"))
            clock.now += 1.0
        LOG.warning("request r9 failed: 502", extra=repeat_key(502, "upstream_error"))
        clock.now += 20.0  # past the window after the one the count closed: quiet again
        LOG.warning("request r10 failed: 503", extra=repeat_key(503, "rate_limit_unavailable"))
    assert handler.lines == [
        "request r0 failed: 503",
        "request r9 failed: 502",
        "request r4 failed: 503 (and 4 more like it in the last 10 s)",
        "request r10 failed: 503",
    ]


def test_below_the_level_only_keyed_lines_are_rate_limited() -> None:
    with rate_limited() as (handler, _):
        for i in range(3):
            LOG.info("access %d", 1)
            LOG.info("request r%d: client disconnected", i, extra=repeat_key("client_disconnected"))
    assert handler.lines == ["access 1", "request r0: client disconnected", "access 1", "access 1"]


def test_a_summary_carries_the_fields_and_no_traceback() -> None:
    clock = Clock()
    with rate_limited(clock=clock) as (handler, repeats):
        for _ in range(3):
            try:
                raise ValueError("boom")
            except ValueError:
                LOG.exception("settle failed", extra={"fields": {"tenant": "acme"}})
        repeats.flush()
    first, summary = handler.records
    assert first.exc_info is not None
    assert summary.getMessage() == "settle failed (repeated 2 times in the last 0 s)"
    assert (summary.exc_info, summary.levelno, summary.fields) == (None, logging.ERROR, {"tenant": "acme"})  # type: ignore[attr-defined]


class Payload:
    """Something a failing request's frame holds."""


def _fail_holding(payload: Payload) -> None:
    try:
        raise ValueError(f"boom {id(payload) and 1}")
    except ValueError:
        LOG.exception("handler failed")


def test_a_held_back_traceback_keeps_no_frame_alive() -> None:
    with rate_limited() as (handler, repeats):
        handler.emit = lambda record: None  # type: ignore[method-assign]
        payloads = [Payload() for _ in range(3)]
        refs = [weakref.ref(p) for p in payloads]
        for payload in payloads:
            _fail_holding(payload)
        del payloads, payload
        gc.collect()
        assert repeats.pending() == 2
        assert [ref() for ref in refs[1:]] == [None, None], "the window holds no traceback"


def test_past_max_keys_new_lines_pass_untracked() -> None:
    clock = Clock()
    with rate_limited(clock=clock) as (handler, repeats):
        for i in range(MAX_KEYS + 10):
            LOG.warning("distinct %d", i)
        LOG.warning("distinct %d", MAX_KEYS + 5)  # untracked: passes again
        LOG.warning("distinct %d", 0)  # tracked: held back
        assert len(handler.lines) == MAX_KEYS + 11
        assert repeats.pending() == 1
        clock.now += 10.0  # every window over: a new key sweeps them and is tracked
        LOG.warning("new")
        LOG.warning("new")
        assert handler.lines[-2:] == ["distinct 0 (repeated 1 time in the last 10 s)", "new"]
        assert repeats.pending() == 1


def test_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="window_s must be > 0"):
        RepeatFilter(0.0)


async def test_on_a_running_loop_the_count_comes_when_the_window_closes() -> None:
    """No later line needed: the loop's timer writes the count at the end of the window."""
    window = 0.05
    with rate_limited(window, clock=asyncio.get_running_loop().time) as (handler, repeats):
        for _ in range(4):
            LOG.warning("upstream refused")
        assert handler.lines == ["upstream refused"]
        handler.wrote.clear()
        await asyncio.wait_for(handler.wrote.wait(), scaled(5.0))
        assert handler.lines[1].startswith("upstream refused (repeated 3 times in the last ")
        assert repeats.pending() == 0


@contextmanager
def gateway_logging(settings: LoggingSettings) -> Iterator[io.StringIO]:
    """``configure_logging`` to a string with its handler the root's only one, as in
    ``sluice serve``; everything restored after."""
    root = logging.getLogger()
    saved, level, installed = list(root.handlers), root.level, logs._INSTALLED[0]
    for other in saved:
        root.removeHandler(other)
    stream = io.StringIO()
    try:
        configure_logging(settings, stream=stream)
        yield stream
    finally:
        for ours in list(root.handlers):
            root.removeHandler(ours)
        for other in saved:
            root.addHandler(other)
        root.setLevel(level)
        logs._INSTALLED[0] = installed


def test_configure_logging_rate_limits_the_gateways_lines() -> None:
    with gateway_logging(LoggingSettings(json_format=True)) as stream:
        for _ in range(50):
            logging.getLogger("sluice.errors").warning("request x failed: 503")
        flush_logs()  # as at shutdown: the count held back is written
        lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [(line["logger"], line["msg"]) for line in lines] == [
        ("sluice.errors", "request x failed: 503"),
        ("sluice.errors", lines[1]["msg"]),
    ]
    assert lines[1]["msg"].startswith("request x failed: 503 (repeated 49 times in the last ")


def test_a_window_of_zero_writes_every_line() -> None:
    with gateway_logging(LoggingSettings(repeat_window_s=0)) as stream:
        for _ in range(5):
            logging.getLogger("sluice.errors").warning("request x failed: 503")
        lines = stream.getvalue().splitlines()
    assert len(lines) == 5


def test_a_reload_writes_the_old_filters_counts() -> None:
    with gateway_logging(LoggingSettings()) as stream:
        for _ in range(3):
            logging.getLogger("sluice.errors").warning("request x failed: 503")
        configure_logging(LoggingSettings(json_format=True), stream=stream)
        lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    assert json.loads(lines[1])["msg"].startswith("request x failed: 503 (repeated 2 times")
