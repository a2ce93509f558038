"""The tenants admin API and the tenant gauges' refresh.

``GET /sluice/v1/tenants`` lists every configured tenant (and the token weights a budget is
charged with now) and ``GET /sluice/v1/tenants/{id}``
shows one: its weight, classes and limits; its buckets and in-flight requests as the limiter
holds them now (Redis when the budget is shared, read-only: ``LevelReader.levels``); its 429s of
the last few minutes by reason (``RecentRefusals``). Both sit behind the admin token like every
``/sluice/v1/*`` route. An unknown tenant is a 404 ``tenant_not_found``.

The same levels refresh the tenant gauges every ``GAUGE_REFRESH_S`` seconds, so they follow
settles and refill while a tenant is idle, not only when it sends a request. Operator guide:
docs/tenants.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any, Final

from aiohttp import web

from gateway.http.errors import RouteNotFound
from gateway.keys import OUTCOME_LISTENERS
from gateway.limits.base import BucketState, LevelReader, LimiterUnavailable, TenantLevels
from gateway.observability.metrics import METRICS, SluiceMetrics
from gateway.tasks import running
from gateway.tenants.auth import Tenant
from gateway.tenants.live import Tenancy
from gateway.tenants.recent import RecentRefusals

__all__ = ["GAUGE_REFRESH_S", "TENANTS_ADMIN", "TenantsAdmin", "install_tenants_admin"]

log = logging.getLogger("sluice.tenancy")

#: Seconds between two refreshes of the tenant gauges from the limiter's levels.
GAUGE_REFRESH_S: Final = 1.0


def bucket_json(state: BucketState | None) -> dict[str, float] | None:
    """A bucket as the API shows it (``None``: unlimited)."""
    if state is None:
        return None
    return {
        "remaining": state.remaining,
        "capacity": state.capacity,
        "limit_per_minute": state.limit_per_minute,
        "reset_after_s": state.reset_after_s,
    }


class TenantsAdmin:
    """The tenants' admin view over one ``Tenancy`` (see the module docstring).

    ``refusals``: the recent 429s (fed by the app's outcome listeners). ``refresh_s`` > 0: the
    gauges' refresh period in seconds.
    """

    def __init__(
        self, tenancy: Tenancy, refusals: RecentRefusals, *, refresh_s: float = GAUGE_REFRESH_S
    ) -> None:
        if refresh_s <= 0:
            raise ValueError(f"refresh_s must be > 0, got {refresh_s!r}")
        self.tenancy = tenancy
        self.refusals = refusals
        self.refresh_s = refresh_s

    async def levels(self, tenant: Tenant) -> TenantLevels | None:
        """``tenant``'s levels now; ``None`` when the limiter cannot tell (storage down and no
        fallback answered, or a limiter that does not report levels)."""
        limiter = self.tenancy.limiter
        if not isinstance(limiter, LevelReader):
            return None
        try:
            return await limiter.levels(tenant.name, tenant.limits)
        except LimiterUnavailable:
            return None

    async def describe(self, tenant: Tenant) -> dict[str, Any]:
        """One tenant as ``GET /sluice/v1/tenants/{id}`` shows it."""
        levels = await self.levels(tenant)
        refusals = self.refusals.by_reason(tenant.name)
        return {
            "id": tenant.name,
            "weight": tenant.weight,
            "default_class": tenant.default_class,
            "allowed_classes": None if tenant.allowed_classes is None else sorted(tenant.allowed_classes),
            "limits": dataclasses.asdict(tenant.limits),
            "buckets": None
            if levels is None
            else {"tokens": bucket_json(levels.tokens), "requests": bucket_json(levels.requests)},
            "in_flight": None if levels is None else levels.in_flight,
            "levels_from": None if levels is None else levels.origin,
            "recent_429s": {
                "window_s": self.refusals.window_s,
                "total": sum(refusals.values()),
                "by_reason": refusals,
            },
        }

    def tenant(self, name: str) -> Tenant:
        """The configured tenant ``name``; the 404 ``tenant_not_found`` otherwise."""
        found = self.tenancy.authenticator.tenants.get(name)
        if found is None:
            raise RouteNotFound(f"No tenant named {name!r} is configured.", code="tenant_not_found")
        return found

    # -- routes --------------------------------------------------------------------------------------

    async def list_view(self, _request: web.Request) -> web.Response:
        """``GET /sluice/v1/tenants``: every configured tenant (``describe``), by name."""
        tenants = list(self.tenancy.authenticator.tenants.values())
        described = await asyncio.gather(*(self.describe(t) for t in tenants))
        weights = self.tenancy.weights()
        by_model = self.tenancy.weights_by_model()
        return web.json_response(
            {
                "object": "list",
                "data": described,
                # What a token costs a budget now (per prompt token, per output token, ...): every
                # request's with plain or fixed weights; with GPU-time weights, the mean over the
                # models' replica groups (what fair share charges), each model's below.
                "token_weights": dataclasses.asdict(weights),
                "token_weights_by_model": {m: dataclasses.asdict(w) for m, w in by_model.items()},
            }
        )

    async def one_view(self, request: web.Request) -> web.Response:
        """``GET /sluice/v1/tenants/{id}``: one tenant (``describe``)."""
        return web.json_response(await self.describe(self.tenant(request.match_info["id"])))

    # -- the gauges ----------------------------------------------------------------------------------

    async def refresh_gauges(self, metrics: SluiceMetrics) -> None:
        """Write every configured tenant's levels, read now, into its gauges."""
        tenants = list(self.tenancy.authenticator.tenants.values())
        found = await asyncio.gather(*(self.levels(t) for t in tenants))
        for tenant, levels in zip(tenants, found, strict=True):
            if levels is not None:
                metrics.observe_levels(tenant.name, levels)

    async def keep_gauges_fresh(self, metrics: SluiceMetrics) -> None:
        """``refresh_gauges`` every ``refresh_s`` seconds, until cancelled; a failure is logged
        and the next period tries again."""
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.refresh_gauges(metrics)
            except Exception:
                log.exception("refreshing the tenant gauges failed")


TENANTS_ADMIN: Final = web.AppKey("tenants_admin", TenantsAdmin)


def install_tenants_admin(
    app: web.Application, admin_app: web.Application, tenancy: Tenancy, *, refresh_s: float = GAUGE_REFRESH_S
) -> TenantsAdmin:
    """Add the tenants routes to ``admin_app`` (``install_admin``'s answer), count ``app``'s 429s
    and refresh the tenant gauges while ``app`` runs. Call after ``install_tenancy`` (whose
    limiter must be started first). Returns the ``TenantsAdmin`` (also ``app[TENANTS_ADMIN]``)."""
    refusals = RecentRefusals()
    admin = TenantsAdmin(tenancy, refusals, refresh_s=refresh_s)
    app[TENANTS_ADMIN] = admin
    app[OUTCOME_LISTENERS].append(refusals.observe)
    admin_app.router.add_get("/sluice/v1/tenants", admin.list_view)
    admin_app.router.add_get("/sluice/v1/tenants/{id}", admin.one_view)

    async def gauges(app: web.Application) -> AsyncIterator[None]:
        metrics = app.get(METRICS)
        if metrics is None:
            yield
            return
        async with running(admin.keep_gauges_fresh(metrics), name="sluice-tenant-gauges"):
            yield

    app.cleanup_ctx.append(gauges)
    return admin
