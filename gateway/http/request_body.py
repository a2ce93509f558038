"""The request body, read whole and in time before any handler runs (``server.client_read_timeout_s``).

aiohttp bounds a request's headers (its keep-alive timer closes a connection that has not
completed them 75 s after it opened; header lines are capped at 8,190 bytes) and its body's size
(``client_max_size``), but not the time a body takes: once the headers are in, the keep-alive
timer is off while the handler runs and ``request.read()`` waits for as long as the client
dribbles. ``body_read_timeout_middleware`` reads the body under ``asyncio.timeout`` before the
tenancy middleware and the handlers (``read_body`` caches it where ``request.read()`` looks,
so their own reads in ``gateway.api.openai.read_request`` return at once). Past the timeout
the client gets a 408 (``RequestBodyTimeout``, ``request_timeout``) with ``Connection:
close``: no tenant budget was touched, no admission decision made, no replica contacted.

Cost: a body that arrived with its headers (the usual case: aiohttp's parser fed it whole before
the handler started) is not waited for and pays one ``is_eof()`` check; only a body still in
flight runs under a timer.

After the 408 aiohttp's lingering close (``lingering_time``, 10 s) reads and discards what the
client still sends for at most 10 s, so the client can read the answer, then closes the
connection.
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from gateway.config.store import SettingsStore
from gateway.http.error_middleware import log_error, request_id_of
from gateway.http.errors import (
    ClientClosedRequest,
    RequestBodyTimeout,
    error_response,
)
from gateway.observability.logs import OUTCOME


def body_read_timeout_middleware(store: SettingsStore) -> Middleware:
    """Middleware factory (install inside the error middleware, before tenancy and the handlers):
    the whole body within ``server.client_read_timeout_s`` seconds (read at request time, so a
    reload applies to the next request), else a 408 that closes the connection.

    A body announced larger than ``server.max_body_bytes`` is not read here: the handler answers
    413 at once. A client gone mid-body is ``ClientClosedRequest`` (499, nobody reads it); a body
    over aiohttp's ``client_max_size`` raises its 413, which the error middleware converts.
    """

    @web.middleware
    async def impl(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not request.content.is_eof():
            refused = await read_body_in_time(request, store)
            if refused is not None:
                return refused
        return await handler(request)

    return impl


async def read_body_in_time(request: web.Request, store: SettingsStore) -> web.StreamResponse | None:
    """The middleware's work for a body not yet whole (``request.content.is_eof()`` false: check
    that first, it is the usual case's only cost): read it within ``server.client_read_timeout_s``
    seconds; ``None`` when it was read (or is announced larger than ``server.max_body_bytes``,
    left for the handler's 413), else the 408 to answer. Raises ``ClientClosedRequest`` when the
    client goes away mid-body."""
    server = store.current.server
    length = request.content_length
    if length is None or length <= server.max_body_bytes:
        timeout_s = server.client_read_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                await read_body(request)
        except TimeoutError:
            return _timed_out(request, timeout_s)
        except ConnectionResetError:
            raise ClientClosedRequest("the client closed the connection while sending the body") from None
    return None


async def read_body(request: web.Request) -> bytes:
    """``request.read()``'s bytes, copied once: the chunks as they arrived, joined at the end.

    aiohttp's own ``read`` grows a ``bytearray`` chunk by chunk (a growth may copy all of it)
    and copies the result once more: for a body of megabytes, several copies made on the event
    loop and a fragmented heap, which a flood of maximum-size bodies pays in ``/healthz``'s
    latency and in peak memory (docs/operations.md, "Floods and slow clients"). The bytes are
    cached where ``request.read()`` looks (``_read_bytes``: aiohttp has no public setter), so it
    and every later reader return them. Past ``client_max_size`` raises aiohttp's 413, as its
    ``read`` does; a client gone mid-body raises ``ConnectionResetError``.
    """
    cached = request._read_bytes
    if cached is not None:
        return cached
    limit = request.client_max_size
    content = request.content
    if limit:
        content.set_read_chunk_size(limit)  # as aiohttp's read: no pause before the limit
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk, end_of_http_chunk = await content.readchunk()
        if not chunk:
            if end_of_http_chunk and not content.at_eof():  # a chunk's end, not the body's
                continue
            break
        size += len(chunk)
        if limit and size > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=size)
        chunks.append(chunk)
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    request._read_bytes = body
    return body


def _timed_out(request: web.Request, timeout_s: float) -> web.StreamResponse:
    """The 408 for a body still incomplete after ``timeout_s`` seconds, closing the connection."""
    err = RequestBodyTimeout(
        f"the request body did not arrive within {timeout_s:g} s (server.client_read_timeout_s)"
    )
    outcome = request.get(OUTCOME)
    if outcome is not None:
        outcome.status, outcome.error = err.status, err.code
    log_error(err, request_id_of(request))
    response = error_response(err)
    response.force_close()
    return response
