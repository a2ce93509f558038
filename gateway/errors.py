"""HTTP errors: the one module that turns failures into OpenAI-style responses.

Everything that can go wrong in front of a client is a typed ``GatewayError`` subclass carrying its
HTTP status, OpenAI ``type`` and ``code``; ``error_response`` and ``sse_error_event`` are the only
places that serialise them, and ``error_middleware`` the only place that catches them. aiohttp's
own ``HTTPException``s (404 unknown route, 405 wrong method, 413 body too large) are converted here
too, so every error a client sees has the body::

    {"error": {"message": str, "type": str, "param": str | null, "code": str | null}}

No traceback ever reaches a client: anything unexpected becomes a generic 500 and is logged with
its traceback. Every error is logged exactly once, with the request id (``log_error``).
"""

from __future__ import annotations

import json
import logging
import math
from json.encoder import encode_basestring_ascii
from typing import Any, ClassVar, Final

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Handler, Middleware

from gateway.admission.decision import Reject, RejectReason
from gateway.admission.retry_after import RetryAfter
from gateway.observability.logs import REQUEST_ID

log = logging.getLogger("sluice.errors")

#: Tells the ``openai`` SDKs whether to retry, whatever the status says.
SHOULD_RETRY = "x-should-retry"


class GatewayError(Exception):
    """Base of every error Sluice answers with; subclasses fix status, type and code.

    ``message`` is shown to the client, so it must never contain internals such as tracebacks.
    """

    #: HTTP status; a class default that one instance may override (see ``from_http_exception``).
    status: int = 500
    error_type: ClassVar[str] = "server_error"
    default_code: ClassVar[str | None] = None
    #: Level ``log_error`` logs it at; ``None``: INFO for 4xx, WARNING for 5xx.
    log_level: ClassVar[int | None] = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code
        if status is not None:
            self.status = status

    def headers(self) -> dict[str, str]:
        """Extra response headers (e.g. ``Retry-After``); empty by default."""
        return {}

    def body(self) -> dict[str, Any]:
        """The OpenAI-style error object, ready for ``json.dumps``."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def body_bytes(self) -> bytes:
        """``body()`` as the bytes ``json.dumps(...).encode()`` writes, without building the dict
        and running the generic encoder when the body has the standard shape (a 429 under a flood
        pays this once per refusal)."""
        if type(self).body is not GatewayError.body:
            return json.dumps(self.body()).encode()
        return error_json(self.message, self.error_type, self.param, self.code)


class InvalidRequest(GatewayError):
    """400: the body is not JSON, or a field is missing or has the wrong type."""

    status = 400
    error_type = "invalid_request_error"


class BodyTooLarge(GatewayError):
    """413: the request body exceeds ``server.max_body_bytes``."""

    status = 413
    error_type = "invalid_request_error"
    default_code = "request_too_large"


class RequestBodyTimeout(GatewayError):
    """408: the request body did not arrive within ``server.client_read_timeout_s`` (a client
    sending it too slowly); the response closes the connection (``Connection: close``)."""

    status = 408
    error_type = "invalid_request_error"
    default_code = "request_timeout"


class RouteNotFound(GatewayError):
    """404: no route for this path."""

    status = 404
    error_type = "invalid_request_error"
    default_code = "not_found"


class MethodNotAllowed(GatewayError):
    """405: the path exists but not for this method; ``allowed`` feeds the ``Allow`` header."""

    status = 405
    error_type = "invalid_request_error"
    default_code = "method_not_allowed"

    def __init__(self, message: str, *, allowed: frozenset[str]) -> None:
        super().__init__(message)
        self.allowed = allowed

    def headers(self) -> dict[str, str]:
        return {"Allow": ",".join(sorted(self.allowed))}


class ModelNotFound(GatewayError):
    """404: no configured replica serves the requested model."""

    status = 404
    error_type = "invalid_request_error"
    default_code = "model_not_found"


class UpstreamError(GatewayError):
    """502: the replica refused the connection, timed out, died mid-response or answered 5xx."""

    status = 502
    error_type = "upstream_error"
    default_code = "upstream_error"


class NoHealthyReplica(GatewayError):
    """503: no healthy replica serves the model right now; retry after ``retry_after_s`` seconds."""

    status = 503
    error_type = "service_unavailable_error"
    default_code = "no_healthy_replica"

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return retry_after_headers(self.retry_after_s)


class ReplicasSaturated(GatewayError):
    """429: every replica that could serve the request answered its own overload refusal (TGI's
    429 ``Model is overloaded``, a 503) moments ago. ``retry_after_s``: when the first of them is
    expected to take requests again (seconds, jittered by the caller). Type and code
    ``overloaded``, as admission's own load refusals."""

    status = 429
    error_type = "overloaded"
    default_code = "overloaded"
    log_level = logging.DEBUG

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return retry_after_headers(self.retry_after_s)


class ServerShuttingDown(GatewayError):
    """503: the gateway is stopping (draining after SIGTERM, or its grace ran out); retry, on
    another gateway replica, after ``retry_after_s`` seconds."""

    status = 503
    error_type = "service_unavailable_error"
    default_code = "server_shutting_down"

    def __init__(
        self, message: str = "Sluice is shutting down; retry shortly", *, retry_after_s: float = 1.0
    ) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return retry_after_headers(self.retry_after_s)


class AdmissionRejected(GatewayError):
    """429: admission refused the request because of load (``gateway.admission.Reject``).

    ``type`` and ``code`` are the reason (``overloaded``, ``slo_unattainable``,
    ``deadline_exceeded``). ``retry_after``: the forecast's jittered delay (``Retry-After`` in
    integer seconds, RFC 9110, plus ``retry-after-ms``, at most 60 s); ``None`` means retrying
    cannot help (the targets are out of reach even on an idle replica), said with
    ``x-should-retry: false``, which the ``openai`` SDKs obey.
    """

    status = 429
    error_type = "overloaded"
    # Counted in metrics and in the access line; one log line per refusal would flood the log
    # exactly when the gateway is busiest.
    log_level = logging.DEBUG

    def __init__(self, message: str, *, reason: str, retry_after: RetryAfter | None) -> None:
        super().__init__(message, code=reason)
        self.reason = reason
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        body = super().body()
        body["error"]["type"] = self.reason
        return body

    def body_bytes(self) -> bytes:
        return error_json(self.message, self.reason, self.param, self.code)

    @property
    def retry_after_s(self) -> float | None:
        """The delay sent, seconds; ``None`` when not retryable."""
        return None if self.retry_after is None else self.retry_after.delay_s

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {SHOULD_RETRY: "false"}
        return self.retry_after.headers()


class PromptTooLarge(GatewayError):
    """400: the prompt exceeds its class's ``max_prompt_tokens`` or every replica's context or KV
    cache. Never retryable: no ``Retry-After``, and ``x-should-retry: false``."""

    status = 400
    error_type = "invalid_request_error"
    default_code = "prompt_too_large"

    def headers(self) -> dict[str, str]:
        return {SHOULD_RETRY: "false"}


class ClientClosedRequest(GatewayError):
    """499 (nginx's code): the client went away before its request was answered; nobody reads it."""

    status = 499
    error_type = "invalid_request_error"
    default_code = "client_disconnected"


class InternalError(GatewayError):
    """500: a bug in Sluice; the client sees only a generic message."""

    status = 500
    error_type = "server_error"
    default_code = "internal_error"


def admission_error(reject: Reject) -> GatewayError:
    """The HTTP error for an enforced admission ``Reject``: 429 for load (``overloaded``,
    ``slo_unattainable``, ``deadline_exceeded``), 503 when no replica is healthy, 400 for
    ``prompt_too_large``."""
    reason = reject.reason
    if reason == RejectReason.PROMPT_TOO_LARGE:
        return PromptTooLarge(reject.message, param="messages")
    if reason == RejectReason.NO_HEALTHY_REPLICA:
        delay = reject.retry_after.delay_s if reject.retry_after is not None else 1.0
        return NoHealthyReplica(reject.message, retry_after_s=delay)
    return AdmissionRejected(reject.message, reason=reason.value, retry_after=reject.retry_after)


#: The longest ``Retry-After`` Sluice sends, seconds: the ``openai`` SDKs ignore a longer one (and
#: fall back to their own short backoff, so the client would come back sooner, not later).
MAX_RETRY_AFTER_S = 60.0


def retry_after_headers(retry_after_s: float) -> dict[str, str]:
    """``Retry-After`` (RFC 9110 delay-seconds: integer, rounded up, at least 1) and ``retry-after-ms``,
    both at most ``MAX_RETRY_AFTER_S`` (a tenant's bucket may refill later than that: its
    ``x-ratelimit-reset-*`` headers keep the exact time; a client told 60 s asks again then)."""
    retry_after_s = min(retry_after_s, MAX_RETRY_AFTER_S)
    seconds = max(1, math.ceil(retry_after_s))
    millis = max(1, math.ceil(retry_after_s * 1000))
    return {"Retry-After": str(seconds), "retry-after-ms": str(millis)}


def _json_string(value: str | None) -> str:
    return "null" if value is None else encode_basestring_ascii(value)


def error_json(message: str, error_type: str, param: str | None, code: str | None) -> bytes:
    """``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`` exactly as
    ``json.dumps(...).encode()`` writes it (the same string escaping, ASCII only), about a fifth
    of its cost."""
    return (
        f'{{"error": {{"message": {encode_basestring_ascii(message)}, '
        f'"type": {encode_basestring_ascii(error_type)}, "param": {_json_string(param)}, '
        f'"code": {_json_string(code)}}}}}'
    ).encode()


def error_response(err: GatewayError) -> web.Response:
    """The JSON response for ``err``: its status, its headers, the OpenAI-style body."""
    return web.Response(
        status=err.status,
        body=err.body_bytes(),
        content_type="application/json",
        headers=err.headers(),
    )


def sse_error_event(err: GatewayError) -> bytes:
    """The last event of a stream cut after its headers were sent: ``data: {"error": ...}``."""
    return b"data: " + err.body_bytes() + b"\n\n"


def from_http_exception(exc: web.HTTPException) -> GatewayError:
    """Map one of aiohttp's own HTTP errors (status >= 400) to our typed error."""
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return BodyTooLarge(f"request body too large: {exc.text or 'over the limit'}")
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = frozenset(exc.allowed_methods)
        return MethodNotAllowed(
            f"method {exc.method} not allowed here; allowed: {', '.join(sorted(allowed))}",
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
    or the error's own ``log_level`` (admission's 429s: DEBUG)."""
    level = logging.ERROR if exc_info else _log_level(err)
    if not log.isEnabledFor(level):
        return
    args = (request_id or "-", err.status, err.code or err.error_type, err.message)
    if exc_info:
        log.log(level, _FAILED, *args, exc_info=True)
        return
    # The record made directly, as ``log_access`` does: ``Logger.log`` would also look up the
    # calling file, line and function (a 4xx flood pays this per request), which no formatter
    # here prints.
    log.handle(log.makeRecord(log.name, level, __file__, 0, _FAILED, args, None))


_FAILED: Final = "request %s failed: %d %s: %s"


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
        detail = cause.message if isinstance(cause, HttpProcessingError) else "cannot be decoded"
        err = InvalidRequest(f"malformed request body: {detail}")
    else:
        err = InternalError("internal server error")
        log_error(err, request_id_of(request), exc_info=True)
        return error_response(err)
    if log.isEnabledFor(_log_level(err)):  # the request id only for a line that is written
        log_error(err, request_id_of(request))
    return error_response(err)


# -- tenants: authentication and budgets (gateway.tenancy raises these) ------------------------------


class Unauthenticated(GatewayError):
    """401: no API key, a malformed one or an unknown one (``code`` ``invalid_api_key``, what
    OpenAI answers and its SDKs raise ``AuthenticationError`` for); also a missing or wrong admin
    token on ``/metrics`` and ``/sluice/v1/*`` (``code`` ``invalid_admin_token``). The message never
    contains the key. ``www_authenticate`` is the RFC 6750 challenge."""

    status = 401
    error_type = "invalid_request_error"
    default_code = "invalid_api_key"
    # The access line (``reason=auth_...``) and the metrics already record each one; an INFO line
    # per refusal too would let anyone flood the log with bad keys.
    log_level = logging.DEBUG

    def __init__(self, message: str, *, www_authenticate: str, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.www_authenticate = www_authenticate

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": self.www_authenticate}


class TenantRateLimited(GatewayError):
    """429: the tenant's token, request or concurrency budget is spent (``type`` and ``code``
    ``rate_limit_exceeded``).

    ``retry_after_s``: seconds until the budgets hold this request again (``Retry-After`` in whole
    seconds rounded up, ``retry-after-ms``); ``None`` sends neither but ``x-should-retry: false``
    (the request can never fit). ``rate_limit_headers``: OpenAI's ``x-ratelimit-limit-*``,
    ``-remaining-*``, ``-reset-*``.
    """

    status = 429
    error_type = "rate_limit_exceeded"
    default_code = "rate_limit_exceeded"
    # Counted in metrics and in the access line, as admission's 429s: a tenant over its budget
    # would otherwise write an extra INFO line per refusal exactly when it floods.
    log_level = logging.DEBUG

    def __init__(
        self, message: str, *, retry_after_s: float | None, rate_limit_headers: dict[str, str]
    ) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.rate_limit_headers = dict(rate_limit_headers)

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {SHOULD_RETRY: "false", **self.rate_limit_headers}
        return {**retry_after_headers(self.retry_after_s), **self.rate_limit_headers}


class RateLimitStorageUnavailable(GatewayError):
    """503: the shared budget store (Redis) is down and ``limits.on_storage_error`` is
    ``fail_closed``; retry after ``retry_after_s`` seconds (the limiter's next probe)."""

    status = 503
    error_type = "service_unavailable_error"
    default_code = "rate_limit_unavailable"

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return retry_after_headers(self.retry_after_s)


#: The RFC 6750 challenge of a 401 from an admin route (``realm`` tells it from a tenant's 401).
ADMIN_CHALLENGE = 'Bearer realm="sluice-admin"'


def admin_token_required() -> Unauthenticated:
    """401 for ``/metrics``, ``/metrics/*`` or ``/sluice/v1/*`` without the admin token (absent,
    malformed or wrong: one answer, so a caller learns nothing about which). ``code``
    ``invalid_admin_token``; the message names the setting, never a token or its hash."""
    return Unauthenticated(
        "This endpoint needs the admin token: Authorization: Bearer <admin token> "
        "(admin.token_sha256, or tenants.auth.admin_token_hash).",
        www_authenticate=ADMIN_CHALLENGE,
        code="invalid_admin_token",
    )
