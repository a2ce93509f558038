"""Every Prometheus object Sluice exports, and the functions that feed them from the core's stats.

The core returns plain values (``RequestOutcome``, ``ReplicaSnapshot``, ``FitReport``, limiter
reservations and stats); only this module turns them into metrics. All objects live in one
``SluiceMetrics`` with its own ``CollectorRegistry``. Names start with ``sluice_``; counters end in
``_total``, durations in ``_seconds``, fractions in ``_ratio``. ``install(app)`` serves
``/metrics`` and ``/metrics/replicas`` (HTTP service discovery) and listens to outcomes; the other
``track_*`` / ``observe_*`` functions are fed by their producers. Until a producer is wired its
metrics have no samples, never a made-up zero. Label values are bounded: unconfigured classes and
tenants become ``other``, missing ones ``none``, anything not shaped like a code ``other``.
What each metric means: docs/dashboards.md.
"""

from __future__ import annotations

import bisect
import math
import re
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from importlib import metadata
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeVar, cast
from urllib.parse import urlsplit

from aiohttp import web
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from gateway.keys import OUTCOME_LISTENERS, PREDICTION_SERVICE, REGISTRY, SCRAPER, STORE
from gateway.observability.logs import RequestOutcome
from predictor import FEATURE_NAMES, FitReport

if TYPE_CHECKING:
    from gateway.replicas.registry import Replica
    from gateway.replicas.snapshot import ReplicaSnapshot
    from gateway.settings import Settings

__all__ = [
    "METRICS",
    "SluiceMetrics",
    "install",
    "replica_targets",
]

# -- buckets ---------------------------------------------------------------------------------------
#: Time to first token, seconds: 25 ms (a warm short prompt) to 2 min (a long prompt in a queue).
TTFT_BUCKETS: Final = (
    0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 7.5, 10, 15, 20, 30, 60, 120
)  # fmt: skip
#: Time per output token, seconds: 5 ms (small model, small batch) to 1 s (a stalled stream).
TPOT_BUCKETS: Final = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1)
#: Whole request, seconds: up to 10 min (long batch generations).
DURATION_BUCKETS: Final = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
#: Time in Sluice's queue, seconds (class deadlines are 0 to about a minute).
QUEUE_WAIT_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)
#: Retry-After sent, seconds: capped at 60 (the OpenAI SDKs refuse more).
RETRY_AFTER_BUCKETS: Final = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60)
#: Time spent in Sluice itself, seconds: 50 µs to 100 ms.
OVERHEAD_BUCKETS: Final = (5e-05, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
#: Signed relative prediction error (predicted - observed) / observed.
ERROR_BUCKETS: Final = (
    -0.9, -0.75, -0.5, -0.35, -0.25, -0.15, -0.1, -0.05, 0, 0.05, 0.1, 0.15, 0.25, 0.35, 0.5, 0.75, 1, 2, 5
)  # fmt: skip
#: Absolute relative prediction error; the predictor's targets are 10-15 % median, 25-35 % p90.
ABS_ERROR_BUCKETS: Final = (0.02, 0.05, 0.1, 0.15, 0.2, 0.25, 0.35, 0.5, 0.75, 1, 2, 5)

NONE_LABEL: Final = "none"
_Metric = TypeVar("_Metric", bound=MetricWrapperBase)
OTHER_LABEL: Final = "other"
_CODE = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
#: Outcome errors that mean the client left, not that Sluice or the replica failed.
_ABANDONED: Final = frozenset({"client_disconnected", "cancelled"})
REPLICA_STATES: Final = ("unknown", "healthy", "unhealthy", "draining")


# -- what the collectors read (structural types: no import of modules still being written) ---------
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


FitSource = Callable[[str], FitReport | None]
QueueSource = Callable[[], Mapping[str, int]]


class ReplicaSource(Protocol):
    """What the replica collector reads (``gateway.replicas.registry.ReplicaRegistry``)."""

    def replicas(self) -> list[Replica]: ...

    def draining(self) -> list[Replica]: ...


# -- label helpers ------------------------------------------------------------------------------------
def limited(value: str | None, allowed: Collection[str]) -> str:
    """``value`` when it is in ``allowed``; ``none`` for ``None``; else ``other``."""
    if value is None:
        return NONE_LABEL
    return value if value in allowed else OTHER_LABEL


def code_label(value: str | None, default: str = NONE_LABEL) -> str:
    """A code (``snake_case``, at most 64 characters) as a label value; ``default`` for ``None``."""
    if value is None:
        return default
    label = _CODE_LABELS.get(value)
    if label is None:
        label = value if _CODE.match(value) else OTHER_LABEL
        if len(_CODE_LABELS) < _CODE_LABELS_KEPT:  # codes are few; anything else is not kept
            _CODE_LABELS[value] = label
    return label


#: ``code_label``'s answers so far (at most ``_CODE_LABELS_KEPT``): one lookup, not a match.
_CODE_LABELS: dict[str, str] = {}
_CODE_LABELS_KEPT: Final = 1024


def configured_classes(settings: Settings) -> frozenset[str]:
    """Class names in ``settings.admission.classes`` (empty until that section exists)."""
    admission = getattr(settings, "admission", None)
    classes = getattr(admission, "classes", None)
    return frozenset(classes) if isinstance(classes, Mapping) else frozenset()


def configured_tenants(settings: Settings) -> frozenset[str]:
    """Tenant names configured in ``settings.tenants`` (the only values the tenant label takes),
    plus the anonymous tenant when one is configured."""
    tenants = settings.tenants
    names = set(tenants.tenants)
    if tenants.auth.anonymous_tenant is not None:
        names.add(tenants.auth.anonymous_tenant)
    return frozenset(names)


# -- reading optional outcome fields ------------------------------------------------------------------
def _number(outcome: RequestOutcome, name: str) -> float | None:
    value: Any = getattr(outcome, name, None)
    if type(value) is float:  # the usual case first
        return value if math.isfinite(value) else None
    if isinstance(value, bool) or not isinstance(value, _NUMBERS) or not math.isfinite(value):
        return None
    return float(value)


_NUMBERS: Final = (int, float)


def _text(outcome: RequestOutcome, name: str) -> str | None:
    value: Any = getattr(outcome, name, None)
    return value if isinstance(value, str) else None


# -- per-request arithmetic (small functions that return numbers) -------------------------------------
def client_ttft_s(outcome: RequestOutcome) -> float | None:
    """Seconds from arrival at Sluice to the first token relayed; ``None`` without a first token."""
    if outcome.first_token_at is None:
        return None
    return outcome.first_token_at - outcome.received_at


def observed_tpot_s(outcome: RequestOutcome) -> float | None:
    """Mean seconds per output token after the first, for a stream that ended without error
    (``RequestOutcome.tpot_s``: ``None`` for non-streamed answers, errors, or fewer than two
    completion tokens)."""
    return outcome.tpot_s


def proxy_overhead_s(outcome: RequestOutcome) -> float | None:
    """Seconds spent in Sluice before the request left for its replica, queue wait excluded.

    ``None`` when it was never dispatched.
    """
    if outcome.dispatched_at is None:
        return None
    wait = _number(outcome, "queue_wait_s") or 0.0
    return max(0.0, outcome.dispatched_at - outcome.received_at - wait)


def relative_error(predicted: float, observed: float) -> float | None:
    """(predicted - observed) / observed; ``None`` when ``observed`` is not > 0."""
    if not observed > 0:
        return None
    return (predicted - observed) / observed


def decision_of(outcome: RequestOutcome) -> tuple[str, str]:
    """(decision, reason) label values: the outcome's own, else derived from where it went."""
    decision = _text(outcome, "decision")
    reason = _text(outcome, "reason")
    if decision is None:
        decision = "admitted" if outcome.replica is not None else "rejected"
    if reason is None:
        reason = "ok" if decision != "rejected" else (outcome.error or "unknown")
    return code_label(decision), code_label(reason)


def slo_result(outcome: RequestOutcome) -> str | None:
    """The SLO result label of an admitted request (see the module docstring); ``None`` = not judged."""
    if outcome.replica is None:  # never dispatched (refused): not judged
        return None
    ttft_target = _number(outcome, "ttft_target_s")
    tpot_target = _number(outcome, "tpot_target_s")
    if ttft_target is None or tpot_target is None:
        return None
    if outcome.error in _ABANDONED:
        return "abandoned"
    if outcome.error is not None or (outcome.status is not None and outcome.status >= 400):
        return "failed"
    if not outcome.stream:
        return _e2e_result(outcome, ttft_target, tpot_target)
    ttft = client_ttft_s(outcome)
    tpot = observed_tpot_s(outcome)
    ttft_ok = ttft is not None and ttft <= ttft_target
    tpot_ok = tpot is None or tpot <= tpot_target
    if ttft_ok and tpot_ok:
        return "met"
    if not ttft_ok and not tpot_ok:
        return "missed_both"
    return "missed_tpot" if ttft_ok else "missed_ttft"


def _e2e_result(outcome: RequestOutcome, ttft_target: float, tpot_target: float) -> str:
    duration = outcome.duration_s
    budget = ttft_target + tpot_target * max(0, (outcome.completion_tokens or 1) - 1)
    return "met" if duration is not None and duration <= budget else "missed_e2e"


def _fast_observe(child: Histogram) -> Callable[[float], None]:
    """``child.observe`` (one labelled child, no exemplar) as prometheus_client 0.26 does it: the
    sum grows by the amount and the first bucket whose upper bound is >= the amount counts one
    (none for NaN); the bucket found by bisection. ``child.observe`` itself when the child does
    not have that layout (another prometheus_client)."""
    bounds = getattr(child, "_upper_bounds", None)
    buckets = getattr(child, "_buckets", None)
    total = getattr(child, "_sum", None)
    if (
        not isinstance(bounds, list)
        or not isinstance(buckets, list)
        or len(bounds) != len(buckets)
        or not bounds
        or bounds[-1] != math.inf
        or not callable(getattr(total, "inc", None))
    ):
        return child.observe
    upper = [float(b) for b in bounds]
    incs = [b.inc for b in buckets]
    add = total.inc  # type: ignore[union-attr]
    find = bisect.bisect_left

    def observe(amount: float) -> None:
        add(amount)
        if amount == amount:  # not NaN: some bound (the last is +Inf) is >= it
            incs[find(upper, amount)](1)

    return observe


# -- the metrics ----------------------------------------------------------------------------------------
class SluiceMetrics:
    """All of Sluice's Prometheus objects in one private ``CollectorRegistry``.

    Label limits start empty (every class and tenant is ``other`` or ``none``) until
    ``set_known_labels`` or ``install`` sets them from the configuration. Not thread-safe beyond
    prometheus_client's own locking; call from the event loop.
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._classes: frozenset[str] = frozenset()
        self._tenants: frozenset[str] = frozenset()
        #: ``child``'s memo: per metric, its children by label values.
        self._children: dict[MetricWrapperBase, dict[tuple[str, ...], MetricWrapperBase]] = {}
        #: ``observer``'s and ``counter``'s memo: per metric, by label values.
        self._updaters: dict[MetricWrapperBase, dict[tuple[str, ...], Callable[[float], None]]] = {}
        r = self.registry
        self.build_info = Gauge(
            "sluice_build_info", "Always 1; the running version.", ["version"], registry=r
        )
        self.build_info.labels(_version()).set(1)

        # Traffic and decisions.
        self.requests = Counter(
            "sluice_requests_total",
            "Requests decided, by class, tenant, decision (admitted, rejected, shadow_rejected) and reason.",
            ["class", "tenant", "decision", "reason"],
            registry=r,
        )
        self.responses = Counter(
            "sluice_responses_total",
            "Responses sent, by class and HTTP status.",
            ["class", "status"],
            registry=r,
        )
        self.request_errors = Counter(
            "sluice_request_errors_total",
            "Requests that ended with an error code (upstream_error, replica_rejected, client_disconnected).",
            ["class", "error"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "sluice_prompt_tokens_total",
            "Prompt tokens the replicas reported.",
            ["class", "tenant"],
            registry=r,
        )
        self.completion_tokens = Counter(
            "sluice_completion_tokens_total",
            "Completion tokens the replicas reported.",
            ["class", "tenant"],
            registry=r,
        )
        self.retry_after = Histogram(
            "sluice_retry_after_seconds",
            "Retry-After sent with rejections, in seconds, by class and reason (overloaded, "
            "slo_unattainable, deadline_exceeded, no_healthy_replica; tenant budgets: tokens, requests, "
            "concurrency).",
            ["class", "reason"],
            buckets=RETRY_AFTER_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "sluice_queue_wait_seconds",
            "Seconds requests spent in Sluice's queue (0 when dispatched at once), by class and decision.",
            ["class", "decision"],
            buckets=QUEUE_WAIT_BUCKETS,
            registry=r,
        )

        # Latency as clients see it, and SLO results.
        self.ttft = Histogram(
            "sluice_ttft_seconds",
            "Time to first token from arrival at Sluice (queue included), streamed requests.",
            ["class"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "sluice_tpot_seconds",
            "Time per output token after the first, streamed requests with >= 2 tokens.",
            ["class"],
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "sluice_request_duration_seconds",
            "Seconds from arrival at Sluice to the end of the response or stream.",
            ["class"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.slo = Counter(
            "sluice_slo_requests_total",
            "Admitted requests judged against their targets, by class and result "
            "(met, missed_ttft, missed_tpot, missed_both, missed_e2e, failed, abandoned).",
            ["class", "result"],
            registry=r,
        )

        # Predictions against what happened, per replica (engine side: from dispatch).
        self.observed_ttft = Histogram(
            "sluice_observed_ttft_seconds",
            "Time to first token from dispatch to the replica, streamed requests.",
            ["replica"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.predicted_ttft = Histogram(
            "sluice_predicted_ttft_seconds",
            "Forecast time to first token from dispatch, for the replica chosen.",
            ["replica"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.observed_tpot = Histogram(
            "sluice_observed_tpot_seconds",
            "Time per output token observed on the replica, streamed requests with >= 2 tokens.",
            ["replica"],
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.predicted_tpot = Histogram(
            "sluice_predicted_tpot_seconds",
            "Forecast time per output token, for the replica chosen.",
            ["replica"],
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.prediction_error = Histogram(
            "sluice_prediction_error_ratio",
            "Signed relative prediction error (predicted - observed) / observed, by replica and kind.",
            ["replica", "kind"],
            buckets=ERROR_BUCKETS,
            registry=r,
        )
        self.prediction_abs_error = Histogram(
            "sluice_prediction_abs_error_ratio",
            "Absolute relative prediction error |predicted - observed| / observed, by replica and kind.",
            ["replica", "kind"],
            buckets=ABS_ERROR_BUCKETS,
            registry=r,
        )
        self.proxy_overhead = Histogram(
            "sluice_proxy_overhead_seconds",
            "Seconds in Sluice before dispatch, queue wait excluded (body, parse, admission, routing).",
            buckets=OVERHEAD_BUCKETS,
            registry=r,
        )

        # Replicas as Sluice sees them (scrape results; the rest is read at scrape time).
        self.replica_scrapes = Counter(
            "sluice_replica_scrapes_total",
            "Scrapes of replicas' /metrics by Sluice, by result (ok, stale).",
            ["replica", "result"],
            registry=r,
        )

        self.replica_scrape_parse_seconds = Counter(
            "sluice_replica_scrape_parse_seconds_total",
            "CPU seconds Sluice spent parsing the replica's /metrics (in a worker thread that holds "
            "the GIL meanwhile), by parser: kept_layout (the values only, the scrape laid out as the "
            "last one) or library (prometheus_client's: a first scrape, or one whose lines changed).",
            ["replica", "parser"],
            registry=r,
        )
        self.replica_scrape_parses = Counter(
            "sluice_replica_scrape_parses_total",
            "Replica /metrics scrapes parsed by Sluice, by parser (kept_layout, library).",
            ["replica", "parser"],
            registry=r,
        )

        # Tenants (as of their last reservation through this gateway).
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
        self._levels = _LatestReservations(self)
        r.register(self._levels)
        self.tenant_bucket_remaining = Gauge(
            "sluice_tenant_bucket_remaining",
            "Tokens or requests left in a tenant's bucket after its last reservation here.",
            ["tenant", "bucket"],
            registry=r,
        )
        self.tenant_bucket_capacity = Gauge(
            "sluice_tenant_bucket_capacity",
            "Size of a tenant's bucket (burst), in tokens or requests.",
            ["tenant", "bucket"],
            registry=r,
        )
        self.tenant_limit_per_minute = Gauge(
            "sluice_tenant_limit_per_minute",
            "A tenant's refill rate, tokens or requests per minute.",
            ["tenant", "bucket"],
            registry=r,
        )
        self.tenant_in_flight = Gauge(
            "sluice_tenant_in_flight_requests",
            "A tenant's unsettled requests across gateways, at its last reservation here.",
            ["tenant"],
            registry=r,
        )
        self.tenant_concurrency_limit = Gauge(
            "sluice_tenant_concurrency_limit", "A tenant's max_concurrent.", ["tenant"], registry=r
        )

        # Configuration reloads.
        self.reloads = Counter(
            "sluice_config_reloads_total", "Configuration reload attempts, by result.", ["result"], registry=r
        )
        self.reload_ok = Gauge(
            "sluice_config_last_reload_successful",
            "1 when the last configuration reload succeeded (or none failed since start), else 0.",
            registry=r,
        )
        self.reload_ok.set(1)
        self.reload_success_time = Gauge(
            "sluice_config_last_reload_success_timestamp_seconds",
            "Unix time of the last successful configuration load (start-up counts).",
            registry=r,
        )
        self.reload_success_time.set_to_current_time()

        self._state = _StateCollector(self, clock)
        r.register(self._state)
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        # python_gc_collections_total and python_gc_objects_collected_total, by generation: the
        # cycle collector's work (its pauses stop the event loop; see gateway.app._quiet_gc).
        GCCollector(registry=r)

    # -- label limits ------------------------------------------------------------------------------
    def set_known_labels(self, *, classes: Iterable[str] = (), tenants: Iterable[str] = ()) -> None:
        """The class and tenant names that may appear as label values (others become ``other``)."""
        self._classes = frozenset(classes)
        self._tenants = frozenset(tenants)

    def follow_settings(self, settings: Settings) -> None:
        """``set_known_labels`` from a settings snapshot (a ``SettingsStore`` subscriber's job)."""
        self.set_known_labels(classes=configured_classes(settings), tenants=configured_tenants(settings))

    def class_label(self, name: str | None) -> str:
        return limited(name, self._classes)

    def tenant_label(self, name: str | None) -> str:
        return limited(name, self._tenants)

    # -- per request ---------------------------------------------------------------------------------
    def child(self, metric: _Metric, *values: str) -> _Metric:
        """``metric.labels(*values)``, memoised per metric and label values: one dict lookup
        instead of prometheus_client's validation, string conversion and lock on every call
        (several per request). Nothing here removes children,
        so the memoised child is the one ``labels`` returns; label values are bounded (classes
        and tenants by ``set_known_labels``, replicas by the configuration)."""
        children = self._children.get(metric)
        if children is None:
            children = self._children[metric] = {}
        found = children.get(values)
        if found is None:
            found = children[values] = metric.labels(*values)
        return cast(_Metric, found)

    def observer(self, histogram: Histogram, *values: str) -> Callable[[float], None]:
        """``histogram.labels(*values).observe``, memoised, and cheaper to call: the bucket found
        by bisection, not by prometheus_client's loop over the bounds, then the same counts
        incremented (``_fast_observe``)."""
        updaters = self._updaters.get(histogram)
        if updaters is None:
            updaters = self._updaters[histogram] = {}
        found = updaters.get(values)
        if found is None:
            found = updaters[values] = _fast_observe(self.child(histogram, *values))
        return found

    def counter(self, counter: Counter, *values: str) -> Callable[[float], None]:
        """``counter.labels(*values).inc`` for amounts known to be >= 0 (``1``), memoised: the
        child's value incremented directly (``Counter.inc`` checks the sign on every call)."""
        updaters = self._updaters.get(counter)
        if updaters is None:
            updaters = self._updaters[counter] = {}
        found = updaters.get(values)
        if found is None:
            child = self.child(counter, *values)
            value = getattr(child, "_value", None)
            inc = getattr(value, "inc", None)
            found = updaters[values] = inc if callable(inc) else child.inc
        return found

    def observe_outcome(self, outcome: RequestOutcome) -> None:
        """Count one finished request (an ``OutcomeListener``): decision, status, tokens, latencies,
        predictions against observations, SLO result and overhead. Never raises on odd values."""
        cls = self.class_label(_text(outcome, "request_class"))
        tenant = self.tenant_label(_text(outcome, "tenant"))
        decision, reason = decision_of(outcome)
        self.counter(self.requests, cls, tenant, decision, reason)(1)
        if outcome.status is not None:
            self.counter(self.responses, cls, str(outcome.status))(1)
        if outcome.error is not None:
            self.counter(self.request_errors, cls, code_label(outcome.error))(1)
        self._observe_tokens(outcome, cls, tenant)
        self._observe_admission(outcome, cls, decision, reason)
        self._observe_latency(outcome, cls)
        if outcome.replica is not None:
            self._observe_prediction(outcome, outcome.replica)
        result = slo_result(outcome)
        if result is not None:
            self.counter(self.slo, cls, result)(1)
        overhead = proxy_overhead_s(outcome)
        if overhead is not None:
            self.proxy_overhead.observe(overhead)

    def _observe_tokens(self, outcome: RequestOutcome, cls: str, tenant: str) -> None:
        if outcome.prompt_tokens:
            self.child(self.prompt_tokens, cls, tenant).inc(outcome.prompt_tokens)
        if outcome.completion_tokens:
            self.child(self.completion_tokens, cls, tenant).inc(outcome.completion_tokens)

    def _observe_admission(self, outcome: RequestOutcome, cls: str, decision: str, reason: str) -> None:
        wait = _number(outcome, "queue_wait_s")
        if wait is not None:
            self.observer(self.queue_wait, cls, decision)(max(0.0, wait))
        retry_after = _number(outcome, "retry_after_s")
        if retry_after is not None and decision == "rejected":
            self.observer(self.retry_after, cls, reason)(max(0.0, retry_after))

    def _observe_latency(self, outcome: RequestOutcome, cls: str) -> None:
        duration = outcome.duration_s
        if duration is not None:
            self.observer(self.duration, cls)(max(0.0, duration))
        ttft = client_ttft_s(outcome)
        if ttft is not None:
            self.observer(self.ttft, cls)(max(0.0, ttft))
        tpot = observed_tpot_s(outcome)
        if tpot is not None:
            self.observer(self.tpot, cls)(tpot)

    def _observe_prediction(self, outcome: RequestOutcome, replica: str) -> None:
        ttft = (_number(outcome, "predicted_ttft_s"), outcome.ttft_s)
        tpot = (_number(outcome, "predicted_tpot_s"), observed_tpot_s(outcome))
        self._observe_pair(replica, "ttft", *ttft, self.predicted_ttft, self.observed_ttft)
        self._observe_pair(replica, "tpot", *tpot, self.predicted_tpot, self.observed_tpot)

    def _observe_pair(
        self,
        replica: str,
        kind: str,
        predicted: float | None,
        observed: float | None,
        predicted_hist: Histogram,
        observed_hist: Histogram,
    ) -> None:
        if observed is not None:
            self.observer(observed_hist, replica)(max(0.0, observed))
        if predicted is None:
            return
        self.observer(predicted_hist, replica)(max(0.0, predicted))
        error = None if observed is None else relative_error(predicted, observed)
        if error is not None:
            self.observer(self.prediction_error, replica, kind)(error)
            self.observer(self.prediction_abs_error, replica, kind)(abs(error))

    # -- replicas ------------------------------------------------------------------------------------
    def observe_snapshot(self, snapshot: ReplicaSnapshot) -> None:
        """Keep the newest snapshot of its replica for the collector and count the scrape."""
        self._state.snapshots[snapshot.name] = snapshot
        self.replica_scrapes.labels(snapshot.name, "stale" if snapshot.stale else "ok").inc()

    def observe_parse(self, replica: str, cpu_s: float, kept_layout: bool) -> None:
        """One scrape of ``replica`` parsed in ``cpu_s`` CPU seconds (``MetricsScraper.on_parse``)."""
        parser = "kept_layout" if kept_layout else "library"
        self.child(self.replica_scrape_parse_seconds, replica, parser).inc(cpu_s)
        self.child(self.replica_scrape_parses, replica, parser).inc()

    def track_replicas(self, source: ReplicaSource) -> None:
        """Read health, state and in-flight counts from ``source`` at every scrape of /metrics."""
        self._state.replicas = source

    def track_step_models(self, report_of: FitSource) -> None:
        """Read each replica's step-model fit (``report_of(name)``) at every scrape of /metrics."""
        self._state.fits = report_of

    # -- admission queue -----------------------------------------------------------------------------
    def track_queue(self, lengths: QueueSource) -> None:
        """Read the queue's waiting requests per class (``lengths()``) at every scrape."""
        self._state.queue = lengths

    # -- tenants and the limiter ---------------------------------------------------------------------
    def observe_reservation(self, reservation: ReservationView) -> None:
        """After a ``reserve``: the tokens reserved now; the tenant's bucket levels, limits and
        in-flight count as of its latest reservation at the next scrape."""
        tenant = self.tenant_label(reservation.tenant)
        if reservation.allowed:
            self.child(self.tenant_tokens_reserved, tenant).inc(max(0.0, reservation.cost_tokens))
        self._levels.latest[tenant] = reservation

    def _set_levels(self, tenant: str, reservation: ReservationView) -> None:
        """The tenant gauges as ``reservation`` (its latest) left them."""
        for kind, bucket in (("tokens", reservation.tokens), ("requests", reservation.requests)):
            if bucket is not None:
                self.child(self.tenant_bucket_remaining, tenant, kind).set(bucket.remaining)
                self.child(self.tenant_bucket_capacity, tenant, kind).set(bucket.capacity)
                self.child(self.tenant_limit_per_minute, tenant, kind).set(bucket.limit_per_minute)
        if reservation.concurrency is not None:
            self.child(self.tenant_in_flight, tenant).set(reservation.concurrency.in_flight)
            self.child(self.tenant_concurrency_limit, tenant).set(reservation.concurrency.limit)

    def observe_settle(self, reservation: ReservationView, actual_cost_tokens: float) -> None:
        """After a ``settle`` of an allowed reservation: the tokens really charged."""
        if reservation.allowed:
            self.child(self.tenant_tokens_settled, self.tenant_label(reservation.tenant)).inc(
                max(0.0, actual_cost_tokens)
            )

    def track_limiter(self, stats: LimiterStatsView, *, redis: bool = True) -> None:
        """Export ``stats`` (Redis errors, fail-open/closed decisions, degraded, over-limit cache) at
        every scrape. ``redis`` False (``limits.backend: memory``): there is no storage to report
        on, so those series keep no samples ("no data", not a made-up "Redis up")."""
        self._state.limiter = stats if redis else None

    # -- configuration -------------------------------------------------------------------------------
    def observe_reload(self, ok: bool) -> None:
        """One reload attempt: ``ok`` True when the file was valid (applied or unchanged)."""
        self.reloads.labels("success" if ok else "failure").inc()
        self.reload_ok.set(1 if ok else 0)
        if ok:
            self.reload_success_time.set_to_current_time()

    # -- exposition ----------------------------------------------------------------------------------
    def exposition(self, accept: str | None = None) -> tuple[bytes, str]:
        """The registry's samples and their content type, negotiated from an ``Accept`` header."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type


class _LatestReservations(Collector):
    """Each tenant's latest reservation (by tenant label), written into the tenant gauges when the
    registry is collected; yields no metric of its own."""

    def __init__(self, owner: SluiceMetrics) -> None:
        self._owner = owner
        self.latest: dict[str, ReservationView] = {}

    def describe(self) -> list[Metric]:
        return []  # nothing of its own (and the registry must not collect it to find out)

    def collect(self) -> list[Metric]:
        latest, self.latest = self.latest, {}
        for tenant, reservation in latest.items():
            self._owner._set_levels(tenant, reservation)
        return []


class _StateCollector(Collector):
    """Gauges read at scrape time from live objects: replicas, snapshots, fits, queue, limiter."""

    def __init__(self, owner: SluiceMetrics, clock: Callable[[], float]) -> None:
        self._owner = owner
        self._clock = clock
        self.replicas: ReplicaSource | None = None
        self.snapshots: dict[str, ReplicaSnapshot] = {}
        self.fits: FitSource | None = None
        self.queue: QueueSource | None = None
        self.limiter: LimiterStatsView | None = None

    def describe(self) -> Iterable[Metric]:
        # Lets the registry check names at registration without touching the live objects.
        return [
            *self._replica_families(),
            *self._fit_families(),
            *self._queue_families(),
            *_limiter_families(),
        ]

    def collect(self) -> Iterable[Metric]:
        replicas = self._live_replicas()
        yield from self._collect_replicas(replicas)
        yield from self._collect_fits([name for name, _ in replicas])
        yield from self._collect_queue()
        yield from self._collect_limiter()

    def _live_replicas(self) -> list[tuple[str, str]]:
        """(name, state) of every configured replica, then the draining ones.

        A replica replaced under the same name (its URL changed) drains beside its successor:
        the name is listed once, with the successor's state (series must be unique).
        """
        if self.replicas is None:
            return []
        live = [(r.name, str(r.state)) for r in self.replicas.replicas()]
        names = {name for name, _ in live}
        return live + [(r.name, "draining") for r in self.replicas.draining() if r.name not in names]

    def _replica_families(self) -> tuple[GaugeMetricFamily, ...]:
        return (
            GaugeMetricFamily(
                "sluice_replica_healthy", "1 when the replica takes traffic.", labels=["replica"]
            ),
            GaugeMetricFamily(
                "sluice_replica_state",
                "1 for the replica's health state (unknown, healthy, unhealthy, draining).",
                labels=["replica", "state"],
            ),
            GaugeMetricFamily(
                "sluice_replica_in_flight_requests",
                "Requests Sluice has dispatched to the replica and not finished.",
                labels=["replica"],
            ),
            GaugeMetricFamily(
                "sluice_replica_metrics_stale",
                "1 when Sluice's last scrape of the replica failed.",
                labels=["replica"],
            ),
            GaugeMetricFamily(
                "sluice_replica_metrics_age_seconds",
                "Seconds since Sluice last scraped the replica successfully.",
                labels=["replica"],
            ),
            GaugeMetricFamily(
                "sluice_replica_kv_cache_usage_ratio",
                "KV-cache use (0-1) as Sluice last read it from the replica.",
                labels=["replica"],
            ),
            GaugeMetricFamily(
                "sluice_replica_requests_running",
                "Requests running on the replica, as Sluice last read it.",
                labels=["replica"],
            ),
            GaugeMetricFamily(
                "sluice_replica_requests_waiting",
                "Requests waiting in the replica's own queue, as Sluice last read it.",
                labels=["replica"],
            ),
        )

    def _collect_replicas(self, replicas: list[tuple[str, str]]) -> Iterator[Metric]:
        healthy, state, in_flight, stale, age, kv, running, waiting = self._replica_families()
        outstanding = self._outstanding()
        now = self._clock()
        for name, current in replicas:
            healthy.add_metric([name], 1.0 if current == "healthy" else 0.0)
            for candidate in REPLICA_STATES:
                state.add_metric([name, candidate], 1.0 if candidate == current else 0.0)
            in_flight.add_metric([name], float(outstanding.get(name, 0)))
            snapshot = self.snapshots.get(name)
            if snapshot is None:
                continue
            stale.add_metric([name], 1.0 if snapshot.stale else 0.0)
            metrics_age = snapshot.metrics_age_s(now)
            for family, value in (
                (age, metrics_age),
                (kv, snapshot.kv_cache_usage),
                (running, snapshot.num_running),
                (waiting, snapshot.num_waiting),
            ):
                if value is not None:
                    family.add_metric([name], float(value))
        self._forget_removed({name for name, _ in replicas})
        yield from (healthy, state, in_flight, stale, age, kv, running, waiting)

    def _outstanding(self) -> dict[str, int]:
        if self.replicas is None:
            return {}
        counts: dict[str, int] = {}
        for replica in [*self.replicas.replicas(), *self.replicas.draining()]:
            counts[replica.name] = counts.get(replica.name, 0) + replica.outstanding
        return counts

    def _forget_removed(self, names: set[str]) -> None:
        if self.replicas is not None:
            for gone in set(self.snapshots) - names:
                del self.snapshots[gone]

    @staticmethod
    def _fit_families() -> tuple[
        GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily, CounterMetricFamily
    ]:
        return (
            GaugeMetricFamily(
                "sluice_step_model_coefficient_seconds",
                "Step-model coefficient, seconds per unit of its term, for the model in use and the prior.",
                labels=["replica", "term", "model"],
            ),
            GaugeMetricFamily(
                "sluice_step_model_fit_error_ratio",
                "Median absolute relative error of step times over recent observations (fit, prior).",
                labels=["replica", "model"],
            ),
            GaugeMetricFamily(
                "sluice_step_model_valid", "1 when the replica's step model can forecast.", labels=["replica"]
            ),
            GaugeMetricFamily(
                "sluice_step_model_effective_observations",
                "Step-time observations the fit holds now (sum of forgetting weights).",
                labels=["replica"],
            ),
            CounterMetricFamily(
                "sluice_step_model_observations",
                "Step-time observations accepted by the fit since start.",
                labels=["replica"],
            ),
        )

    def _collect_fits(self, names: list[str]) -> Iterator[Metric]:
        coefficient, error, valid, effective, accepted = self._fit_families()
        for name in names if self.fits is not None else []:
            report = self.fits(name) if self.fits is not None else None
            if report is None:
                continue
            for term, value in zip(FEATURE_NAMES, report.params.coefficients(), strict=True):
                coefficient.add_metric([name, term, "in_use"], value)
            if report.prior is not None:
                for term, value in zip(FEATURE_NAMES, report.prior.coefficients(), strict=True):
                    coefficient.add_metric([name, term, "prior"], value)
            if report.mdape is not None:
                error.add_metric([name, "fit"], report.mdape)
            if report.prior_mdape is not None:
                error.add_metric([name, "prior"], report.prior_mdape)
            valid.add_metric([name], 1.0 if report.valid else 0.0)
            effective.add_metric([name], report.effective_observations)
            accepted.add_metric([name], float(report.observations_total))
        yield from (coefficient, error, valid, effective)
        # A counter family is named without ``_total``; it is exposed with it.
        yield accepted

    @staticmethod
    def _queue_families() -> tuple[GaugeMetricFamily]:
        return (
            GaugeMetricFamily("sluice_queue_length", "Requests waiting in Sluice's queue.", labels=["class"]),
        )

    def _collect_queue(self) -> Iterator[Metric]:
        (length,) = self._queue_families()
        if self.queue is not None:
            totals: dict[str, int] = {}
            for name, count in self.queue().items():
                label = self._owner.class_label(name)
                totals[label] = totals.get(label, 0) + count
            for label, count in sorted(totals.items()):
                length.add_metric([label], float(count))
        yield length

    def _collect_limiter(self) -> Iterator[Metric]:
        families = _limiter_families()
        errors, fail_open, fail_closed, transitions, cached, degraded, repairs, abandoned, pending = families
        stats = self.limiter
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


def _version() -> str:
    try:
        return metadata.version("sluice")
    except metadata.PackageNotFoundError:
        return "unknown"


# -- HTTP --------------------------------------------------------------------------------------------
def replica_targets(replicas: Iterable[Replica]) -> list[dict[str, object]]:
    """Prometheus HTTP service-discovery groups: one per replica, ``replica`` and ``backend`` labels.

    The replica's URL gives ``__address__`` (host:port), ``__scheme__`` and ``__metrics_path__``
    (its path prefix + ``/metrics``), so Prometheus scrapes exactly what Sluice routes to.
    """
    groups: list[dict[str, object]] = []
    for replica in replicas:
        url = urlsplit(replica.base_url)
        port = url.port or (443 if url.scheme == "https" else 80)
        host = url.hostname or ""
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        labels = {
            "__scheme__": url.scheme,
            "__metrics_path__": url.path.rstrip("/") + "/metrics",
            "replica": replica.name,
            "backend": replica.settings.backend,
        }
        groups.append({"targets": [address], "labels": labels})
    return groups


#: The application's ``SluiceMetrics`` (set by ``install``).
METRICS = web.AppKey("metrics", SluiceMetrics)


def install(
    app: web.Application,
    metrics: SluiceMetrics | None = None,
    *,
    serve_on: web.Application | None = None,
) -> SluiceMetrics:
    """Add ``/metrics`` and ``/metrics/replicas`` to ``serve_on`` (default ``app``; the admin
    listener's application when ``admin.port`` is set, see ``gateway.admin``) and feed ``metrics``
    from ``app``.

    Call at the end of ``build_app`` (or after it), before the app starts. Wires what the app
    already has: ``app[STORE]`` (label limits follow every reload), ``app[OUTCOME_LISTENERS]``
    (``observe_outcome``) and, at startup, ``app[REGISTRY]`` (``track_replicas``),
    ``app[PREDICTION_SERVICE].report`` (``track_step_models``) and ``app[SCRAPER]``
    (``observe_snapshot`` on every scrape, ``observe_parse`` on every parse). Returns the metrics
    (also at ``app[METRICS]``) for the producers that are not in the app yet (queue, limiter,
    reloader: see the module docstring).
    """
    chosen = metrics if metrics is not None else SluiceMetrics()
    app[METRICS] = chosen
    store = app[STORE]
    chosen.follow_settings(store.current)
    store.subscribe(lambda _old, new: chosen.follow_settings(new))
    app[OUTCOME_LISTENERS].append(chosen.observe_outcome)

    async def bind(app: web.Application) -> None:
        # on_startup runs after every cleanup_ctx has set up, so these objects exist by now.
        chosen.track_replicas(app[REGISTRY])
        chosen.track_step_models(app[PREDICTION_SERVICE].report)
        app[SCRAPER].subscribe(chosen.observe_snapshot)
        app[SCRAPER].on_parse(chosen.observe_parse)

    async def metrics_handler(request: web.Request) -> web.Response:
        body, content_type = chosen.exposition(request.headers.get("Accept"))
        # Content-Type carries its own charset/version parameters: set the header raw.
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def targets_handler(request: web.Request) -> web.Response:
        # ``app``, not ``request.app``: the request may have come in on the admin listener.
        registry = app.get(REGISTRY)
        replicas = [] if registry is None else registry.replicas()
        return web.json_response(replica_targets(replicas))

    app.on_startup.append(bind)
    routes = (app if serve_on is None else serve_on).router
    routes.add_get("/metrics", metrics_handler)
    routes.add_get("/metrics/replicas", targets_handler)
    return chosen
