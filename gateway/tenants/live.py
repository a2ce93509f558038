"""Tenants on the live request path: API key -> tenant, reserve a token budget, settle it after.

What it does
    ``install_tenancy(app)`` adds one middleware (inside the request-id and error middlewares, in
    front of the proxy handler) and the limiter's lifecycle. For ``POST /v1/chat/completions`` and
    ``POST /v1/completions`` the middleware

    1. authenticates: the ``Authorization: Bearer <key>`` header alone names the tenant (no
       header, parameter or body field can choose it); a missing key is a 401 when
       ``tenants.auth_required`` (else the request belongs to the anonymous tenant), a malformed
       or unknown key always is; the tenant is ``request[TENANT]`` from then on. With no tenant
       configured at all, tenancy is off: the header is not looked at (OpenAI SDKs always send
       some key) and ``request[TENANT]`` stays unset (the request is no tenant's);
    2. reserves, in ONE limiter call, ``w_in x prompt tokens + w_out x predicted output`` weighted
       tokens (``gateway.tenants.pricing``: the weights and ``request_cost``), one request and
       one concurrency slot. Prompt tokens are the request's one estimate
       (``gateway.admission.sizing``, which admission reuses; exact for token-id prompts), the
       output is the prediction service's output-length estimate capped by ``max_tokens``. A
       rejection is a 429 (``Refused``, ``rate_limit_exceeded``: exact ``Retry-After``, OpenAI's
       ``x-ratelimit-*`` headers); a tenant known to be over its limit is answered from the
       limiter's in-process over-limit cache. Storage down under ``fail_closed`` is a 503;
    3. runs the handler, and in its ``finally`` starts the settle, EXACTLY ONCE, with the real
       usage from ``request[OUTCOME]`` (see ``settled_usage``), whatever ended the request: a
       normal end, a replica error, a client that went away, a cancelled handler (shutdown).

    A tenant without any budget (the built-in anonymous tenant of a configuration without
    tenants) skips steps 2 and 3: nothing to enforce, nothing to pay.

    ``/metrics`` (and ``/metrics/*``) and ``/sluice/v1/*`` need ``Bearer <admin token>`` when
    ``tenants.auth.admin_token_hash`` is set; otherwise they are protected by the bind address
    only (``docs/tenants.md`` shows both set-ups).

Trade-offs
    The settle runs as its own task, created synchronously in ``finally`` (no ``await`` between
    the end of the handler and its creation, so no cancellation can skip it), and not awaited:
    a non-streamed response is not delayed by a Redis round trip. The lifecycle awaits
    outstanding settles before it closes the limiter, and closing it gives every settle whose
    Redis call failed (re-run in the background until Redis answers) one last attempt. The
    request body is read and parsed here, once: the proxy gets the same ``ParsedRequest``
    (``read_request`` keeps it on the request; ``bench/tenancy_cost.py`` measures the whole
    cost). Each reservation has its own fresh id (``new_request_id``: unique per process, a
    random per-process prefix), never the request's: a client-chosen ``x-request-id`` repeated
    on concurrent requests must not make the limiter treat them as one retried call.

Secrets
    Nothing here logs a key, a hash or an ``Authorization`` value; 401 bodies never echo them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Final

from aiohttp import web
from aiohttp.typedefs import Handler

from gateway.admission.fairness import TokenWeights
from gateway.admission.retry_after import UNMEASURED_WAIT_S, RefusalReason, retry_after
from gateway.admission.sizing import estimated_prompt_tokens
from gateway.api.openai import COMPLETION_ROUTES, Endpoint, read_request
from gateway.config.settings import Settings
from gateway.config.store import SettingsStore
from gateway.http.errors import (
    GatewayError,
    Refused,
    Unauthenticated,
    rate_limit_headers,
)
from gateway.keys import OUTCOME_LISTENERS, PREDICTION_SERVICE, STORE, OutcomeListener
from gateway.limits.base import (
    Limiter,
    LimiterStats,
    LimiterUnavailable,
    Reservation,
    TenantLimits,
    rejection_reason,
)
from gateway.limits.factory import build_limiter
from gateway.observability.logs import OUTCOME, RequestOutcome, new_request_id
from gateway.observability.metrics import METRICS, SluiceMetrics
from gateway.prediction.service import PredictionService
from gateway.tenants import Authenticator, AuthError, Tenant
from gateway.tenants.pricing import (
    configured_weights,
    fleet_token_weights,
    predicted_output_tokens,
    request_cost,
)

__all__ = [
    "HELD",
    "TENANCY",
    "TENANT",
    "Held",
    "Tenancy",
    "install_tenancy",
    "settled_usage",
]

log = logging.getLogger("sluice.tenancy")

#: Least seconds between two recomputations of the step-model weights (a few step-time lookups
#: per replica; the fit and the observed batch change by the scrape, every second or so).
WEIGHTS_REFRESH_S: Final = 1.0
#: Seconds the lifecycle waits for outstanding settles at shutdown before closing the limiter.
DRAIN_TIMEOUT_S: Final = 10.0

_COMPLETION_PATHS: Final[Mapping[str, Endpoint]] = COMPLETION_ROUTES
_UNLIMITED: Final = TenantLimits()
_ADMIN_CHALLENGE: Final = 'Bearer realm="sluice-admin"'


@dataclass(frozen=True, slots=True)
class Held:
    """An allowed reservation and what it was computed from (settle needs all of it).

    ``prompt_tokens``: the prompt estimate reserved; ``output_tokens``: the predicted output
    reserved (capped by ``max_tokens``, for all ``choices`` together); ``weights``: the weights
    both costs use (``request_cost``).
    """

    reservation: Reservation
    weights: TokenWeights
    prompt_tokens: int
    output_tokens: int
    #: The request's choices (``n``): ``output_tokens`` is all of theirs together.
    choices: int = 1


TENANT: Final = web.RequestKey("tenant", Tenant)
HELD: Final = web.RequestKey("tenant_reservation", Held)


# -- what a request is charged -----------------------------------------------------------------------


def settled_usage(outcome: RequestOutcome, held: Held) -> tuple[int, int]:
    """(prompt, output) tokens a finished request is charged, from what the outcome knows.

    Never reached a replica (``dispatched_at`` unset): (0, 0), nothing ran. Otherwise the prompt
    is the replica's usage count, else the reserved estimate, and the output is the usage count;
    without one (a request cut short, a replica error), the tokens it streamed as the proxy
    counted them (``tokens_streamed``); else the reserved prediction when tokens did flow (a
    complete non-streamed answer that carried no usage); else 0.
    """
    if outcome.dispatched_at is None:
        return 0, 0
    prompt = outcome.prompt_tokens if outcome.prompt_tokens is not None else held.prompt_tokens
    if outcome.completion_tokens is not None:
        return prompt, outcome.completion_tokens
    if outcome.tokens_streamed > 0:
        return prompt, outcome.tokens_streamed
    produced = outcome.first_token_at is not None or (
        not outcome.stream and outcome.status == 200 and outcome.error is None
    )
    return prompt, held.output_tokens if produced else 0


def is_unlimited(limits: TenantLimits) -> bool:
    """True when ``limits`` bound nothing (no bucket and no concurrency limit)."""
    return limits == _UNLIMITED or (
        limits.tokens_per_minute is None
        and limits.requests_per_minute is None
        and limits.max_concurrent is None
    )


# -- headers and messages ----------------------------------------------------------------------------


def rejection_message(reservation: Reservation) -> str:
    """The 429 message: which budget, what the request needs, when to retry (never a key)."""
    name = reservation.tenant
    tokens = reservation.tokens
    if reservation.oversize and tokens is not None:
        return (
            f"Request too large for tenant {name}: it needs {reservation.cost_tokens:.0f} weighted tokens, "
            f"more than its token budget can ever hold ({tokens.capacity:.0f}). Lower max_tokens or "
            "shorten the prompt."
        )
    reason = rejection_reason(reservation)
    what = {
        "tokens": "weighted tokens per minute",
        "requests": "requests per minute",
        "concurrency": "concurrent requests",
    }.get(reason, reason)
    retry = reservation.retry_after_s
    when = (
        f" Please try again in {retry:.3g}s."
        if retry is not None and math.isfinite(retry)
        else " Please try again when one of your requests has finished."
    )
    return f"Rate limit reached for tenant {name} on {what}.{when}"


def rejection_error(reservation: Reservation) -> Refused:
    """The 429 for a rejected reservation: the limiter's exact wait (``retry_after``, no jitter);
    the unmeasured wait when only a concurrency slot is missing (one frees when a request ends,
    time unknown); not retryable when the request can never fit."""
    reason = RefusalReason.RATE_LIMITED
    if reservation.oversize:
        retry = None
    else:
        wait = reservation.retry_after_s
        retry = retry_after(reason, UNMEASURED_WAIT_S if wait is None else wait)
    return Refused(reason, rejection_message(reservation), retry_after=retry, reservation=reservation)


def auth_error(err: AuthError) -> Unauthenticated:
    """The 401 for an ``AuthError`` (its message and RFC 6750 challenge)."""
    return Unauthenticated(err.message, www_authenticate=err.headers()["WWW-Authenticate"], code=err.code)


def admin_error() -> Unauthenticated:
    """The 401 for ``/metrics`` or ``/sluice/v1/*`` without the admin token."""
    return Unauthenticated(
        "This endpoint needs the admin token: Authorization: Bearer <admin token> "
        "(tenants.auth.admin_token_hash).",
        www_authenticate=_ADMIN_CHALLENGE,
        code="invalid_admin_token",
    )


def is_admin_path(path: str) -> bool:
    """``/metrics``, ``/metrics/...`` and ``/sluice/v1/...``: the endpoints the admin token guards."""
    return path in ("/metrics", "/sluice/v1") or path.startswith(("/metrics/", "/sluice/v1/"))


# -- the live part -----------------------------------------------------------------------------------


class Tenancy:
    """Authentication, the limiter and its lifecycle, for one application (see the module docstring).

    ``limiter``: use this one instead of building ``limits:``'s (tests; a fake clock); it is closed
    at shutdown all the same. ``stats``: the counters every limiter layer shares (exported by the
    metrics module). ``clock``: monotonic seconds, for the weights' refresh and outcome times.
    """

    def __init__(
        self,
        store: SettingsStore,
        predictions: PredictionService,
        *,
        limiter: Limiter | None = None,
        stats: LimiterStats | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._predictions = predictions
        self._limiter = limiter
        self.stats = limiter_stats(limiter) if stats is None else stats
        self._clock = clock
        self._auth = Authenticator(store.current.tenants)
        self._weights: TokenWeights | None = None
        self._weights_at = -math.inf
        #: ``limits.token_weights`` as ``TokenWeights`` (``None``: from the step model), built
        #: once per configuration, not per request.
        self._pinned = configured_weights(store.current.limits)
        self._pending: set[asyncio.Task[None]] = set()
        self._listeners: list[OutcomeListener] = []
        self.metrics: SluiceMetrics | None = None
        #: Settles started (one per allowed reservation) and the ones whose limiter call raised.
        self.settles_started = 0
        self.settle_failures = 0
        store.subscribe(self._on_swap)

    # -- state ---------------------------------------------------------------------------------------

    @property
    def authenticator(self) -> Authenticator:
        """The authenticator of the current ``tenants:`` (rebuilt when a reload changes it)."""
        return self._auth

    @property
    def limiter(self) -> Limiter:
        """The limiter; only after startup (``start``)."""
        if self._limiter is None:
            raise RuntimeError("the limiter is built at startup")
        return self._limiter

    def use_limiter(self, limiter: Limiter, stats: LimiterStats | None = None) -> None:
        """Use ``limiter`` instead of the one ``limits:`` describes (call before startup; tests
        give a memory limiter on a fake clock). ``stats``: its counters (default: its own)."""
        self._limiter = limiter
        self.stats = limiter_stats(limiter) if stats is None else stats

    @property
    def pending_settles(self) -> int:
        """Settles started and not finished yet."""
        return len(self._pending)

    def _on_swap(self, old: Settings, new: Settings) -> None:
        if old.tenants != new.tenants:
            self._auth = Authenticator(new.tenants)
        if old.limits.token_weights != new.limits.token_weights:
            self._weights = None
            self._pinned = configured_weights(new.limits)

    def weights(self) -> TokenWeights:
        """The token weights a reservation made now uses (see the module docstring)."""
        if self._pinned is not None:
            return self._pinned
        now = self._clock()
        if self._weights is None or now - self._weights_at >= WEIGHTS_REFRESH_S:
            self._weights = fleet_token_weights(self._predictions, self._store.current.all_replicas())
            self._weights_at = now
        return self._weights

    # -- lifecycle -----------------------------------------------------------------------------------

    def start(self, metrics: SluiceMetrics | None, listeners: list[OutcomeListener]) -> None:
        """Build the limiter (unless one was given) and bind the metrics, if the app has them."""
        if self._limiter is None:
            self._limiter = build_limiter(self._store.current.limits, stats=self.stats)
        self._listeners = listeners
        self.metrics = metrics
        if metrics is not None:
            metrics.track_limiter(self.stats, redis=self._store.current.limits.backend == "redis")

    async def drain(self, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Wait until every settle started so far has finished (at most ``timeout_s`` seconds)."""
        if self._pending:
            await asyncio.wait(set(self._pending), timeout=timeout_s)

    async def stop(self) -> None:
        """Finish outstanding settles, then close the limiter."""
        await self.drain()
        if self._pending:
            log.warning(
                "%d settles still running at shutdown; their leases expire on their own", len(self._pending)
            )
        if self._limiter is not None:
            await self._limiter.close()

    # -- the middleware ------------------------------------------------------------------------------

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """See the module docstring; every error raised here is a ``GatewayError``."""
        if is_admin_path(request.path):
            if not self._auth.admin_allowed(request.headers.get("Authorization")):
                raise admin_error()
            return await handler(request)
        endpoint = _COMPLETION_PATHS.get(request.path) if request.method == "POST" else None
        if endpoint is None:
            return await handler(request)
        outcome = request[OUTCOME]
        tenant = self._authenticate(request, outcome)
        if is_unlimited(tenant.limits):
            return await handler(request)
        held = await self._reserve(request, endpoint, tenant, outcome)
        request[HELD] = held
        try:
            return await handler(request)
        finally:
            self._settle_later(held, outcome)

    def _authenticate(self, request: web.Request, outcome: RequestOutcome) -> Tenant:
        auth = self._auth
        anonymous = auth.anonymous
        if not auth.tenants and anonymous is not None:
            # No tenant configured: tenancy is off and the header is not ours to judge (OpenAI
            # SDKs always send some key; a replica may check its own). No TENANT: nobody's.
            return anonymous
        found = auth.authenticate(request.headers.get("Authorization"))
        if isinstance(found, AuthError):
            outcome.reason = f"auth_{found.reason.value}"
            raise self._refused(outcome, auth_error(found))
        request[TENANT] = found
        if found.name in auth.tenants:
            outcome.tenant = found.name
        return found

    async def _reserve(
        self, request: web.Request, endpoint: Endpoint, tenant: Tenant, outcome: RequestOutcome
    ) -> Held:
        settings = self._store.current
        try:
            parsed = await read_request(request, endpoint, settings.server.max_body_bytes)
        except GatewayError as err:
            outcome.status, outcome.error = err.status, err.code
            raise
        outcome.model, outcome.stream = parsed.model, parsed.stream
        weights = self.weights()
        prompt = estimated_prompt_tokens(request, self._predictions, parsed)
        output = predicted_output_tokens(self._predictions, parsed, tenant.name, prompt)
        cost = request_cost(weights, prompt, output, parsed.choices)
        try:
            reservation = await self.limiter.reserve(
                tenant.name, cost_tokens=cost, limits=tenant.limits, request_id=new_request_id()
            )
        except LimiterUnavailable as exc:
            outcome.reason = "limiter_unavailable"
            retry = retry_after(RefusalReason.LIMITER_UNAVAILABLE, settings.limits.retry_backoff_s)
            outcome.retry_after_s = retry.delay_s
            raise self._refused(
                outcome, Refused(RefusalReason.LIMITER_UNAVAILABLE, f"{exc}; retry later", retry_after=retry)
            ) from None
        if self.metrics is not None:
            self.metrics.observe_reservation(reservation)
        if not reservation.allowed:
            # Built and raised in one expression: an error held in a local of this frame would make
            # a reference cycle with its own traceback (error -> traceback -> this frame -> error),
            # and the whole request would wait for the cycle collector instead of being freed.
            raise self._rate_limited(outcome, reservation)
        return Held(reservation, weights, prompt, output, parsed.choices)

    def _rate_limited(self, outcome: RequestOutcome, reservation: Reservation) -> GatewayError:
        """The 429 for a reservation its limiter refused, recorded on the outcome (``_refused``)."""
        refusal = rejection_error(reservation)
        outcome.reason = rejection_reason(reservation)
        outcome.retry_after_s = refusal.retry_after_s  # what the 429 says (concurrency: 1 s)
        return self._refused(outcome, refusal)

    def _refused(self, outcome: RequestOutcome, err: GatewayError) -> GatewayError:
        """Record a refusal answered here on the outcome and tell the outcome listeners (the proxy
        never sees this request); returns ``err`` for the caller to raise."""
        outcome.status, outcome.error, outcome.decision = err.status, err.code, "rejected"
        outcome.finished_at = self._clock()
        for listener in self._listeners:
            try:
                listener(outcome)
            except Exception:
                log.exception("outcome listener %r failed", listener)
        return err

    # -- settling ------------------------------------------------------------------------------------

    def _settle_later(self, held: Held, outcome: RequestOutcome) -> None:
        """Start the one settle of ``held`` as its own task (synchronous: nothing can interrupt it)."""
        self.settles_started += 1
        task = asyncio.get_running_loop().create_task(self._settle(held, outcome), name="sluice-settle")
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _settle(self, held: Held, outcome: RequestOutcome) -> None:
        prompt, output = settled_usage(outcome, held)
        actual = request_cost(held.weights, prompt, output, held.choices)
        try:
            await self.limiter.settle(held.reservation, actual_cost_tokens=actual)
        except Exception:
            self.settle_failures += 1
            # Once, then every 1000th: a broken limiter must not flood the log at request rate.
            if self.settle_failures % 1000 == 1:
                log.exception(
                    "settle failed for tenant %s (%d so far)", held.reservation.tenant, self.settle_failures
                )
            return
        if self.metrics is not None:
            self.metrics.observe_settle(held.reservation, actual)


def limiter_stats(limiter: Limiter | None) -> LimiterStats:
    """The stats a given limiter counts into (its ``stats`` attribute), else fresh ones."""
    stats = getattr(limiter, "stats", None)
    return stats if isinstance(stats, LimiterStats) else LimiterStats()


TENANCY: Final = web.AppKey("tenancy", Tenancy)


async def add_rate_limit_headers(request: web.BaseRequest, response: web.StreamResponse) -> None:
    """``on_response_prepare`` hook: an admitted request's response carries its ``x-ratelimit-*``
    headers, as OpenAI's responses do."""
    held = request.get(HELD)
    if held is not None:
        response.headers.update(rate_limit_headers(held.reservation))


def install_tenancy(
    app: web.Application,
    *,
    limiter: Limiter | None = None,
    stats: LimiterStats | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Tenancy:
    """Wire tenants into ``app`` (built by ``gateway.app.build_app``): the middleware (appended, so
    it runs inside the request-id and error middlewares), the limiter's lifecycle, the
    ``x-ratelimit-*`` response hook. Returns the ``Tenancy`` (also ``app[TENANCY]``).

    ``limiter``/``stats``/``clock``: see ``Tenancy``. Call before the app starts.
    """
    tenancy = Tenancy(app[STORE], app[PREDICTION_SERVICE], limiter=limiter, stats=stats, clock=clock)
    app[TENANCY] = tenancy
    app.middlewares.append(tenancy.middleware)
    app.on_response_prepare.append(add_rate_limit_headers)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        tenancy.start(app.get(METRICS), app[OUTCOME_LISTENERS])
        try:
            yield
        finally:
            try:
                await tenancy.stop()
            except Exception:
                log.exception("closing the limiter failed")

    app.cleanup_ctx.append(lifecycle)
    return tenancy
