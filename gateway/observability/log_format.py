"""The two line formats of Sluice's logs: text (``key=value``) and JSON, one line per record.

``TextFormatter`` and ``JsonFormatter`` format any record, its structured ``fields`` included;
their ``access_line`` gives an access record's line straight from a ``RequestOutcome``, the same
text ``format`` would give, without the record (the access log's hot path).
"""

from __future__ import annotations

import json
import logging
import time
from json.encoder import encode_basestring_ascii
from typing import Any, Final

from gateway.observability.outcome import ACCESS_LOGGER, RequestOutcome, access_fields

__all__ = ["JsonFormatter", "TextFormatter"]


class TextFormatter(logging.Formatter):
    """``time level logger message key=value ...``; structured ``fields`` appended as key=value."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

        #: ``formatTime``'s memo: (whole epoch second, its local time text).
        self._second: tuple[int, str] = (-1, "")

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] | None = getattr(record, "fields", None)
        if record.exc_info or record.exc_text or record.stack_info:
            line = super().format(record)
        else:
            # ``logging.Formatter.format``'s line for this format, without its generic steps
            # (style lookup, ``%`` against the record's ``__dict__``): the access line's hot path.
            record.message = record.getMessage()
            record.asctime = self.formatTime(record)
            line = f"{record.asctime} {record.levelname} {record.name} {record.message}"
        if not fields:
            return line
        head, sep, tail = line.partition("\n")  # keep a traceback after the fields
        return f"{head} {_text_pairs(fields)}{sep}{tail}"

    def access_line(self, outcome: RequestOutcome, created: float) -> str:
        """``format``'s line for ``outcome``'s access record (``access_fields``) made at ``created``
        (epoch seconds), without the record or the fields' dict."""
        asctime = self._asctime(created, int((created - int(created)) * 1000) + 0.0)
        level = logging.getLevelName(logging.INFO)
        return f"{asctime} {level} {ACCESS_LOGGER} access {_access_pairs(outcome)}"

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        """``logging.Formatter.formatTime``'s text, with the date and time part computed once per
        second (an access line per request otherwise pays a ``localtime`` and a ``strftime``)."""
        if datefmt or not self.default_msec_format:
            return super().formatTime(record, datefmt)
        return self._asctime(record.created, record.msecs)

    def _asctime(self, created: float, msecs: float) -> str:
        if not self.default_msec_format:
            return time.strftime(self.default_time_format, self.converter(created))
        second = int(created)
        memo = self._second
        if memo[0] != second:
            memo = self._second = (second, time.strftime(self.default_time_format, self.converter(second)))
        return self.default_msec_format % (memo[1], msecs)


def _text_pairs(fields: dict[str, Any]) -> str:
    """``key=value`` for each field, space separated (``_text_value``)."""
    return " ".join([f"{key}={_text_value(value)}" for key, value in fields.items()])


def _access_pairs(o: RequestOutcome) -> str:
    """``_text_pairs(access_fields(o))``, one f-string: the same keys in the same order, each
    value through ``_text_value`` (keep it in step with ``access_fields``). The fields that are
    often ``None`` print their ``-`` inline (no call): a 429 has no replica, tokens or TTFT."""
    tv, ms = _text_value, _ms_text
    return (
        f"request_id={tv(o.request_id)} method={tv(o.method)} path={tv(o.path)} status={tv(o.status)} "
        f"tenant={'-' if o.tenant is None else tv(o.tenant)} "
        f"class={'-' if o.request_class is None else tv(o.request_class)} "
        f"decision={'-' if o.decision is None else tv(o.decision)} "
        f"reason={'-' if o.reason is None else tv(o.reason)} "
        f"replica={'-' if o.replica is None else tv(o.replica)} "
        f"model={'-' if o.model is None else tv(o.model)} stream={tv(o.stream)} "
        f"duration_ms={ms(o.duration_s)} queue_wait_ms={ms(o.queue_wait_s)} "
        f"retry_after_ms={ms(o.retry_after_s)} predicted_ttft_ms={ms(o.predicted_ttft_s)} "
        f"ttft_ms={ms(o.ttft_s)} predicted_tpot_ms={ms(o.predicted_tpot_s)} tpot_ms={ms(o.tpot_s)} "
        f"prompt_tokens={'-' if o.prompt_tokens is None else tv(o.prompt_tokens)} "
        f"completion_tokens={'-' if o.completion_tokens is None else tv(o.completion_tokens)} "
        f"expected_cached_tokens={'-' if o.expected_cached_tokens is None else tv(o.expected_cached_tokens)} "
        f"cached_tokens={'-' if o.cached_tokens is None else tv(o.cached_tokens)} "
        f"tokens_streamed={tv(o.tokens_streamed)} "
        f"prompt_weight={'-' if o.prompt_weight is None else tv(o.prompt_weight)} "
        f"output_weight={'-' if o.output_weight is None else tv(o.output_weight)} "
        f"error={'-' if o.error is None else tv(o.error)}"
    )


def _ms_text(seconds: float | None) -> str:
    """``_text_value(_ms(seconds))``."""
    return "-" if seconds is None else _text_value(round(seconds * 1000, 1))


def _text_value(value: Any) -> str:
    if value is None:
        return "-"
    kind = type(value)
    if kind is int or kind is float:
        return str(value)
    if value is True:
        return "true"
    if value is False:
        return "false"
    text = value if kind is str else str(value)
    return json.dumps(text) if (" " in text or not text) else text


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (epoch seconds), level, logger, msg, structured fields, exc."""

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields: dict[str, Any] | None = getattr(record, "fields", None)
        if fields:
            payload.update(fields)
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return json.dumps(payload, default=str)

    def access_line(self, outcome: RequestOutcome, created: float) -> str:
        """``format``'s line for ``outcome``'s access record (``access_fields``) made at
        ``created`` (epoch seconds), without the record: the same object, keys in the same order,
        by the same encoder settings (``json.dumps(..., default=str)``)."""
        level = encode_basestring_ascii(logging.getLevelName(logging.INFO))
        fields = _FIELDS_JSON.encode(access_fields(outcome))
        return f'{{"ts": {round(created, 6)!r}, "level": {level}, {_ACCESS_JSON_NAME}, {fields[1:]}'


#: The access line's ``logger`` and ``msg`` members in ``JsonFormatter``'s JSON.
_ACCESS_JSON_NAME: Final = f'"logger": "{ACCESS_LOGGER}", "msg": "access"'


#: ``json.dumps(..., default=str)``'s encoder, made once.
_FIELDS_JSON = json.JSONEncoder(default=str)
