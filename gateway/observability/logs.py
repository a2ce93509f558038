"""Logging setup, request ids and the structured access log.

``configure_logging(settings)`` installs one stderr handler (text or JSON: ``log_format``).
``RequestOutcome`` (``gateway.observability.outcome``, exported here too) is what happened to one
request. ``request_context_middleware`` gives every request an id and an outcome and writes one
access line when it is done; ``add_request_id_header`` puts the id on every response. Lines below
WARNING are buffered and written in batches (at most every ``ACCESS_FLUSH_INTERVAL_S``, or past
``ACCESS_BUFFER_CHARS``, before a WARNING, and at ``flush``), like nginx's ``access_log buffer=``.
Repeated lines are rate-limited with a count (``gateway.observability.repeats``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
import re
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Handler, Middleware

from gateway.config.settings import LoggingSettings
from gateway.config.store import SettingsStore
from gateway.http.echo import clip
from gateway.observability.log_format import JsonFormatter, TextFormatter
from gateway.observability.outcome import ACCESS_LOGGER, RequestOutcome, access_fields
from gateway.observability.repeats import RepeatFilter

access_log = logging.getLogger(ACCESS_LOGGER)
#: Buffered lines are written once they hold this many characters (else at the end of the event
#: loop's iteration, at most once per ``ACCESS_FLUSH_INTERVAL_S``).
ACCESS_BUFFER_CHARS = 64 * 1024
#: Seconds between two writes of buffered lines, at least: a line waits at most this long (plus
#: the loop iteration) to be written. Under a 429 flood a write per loop iteration would be a
#: syscall every request or two; nginx's ``flush=`` and Envoy's file flush interval bound it the
#: same way, in seconds.
ACCESS_FLUSH_INTERVAL_S = 0.01

REQUEST_ID_HEADER = "x-request-id"
#: An incoming ``x-request-id`` is honoured only when it matches this (else we generate one).
_SANE_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:/+=@-]{1,128}$")


REQUEST_ID = web.RequestKey("request_id", str)
OUTCOME = web.RequestKey("outcome", RequestOutcome)


_MASK64 = (1 << 64) - 1


class _RequestIds:
    """Request ids: a random 64-bit prefix per process, then a 64-bit counter run through a
    random bijection of 64-bit integers (``n * odd + offset`` mod 2**64, so ids do not read as a
    count of the requests served): 32 lowercase hex characters in all. Unique within a process
    (for 2**64 ids); across processes and restarts two processes share a prefix with probability
    about n**2 / 2**65 for n processes (a forked child draws its own). A fraction of ``uuid4``'s
    cost (no syscall, no ``UUID`` object), paid on every request."""

    __slots__ = ("counter", "offset", "prefix", "step")

    def __init__(self) -> None:
        self.reseed()

    def reseed(self) -> None:
        seed = os.urandom(24)
        self.prefix = seed[:8].hex()
        self.step = int.from_bytes(seed[8:16]) | 1  # odd: a bijection mod 2**64
        self.offset = int.from_bytes(seed[16:])
        self.counter = itertools.count()

    def next(self) -> str:
        return f"{self.prefix}{(next(self.counter) * self.step + self.offset) & _MASK64:016x}"


_IDS = _RequestIds()
os.register_at_fork(after_in_child=_IDS.reseed)


def new_request_id() -> str:
    """A fresh request id: 32 lowercase hex characters, unique (see ``_RequestIds``)."""
    return _IDS.next()


def sane_request_id(value: str | None) -> str | None:
    """``value`` when it is safe to echo and log (1-128 chars of ``[A-Za-z0-9._:/+=@-]``), else None."""
    if value is None or not _SANE_REQUEST_ID.match(value):
        return None
    return value


def start_request(request: web.Request, received_at: float) -> RequestOutcome:
    """The first half of ``request_context_middleware``: give ``request`` its id (an incoming sane
    ``x-request-id``, else a new one) and its ``RequestOutcome`` (received at ``received_at``,
    monotonic seconds), both stored on the request; returns the outcome."""
    request_id = sane_request_id(request.headers.get(REQUEST_ID_HEADER)) or new_request_id()
    request[REQUEST_ID] = request_id
    outcome = RequestOutcome(
        request_id=request_id, method=request.method, path=clip(request.path), received_at=received_at
    )
    request[OUTCOME] = outcome
    return outcome


def end_request(outcome: RequestOutcome, status: int, finished_at: float, store: SettingsStore) -> None:
    """The second half: ``outcome``'s status (``status`` unless a layer set one) and end time
    (``finished_at``, monotonic seconds, unless already set), then its access line unless
    ``logging.access_log`` is false."""
    if outcome.status is None:
        outcome.status = status
    if outcome.finished_at is None:
        outcome.finished_at = finished_at
    if store.current.logging.access_log:
        log_access(outcome)


def request_context_middleware(
    store: SettingsStore, *, clock: Callable[[], float] = time.monotonic
) -> Middleware:
    """Middleware factory (install first, i.e. outermost): request id, outcome, access line.

    The access line is written after the handler returns, i.e. after a stream fully ended, so its
    duration covers the whole response. It is skipped when ``logging.access_log`` is false. The
    status logged: the response's; an ``HTTPException``'s raised through; 499 when the handler was
    cancelled (client gone, shutdown); 500 for anything else.
    """

    @web.middleware
    async def impl(request: web.Request, handler: Handler) -> web.StreamResponse:
        outcome = start_request(request, clock())
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:  # client gone (handler_cancellation) or shutdown
            status = 499
            raise
        finally:
            end_request(outcome, status, clock(), store)

    return impl


async def add_request_id_header(request: web.BaseRequest, response: web.StreamResponse) -> None:
    """``on_response_prepare`` hook: every response carries ``x-request-id``."""
    request_id = request.get(REQUEST_ID)
    if request_id is None:
        request_id = sane_request_id(request.headers.get(REQUEST_ID_HEADER)) or new_request_id()
    response.headers[REQUEST_ID_HEADER] = request_id


def log_access(outcome: RequestOutcome) -> None:
    """Write ``outcome``'s access line (INFO on ``sluice.access``, ``access_fields`` as its fields).

    When ``configure_logging``'s handler alone would print it (see ``_direct_handler``), the line
    is formatted straight from the outcome, exactly as that handler's formatter would print the
    record, and buffered (``SluiceLogHandler.buffer``): no ``LogRecord``, no logging dispatch.
    Otherwise a record is made directly and handled: ``Logger.info`` would also look up the
    calling file, line and function, which no formatter here prints (``lineno`` is 0,
    ``funcName`` ``None``)."""
    handler = _direct_handler()
    if handler is not None:
        line = handler.access_line(outcome, time.time())
        if line is not None:
            handler.buffer(line)
            return
    if access_log.isEnabledFor(logging.INFO):
        extra = {"fields": access_fields(outcome)}
        record = access_log.makeRecord(
            access_log.name, logging.INFO, __file__, 0, "access", (), None, None, extra
        )
        access_log.handle(record)


def _direct_handler() -> SluiceLogHandler | None:
    """The handler ``configure_logging`` installed when an INFO record of ``sluice.access`` would
    reach it and no other handler and pass no filter (``Logger.callHandlers``' walk, for the
    usual tree: the access logger right under the root), else ``None``."""
    handler = _INSTALLED[0]
    if handler is None:
        return None
    logger = access_log
    if logger.handlers or logger.filters or not logger.propagate or logger.parent is not _ROOT:
        return None
    if not logger.isEnabledFor(logging.INFO):  # levels, ``disabled``, ``logging.disable``
        return None
    handlers = _ROOT.handlers
    if len(handlers) != 1 or handlers[0] is not handler or handler.level > logging.INFO:
        return None
    # ``configure_logging``'s repeat filter lets every unkeyed INFO record through.
    if any(not isinstance(f, RepeatFilter) for f in handler.filters):
        return None
    return handler


class RedactMalformedRequests(logging.Filter):
    """On aiohttp's ``aiohttp.server`` logger: a request aiohttp could not parse (bad header
    bytes, bad chunking) is logged as one INFO line naming only the error class.

    aiohttp logs it at ERROR with a traceback whose message quotes the offending bytes, which can
    be an ``Authorization`` header: a key must never reach the logs. The client already got
    aiohttp's 400; this is the client's fault, not Sluice's.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            record.msg, record.args = "malformed HTTP request refused (%s)", (type(exc).__name__,)
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


_REDACTOR = RedactMalformedRequests()


class SluiceLogHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler ``configure_logging`` installs on the root logger (calling it again replaces
    it): every record to ``stream``, one line each, in the order they were logged.

    Records below WARNING (the access lines, those ``log_access`` formats itself included) are
    buffered and written together, one ``write`` and one ``flush`` for all of them: at the end of
    the running event loop's current iteration (``call_soon``), or, when the last write was less
    than ``ACCESS_FLUSH_INTERVAL_S`` ago, that long after it (``call_later``), as soon as they hold
    ``ACCESS_BUFFER_CHARS`` characters, before a record at WARNING or above (written at once, as
    ``logging.StreamHandler`` does), and at ``flush`` (which ``logging.shutdown`` calls at exit,
    ``configure_logging`` when it replaces the handler, and the application's cleanup). Without a
    running event loop in the thread a line is written at once.
    """

    def __init__(self, stream: Any = None) -> None:
        super().__init__(stream)
        lock = self.lock
        assert lock is not None  # ``logging.Handler.__init__`` made it (re-entrant)
        #: ``self.lock``: held for every write, so lines from several threads never interleave.
        self._lock: threading.RLock = lock
        self._pending: list[str] = []
        self._pending_chars = 0
        #: The event loop a flush is scheduled on (``None``: none is).
        self._flush_on: asyncio.AbstractEventLoop | None = None
        #: When buffered lines were last written (``time.monotonic``; -inf: never).
        self._written_at = -math.inf
        _HANDLERS.add(self)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
            if record.levelno < logging.WARNING:
                self.buffer(line)
                return
            with self._lock:
                self._write_pending()
                self.stream.write(line + self.terminator)
                self.flush()
        except RecursionError:  # as logging.StreamHandler: see issue 36272
            raise
        except Exception:
            self.handleError(record)

    def access_line(self, outcome: RequestOutcome, created: float) -> str | None:
        """The line this handler's formatter prints for ``outcome``'s access record made at
        ``created`` (epoch seconds); ``None`` for a formatter other than Sluice's own two."""
        formatter = self.formatter
        if type(formatter) is TextFormatter or type(formatter) is JsonFormatter:
            return formatter.access_line(outcome, created)
        return None

    def buffer(self, line: str) -> None:
        """Queue one line (no terminator); written as the class docstring says."""
        with self._lock:
            self._pending.append(line)
            self._pending_chars += len(line)
            if self._pending_chars < ACCESS_BUFFER_CHARS:
                try:
                    loop = asyncio.get_running_loop()
                except RuntimeError:
                    loop = None
                if loop is not None:
                    if self._flush_on is not loop:
                        self._flush_on = loop
                        wait = self._written_at + ACCESS_FLUSH_INTERVAL_S - time.monotonic()
                        if wait > 0.0:
                            loop.call_later(wait, self._flush_soon)
                        else:
                            loop.call_soon(self._flush_soon)
                    return
            self._write_pending()

    def flush(self) -> None:
        """Write the buffered lines, then flush the stream."""
        with self._lock:
            self._write_pending()
            super().flush()

    def write_buffered(self) -> None:
        """Write the buffered lines now, if any (the stream is left alone otherwise)."""
        with self._lock:
            self._write_pending()

    def _flush_soon(self) -> None:
        with self._lock:
            self._flush_on = None
            self._write_pending()

    def _write_pending(self) -> None:
        """Write and flush the buffered lines (call with the lock held); a failed write is
        reported as ``logging`` reports one (``handleError``) and its lines are dropped."""
        pending = self._pending
        if not pending:
            return
        terminator = self.terminator
        text = terminator.join(pending) + terminator
        count = len(pending)
        pending.clear()
        self._pending_chars = 0
        self._written_at = time.monotonic()
        try:
            self.stream.write(text)
            super().flush()
        except RecursionError:
            raise
        except Exception:
            self.handleError(
                logging.makeLogRecord({"name": "sluice.logs", "msg": f"{count} buffered lines not written"})
            )

    def _forget_pending(self) -> None:
        """In a forked child: the parent writes the lines it had buffered."""
        self._pending.clear()
        self._pending_chars = 0
        self._flush_on = None


#: Every ``SluiceLogHandler`` (for ``os.fork``: a child forgets its parent's buffered lines).
_HANDLERS: weakref.WeakSet[SluiceLogHandler] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for handler in list(_HANDLERS):
        handler._forget_pending()


os.register_at_fork(after_in_child=_after_fork_in_child)

_ROOT = logging.getLogger()
#: The handler ``configure_logging`` installed last (``None`` before it ran).
_INSTALLED: list[SluiceLogHandler | None] = [None]


def flush_logs() -> None:
    """Write every buffered line now (of every ``SluiceLogHandler``), the counts of repeated
    lines held back (``RepeatFilter.flush``) included."""
    for handler in list(_HANDLERS):
        for repeats in [f for f in handler.filters if isinstance(f, RepeatFilter)]:
            repeats.flush()
        handler.write_buffered()


def configure_logging(settings: LoggingSettings, *, stream: Any = None) -> None:
    """Send all logging to ``stream`` (default: ``sys.stderr``) in ``settings``' format and level,
    repeated lines rate-limited per ``settings.repeat_window_s`` (``RepeatFilter``); safe to call
    again on reload (the handler it installed before is flushed and replaced)."""
    root = _ROOT
    old = [h for h in root.handlers if isinstance(h, SluiceLogHandler)]
    for handler in old:
        root.removeHandler(handler)
        handler.flush()
    handler = SluiceLogHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(JsonFormatter() if settings.json_format else TextFormatter())
    if settings.repeat_window_s > 0:
        handler.addFilter(RepeatFilter(settings.repeat_window_s))
    root.addHandler(handler)
    _INSTALLED[0] = handler
    root.setLevel(settings.level)
    for replaced in old:  # the counts it held back, written by the new handler
        for repeats in [f for f in replaced.filters if isinstance(f, RepeatFilter)]:
            repeats.flush()
    server_log = logging.getLogger("aiohttp.server")
    if _REDACTOR not in server_log.filters:
        server_log.addFilter(_REDACTOR)
