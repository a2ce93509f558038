"""HTTP errors: the one module that turns failures into OpenAI-style responses.

Everything that can go wrong in front of a client is a typed ``GatewayError`` subclass carrying its
HTTP status, OpenAI ``type`` and ``code``; ``error_response`` and ``sse_error_event`` are the only
places that serialise them, and ``gateway.http.error_middleware`` the only place that catches
them. aiohttp's
own ``HTTPException``s (404 unknown route, 405 wrong method, 413 body too large) are converted here
too, so every error a client sees has the body::

    {"error": {"message": str, "type": str, "param": str | null, "code": str | null}}

No traceback ever reaches a client: anything unexpected becomes a generic 500 and is logged with
its traceback. Every error is logged exactly once, with the request id (``log_error`` there).

Refusals (a tenant's budget, admission, no replica, replicas that refused as overloaded, a
shutdown) are ONE type, ``Refused``, carrying a ``RefusalReason`` and the ``RetryAfter`` that
``gateway.admission.retry_after.retry_after`` computed. This module alone maps it to status, type,
code (``_ANSWERS``), headers (``Retry-After``, ``retry-after-ms`` or ``x-should-retry: false``,
OpenAI's ``x-ratelimit-*``, the ``x-sluice-*`` reason headers of a refusal no admission decision
described) and body. ``docs/architecture.md`` tabulates reason -> status -> Retry-After rule.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii
from typing import Any, ClassVar, Final

from aiohttp import web

from gateway.admission.config import AdmissionSettings
from gateway.admission.decision import ContextExcess, Reject
from gateway.admission.headers import ADMISSION, CLASS, REASON
from gateway.admission.retry_after import RefusalReason, RetryAfter
from gateway.http.echo import MESSAGE_LIMIT, clip
from gateway.http.rate_limit_headers import ietf_rate_limit_headers, rate_limit_headers
from gateway.limits.base import Reservation

#: Tells the ``openai`` SDKs whether to retry, whatever the status says.
SHOULD_RETRY = "x-should-retry"


class GatewayError(Exception):
    """Base of every error Sluice answers with; subclasses fix status, type and code.

    ``message`` is shown to the client: fixed text (docs/operations.md, "What a client is told"),
    never an exception's text or a traceback; a value the client sent is ``clip``-ped into it,
    and any message is cut at ``MESSAGE_LIMIT`` characters. ``detail`` is for the log only
    (``log_error``): the exception or the replica's own words, cut the same way.
    """

    #: HTTP status; a class default that one instance may override (see ``from_http_exception``).
    status: int = 500
    error_type: ClassVar[str] = "server_error"
    default_code: ClassVar[str | None] = None
    #: Level ``log_error`` logs it at; ``None``: INFO for 4xx, WARNING for 5xx.
    log_level: int | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int | None = None,
        detail: str | None = None,
    ) -> None:
        message = clip(message, MESSAGE_LIMIT)
        super().__init__(message)
        self.message = message
        self.detail = None if detail is None else clip(detail, MESSAGE_LIMIT)
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


class ContextLengthExceeded(GatewayError):
    """400: a replica refused the prompt and output cap as longer than its context; its own words
    (which name the context length), as OpenAI's ``context_length_exceeded``
    (``replica_context_error``)."""

    status = 400
    error_type = "invalid_request_error"
    default_code = "context_length_exceeded"


class UpstreamError(GatewayError):
    """502: the replica refused the connection, timed out, died mid-response or answered 5xx."""

    status = 502
    error_type = "upstream_error"
    default_code = "upstream_error"


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


# -- refusals: the one map from a refusal to its answer ----------------------------------------------


@dataclass(frozen=True, slots=True)
class _Answer:
    """How a refusal reason is answered: HTTP status, OpenAI ``type`` and ``code``."""

    status: int
    error_type: str
    code: str


_UNAVAILABLE: Final = "service_unavailable_error"
#: Reason -> status, type, code. Load and budget refusals are 429 (the ``openai`` SDKs retry them
#: after ``Retry-After``), a missing backend or a stopping gateway 503, an oversized prompt 400.
_ANSWERS: Final[dict[RefusalReason, _Answer]] = {
    RefusalReason.RATE_LIMITED: _Answer(429, "rate_limit_exceeded", "rate_limit_exceeded"),
    RefusalReason.LIMITER_UNAVAILABLE: _Answer(503, _UNAVAILABLE, "rate_limit_unavailable"),
    RefusalReason.OVERLOADED: _Answer(429, "overloaded", "overloaded"),
    RefusalReason.SLO_UNATTAINABLE: _Answer(429, "slo_unattainable", "slo_unattainable"),
    RefusalReason.DEADLINE_EXCEEDED: _Answer(429, "deadline_exceeded", "deadline_exceeded"),
    RefusalReason.PROMPT_TOO_LARGE: _Answer(400, "invalid_request_error", "prompt_too_large"),
    RefusalReason.NO_HEALTHY_REPLICA: _Answer(503, _UNAVAILABLE, "no_healthy_replica"),
    RefusalReason.REPLICAS_SATURATED: _Answer(429, "overloaded", "overloaded"),
    RefusalReason.SHUTTING_DOWN: _Answer(503, _UNAVAILABLE, "server_shutting_down"),
}


class Refused(GatewayError):
    """Sluice refused the request; everything a client sees follows from ``reason``.

    ``retry_after``: when to come back (``gateway.admission.retry_after.retry_after``); ``None``
    means retrying cannot help, said with ``x-should-retry: false``, which the ``openai`` SDKs
    obey. ``reservation``: a tenant's refused reservation, whose buckets give OpenAI's
    ``x-ratelimit-*`` headers (and the IETF fields with ``ietf_headers``). ``code``: a finer code
    than the reason's own (a ``prompt_too_large`` that is OpenAI's ``context_length_exceeded``).
    Refusals answered 429 are logged at DEBUG: they are counted in metrics and in the access
    line, and a line per refusal would flood the log exactly when the gateway is busiest.
    """

    def __init__(
        self,
        reason: RefusalReason,
        message: str,
        *,
        retry_after: RetryAfter | None,
        param: str | None = None,
        reservation: Reservation | None = None,
        detail: str | None = None,
        code: str | None = None,
        ietf_headers: bool = False,
    ) -> None:
        answer = _ANSWERS[reason]
        super().__init__(message, param=param, code=code or answer.code, status=answer.status, detail=detail)
        self.reason = reason
        self.retry_after = retry_after
        self.reservation = reservation
        self.ietf_headers = ietf_headers
        self._error_type = answer.error_type
        if answer.status == 429:
            self.log_level = logging.DEBUG

    @property
    def retry_after_s(self) -> float | None:
        """The delay sent, seconds; ``None`` when not retryable."""
        return None if self.retry_after is None else self.retry_after.delay_s

    def headers(self) -> dict[str, str]:
        return refusal_headers(self.retry_after, self.reservation, ietf=self.ietf_headers)

    def body(self) -> dict[str, Any]:
        body = super().body()
        body["error"]["type"] = self._error_type
        return body

    def body_bytes(self) -> bytes:
        return error_json(self.message, self._error_type, self.param, self.code)


class AdmissionRejected(Refused):
    """429: admission refused the request because of load (``reason``: ``overloaded``,
    ``slo_unattainable``, ``deadline_exceeded``); type and code are the reason.

    Without ``retry_after`` (even an idle replica could not serve it as asked: a configuration
    mismatch, not load) it is a 400 ``invalid_request_error`` with the reason as its code and
    ``x-should-retry: false``, which the ``openai`` SDKs raise as ``BadRequestError`` and never
    retry; its message says which target or limit to change. ``detail``: for the log only."""

    def __init__(
        self, message: str, *, reason: str, retry_after: RetryAfter | None, detail: str | None = None
    ) -> None:
        super().__init__(RefusalReason(reason), message, retry_after=retry_after, detail=detail)
        if retry_after is None:
            self.status = 400
            self._error_type = "invalid_request_error"
            self.log_level = None


def admission_error(reject: Reject, *, endpoint: str = "chat") -> Refused:
    """The refusal for an enforced admission ``Reject``: 429 for load (``overloaded``,
    ``slo_unattainable``, ``deadline_exceeded``; 400 when not retryable: ``AdmissionRejected``),
    503 when no replica is healthy, 400 for
    ``prompt_too_large`` (OpenAI's ``context_length_exceeded`` when it is the context that is
    exceeded: ``context_length_error``); the reject's own ``retry_after`` (``None``: not
    retryable). ``endpoint`` (``gateway.api.openai.Endpoint``) names the prompt's field."""
    reason = RefusalReason(reject.reason.value)
    if reason == RefusalReason.PROMPT_TOO_LARGE:
        if reject.context is not None:
            return context_length_error(reject.context, endpoint)
        return Refused(reason, reject.message, retry_after=None, param=prompt_param(endpoint))
    if reason == RefusalReason.NO_HEALTHY_REPLICA:
        return Refused(reason, reject.message, retry_after=reject.retry_after)
    # The replica's name is the operator's: the log line's, never the client's message.
    detail = None if reject.replica is None else f"best replica {reject.replica}"
    return AdmissionRejected(
        reject.message, reason=reason.value, retry_after=reject.retry_after, detail=detail
    )


#: The request field that holds the prompt, per endpoint (``gateway.api.openai.Endpoint``).
_PROMPT_PARAMS: Final = {"chat": "messages", "completions": "prompt", "generate": "inputs"}
CONTEXT_LENGTH_EXCEEDED: Final = "context_length_exceeded"


def prompt_param(endpoint: str) -> str:
    """The field that holds ``endpoint``'s prompt: ``messages``, ``prompt`` or ``inputs``."""
    return _PROMPT_PARAMS.get(endpoint.removesuffix("_stream"), "messages")


def context_length_error(excess: ContextExcess, endpoint: str) -> Refused:
    """400 ``context_length_exceeded`` (type ``invalid_request_error``), worded as OpenAI words
    it, with the context length: blamed on the prompt's field when the prompt alone fills the
    context, else on ``max_tokens``. Not retryable."""
    field = prompt_param(endpoint)
    where = "messages" if field == "messages" else "prompt"
    context, prompt = excess.context_tokens, excess.prompt_tokens
    shown = f"at least {prompt}" if excess.at_least else str(prompt)
    if excess.prompt_over or excess.max_tokens is None:
        message = (
            f"This model's maximum context length is {context} tokens. However, your {where} "
            f"resulted in {shown} tokens. Please reduce the length of the {where}."
        )
    else:
        total = prompt + excess.max_tokens
        message = (
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{'at least ' if excess.at_least else ''}{total} tokens ({shown} in the {where}, "
            f"{excess.max_tokens} in the completion). Please reduce the length of the {where} or "
            "completion."
        )
        field = "max_tokens"
    return Refused(
        RefusalReason.PROMPT_TOO_LARGE, message, retry_after=None, param=field, code=CONTEXT_LENGTH_EXCEEDED
    )


#: The engines' words for a request longer than the context: vLLM's ("This model's maximum
#: context length is N tokens. However, your prompt contains M input tokens ..." and
#: "max_tokens=M cannot be greater than max_model_len=N"), SGLang's ("... is longer than the
#: model's context length (N tokens)") and TGI's ("`inputs` tokens + `max_new_tokens` must be
#: <= N"). The group is the context length.
_CONTEXT_WORDS: Final = re.compile(
    r"maximum context length is (\d+) tokens|cannot be greater than max_model_len=(\d+)"
    r"|longer than the model's context length \((\d+) tokens\)|`max_new_tokens` must be <= (\d+)"
)
#: vLLM's ``VLLMValidationError`` appends ``(parameter=..., value=...)`` to its message.
_VLLM_PARAMETER: Final = re.compile(r"\s*\(parameter=([\w.]+)(?:, value=[^)]*)?\)\s*$")


def replica_context_error(message: str, endpoint: str) -> ContextLengthExceeded | None:
    """A replica's 400 ``message`` as OpenAI's ``context_length_exceeded`` when it says the request
    is longer than the context (``_CONTEXT_WORDS``), else ``None`` (relayed as the replica sent it).
    ``param``: ``max_tokens`` when the replica blames the output cap, else the prompt's field."""
    if _CONTEXT_WORDS.search(message) is None:
        return None
    blamed = _VLLM_PARAMETER.search(message)
    text = message[: blamed.start()] if blamed is not None else message
    over_cap = "max_tokens" in text or (
        blamed is not None and blamed.group(1) in {"max_tokens", "max_completion_tokens"}
    )
    return ContextLengthExceeded(text, param="max_tokens" if over_cap else prompt_param(endpoint))


def refusal_headers(
    retry: RetryAfter | None, reservation: Reservation | None = None, *, ietf: bool = False
) -> dict[str, str]:
    """A refusal's headers: ``Retry-After`` (RFC 9110 delay-seconds, 1..60) and ``retry-after-ms``
    (1..60,000) when it may be retried, else ``x-should-retry: false``; plus the tenant's
    ``x-ratelimit-*`` when ``reservation`` is given (a bucket refilling later than 60 s keeps its
    exact time there; a client told 60 s asks again then), and with ``ietf`` the IETF fields
    (``ietf_rate_limit_headers``)."""
    if retry is None:
        headers = {SHOULD_RETRY: "false"}
    else:
        headers = {"Retry-After": str(retry.seconds), "retry-after-ms": str(retry.milliseconds)}
    if reservation is not None:
        headers.update(rate_limit_headers(reservation))
        if ietf:
            headers.update(ietf_rate_limit_headers(reservation))
    return headers


def refusal_reason_headers(
    request_class: str, reason: RefusalReason, settings: AdmissionSettings
) -> dict[str, str]:
    """The ``x-sluice-*`` headers of a refusal no admission decision described (``reason``, e.g.
    ``replicas_saturated``: every replica answered its own overload refusal): class, ``rejected``
    and the reason, no prediction. Empty when ``admission.expose_prediction_headers`` is off."""
    if not settings.expose_prediction_headers:
        return {}
    return {CLASS: request_class, ADMISSION: "rejected", REASON: reason.value}


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


# -- tenants: authentication and budgets (gateway.tenants.live raises these) ------------------------------


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
