"""Where errors are caught and logged: the error middleware and ``log_error``.

Every exception that leaves a handler passes ``response_for_exception``: a ``GatewayError`` is
answered as ``gateway.http.errors`` renders it, aiohttp's own HTTP errors and undecodable bodies
are converted to one first, and anything else becomes a generic 500 whose traceback is logged
(never sent). Each error is logged exactly once, with its request id, at a level set by its
status (``log_error``); lines that differ only by request id count as repeats.
"""

from __future__ import annotations

import logging
import sys
from typing import Final

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Handler, Middleware

from gateway.http.echo import clip
from gateway.http.errors import (
    BodyTooLarge,
    GatewayError,
    InternalError,
    InvalidRequest,
    MethodNotAllowed,
    RouteNotFound,
    error_response,
)
from gateway.observability.logs import REQUEST_ID
from gateway.observability.repeats import repeat_key

__all__ = ["error_middleware", "from_http_exception", "log_error", "request_id_of", "response_for_exception"]

#: The errors' logger (its name is what operators filter on).
log = logging.getLogger("sluice.errors")


def from_http_exception(exc: web.HTTPException) -> GatewayError:
    """Map one of aiohttp's own HTTP errors (status >= 400) to our typed error."""
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return BodyTooLarge("request body over the limit (server.max_body_bytes)")
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = frozenset(exc.allowed_methods)
        return MethodNotAllowed(
            f"method {clip(exc.method, 32)} not allowed here; allowed: {', '.join(sorted(allowed))}",
            allowed=allowed,
        )
    if isinstance(exc, web.HTTPNotFound):
        return RouteNotFound("no such route")
    if exc.status >= 500:
        return InternalError("internal server error")
    return _client_error_for(exc.status, exc.reason)


def _client_error_for(status: int, reason: str) -> GatewayError:
    """A 4xx we have no dedicated class for (e.g. 400 from a malformed header), status kept."""
    return InvalidRequest(reason or "bad request", status=status)


def log_error(err: GatewayError, request_id: str | None, *, exc_info: bool = False) -> None:
    """Log ``err`` once: WARNING for 5xx (ERROR with traceback when ``exc_info``), INFO for 4xx,
    or the error's own ``log_level`` (admission's 429s: DEBUG). Lines that differ only by their
    request id count as repeats (``repeat_key``; with a traceback: the same exception type raised
    at the same line)."""
    level = logging.ERROR if exc_info else _log_level(err)
    if not log.isEnabledFor(level):
        return
    code = err.code or err.error_type
    args: tuple[object, ...] = (request_id or "-", err.status, code, err.message)
    template = _FAILED
    if err.detail is not None:  # the log's alone; not part of the repeat key
        args, template = (*args, err.detail), _FAILED_DETAIL
    if exc_info:
        failure = sys.exc_info()[1]
        where = failure.__traceback__ if failure is not None else None
        while where is not None and where.tb_next is not None:
            where = where.tb_next
        place = (where.tb_frame.f_code.co_filename, where.tb_lineno) if where is not None else None
        key = repeat_key(err.status, code, err.message[:_KEYED_CHARS], type(failure).__name__, place)
        log.log(level, template, *args, exc_info=True, extra=key)
        return
    # The record made directly, as ``log_access`` does: ``Logger.log`` would also look up the
    # calling file, line and function (a 4xx flood pays this per request), which no formatter
    # here prints.
    key = repeat_key(err.status, code, err.message[:_KEYED_CHARS])
    log.handle(log.makeRecord(log.name, level, __file__, 0, template, args, None, None, key))


_FAILED: Final = "request %s failed: %d %s: %s"
_FAILED_DETAIL: Final = "request %s failed: %d %s: %s (%s)"
#: Characters of an error's message that tell two lines apart as repeats (a key holds no more).
_KEYED_CHARS: Final = 256


def _log_level(err: GatewayError) -> int:
    """The level ``log_error`` logs ``err`` at without a traceback."""
    if err.log_level is not None:
        return err.log_level
    return logging.INFO if err.status < 500 else logging.WARNING


def request_id_of(request: web.Request) -> str | None:
    """The request id assigned by the request-id middleware, if it ran."""
    return request.get(REQUEST_ID)


def error_middleware() -> Middleware:
    """Middleware factory: every exception leaving a handler becomes our JSON error response
    (``response_for_exception``). Cancellation is not caught.
    """

    @web.middleware
    async def impl(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except Exception as exc:
            response = response_for_exception(request, exc)
            if response is None:
                raise
            return response

    return impl


def response_for_exception(request: web.Request, exc: Exception) -> web.Response | None:
    """The answer to ``exc`` raised while handling ``request``, logged once (``log_error``);
    call it in the ``except`` block (a 500's traceback is the exception being handled).

    ``GatewayError`` -> its response; aiohttp ``HTTPException`` with status >= 400 -> converted;
    aiohttp's ``RequestPayloadError`` (a body it cannot decode) -> 400; anything else -> generic
    500 with the traceback logged. ``None`` for an ``HTTPException`` below 400 (a redirect): the
    caller raises it on.
    """
    if isinstance(exc, GatewayError):
        err: GatewayError = exc
    elif isinstance(exc, web.HTTPException):
        if exc.status < 400:
            return None
        err = from_http_exception(exc)
    elif isinstance(exc, web.RequestPayloadError):
        # A body aiohttp could not decode while the handler read it (corrupt gzip or deflate
        # data, broken chunking): the client's fault, a 400, never a 500.
        cause = exc.__cause__
        detail = cause.message if isinstance(cause, HttpProcessingError) else str(exc)
        err = InvalidRequest("malformed request body: it cannot be decoded", detail=detail)
    else:
        err = InternalError("internal server error")
        log_error(err, request_id_of(request), exc_info=True)
        return error_response(err)
    if log.isEnabledFor(_log_level(err)):  # the request id only for a line that is written
        log_error(err, request_id_of(request))
    return error_response(err)
