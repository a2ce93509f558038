"""Repeated log lines, rate-limited with a count: a ``logging.Filter``.

A flood of one warning (a 503 per request while Redis is down, a scrape failing every 100 ms)
says nothing new after its first line. ``RepeatFilter`` lets the first record of a key through
and opens a window of ``window_s`` seconds for that key; the key's further records in the window
are counted, not written; when the window closes, one line reports them (the last one's message
plus ``(repeated N times in the last W s)``, or ``(and N more like it ...)`` for a keyed line;
no traceback) and, if any were counted, a new window opens, so a flood that lasts writes one
line per window. A key with nothing counted in its window is quiet again: its next record passes
at once.

A record's key is its logger, level and formatted message (identical lines), or, for records
made with ``extra=repeat_key(...)`` (lines that differ only by a request id), its logger, level
and that key. Records below ``level`` without a key pass untouched, so the access log is never
thinned. A window is closed on the event loop's timer when one runs in the logging thread, else
by the key's next record or ``flush`` (at shutdown: no count is ever lost). Thread-safe.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["DEFAULT_WINDOW_S", "MAX_KEYS", "REPEAT_KEY", "RepeatFilter", "repeat_key"]

#: Seconds a key's repeats are counted before one line reports them.
DEFAULT_WINDOW_S: Final = 10.0
#: The record attribute ``repeat_key`` sets (``extra={REPEAT_KEY: ...}``).
REPEAT_KEY: Final = "repeat_key"
#: The attribute that marks a summary line (it passes the filter that made it).
_SUMMARY: Final = "repeat_summary"
#: Keys tracked at most; a record with a new key past this passes untracked (logs fail open).
MAX_KEYS: Final = 1024
#: Characters of a message that tell two records apart (a key holds no more).
_KEYED_CHARS: Final = 1024
#: Seconds between two sweeps of the closed windows when ``MAX_KEYS`` are tracked, at least.
_SWEEP_EVERY_S: Final = 1.0


def repeat_key(*parts: Hashable) -> dict[str, Any]:
    """``extra=`` for a logging call whose lines differ only by what ``parts`` leave out (a
    request id): records of one logger and level with equal ``parts`` count as repeats."""
    return {REPEAT_KEY: parts}


@dataclass(frozen=True, slots=True)
class _Seen:
    """What a summary repeats of a record held back: not the record itself, whose traceback
    would keep its frames (and everything they reference) alive until the window closes."""

    name: str
    levelno: int
    pathname: str
    lineno: int
    func: str | None
    msg: object
    args: Any
    fields: Any

    @classmethod
    def of(cls, record: logging.LogRecord) -> _Seen:
        return cls(
            record.name,
            record.levelno,
            record.pathname,
            record.lineno,
            record.funcName,
            record.msg,
            record.args,
            getattr(record, "fields", None),
        )

    def message(self) -> str:
        """The record's message, as ``LogRecord.getMessage`` makes it."""
        msg = str(self.msg)
        if not self.args:
            return msg
        try:
            return str(msg % self.args)
        except Exception:  # logging would report it; a summary must not raise
            return f"{msg} {self.args!r}"


@dataclass(slots=True)
class _Window:
    """One key's window: from ``start`` to ``end`` (the filter's clock, seconds), the records
    counted in it and the last of them (the summary's message)."""

    start: float
    end: float
    count: int = 0
    last: _Seen | None = None
    keyed: bool = False
    timer: asyncio.TimerHandle | None = None


class RepeatFilter(logging.Filter):
    """See the module docstring. ``window_s`` > 0: the window, seconds; ``level``: records at or
    above it are rate-limited by message, below it only when they carry a ``repeat_key``;
    ``clock``: monotonic seconds (tests inject one); ``emit``: how a summary record is written
    (default: the handlers of its logger, ``Logger.handle``)."""

    def __init__(
        self,
        window_s: float = DEFAULT_WINDOW_S,
        *,
        level: int = logging.WARNING,
        clock: Callable[[], float] = time.monotonic,
        emit: Callable[[logging.LogRecord], None] | None = None,
    ) -> None:
        super().__init__()
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        self.window_s = window_s
        self.level = level
        self._clock = clock
        self._emit = emit if emit is not None else _handle_on_logger
        self._windows: dict[Hashable, _Window] = {}
        self._lock = threading.Lock()
        self._swept_at = -math.inf
        #: Total records held back, for tests and curiosity.
        self.suppressed_total = 0

    def filter(self, record: logging.LogRecord) -> bool:
        explicit = getattr(record, REPEAT_KEY, None)
        if explicit is None:
            if record.levelno < self.level or getattr(record, _SUMMARY, False):
                return True
            key: Hashable = (record.name, record.levelno, record.getMessage()[:_KEYED_CHARS])
        else:
            key = (record.name, record.levelno, explicit)
        now = self._clock()
        with self._lock:
            due = self._close_due(key, now)
            window = self._windows.get(key)
            if window is None:
                if len(self._windows) < MAX_KEYS or self._sweep(now, due):
                    self._windows[key] = _Window(now, now + self.window_s, keyed=explicit is not None)
                passed = True
            else:
                window.count += 1
                window.last = _Seen.of(record)
                self.suppressed_total += 1
                if window.timer is None:
                    window.timer = _call_later(window.end - now, self._on_timer, key)
                passed = False
        for summary in due:
            self._emit(summary)
        return passed

    def flush(self) -> None:
        """Write the summary of every open window with records counted, now; forget all keys."""
        now = self._clock()
        with self._lock:
            due = [s for w in self._windows.values() if (s := _summary(w, now)) is not None]
            for window in self._windows.values():
                if window.timer is not None:
                    window.timer.cancel()
            self._windows.clear()
        for summary in due:
            self._emit(summary)

    def pending(self) -> int:
        """Records counted in open windows and not yet reported."""
        with self._lock:
            return sum(w.count for w in self._windows.values())

    def _on_timer(self, key: Hashable) -> None:
        now = self._clock()
        with self._lock:
            window = self._windows.get(key)
            if window is not None:
                window.timer = None
            due = self._close_due(key, now)
            window = self._windows.get(key)
            if window is not None and window.count and window.timer is None:
                # The loop's timer fired a hair before the filter's clock reached the end.
                window.timer = _call_later(window.end - now, self._on_timer, key)
        for summary in due:
            self._emit(summary)

    def _close_due(self, key: Hashable, now: float) -> list[logging.LogRecord]:
        """Close ``key``'s windows that ended by ``now`` (call with the lock held): the summaries
        to write. A window with records counted is followed by the next one, from its end."""
        due: list[logging.LogRecord] = []
        window = self._windows.get(key)
        while window is not None and window.end <= now:
            if window.timer is not None:
                window.timer.cancel()
            summary = _summary(window, window.end)
            if summary is None:
                del self._windows[key]
                return due
            due.append(summary)
            window = self._windows[key] = _Window(window.end, window.end + self.window_s, keyed=window.keyed)
        return due

    def _sweep(self, now: float, due: list[logging.LogRecord]) -> bool:
        """Close every window that ended by ``now`` (summaries appended to ``due``), at most once
        per ``_SWEEP_EVERY_S``; whether there is room for one more key afterwards."""
        if now - self._swept_at < _SWEEP_EVERY_S:
            return False
        self._swept_at = now
        for key in [k for k, w in self._windows.items() if w.end <= now]:
            due.extend(self._close_due(key, now))
        return len(self._windows) < MAX_KEYS


def _summary(window: _Window, now: float) -> logging.LogRecord | None:
    """The line reporting ``window``'s counted records at ``now``; ``None`` when none were."""
    last = window.last
    if not window.count or last is None:
        return None
    if window.keyed:
        note = "and %d more like it"
    else:
        note = "repeated %d time" if window.count == 1 else "repeated %d times"
    record = logging.LogRecord(
        last.name,
        last.levelno,
        last.pathname,
        last.lineno,
        f"%s ({note} in the last %.3g s)",
        (last.message(), window.count, max(now - window.start, 0.0)),
        None,
        last.func,
    )
    if last.fields is not None:
        record.fields = last.fields
    setattr(record, _SUMMARY, True)
    return record


def _handle_on_logger(record: logging.LogRecord) -> None:
    logging.getLogger(record.name).handle(record)


def _call_later(
    delay_s: float, callback: Callable[[Hashable], None], key: Hashable
) -> asyncio.TimerHandle | None:
    """``callback(key)`` after ``delay_s`` on the running event loop; ``None`` without one."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return None
    return loop.call_later(max(delay_s, 0.0), callback, key)
