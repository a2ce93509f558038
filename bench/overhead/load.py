"""The overhead bench's load tool: a closed-loop HTTP/1.1 client on a raw asyncio protocol.

``concurrency`` keep-alive connections each send one request, read its whole answer, and send
the next at once, for ``warmup_s + duration_s`` seconds. Requests that finish within the last
``duration_s`` seconds count (the throughput is their number over ``duration_s``; a request in
flight at the end is dropped). Per request it records:

* **latency**: from writing the request to the last byte of the answer (seconds);
* **TTFB**: from writing the request to the first body bytes that carry an SSE ``data:`` line
  (streams; the client's time to first token) or to the first body byte (plain answers).

The answer is parsed properly (status line, ``Content-Length`` or ``Transfer-Encoding: chunked``,
or read to the close): aiohttp's own client costs more per request than a fast proxy does, so it
would measure itself. Bodies are checked: a 200 stream must end with ``data: [DONE]``, a 200 JSON
answer must hold ``"choices"``; anything else counts as an error, with its status.

Use: ``await closed_loop(url, body, headers, concurrency=32, duration_s=5)`` -> ``LoadResult``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import urlsplit

import numpy as np


@dataclass
class LoadResult:
    """What one closed-loop run measured. Latencies and TTFBs in seconds, one per good request."""

    concurrency: int
    duration_s: float
    latencies_s: list[float] = field(default_factory=list)
    ttfbs_s: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    #: Answers completed over the whole run, warm-up and errors included.
    completed_all: int = 0

    @property
    def ok(self) -> int:
        return len(self.latencies_s)

    @property
    def requests_per_s(self) -> float:
        return self.ok / self.duration_s if self.duration_s > 0 else 0.0

    def latency_ms(self, q: float) -> float:
        """The ``q`` quantile (0-1) of latency in ms; NaN with no sample."""
        return float(np.quantile(self.latencies_s, q)) * 1e3 if self.latencies_s else float("nan")

    def ttfb_ms(self, q: float) -> float:
        """The ``q`` quantile (0-1) of TTFB in ms; NaN with no sample."""
        return float(np.quantile(self.ttfbs_s, q)) * 1e3 if self.ttfbs_s else float("nan")

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1


def build_request(url: str, body: Mapping[str, Any], headers: Mapping[str, str]) -> bytes:
    """``POST`` of ``body`` (JSON) to ``url`` as HTTP/1.1 keep-alive bytes on the wire."""
    parts = urlsplit(url)
    payload = json.dumps(body, separators=(",", ":")).encode()
    head = [
        f"POST {parts.path or '/'} HTTP/1.1",
        f"Host: {parts.netloc}",
        "Content-Type: application/json",
        "Accept: */*",
        f"Content-Length: {len(payload)}",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + payload


_HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TO_CLOSE = range(6)


class _Connection(asyncio.Protocol):
    """One keep-alive connection sending ``request`` back to back until ``end`` (perf_counter s).

    Results go to ``result`` when the request started at or after ``count_from``. ``done``
    resolves when the connection is over (the end, an error, or the server closed it).
    """

    def __init__(
        self,
        request: bytes,
        stream: bool,
        count_from: float,
        end: float,
        result: LoadResult,
        done: asyncio.Future[None],
    ) -> None:
        self._request, self._stream = request, stream
        self._count_from, self._end = count_from, end
        self._result, self._done = result, done
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._body = bytearray()
        self._state = _HEAD
        self._need = 0
        self._status = 0
        self._close_after = False
        self._started = 0.0
        self._first: float | None = None

    # -- sending ------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self._send()

    def _send(self) -> None:
        assert self._transport is not None
        self._state, self._status, self._close_after, self._first = _HEAD, 0, False, None
        self._body.clear()
        self._started = time.perf_counter()
        self._transport.write(self._request)

    # -- receiving ----------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        self._buf += data
        while self._step():
            pass

    def _body_bytes(self, chunk: bytes | bytearray) -> None:
        if (
            self._first is None
            and chunk
            and (not self._stream or b"data:" in chunk or b"data:" in self._body)
        ):
            self._first = time.perf_counter()
        self._body += chunk

    def _step(self) -> bool:
        """Consume what the buffer allows for the current state; False when it needs more bytes."""
        buf = self._buf
        if self._state == _HEAD:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return False
            head = bytes(buf[:end]).decode("latin-1").split("\r\n")
            del buf[: end + 4]
            self._status = int(head[0].split(" ", 2)[1])
            fields = {}
            for line in head[1:]:
                name, _, value = line.partition(":")
                fields[name.strip().lower()] = value.strip().lower()
            self._close_after = fields.get("connection") == "close" or head[0].startswith("HTTP/1.0")
            if "chunked" in fields.get("transfer-encoding", ""):
                self._state = _CHUNK_SIZE
            elif "content-length" in fields:
                self._state, self._need = _LENGTH, int(fields["content-length"])
            else:
                self._state, self._close_after = _TO_CLOSE, True
            return True
        if self._state == _LENGTH:
            if len(buf) < self._need:
                return False
            self._body_bytes(buf[: self._need])
            del buf[: self._need]
            self._complete()
            return True
        if self._state == _CHUNK_SIZE:
            end = buf.find(b"\r\n")
            if end < 0:
                return False
            size = int(bytes(buf[:end]).split(b";", 1)[0], 16)
            del buf[: end + 2]
            self._state, self._need = (_CHUNK_END, 0) if size == 0 else (_CHUNK_DATA, size)
            return True
        if self._state == _CHUNK_DATA:
            if len(buf) < self._need + 2:
                return False
            self._body_bytes(buf[: self._need])
            del buf[: self._need + 2]
            self._state = _CHUNK_SIZE
            return True
        if self._state == _CHUNK_END:  # optional trailers, then an empty line
            end = buf.find(b"\r\n")
            if end < 0:
                return False
            del buf[: end + 2]
            if end == 0:
                self._complete()
            return True
        # _TO_CLOSE: everything until the server closes
        if buf:
            self._body_bytes(buf)
            buf.clear()
        return False

    def _complete(self) -> None:
        now = time.perf_counter()
        self._result.completed_all += 1
        if self._count_from <= now <= self._end:
            if self._status != 200:
                self._result.error(str(self._status))
            elif not self._valid():
                self._result.error("bad body")
            else:
                self._result.latencies_s.append(now - self._started)
                self._result.ttfbs_s.append((self._first or now) - self._started)
        assert self._transport is not None
        if self._close_after or now >= self._end:
            self._state = -1
            self._transport.close()
            return
        self._send()

    def _valid(self) -> bool:
        body = self._body
        if self._stream:
            return body.rstrip().endswith(b"data: [DONE]")
        return b'"choices"' in body

    def connection_lost(self, exc: Exception | None) -> None:
        if self._state == _TO_CLOSE:
            self._complete_at_close()
        elif self._state != -1 and time.perf_counter() < self._end:
            self._result.error(type(exc).__name__ if exc else "closed mid-answer")
        if not self._done.done():
            self._done.set_result(None)

    def _complete_at_close(self) -> None:
        self._close_after = True
        now = time.perf_counter()
        self._result.completed_all += 1
        if self._count_from <= now <= self._end:
            if self._status == 200 and self._valid():
                self._result.latencies_s.append(now - self._started)
                self._result.ttfbs_s.append((self._first or now) - self._started)
            else:
                self._result.error(str(self._status) if self._status != 200 else "bad body")
        self._state = -1


async def closed_loop(
    url: str,
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    *,
    concurrency: int,
    duration_s: float,
    warmup_s: float = 0.5,
) -> LoadResult:
    """``concurrency`` closed-loop connections posting ``body`` to ``url``; see the module doc."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    request = build_request(url, body, headers)
    stream = bool(body.get("stream"))
    loop = asyncio.get_running_loop()
    count_from = time.perf_counter() + warmup_s
    end = count_from + duration_s
    result = LoadResult(concurrency=concurrency, duration_s=duration_s)

    async def connection() -> None:
        while time.perf_counter() < end:
            done: asyncio.Future[None] = loop.create_future()
            try:
                await loop.create_connection(
                    functools.partial(_Connection, request, stream, count_from, end, result, done), host, port
                )
            except OSError as exc:
                result.error(type(exc).__name__)
                await asyncio.sleep(0.05)
                continue
            # Never wait much past the end for an answer that does not come.
            try:
                await asyncio.wait_for(asyncio.shield(done), max(0.0, end - time.perf_counter()) + 10.0)
            except TimeoutError:
                result.error("timeout")
                return

    await asyncio.gather(*(connection() for _ in range(concurrency)))
    return result
