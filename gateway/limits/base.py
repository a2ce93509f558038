"""The limiter contract: one Protocol, its value types and its one storage error.

A ``Limiter`` holds three budgets per tenant (tokens per minute, requests per minute, concurrent
requests) and takes from all of them at once or from none. ``reserve`` happens at admission with
the tenant's ``TenantLimits`` (passed on every call, so a reload applies to the next request) and
a request id unique per reservation; ``settle`` happens exactly once when the request ends, with
the tokens it really cost, and frees the concurrency slot. A ``Reservation`` carries everything a
429 needs from the limiter (``x-ratelimit-*`` headers, the exact wait until the buckets refill;
admission adds the wait for a concurrency slot and the jitter: ``admission.budget``). Storage
failures surface as ``LimiterUnavailable`` only; the failure policy (``failover.FailoverLimiter``)
decides what it means.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from gateway.limits import bucket

#: Which budget stopped a reservation.
LimitKind = Literal["tokens", "requests", "concurrency"]
LIMIT_KINDS: tuple[LimitKind, ...] = ("tokens", "requests", "concurrency")


class LimiterUnavailable(Exception):
    """The limiter's storage failed or did not answer within its timeout.

    Raised by storage backends (the cause is chained) and, under ``fail_closed``, by
    ``FailoverLimiter``; the gateway maps it to 503.
    """


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """One tenant's budgets; ``None`` means unlimited.

    ``tokens_per_minute`` and ``requests_per_minute`` are refill rates (> 0). ``token_burst`` and
    ``request_burst`` are the bucket capacities, defaulting to one minute's worth; a reservation
    costing more than ``token_burst`` can never succeed. ``max_concurrent`` (>= 1) caps requests
    reserved and not yet settled.
    """

    tokens_per_minute: float | None = None
    requests_per_minute: float | None = None
    max_concurrent: int | None = None
    token_burst: float | None = None
    request_burst: float | None = None

    def __post_init__(self) -> None:
        for name in ("tokens_per_minute", "requests_per_minute", "token_burst"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if self.request_burst is not None and not (
            self.request_burst >= 1 and math.isfinite(self.request_burst)
        ):
            raise ValueError(f"request_burst must be a finite number >= 1, got {self.request_burst!r}")
        if self.max_concurrent is not None and self.max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {self.max_concurrent!r}")

    @property
    def token_capacity(self) -> float | None:
        """Token bucket size in tokens (``token_burst``, else one minute's worth); None: unlimited."""
        if self.tokens_per_minute is None:
            return None
        return self.token_burst if self.token_burst is not None else self.tokens_per_minute

    @property
    def request_capacity(self) -> float | None:
        """Request bucket size (``request_burst``, else one minute's worth, at least 1); None: unlimited."""
        if self.requests_per_minute is None:
            return None
        if self.request_burst is not None:
            return self.request_burst
        return max(self.requests_per_minute, 1.0)

    def scaled(self, share: float) -> TenantLimits:
        """These limits times ``share`` (0 < share <= 1): one gateway's part of a shared budget.

        Rates and bursts scale linearly (a request bucket keeps room for one request); the
        concurrency limit rounds up (``bucket.scaled_concurrency``).
        """
        if share == 1.0:
            return self
        token_capacity, request_capacity = self.token_capacity, self.request_capacity
        return TenantLimits(
            tokens_per_minute=None if self.tokens_per_minute is None else self.tokens_per_minute * share,
            requests_per_minute=None
            if self.requests_per_minute is None
            else self.requests_per_minute * share,
            max_concurrent=None
            if self.max_concurrent is None
            else bucket.scaled_concurrency(self.max_concurrent, share),
            token_burst=None if token_capacity is None else token_capacity * share,
            request_burst=None if request_capacity is None else max(request_capacity * share, 1.0),
        )


@dataclass(frozen=True, slots=True)
class BucketState:
    """One bucket as a reservation left it.

    ``limit_per_minute`` is the refill rate (``x-ratelimit-limit-*``); ``capacity`` the bucket size;
    ``remaining`` the tokens (or requests) left after this reservation, negative while a settle's
    extra charge is being paid off (headers should show ``max(0, floor(remaining))``);
    ``reset_after_s`` the seconds until the bucket is full again (``x-ratelimit-reset-*``);
    ``retry_after_s`` the seconds until it holds what this reservation asked for: 0.0 when it
    does, ``math.inf`` when it never can.
    """

    limit_per_minute: float
    capacity: float
    remaining: float
    reset_after_s: float
    retry_after_s: float


@dataclass(frozen=True, slots=True)
class ConcurrencyState:
    """Concurrent requests: ``limit`` and ``in_flight`` (reserved, unsettled, lease not expired).

    ``in_flight`` includes this reservation when it was allowed.
    """

    limit: int
    in_flight: int


@dataclass(frozen=True, slots=True)
class Reservation:
    """The answer to ``Limiter.reserve``; pass it back to ``settle`` unchanged.

    ``allowed``: all budgets were taken (else none was). ``blocked_by``: the budgets that stopped
    it (empty when allowed). ``oversize``: ``cost_tokens`` exceeds the token bucket's capacity, so
    it can never succeed. ``retry_after_s``: 0.0 when allowed; for a rejection the exact seconds
    until the token and request budgets hold this cost, or ``None`` when that time is unknown
    (only a concurrency slot is missing: it frees when some request ends) or infinite
    (``oversize``). When ``concurrency`` is blocked as well as a bucket, it is a lower bound.
    ``tokens``/``requests``/``concurrency`` are ``None`` for an unlimited budget. ``limits`` are
    the tenant limits the reservation was made under (settle uses them). ``origin`` names the
    limiter that made it; ``from_cache`` says it was answered by the in-process over-limit cache.
    """

    request_id: str
    tenant: str
    allowed: bool
    cost_tokens: float
    limits: TenantLimits
    tokens: BucketState | None
    requests: BucketState | None
    concurrency: ConcurrencyState | None
    blocked_by: frozenset[LimitKind]
    oversize: bool
    retry_after_s: float | None
    origin: str
    from_cache: bool = False

    @property
    def retryable(self) -> bool:
        """False when the same request can never be admitted (``oversize``)."""
        return not self.oversize


class Limiter(Protocol):
    """Per-tenant token, request and concurrency budgets; every backend passes the contract suite.

    All methods are safe to call concurrently from many tasks. Backends that use storage raise
    ``LimiterUnavailable`` (and nothing else for storage trouble) within their timeout.
    """

    name: str

    async def reserve(
        self, tenant: str, *, cost_tokens: float, limits: TenantLimits, request_id: str
    ) -> Reservation:
        """Take ``cost_tokens`` (>= 0) tokens, one request and one concurrency slot, all or none.

        One storage round trip. Idempotent per ``request_id``: a reserve repeating the id of an
        unsettled allowed reservation (a retried call) is allowed and takes nothing more, so
        request ids must be unique per request. The concurrency slot is a lease: if the request
        is never settled (a crashed gateway) it expires after the backend's lease TTL.
        ``ValueError`` for a negative or non-finite cost.
        """
        ...

    async def settle(self, reservation: Reservation, *, actual_cost_tokens: float) -> None:
        """Charge ``actual_cost_tokens - reservation.cost_tokens`` (a refund when negative) and
        release the concurrency slot.

        Idempotent per request id: the first call for an allowed reservation applies, any later
        call (or a call for a rejected reservation, or after the lease expired) is a no-op.
        """
        ...

    async def in_flight(self, tenant: str) -> int:
        """Reservations of ``tenant`` allowed and not yet settled (leases not expired)."""
        ...

    async def close(self) -> None:
        """Release connections; the limiter is unusable afterwards."""
        ...


@dataclass(frozen=True, slots=True)
class TenantLevels:
    """A tenant's budgets as they stand now, read without taking anything (``LevelReader``).

    ``tokens``/``requests``: the buckets now (``retry_after_s`` 0.0), ``None`` when unlimited;
    ``in_flight``: reservations allowed and not settled (leases not expired); ``limits``: the
    limits these levels are of (a fallback's share while storage is down); ``origin``: the
    limiter that answered.
    """

    tokens: BucketState | None
    requests: BucketState | None
    in_flight: int
    limits: TenantLimits
    origin: str


@runtime_checkable
class LevelReader(Protocol):
    """A limiter that can report a tenant's levels without side effects on its buckets."""

    async def levels(self, tenant: str, limits: TenantLimits) -> TenantLevels:
        """``tenant``'s buckets and in-flight count under ``limits``, now; takes and writes nothing.
        Storage backends raise ``LimiterUnavailable`` as for ``reserve``."""
        ...


def tenant_levels(
    limits: TenantLimits, token_level: float, request_level: float, in_flight: int, origin: str
) -> TenantLevels:
    """``TenantLevels`` from a backend's bucket levels (``math.inf`` for an unlimited bucket)."""
    return TenantLevels(
        tokens=token_bucket_state(limits, token_level, 0.0, blocked=False),
        requests=request_bucket_state(limits, request_level, blocked=False),
        in_flight=in_flight,
        limits=limits,
        origin=origin,
    )


@dataclass
class LimiterStats:
    """Counters shared by one limiter stack; ``gateway.observability.metrics`` exports them.

    Each reserve is counted once, by the layer that answered it. ``rejected_total`` is keyed by
    the first blocking budget (``tokens``, ``requests``, ``concurrency``) or ``oversize``.
    """

    reserves_total: int = 0
    allowed_total: int = 0
    rejected_total: dict[str, int] = field(default_factory=dict)
    #: Rejections answered from the in-process over-limit cache, without storage.
    local_cache_rejections_total: int = 0
    settles_total: int = 0
    #: Settle calls that did nothing (second settle, rejected reservation, expired lease).
    settles_noop_total: int = 0
    #: Storage calls that raised ``LimiterUnavailable`` (reserve and settle).
    storage_errors_total: int = 0
    #: Reserves answered by the local fallback because storage was down (fail_open).
    fail_open_total: int = 0
    #: Reserves refused with ``LimiterUnavailable`` because storage was down (fail_closed).
    fail_closed_total: int = 0
    #: Changes between "storage up" and "storage down", both ways.
    transitions_total: int = 0
    #: True while the failure policy is active (storage considered down).
    degraded: bool = False
    #: Repairs started: a settle (or a reserve) whose storage call failed is run again in the
    #: background until storage answers it (``RedisLimiter``), so its refund is never lost.
    repairs_total: int = 0
    #: Repair attempts that failed again and were retried after a backoff.
    repair_retries_total: int = 0
    #: Repairs whose call applied the settle (the failed call had not run on the server).
    repairs_applied_total: int = 0
    #: Repairs given up: their lease expired, or the limiter closed while storage was down.
    repairs_abandoned_total: int = 0
    #: Repairs started and not finished yet.
    repairs_pending: int = 0

    def count_reserve(self, reservation: Reservation) -> None:
        """Count one answered reserve."""
        self.reserves_total += 1
        if reservation.allowed:
            self.allowed_total += 1
            return
        reason = rejection_reason(reservation)
        self.rejected_total[reason] = self.rejected_total.get(reason, 0) + 1
        if reservation.from_cache:
            self.local_cache_rejections_total += 1

    def count_settle(self, applied: bool) -> None:
        """Count one settle call; ``applied`` is False for a no-op."""
        if applied:
            self.settles_total += 1
        else:
            self.settles_noop_total += 1


def rejection_reason(reservation: Reservation) -> str:
    """``oversize`` or the first blocking budget in ``LIMIT_KINDS`` order; ``""`` when allowed."""
    if reservation.oversize:
        return "oversize"
    for kind in LIMIT_KINDS:
        if kind in reservation.blocked_by:
            return kind
    return ""


def token_bucket_state(
    limits: TenantLimits, level: float, need: float, *, blocked: bool, oversize: bool = False
) -> BucketState | None:
    """The token bucket of ``limits`` at ``level`` (after the take when allowed); None: unlimited."""
    if limits.tokens_per_minute is None or limits.token_capacity is None:
        return None
    return _state(limits.tokens_per_minute, limits.token_capacity, level, need, blocked, oversize)


def request_bucket_state(limits: TenantLimits, level: float, *, blocked: bool) -> BucketState | None:
    """The request bucket of ``limits`` at ``level``; None: unlimited."""
    if limits.requests_per_minute is None or limits.request_capacity is None:
        return None
    return _state(limits.requests_per_minute, limits.request_capacity, level, 1.0, blocked, False)


def _state(
    per_minute: float, capacity: float, level: float, need: float, blocked: bool, never: bool
) -> BucketState:
    rate = per_minute / 60.0
    if never:
        retry = math.inf
    elif blocked:
        retry = bucket.wait_for(need, level, rate)
    else:
        retry = 0.0
    return BucketState(
        limit_per_minute=per_minute,
        capacity=capacity,
        remaining=level,
        reset_after_s=bucket.reset_after(level, rate, capacity),
        retry_after_s=retry,
    )


def overall_retry_after(
    blocked_by: frozenset[LimitKind], oversize: bool, tokens: BucketState | None, requests: BucketState | None
) -> float | None:
    """``Reservation.retry_after_s`` from its parts (see there)."""
    if not blocked_by:
        return 0.0
    if oversize or not blocked_by & {"tokens", "requests"}:
        return None
    return max(b.retry_after_s for b in (tokens, requests) if b is not None)


def build_reservation(
    *,
    tenant: str,
    request_id: str,
    cost_tokens: float,
    limits: TenantLimits,
    enforced: TenantLimits,
    token_level: float,
    token_need: float,
    request_level: float,
    in_flight: int,
    blocked: frozenset[LimitKind],
    oversize: bool,
    origin: str,
) -> Reservation:
    """A ``Reservation`` from a backend's decision.

    ``limits`` are the tenant's (kept for settle); ``enforced`` the limits the backend applied and
    reports (``limits`` scaled to a share, or ``limits`` itself). Levels are after the take when
    allowed; ``token_need`` is what the token bucket had to hold (the cost, at most its capacity).
    """
    tokens = token_bucket_state(
        enforced, token_level, token_need, blocked="tokens" in blocked, oversize=oversize
    )
    requests = request_bucket_state(enforced, request_level, blocked="requests" in blocked)
    concurrency = (
        None
        if enforced.max_concurrent is None
        else ConcurrencyState(limit=enforced.max_concurrent, in_flight=in_flight)
    )
    return Reservation(
        request_id=request_id,
        tenant=tenant,
        allowed=not blocked,
        cost_tokens=cost_tokens,
        limits=limits,
        tokens=tokens,
        requests=requests,
        concurrency=concurrency,
        blocked_by=blocked,
        oversize=oversize,
        retry_after_s=overall_retry_after(blocked, oversize, tokens, requests),
        origin=origin,
    )
