"""The rate-limit headers of a tenant's budget: OpenAI's ``x-ratelimit-*`` and the IETF fields.

Both are rendered from a limiter ``Reservation`` (its request and token buckets, its concurrency
slots), on a refusal (``gateway.http.errors``) and on an admitted response
(``gateway.admission.live_budget``). Pure: strings from numbers.
"""

from __future__ import annotations

import math
from typing import Final

from gateway.limits.base import BucketState, Reservation

__all__ = [
    "RATELIMIT",
    "RATELIMIT_POLICY",
    "go_duration",
    "ietf_rate_limit_headers",
    "rate_limit_headers",
]


def go_duration(seconds: float) -> str:
    """``seconds`` as OpenAI's ``x-ratelimit-reset-*`` values (Go's duration syntax), rounded up
    to the millisecond: ``0s``, ``20ms``, ``1s``, ``1.5s``, ``6m0s``, ``1h2m3.5s``."""
    millis = max(0, math.ceil(seconds * 1000.0 - 1e-6)) if math.isfinite(seconds) else 0
    if millis == 0:
        return "0s"
    if millis < 1000:
        return f"{millis}ms"
    hours, rest = divmod(millis, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest // 1000}.{rest % 1000:03d}".rstrip("0").rstrip(".")
    head = (f"{hours}h" if hours else "") + (f"{minutes}m" if hours or minutes else "")
    return f"{head}{secs}s"


def _bucket_headers(kind: str, state: BucketState) -> dict[str, str]:
    return {
        f"x-ratelimit-limit-{kind}": str(round(state.limit_per_minute)),
        f"x-ratelimit-remaining-{kind}": str(max(0, math.floor(state.remaining))),
        f"x-ratelimit-reset-{kind}": go_duration(state.reset_after_s),
    }


def rate_limit_headers(reservation: Reservation) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` for ``reservation``
    (a refusal's, and an admitted response's: ``gateway.admission.live_budget.rate_limit_headers_hook``).

    Limit: the budget per minute; remaining: whole units left (never negative); reset: time until
    the bucket is full again. A budget that is unlimited has no headers.
    """
    headers: dict[str, str] = {}
    if reservation.requests is not None:
        headers.update(_bucket_headers("requests", reservation.requests))
    if reservation.tokens is not None:
        headers.update(_bucket_headers("tokens", reservation.tokens))
    return headers


#: The IETF fields' names (draft-ietf-httpapi-ratelimit-headers-11).
RATELIMIT_POLICY: Final = "RateLimit-Policy"
RATELIMIT: Final = "RateLimit"


def ietf_rate_limit_headers(reservation: Reservation) -> dict[str, str]:
    """The IETF ``RateLimit-Policy`` and ``RateLimit`` fields for ``reservation``
    (draft-ietf-httpapi-ratelimit-headers-11: structured-field lists, one item per budget the
    tenant has; none when it has none).

    ``"requests"`` and ``"tokens"``: quota ``q`` per window ``w`` of 60 s (the budget per minute, as
    ``x-ratelimit-limit-*``), ``r`` whole units left (never negative), ``t`` whole seconds until the
    bucket is full again (rounded up); tokens in the unit the budget counts (``qu="tokens"``, a
    unit outside the draft's registry). ``"concurrency"``: ``q`` requests at once
    (``qu="concurrent-requests"``), ``r`` slots free, no window."""
    policies: list[str] = []
    levels: list[str] = []
    for name, state, unit in (
        ("requests", reservation.requests, ""),
        ("tokens", reservation.tokens, ';qu="tokens"'),
    ):
        if state is not None:
            policies.append(f'"{name}";q={round(state.limit_per_minute)};w=60{unit}')
            reset = max(0, math.ceil(state.reset_after_s - 1e-9)) if math.isfinite(state.reset_after_s) else 0
            levels.append(f'"{name}";r={max(0, math.floor(state.remaining))};t={reset}')
    slots = reservation.concurrency
    if slots is not None:
        policies.append(f'"concurrency";q={slots.limit};qu="concurrent-requests"')
        levels.append(f'"concurrency";r={max(0, slots.limit - slots.in_flight)}')
    if not policies:
        return {}
    return {RATELIMIT_POLICY: ", ".join(policies), RATELIMIT: ", ".join(levels)}
