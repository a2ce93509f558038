"""Tenants and the limiter: tokens reserved and settled, each tenant's bucket levels and limits as
of its latest reservation through this gateway, and the limiter stack's Redis counters.

``TenantMetrics`` is fed by the limiter's producer (``observe_reservation`` after a reserve,
``observe_settle`` after a settle); the level gauges are written at scrape time, not per request,
and refreshed from the limiter's read-only levels every second or so (``observe_levels``), so an
idle tenant's gauges decay to the truth.
``LimiterCollector`` reads ``LimiterStatsView`` at every scrape; no samples while none is wired
(or for the memory backend, which has no storage to report on). The ``*View`` protocols are
what these read of ``gateway.limits.base``'s types.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Literal, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.observability.metrics.children import Children
from gateway.observability.metrics.labels import LabelLimits


class BucketView(Protocol):
    """A token or request bucket as a reservation left it (``gateway.limits.base.BucketState``)."""

    @property
    def limit_per_minute(self) -> float: ...
    @property
    def capacity(self) -> float: ...
    @property
    def remaining(self) -> float: ...


class ConcurrencyView(Protocol):
    """A tenant's concurrency budget (``gateway.limits.base.ConcurrencyState``)."""

    @property
    def limit(self) -> int: ...
    @property
    def in_flight(self) -> int: ...


class ReservationView(Protocol):
    """What metrics read of a limiter reservation (``gateway.limits.base.Reservation``)."""

    @property
    def tenant(self) -> str: ...
    @property
    def allowed(self) -> bool: ...
    @property
    def cost_tokens(self) -> float: ...
    @property
    def tokens(self) -> BucketView | None: ...
    @property
    def requests(self) -> BucketView | None: ...
    @property
    def concurrency(self) -> ConcurrencyView | None: ...


class LevelsView(Protocol):
    """A tenant's budgets read from the limiter now (``gateway.limits.base.TenantLevels``)."""

    @property
    def tokens(self) -> BucketView | None: ...
    @property
    def requests(self) -> BucketView | None: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def limits(self) -> LimitsView: ...


class LimitsView(Protocol):
    """A tenant's configured concurrency limit (``gateway.limits.base.TenantLimits``)."""

    @property
    def max_concurrent(self) -> int | None: ...


class LimiterStatsView(Protocol):
    """The cumulative counters of one limiter stack (``gateway.limits.base.LimiterStats``)."""

    storage_errors_total: int
    fail_open_total: int
    fail_closed_total: int
    transitions_total: int
    local_cache_rejections_total: int
    degraded: bool
    repairs_total: int
    repairs_abandoned_total: int
    repairs_pending: int


class TenantMetrics:
    """The tenant series, registered in ``registry`` at construction (in exposition order);
    tenant names are limited by ``labels``."""

    def __init__(
        self,
        registry: CollectorRegistry,
        children: Children,
        labels: LabelLimits,
        *,
        budgets_per_worker: bool = False,
    ) -> None:
        """``budgets_per_worker``: with several workers, each keeps its own share of every budget
        (``limits.backend: memory``), so the host's levels are the workers' summed; otherwise they
        all read the one budget in Redis and the host's level is the latest read."""
        levels_mode: Literal["livesum", "livemostrecent"] = "livemostrecent"
        if budgets_per_worker:
            levels_mode = "livesum"
        self._children = children
        self._labels = labels
        r = registry
        # As of each tenant's last reservation through this gateway.
        self.tenant_tokens_reserved = Counter(
            "sluice_tenant_tokens_reserved_total",
            "Weighted tokens reserved at admission (prompt + predicted output), allowed reservations.",
            ["tenant"],
            registry=r,
        )
        self.tenant_tokens_settled = Counter(
            "sluice_tenant_tokens_settled_total",
            "Weighted tokens actually charged when requests ended.",
            ["tenant"],
            registry=r,
        )
        # The level gauges below are set at scrape time from each tenant's latest reservation
        # (``observe_reservation`` only remembers it): seven ``set`` calls per request are too
        # many for the hot path. Registered before them, so a scrape brings them up to date
        # before it reads them (the registry collects in order).
        self.levels = _LatestReservations(self)
        r.register(self.levels)
        self.tenant_bucket_remaining = Gauge(
            "sluice_tenant_bucket_remaining",
            "Tokens or requests left in a tenant's bucket after its last reservation here.",
            ["tenant", "bucket"],
            registry=r,
            multiprocess_mode=levels_mode,
        )
        self.tenant_bucket_capacity = Gauge(
            "sluice_tenant_bucket_capacity",
            "Size of a tenant's bucket (burst), in tokens or requests.",
            ["tenant", "bucket"],
            registry=r,
            multiprocess_mode=levels_mode,
        )
        self.tenant_limit_per_minute = Gauge(
            "sluice_tenant_limit_per_minute",
            "A tenant's refill rate, tokens or requests per minute.",
            ["tenant", "bucket"],
            registry=r,
            multiprocess_mode=levels_mode,
        )
        self.tenant_in_flight = Gauge(
            "sluice_tenant_in_flight_requests",
            "A tenant's unsettled requests across gateways, at its last reservation here.",
            ["tenant"],
            registry=r,
            multiprocess_mode=levels_mode,
        )
        self.tenant_concurrency_limit = Gauge(
            "sluice_tenant_concurrency_limit",
            "A tenant's max_concurrent.",
            ["tenant"],
            registry=r,
            multiprocess_mode=levels_mode,
        )

    def observe_reservation(self, reservation: ReservationView) -> None:
        """After a ``reserve``: the tokens reserved now; the tenant's bucket levels, limits and
        in-flight count as of its latest reservation at the next scrape."""
        tenant = self._labels.tenant_label(reservation.tenant)
        if reservation.allowed:
            self._children.child(self.tenant_tokens_reserved, tenant).inc(max(0.0, reservation.cost_tokens))
        self.levels.latest[tenant] = reservation

    def set_levels(self, tenant: str, reservation: ReservationView) -> None:
        """The tenant gauges as ``reservation`` (its latest) left them."""
        child = self._children.child
        for kind, bucket in (("tokens", reservation.tokens), ("requests", reservation.requests)):
            if bucket is not None:
                child(self.tenant_bucket_remaining, tenant, kind).set(bucket.remaining)
                child(self.tenant_bucket_capacity, tenant, kind).set(bucket.capacity)
                child(self.tenant_limit_per_minute, tenant, kind).set(bucket.limit_per_minute)
        if reservation.concurrency is not None:
            child(self.tenant_in_flight, tenant).set(reservation.concurrency.in_flight)
            child(self.tenant_concurrency_limit, tenant).set(reservation.concurrency.limit)

    def observe_levels(self, tenant_name: str, levels: LevelsView) -> None:
        """The tenant gauges from the limiter's levels read now (the periodic refresh that makes
        them follow settles and refill while the tenant is idle); replaces any reservation not
        yet written, which is older than this read."""
        tenant = self._labels.tenant_label(tenant_name)
        self.levels.latest.pop(tenant, None)
        child = self._children.child
        for kind, bucket in (("tokens", levels.tokens), ("requests", levels.requests)):
            if bucket is not None:
                child(self.tenant_bucket_remaining, tenant, kind).set(bucket.remaining)
                child(self.tenant_bucket_capacity, tenant, kind).set(bucket.capacity)
                child(self.tenant_limit_per_minute, tenant, kind).set(bucket.limit_per_minute)
        child(self.tenant_in_flight, tenant).set(levels.in_flight)
        if levels.limits.max_concurrent is not None:
            child(self.tenant_concurrency_limit, tenant).set(levels.limits.max_concurrent)

    def observe_settle(self, reservation: ReservationView, actual_cost_tokens: float) -> None:
        """After a ``settle`` of an allowed reservation: the tokens really charged."""
        if reservation.allowed:
            tenant = self._labels.tenant_label(reservation.tenant)
            self._children.child(self.tenant_tokens_settled, tenant).inc(max(0.0, actual_cost_tokens))


class _LatestReservations(Collector):
    """Each tenant's latest reservation (by tenant label), written into the tenant gauges when the
    registry is collected; yields no metric of its own."""

    def __init__(self, owner: TenantMetrics) -> None:
        self._owner = owner
        self.latest: dict[str, ReservationView] = {}

    def describe(self) -> list[Metric]:
        return []  # nothing of its own (and the registry must not collect it to find out)

    def collect(self) -> list[Metric]:
        latest, self.latest = self.latest, {}
        for tenant, reservation in latest.items():
            self._owner.set_levels(tenant, reservation)
        return []


class WeightsView(Protocol):
    """What one token of each kind costs a tenant's token budget (``TokenWeights``)."""

    @property
    def input(self) -> float: ...
    @property
    def output(self) -> float: ...


class TokenWeightCollector(Collector):
    """``sluice_token_weight{token="prompt"|"output"}``: what one prompt and one output token
    cost a tenant's token budget now, read from ``source()`` at every scrape (1 and 1 with plain
    tokens; with GPU-time weights the mean over the models' replica groups, what fair share
    charges); nothing while ``source`` is ``None``. ``sluice_model_token_weight{model, token}``:
    with GPU-time weights, each model's replica group's, read from ``by_model()`` (no series
    otherwise: every model's are ``sluice_token_weight``)."""

    def __init__(self) -> None:
        self.source: Callable[[], WeightsView] | None = None
        self.by_model: Callable[[], Mapping[str, WeightsView]] | None = None

    def describe(self) -> Iterable[Metric]:
        return [self._family(), self._model_family()]

    def collect(self) -> Iterator[Metric]:
        family, per_model = self._family(), self._model_family()
        if self.source is not None:
            weights = self.source()
            family.add_metric(["prompt"], weights.input)
            family.add_metric(["output"], weights.output)
        if self.by_model is not None:
            for model, weights in self.by_model().items():
                per_model.add_metric([model, "prompt"], weights.input)
                per_model.add_metric([model, "output"], weights.output)
        yield family
        yield per_model

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "sluice_token_weight",
            "What one token of a kind costs a tenant's token budget now (1 with plain tokens, the "
            "default; limits.token_weights; with mode gpu_time, the mean over models).",
            labels=["token"],
        )

    @staticmethod
    def _model_family() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "sluice_model_token_weight",
            "With limits.token_weights mode gpu_time: what one token of a kind of a request for "
            "the model costs a tenant's token budget now (its replica group's weights).",
            labels=["model", "token"],
        )


class LimiterCollector(Collector):
    """The limiter stack's counters, read from ``stats`` at every scrape; none while ``None``."""

    def __init__(self) -> None:
        self.stats: LimiterStatsView | None = None

    def describe(self) -> Iterable[Metric]:
        return _limiter_families()

    def collect(self) -> Iterator[Metric]:
        families = _limiter_families()
        errors, fail_open, fail_closed, transitions, cached, degraded, repairs, abandoned, pending = families
        stats = self.stats
        if stats is not None:
            errors.add_metric([], float(stats.storage_errors_total))
            fail_open.add_metric([], float(stats.fail_open_total))
            fail_closed.add_metric([], float(stats.fail_closed_total))
            transitions.add_metric([], float(stats.transitions_total))
            cached.add_metric([], float(stats.local_cache_rejections_total))
            degraded.add_metric([], 1.0 if stats.degraded else 0.0)
            repairs.add_metric([], float(stats.repairs_total))
            abandoned.add_metric([], float(stats.repairs_abandoned_total))
            pending.add_metric([], float(stats.repairs_pending))
        yield from families


def _limiter_families() -> tuple[
    CounterMetricFamily,
    CounterMetricFamily,
    CounterMetricFamily,
    CounterMetricFamily,
    CounterMetricFamily,
    GaugeMetricFamily,
    CounterMetricFamily,
    CounterMetricFamily,
    GaugeMetricFamily,
]:
    return (
        CounterMetricFamily("sluice_redis_errors", "Limiter storage (Redis) calls that failed or timed out."),
        CounterMetricFamily(
            "sluice_redis_fail_open", "Reservations answered by the local fallback while Redis was down."
        ),
        CounterMetricFamily(
            "sluice_redis_fail_closed", "Reservations refused (503) because Redis was down (fail_closed)."
        ),
        CounterMetricFamily("sluice_redis_transitions", "Changes between Redis up and down, both ways."),
        CounterMetricFamily(
            "sluice_limiter_local_cache_rejections",
            "Tenant rejections answered from the in-process over-limit cache, without Redis.",
        ),
        GaugeMetricFamily("sluice_redis_degraded", "1 while the limiter treats Redis as down."),
        CounterMetricFamily(
            "sluice_redis_repairs",
            "Settles (and reserves) whose Redis call failed, re-run in the background until Redis answers.",
        ),
        CounterMetricFamily(
            "sluice_redis_repairs_abandoned",
            "Repairs given up (the lease expired, or shutdown with Redis down): a refund lost.",
        ),
        GaugeMetricFamily("sluice_redis_repairs_pending", "Repairs waiting for Redis to answer."),
    )
