"""What happened to one request (``RequestOutcome``) and its access line's fields.

The proxy and admission fill a ``RequestOutcome`` in as the request goes; the access log
(``gateway.observability.logs``), its formatters and the metrics read it. ``access_fields`` gives
the access line's fields in print order, durations in milliseconds. ``ACCESS_LOGGER`` is the
logger the access lines go to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ACCESS_LOGGER", "RequestOutcome", "access_fields"]

#: The access logger's name: its records are the access lines (``gateway.observability.logs``).
ACCESS_LOGGER = "sluice.access"


@dataclass(slots=True)
class RequestOutcome:
    """What happened to one request. Times are ``time.monotonic()`` seconds; ``None`` = unknown.

    ``prompt_tokens`` / ``completion_tokens`` are the replica's own usage counts (``None`` when
    the replica never reported them, e.g. a stream cut before its usage chunk).
    ``status`` is the HTTP status sent to the client (200 for a stream even if it was cut later;
    then ``error`` says why). ``error`` is an error code such as ``upstream_error`` or
    ``client_disconnected``; ``None`` means the request completed normally.
    """

    request_id: str
    method: str
    path: str
    received_at: float
    model: str | None = None
    stream: bool = False
    replica: str | None = None
    status: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    dispatched_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    error: str | None = None
    #: The resolved class and tenant; ``None`` until admission / tenancy set them (metrics: ``none``).
    request_class: str | None = None
    tenant: str | None = None
    #: ``admitted``, ``rejected`` or ``shadow_rejected`` (a shadow rule would have rejected it; it
    #: was admitted); ``None``: derived from whether a replica was chosen.
    decision: str | None = None
    #: Why the decision was taken (a ``RejectReason`` value, or ``None`` for a plain admit).
    reason: str | None = None
    #: Seconds in Sluice's queue, 0.0 when dispatched at once; ``None``: never went through it.
    queue_wait_s: float | None = None
    #: The exact Retry-After of a rejection, seconds (the header rounds it up to whole seconds).
    retry_after_s: float | None = None
    #: The effective targets, seconds (after a client deadline tightened them).
    ttft_target_s: float | None = None
    tpot_target_s: float | None = None
    #: The engine forecast for the replica the request was sent to, in seconds (TTFT from dispatch).
    predicted_ttft_s: float | None = None
    predicted_tpot_s: float | None = None
    #: Content-carrying SSE events relayed (one per engine step per sequence on vLLM): what a
    #: stream cut before its usage chunk really produced.
    tokens_streamed: int = 0
    #: What one prompt and one output token cost its tenant's token budget (``None``: no token
    #: budget held); 1 and 1 with plain tokens, the default.
    prompt_weight: float | None = None
    output_weight: float | None = None
    #: Prompt tokens admission expected to hit the replica's prefix cache, and those the
    #: replica's usage says did (``None``: not sent, or the replica did not say).
    expected_cached_tokens: int | None = None
    cached_tokens: int | None = None

    @property
    def ttft_s(self) -> float | None:
        """Seconds from dispatch to the replica until the first generated token arrived."""
        if self.dispatched_at is None or self.first_token_at is None:
            return None
        return self.first_token_at - self.dispatched_at

    @property
    def tpot_s(self) -> float | None:
        """Mean seconds per output token after the first, for a stream that ended without error.

        ``None`` for non-streamed answers, errors, or fewer than two completion tokens (the
        replica's usage count; the SSE event count is not a token count on every engine).
        """
        tokens = self.completion_tokens
        if self.first_token_at is None or self.finished_at is None or self.error is not None:
            return None
        if tokens is None or tokens < 2:
            return None
        return max(0.0, self.finished_at - self.first_token_at) / (tokens - 1)

    @property
    def duration_s(self) -> float | None:
        """Seconds from receipt by the gateway until the response (or stream) fully ended."""
        if self.finished_at is None:
            return None
        return self.finished_at - self.received_at


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def access_fields(outcome: RequestOutcome) -> dict[str, Any]:
    """The access line's fields, in print order; durations in milliseconds, rounded to 0.1.

    Who (request id, tenant, class), where (replica, model), what was decided and why (decision,
    reason, queue wait, Retry-After), how it went (status, error, predicted against actual TTFT
    and TPOT, expected against reported prefix-cache hits) and what it cost (tokens in and out,
    and the weights its tenant's budget charged them at). Never prompt text or keys: only the
    tenant's name, which the tenants section of the config defines.
    """
    return {
        "request_id": outcome.request_id,
        "method": outcome.method,
        "path": outcome.path,
        "status": outcome.status,
        "tenant": outcome.tenant,
        "class": outcome.request_class,
        "decision": outcome.decision,
        "reason": outcome.reason,
        "replica": outcome.replica,
        "model": outcome.model,
        "stream": outcome.stream,
        "duration_ms": _ms(outcome.duration_s),
        "queue_wait_ms": _ms(outcome.queue_wait_s),
        "retry_after_ms": _ms(outcome.retry_after_s),
        "predicted_ttft_ms": _ms(outcome.predicted_ttft_s),
        "ttft_ms": _ms(outcome.ttft_s),
        "predicted_tpot_ms": _ms(outcome.predicted_tpot_s),
        "tpot_ms": _ms(outcome.tpot_s),
        "prompt_tokens": outcome.prompt_tokens,
        "completion_tokens": outcome.completion_tokens,
        "expected_cached_tokens": outcome.expected_cached_tokens,
        "cached_tokens": outcome.cached_tokens,
        "tokens_streamed": outcome.tokens_streamed,
        "prompt_weight": outcome.prompt_weight,
        "output_weight": outcome.output_weight,
        "error": outcome.error,
    }
