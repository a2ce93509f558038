"""Server-sent events, incrementally: split a byte stream into whole events as chunks arrive.

The relay needs to look at each event (to find the usage chunk and the first token) without
waiting for the whole body, and network chunks cut events anywhere, even inside a ``\\r\\n``.
``EventSplitter`` buffers only the unfinished tail. Line endings are normalised to ``\\n`` (the SSE
spec allows ``\\r\\n``, ``\\r`` and ``\\n``), and every event comes out terminated by a blank line,
ready to be written to the client as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

DONE = "[DONE]"


@dataclass(frozen=True, slots=True)
class Event:
    """One SSE event: ``raw`` is its bytes including the final blank line (``\\n`` endings).

    ``data`` is the concatenation of its ``data:`` fields joined by ``\\n`` per the SSE spec, or
    ``None`` when it has none (a comment or keep-alive such as ``: ping``).
    """

    raw: bytes
    data: str | None


class EventSplitter:
    """Feed bytes, get the events completed so far; holds back only the incomplete tail."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        # The last chunk ended in \r: a \n opening the next chunk is the rest of that \r\n.
        self._skip_lf = False

    def feed(self, chunk: bytes) -> list[Event]:
        """Append ``chunk`` and return the events it completed, in order (possibly none)."""
        if (
            not self._buffer
            and not self._skip_lf
            and chunk.find(b"\n") == len(chunk) - 2 > 0
            and chunk.endswith(b"\n\n")
            and b"\r" not in chunk
        ):
            # The common case, a chunk that is exactly one whole one-line event (an engine step's
            # token per read): what the loop below returns for it, without copying it through
            # the buffer (the hot path of every stream).
            return [Event(chunk, _one_line_data(chunk))]
        if self._skip_lf and chunk.startswith(b"\n"):
            chunk = chunk[1:]
        if chunk:
            self._skip_lf = chunk.endswith(b"\r")
        if b"\r" in chunk:
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        # Only the new bytes (and the one before them) can complete an event: a large event
        # arriving in many small chunks is scanned once, not once per chunk.
        scan_from = max(len(self._buffer) - 1, 0)
        self._buffer += chunk
        events: list[Event] = []
        while True:
            end = self._buffer.find(b"\n\n", scan_from)
            if end < 0:
                return events
            scan_from = 0
            block = bytes(self._buffer[: end + 2])
            del self._buffer[: end + 2]
            stripped = block.lstrip(b"\n")  # blank lines between events carry nothing
            if stripped:
                events.append(Event(stripped, event_data(stripped)))

    @property
    def pending(self) -> bytes:
        """The unterminated tail (an event cut off if the stream ends now)."""
        return bytes(self._buffer)


def event_data(raw: bytes) -> str | None:
    """The ``data`` field of one event (see ``Event.data``); invalid UTF-8 is replaced."""
    if raw.find(b"\n") == len(raw) - 2:
        return _one_line_data(raw)
    return event_data_fields(raw)


def _one_line_data(raw: bytes) -> str | None:
    """``event_data`` of an event that is one line and the blank line: a ``data: `` line's value
    (an OpenAI stream's every event) read directly, any other field by field."""
    if raw.startswith(b"data: "):
        return raw[6:-2].decode("utf-8", errors="replace")
    return event_data_fields(raw)


def event_data_fields(raw: bytes) -> str | None:
    """``event_data`` field by field, for any event (``event_data``'s general case)."""
    values: list[str] = []
    for line in raw.decode("utf-8", errors="replace").split("\n"):
        if line == "data":
            values.append("")
        elif line.startswith("data:"):
            value = line[5:]
            values.append(value[1:] if value.startswith(" ") else value)
    return "\n".join(values) if values else None


def encode_data(data: str) -> bytes:
    """One ``data:`` event carrying ``data`` (which must not contain newlines)."""
    return b"data: " + data.encode() + b"\n\n"
