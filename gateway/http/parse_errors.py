"""OpenAI-style JSON errors for requests aiohttp's HTTP parser refuses, never quoting their bytes.

aiohttp answers an unparsable request line or header itself (``RequestHandler.handle_error``),
before any middleware, with a text 400 that quotes the offending line, which may hold a client's
API key; it offers no public hook (aio-libs/aiohttp#3287). ``install()`` therefore replaces that
one method, process-wide: aiohttp's own still runs first (it logs, redacted by
``RedactMalformedRequests``), then its answer is swapped for ``gateway.http.errors``' JSON body
(``malformed_request``, a fixed message naming only the kind of error; 5xx: ``internal_error``),
status kept, ``Server`` the configured name, connection closed. ``run_gateway`` calls it; an
integration test fails if aiohttp moves the method.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable

from aiohttp import hdrs, web
from aiohttp.http_exceptions import (
    BadHttpMethod,
    BadStatusLine,
    HttpProcessingError,
    InvalidHeader,
    InvalidURLError,
    LineTooLong,
)
from aiohttp.web_protocol import RequestHandler

from gateway.http.errors import GatewayError, InternalError, InvalidRequest, error_response

log = logging.getLogger("sluice.parse_errors")

#: The ``code`` of the 4xx a request aiohttp cannot parse gets.
MALFORMED_REQUEST = "malformed_request"

#: The parameters of ``RequestHandler.handle_error`` this module was written against (aiohttp
#: 3.14.5, as pinned in pyproject.toml): ``(self, request, status=500, exc=None, message=None)``.
HANDLE_ERROR_PARAMETERS = ("self", "request", "status", "exc", "message")

#: aiohttp's own method, run first by ``_json_handle_error`` (logging, ``ConnectionError``).
_AIOHTTP_HANDLE_ERROR = RequestHandler.handle_error
#: The ``Server`` header when ``install`` was given none (``server.server_header``'s default).
DEFAULT_SERVER_HEADER = "sluice"


def _default_server_header() -> str:
    return DEFAULT_SERVER_HEADER


#: The ``Server`` header of these answers (``install``'s ``server_header``), read per answer.
_server_header: Callable[[], str] = _default_server_header

#: What the client is told when aiohttp's reason is not a known one: by error class, most
#: specific first.
_KINDS: tuple[tuple[type[HttpProcessingError], str], ...] = (
    (BadHttpMethod, "invalid method"),
    (BadStatusLine, "invalid request line"),
    (InvalidURLError, "invalid request target"),
    (InvalidHeader, "invalid header"),
)

#: Reasons aiohttp's C parser (llhttp) gives, shown as they are: fixed strings, so an exact match
#: cannot carry the request's bytes (which aiohttp appends after ``":\n"``).
_SAFE_REASONS = frozenset(
    {
        "Content-Length can't be present with Transfer-Encoding",
        "Content-Length overflow",
        "Duplicate Content-Length",
        "Empty Content-Length",
        "Expected CRLF after version",
        "Expected HTTP/, RTSP/ or ICE/",
        "Expected LF after CR",
        "Expected LF after headers",
        "Expected space after method",
        "Invalid HTTP version",
        "Invalid `Transfer-Encoding` header value",
        "Invalid char in url path",
        "Invalid char in url query",
        "Invalid char in url fragment start",
        "Invalid character in Content-Length",
        "Invalid characters in url",
        "Invalid header field char",
        "Invalid header token",
        "Invalid header value char",
        "Invalid major version",
        "Invalid method encountered",
        "Invalid minor version",
        "Missing expected CR after header value",
        "Missing expected LF after header value",
        "Request has invalid `Transfer-Encoding`",
        "Too many headers received",
        "Transfer-Encoding can't be present with Content-Length",
        "Unexpected space after start line",
        "Unexpected start char in url",
        "Unexpected whitespace after header value",
    }
)


def _describe(exc: BaseException | None) -> str:
    """What went wrong, from a fixed vocabulary: aiohttp's reason when it is one of
    ``_SAFE_REASONS``, else the error's class; never text taken from the request."""
    if isinstance(exc, LineTooLong):  # its message quotes the line
        return "request line or header too long"
    if isinstance(exc, HttpProcessingError):
        reason = exc.message.partition(":\n")[0]
        if reason in _SAFE_REASONS:
            return reason
    return next((text for cls, text in _KINDS if isinstance(exc, cls)), "invalid header or framing")


def parse_error(status: int, exc: BaseException | None) -> GatewayError:
    """The error a request aiohttp answered itself gets: ``status`` kept (400 for everything the
    parser refuses in aiohttp 3.14); a 4xx is ``malformed_request`` with a message naming only the
    kind of error (``_describe``); a 5xx is the generic ``internal_error``."""
    if status >= 500:
        return InternalError("internal server error", status=status)
    return InvalidRequest(f"malformed HTTP request: {_describe(exc)}", code=MALFORMED_REQUEST, status=status)


def _json_handle_error(
    self: RequestHandler,
    request: web.BaseRequest,
    status: int = 500,
    exc: BaseException | None = None,
    message: str | None = None,
) -> web.StreamResponse:
    """``RequestHandler.handle_error``'s contract (a response that closes the connection; raises
    ``ConnectionError`` when part of a response was already sent), with ``parse_error``'s body."""
    _AIOHTTP_HANDLE_ERROR(self, request, status, exc, message)
    response = error_response(parse_error(status, exc))
    response.headers[hdrs.SERVER] = _server_header()
    response.force_close()
    return response


def hook_supported() -> bool:
    """True when this aiohttp's ``RequestHandler.handle_error`` has the shape ``install`` replaces
    (or is already replaced)."""
    method = RequestHandler.__dict__.get("handle_error")
    if method is _json_handle_error:
        return True
    return callable(method) and tuple(inspect.signature(method).parameters) == HANDLE_ERROR_PARAMETERS


def install(server_header: Callable[[], str] | None = None) -> bool:
    """Make every aiohttp server of this process answer what it cannot parse with ``parse_error``'s
    JSON, its ``Server`` header ``server_header()`` (read per answer; default
    ``DEFAULT_SERVER_HEADER``). Idempotent (a later call replaces ``server_header``). Returns
    False, with a warning and aiohttp's answer left in place, when this aiohttp's
    ``RequestHandler.handle_error`` is not the one this module knows."""
    global _server_header
    if server_header is not None:
        _server_header = server_header
    if RequestHandler.handle_error is _json_handle_error:
        return True
    if not hook_supported():
        log.warning(
            "aiohttp's RequestHandler.handle_error has changed: requests aiohttp cannot parse "
            "keep aiohttp's plain-text 400, which quotes the offending bytes"
        )
        return False
    RequestHandler.handle_error = _json_handle_error  # type: ignore[method-assign]
    return True
