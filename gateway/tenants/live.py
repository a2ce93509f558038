"""Tenants on the live request path: API key -> tenant, the admin guard, the limiter's lifecycle.

What it does
    ``install_tenancy(app)`` adds one middleware (inside the request-id and error middlewares, in
    front of the proxy handler), the ``x-ratelimit-*`` response hook and the limiter's lifecycle.
    For the completion routes (``POST /v1/chat/completions``, ``/v1/completions`` and TGI's) the
    middleware authenticates: the ``Authorization: Bearer <key>`` header alone names the tenant
    (no header, parameter or body field can choose it); a missing key is a 401 when
    ``tenants.auth_required`` (else the request belongs to the anonymous tenant), a malformed or
    unknown key always is; the tenant is ``request[TENANT]`` from then on. With no tenant
    configured at all, tenancy is off: the header is not looked at (OpenAI SDKs always send some
    key) and ``request[TENANT]`` stays unset (the request is no tenant's). ``GET /v1/models`` is
    authenticated the same way, so that a wrong key fails there as it would on a completion (an
    SDK's ``models.list()`` is how clients check a key), and charges no budget. Every other route
    (health, admin) is nobody's.

    The tenant's budget is the admission engine's (``gateway.admission.live_budget``: reserved
    in ``LiveAdmission.admit`` before the decision, settled by the engine when the request ends,
    refunded when it is refused or never reaches a replica). ``Tenancy`` owns what it runs on:
    the limiter (``limits:``; closed at shutdown, after the outstanding settles), the token
    weights reservations are priced with (``weights(model)``: with GPU-time weights, those of
    the model's replica group, the registry's replicas serving it), and the ``LiveBudget`` over
    both.

    ``/metrics`` (and ``/metrics/*``) and ``/sluice/v1/*`` need ``Bearer <admin token>`` when
    ``tenants.auth.admin_token_hash`` is set; otherwise they are protected by the bind address
    only (``docs/tenants.md`` shows both set-ups).

Secrets
    Nothing here logs a key, a hash or an ``Authorization`` value; 401 bodies never echo them.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Final

from aiohttp import web
from aiohttp.typedefs import Handler

from gateway.admission.fairness import TokenWeights
from gateway.admission.live_budget import LiveBudget, rate_limit_headers_hook
from gateway.api.openai import COMPLETION_ROUTES, Endpoint
from gateway.config.settings import Settings
from gateway.config.store import SettingsStore
from gateway.http.errors import GatewayError, Unauthenticated
from gateway.keys import OUTCOME_LISTENERS, PREDICTION_SERVICE, REGISTRY, STORE, OutcomeListener
from gateway.limits.base import Limiter, LimiterStats
from gateway.limits.config import GpuTimeWeightSettings
from gateway.limits.factory import build_limiter
from gateway.observability.logs import OUTCOME
from gateway.observability.metrics import METRICS, SluiceMetrics
from gateway.observability.outcome import RequestOutcome
from gateway.prediction.service import PredictionService
from gateway.tenants import Authenticator, AuthError, Tenant
from gateway.tenants.pricing import PLAIN_WEIGHTS, GroupWeights, ReplicaGroups, configured_weights
from gateway.workers import worker_count

__all__ = ["TENANCY", "TENANT", "Tenancy", "install_tenancy"]

log = logging.getLogger("sluice.tenancy")

#: Least seconds between two recomputations of the step-model weights (a few step-time lookups
#: per replica, every replica group at once; the fit changes by the scrape, every second or so).
WEIGHTS_REFRESH_S: Final = 1.0

_COMPLETION_PATHS: Final[Mapping[str, Endpoint]] = COMPLETION_ROUTES
#: The model list: authenticated like a completion, never charged.
MODELS_PATH: Final = "/v1/models"
_ADMIN_CHALLENGE: Final = 'Bearer realm="sluice-admin"'


TENANT: Final = web.RequestKey("tenant", Tenant)


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
    """Authentication, the limiter, the token weights and the budget over them, for one
    application (see the module docstring).

    ``limiter``: use this one instead of building ``limits:``'s (tests; a fake clock); it is closed
    at shutdown all the same. ``stats``: the counters every limiter layer shares (exported by the
    metrics module). ``clock``: monotonic seconds, for the weights' refresh and outcome times.
    ``groups``: the replicas serving each model, read at each refresh of the GPU-time weights
    (``use_groups``; the app binds the registry's at startup; none: every model is priced at
    ``DEFAULT_WEIGHTS``).
    """

    def __init__(
        self,
        store: SettingsStore,
        predictions: PredictionService,
        *,
        limiter: Limiter | None = None,
        stats: LimiterStats | None = None,
        clock: Callable[[], float] = time.monotonic,
        groups: Callable[[], ReplicaGroups] | None = None,
    ) -> None:
        self._store = store
        self._groups: Callable[[], ReplicaGroups] = groups or (lambda: {})
        self._predictions = predictions
        self._limiter = limiter
        self.stats = limiter_stats(limiter) if stats is None else stats
        self._clock = clock
        #: Keys beyond the configuration's (``use_keys``): hash -> tenant, and revoked hashes.
        self._issued: Mapping[str, str] = {}
        self._revoked: frozenset[str] = frozenset()
        self._auth = Authenticator(store.current.tenants)
        self._weights_at = -math.inf
        #: ``limits.token_weights`` as ``TokenWeights`` (plain when null; ``None``: GPU-time
        #: weighting, ``_gpu_time``), built once per configuration, not per request.
        self._pinned = configured_weights(store.current.limits)
        self._gpu_time: GroupWeights | None = None
        self._budget: LiveBudget | None = None
        self._listeners: list[OutcomeListener] = []
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

    @property
    def budget(self) -> LiveBudget:
        """The tenants' budgets as the admission engine reserves and settles them; only after
        startup (``start``)."""
        if self._budget is None:
            raise RuntimeError("the budget is built at startup")
        return self._budget

    def use_limiter(self, limiter: Limiter, stats: LimiterStats | None = None) -> None:
        """Use ``limiter`` instead of the one ``limits:`` describes (tests give a memory limiter on
        a fake clock; after startup, the budget reserves with it from then on). ``stats``: its
        counters (default: its own)."""
        self._limiter = limiter
        self.stats = limiter_stats(limiter) if stats is None else stats
        if self._budget is not None:
            self._budget.limiter = limiter

    def use_keys(self, issued: Mapping[str, str], revoked: frozenset[str]) -> None:
        """Authenticate with the key store's keys too from now on: ``issued`` (hash -> tenant)
        added to the configuration's, ``revoked`` hashes of configured keys taken away."""
        if issued == self._issued and revoked == self._revoked:
            return
        self._issued, self._revoked = dict(issued), revoked
        self._auth = Authenticator(self._store.current.tenants, issued=self._issued, revoked=revoked)

    def _on_swap(self, old: Settings, new: Settings) -> None:
        if old.tenants != new.tenants:
            self._auth = Authenticator(new.tenants, issued=self._issued, revoked=self._revoked)
        if old.limits.token_weights != new.limits.token_weights:
            self._pinned = configured_weights(new.limits)
            self._gpu_time = None
            self._weights_at = -math.inf

    def use_groups(self, groups: Callable[[], ReplicaGroups]) -> None:
        """Price GPU time per the replica groups ``groups()`` names from now on (model id ->
        the replicas serving it; ``ReplicaRegistry.model_groups``), from the next refresh."""
        self._groups = groups
        self._weights_at = -math.inf

    def weights(self, model: str | None = None) -> TokenWeights:
        """The token weights a reservation for ``model`` made now uses: plain tokens by default,
        the pinned ones, or the GPU-time weights in force for ``model``'s replica group
        (``DEFAULT_WEIGHTS`` for a model no replica serves; ``None``: the mean over the groups,
        what fair share charges). Every group is recomputed at most every ``WEIGHTS_REFRESH_S``
        seconds (see ``gateway.tenants.pricing``); in between, and always with plain or pinned
        weights, this is a lookup."""
        if self._pinned is not None:
            return self._pinned
        groups = self._group_weights()
        return PLAIN_WEIGHTS if groups is None else groups.for_model(model)

    def weights_by_model(self) -> dict[str, TokenWeights]:
        """With GPU-time weights, those in force per model served now (its replica group's),
        by model id; ``{}`` with plain or pinned weights (every model's are ``weights()``)."""
        groups = None if self._pinned is not None else self._group_weights()
        return {} if groups is None else groups.by_model()

    def _group_weights(self) -> GroupWeights | None:
        """The GPU-time weights of every replica group, refreshed when they are due; ``None``
        unless GPU-time weighting is on."""
        settings = self._store.current.limits.token_weights
        if not isinstance(settings, GpuTimeWeightSettings):  # pinned is None only with gpu_time
            return None
        now = self._clock()
        groups = self._gpu_time
        if groups is None:
            groups = self._gpu_time = GroupWeights(settings)
        elif now - self._weights_at < WEIGHTS_REFRESH_S:
            return groups
        self._weights_at = now
        groups.refresh(self._groups(), self._predictions, now)
        return groups

    @property
    def weighted(self) -> bool:
        """Whether the token budget counts weighted tokens (not plain prompt + output tokens)."""
        pinned = self._pinned
        return pinned is None or not (pinned.input == pinned.output == 1.0)

    # -- lifecycle -----------------------------------------------------------------------------------

    def start(self, metrics: SluiceMetrics | None, listeners: list[OutcomeListener]) -> None:
        """Build the limiter (unless one was given) and the budget over it, and bind the metrics,
        if the app has them."""
        if self._limiter is None:
            # Several workers with budgets in memory: each keeps 1/N of them (gateway.workers).
            share = 1.0 / worker_count()
            self._limiter = build_limiter(self._store.current.limits, stats=self.stats, memory_share=share)
        self._listeners = listeners
        store = self._store
        self._budget = LiveBudget(
            self._limiter,
            self.weights,
            model_weights=self.weights,
            metrics=metrics,
            retry_backoff_s=lambda: store.current.limits.retry_backoff_s,
        )
        if metrics is not None:
            metrics.track_limiter(self.stats, redis=self._store.current.limits.backend == "redis")
            metrics.track_token_weights(self.weights, by_model=self.weights_by_model)

    async def stop(self) -> None:
        """Finish outstanding settles, then close the limiter."""
        budget = self._budget
        if budget is not None:
            await budget.drain()
            if budget.pending_settles:
                log.warning(
                    "%d settles still running at shutdown; their leases expire on their own",
                    budget.pending_settles,
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
        if request.method == "POST" and request.path in _COMPLETION_PATHS:
            self._authenticate(request, request[OUTCOME])
        elif request.path == MODELS_PATH and request.method in ("GET", "HEAD"):
            self._authenticate(request, request[OUTCOME], listeners=False)
        return await handler(request)

    def _authenticate(self, request: web.Request, outcome: RequestOutcome, *, listeners: bool = True) -> None:
        """``request[TENANT]`` from its key, or raise the 401; ``listeners``: tell the outcome
        listeners of a refusal (the completions, which the metrics count; not the model list)."""
        auth = self._auth
        if not auth.tenants and auth.anonymous is not None:
            # No tenant configured: tenancy is off and the header is not ours to judge (OpenAI
            # SDKs always send some key; a replica may check its own). No TENANT: nobody's.
            return
        found = auth.authenticate(request.headers.get("Authorization"))
        if isinstance(found, AuthError):
            outcome.reason = f"auth_{found.reason.value}"
            if not listeners:
                raise auth_error(found)
            raise self._refused(outcome, auth_error(found))
        request[TENANT] = found
        if found.name in auth.tenants:
            outcome.tenant = found.name

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


def limiter_stats(limiter: Limiter | None) -> LimiterStats:
    """The stats a given limiter counts into (its ``stats`` attribute), else fresh ones."""
    stats = getattr(limiter, "stats", None)
    return stats if isinstance(stats, LimiterStats) else LimiterStats()


TENANCY: Final = web.AppKey("tenancy", Tenancy)


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

    ``limiter``/``stats``/``clock``: see ``Tenancy``. Call before the app starts, and before
    admission's cleanup context is appended: admission reserves through ``Tenancy.budget``, so the
    limiter starts before it and closes after it (after the settles its end started).
    """
    tenancy = Tenancy(app[STORE], app[PREDICTION_SERVICE], limiter=limiter, stats=stats, clock=clock)
    app[TENANCY] = tenancy
    app.middlewares.append(tenancy.middleware)
    store = app[STORE]
    app.on_response_prepare.append(rate_limit_headers_hook(lambda: store.current.limits.ietf_headers))

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        registry = app.get(REGISTRY)
        if registry is not None:  # built by the replicas' context, which starts before this one
            tenancy.use_groups(registry.model_groups)
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
