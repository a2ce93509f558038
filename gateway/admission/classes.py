"""Which class a request belongs to, and the client's own deadline, from header values.

Pure functions over header *values* (the caller reads the headers named in
``AdmissionSettings.headers``): no HTTP types here.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from gateway.admission.config import AdmissionSettings

__all__ = ["ClassChoice", "ClassSource", "InvalidHeader", "choose_class", "client_deadline_s"]

_MILLIS: Final = re.compile(r"^[0-9]{1,12}(\.[0-9]{1,6})?$")


class ClassSource(StrEnum):
    """Where a request's class came from."""

    HEADER = "header"
    TENANT = "tenant"
    DEFAULT = "default"


@dataclass(frozen=True, slots=True)
class ClassChoice:
    """The class a request is judged as, and why.

    ``ignored_header``: a class header value that was not honoured (unknown class, or one the tenant
    may not use); the request then gets its tenant's or the configured default class. Worth a
    response header (``x-sluice-class`` with the class used) so the client can see it.
    """

    name: str
    source: ClassSource
    ignored_header: str | None = None


class InvalidHeader(ValueError):
    """A steering header whose value cannot be read; the caller answers 400 with ``message``,
    which quotes at most the value's first ``QUOTED_CHARS`` characters."""

    #: Characters of the value quoted in ``message`` (a header may hold 8 KiB).
    QUOTED_CHARS: Final = 64

    def __init__(self, header: str, value: str, message: str) -> None:
        self.header = header
        self.value = value
        quoted = value if len(value) <= self.QUOTED_CHARS else f"{value[: self.QUOTED_CHARS]}…"
        self.message = f"invalid {header} header {quoted!r}: {message}"
        super().__init__(self.message)


def choose_class(
    settings: AdmissionSettings,
    header_value: str | None,
    *,
    tenant_default: str | None = None,
    allowed: Collection[str] | None = None,
) -> ClassChoice:
    """The class for a request: the header's when configured and allowed, else the tenant's
    default (when configured), else ``settings.default_class``.

    ``allowed``: classes the tenant may ask for by header; ``None`` means every configured class.
    """
    fallback = ClassChoice(settings.default_class, ClassSource.DEFAULT)
    if tenant_default is not None and tenant_default in settings.classes:
        fallback = ClassChoice(tenant_default, ClassSource.TENANT)
    if header_value is None:
        return fallback
    name = header_value.strip()
    if name in settings.classes and (allowed is None or name in allowed):
        return ClassChoice(name, ClassSource.HEADER)
    return ClassChoice(fallback.name, fallback.source, ignored_header=header_value)


def client_deadline_s(
    arrival_s: float, header_value: str | None, *, header: str = "x-sluice-deadline-ms"
) -> float | None:
    """The client's first-token deadline on the admission clock: arrival + the header's milliseconds.

    ``None`` without a header. Raises ``InvalidHeader`` unless the value is a non-negative decimal
    number of milliseconds. The result is used with ``min()`` against the class target, so a
    deadline later than the target changes nothing: a client can only tighten it.
    """
    if header_value is None:
        return None
    seconds = _deadlines.get(header_value)
    if seconds is None:
        text = header_value.strip()
        if not _MILLIS.match(text):
            raise InvalidHeader(header, header_value, "expected a non-negative number of milliseconds")
        seconds = float(text) / 1000.0
        if len(_deadlines) >= _DEADLINES_KEPT:
            _deadlines.clear()
        _deadlines[header_value] = seconds
    return arrival_s + seconds


#: Valid deadline header values already read, as seconds (clients send a few values, over and
#: over: one lookup instead of a match and a parse). Cleared when it holds ``_DEADLINES_KEPT``.
_deadlines: dict[str, float] = {}
_DEADLINES_KEPT: Final = 1024
