"""Every Prometheus object Sluice exports, by domain, and ``SluiceMetrics``, the one object the
core's producers feed.

The core returns plain values (``RequestOutcome``, ``ReplicaSnapshot``, ``FitReport``, limiter
reservations and stats); only this package turns them into metrics. ``SluiceMetrics`` owns one
private ``CollectorRegistry`` and composes the domains: ``requests`` (decisions, client latency,
SLO, queue), ``prediction`` (per replica, and the step-model fits), ``replicas``, ``tenants``
(and the limiter), ``process`` (build, reloads, runtime); ``labels`` bounds label values,
``children`` memoises labelled children, ``outcomes`` is the per-request arithmetic, and
``endpoints.install(app)`` serves ``/metrics`` and ``/metrics/replicas``. Names start with
``sluice_``; counters end in ``_total``, durations in ``_seconds``, fractions in ``_ratio``.
Until a producer is wired its metrics have no samples, never a made-up zero.
Every metric with its labels: docs/metrics.md (``reference``); how the panels use them: docs/dashboards.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from gateway.observability.metrics.children import Children
from gateway.observability.metrics.labels import LabelLimits, configured_classes, configured_tenants
from gateway.observability.metrics.ledger import LedgerCollector, LedgerStatsView
from gateway.observability.metrics.multiprocess import (
    LiveSnapshots,
    exposition_registry,
    multiprocess_directory,
)
from gateway.observability.metrics.outcomes import text_field
from gateway.observability.metrics.prediction import (
    CorrectionCollector,
    CorrectionSource,
    FitSource,
    PredictionMetrics,
    StepModelCollector,
)
from gateway.observability.metrics.process import (
    ReloadMetrics,
    register_build_info,
    register_runtime,
    register_worker_requests,
)
from gateway.observability.metrics.replicas import ReplicaCollector, ReplicaMetrics, ReplicaSource
from gateway.observability.metrics.requests import (
    AttainmentCollector,
    AttainmentSource,
    QueueCollector,
    QueueSource,
    RequestMetrics,
    SizeShareCollector,
    SizeShareSource,
)
from gateway.observability.metrics.tenants import (
    LevelsView,
    LimiterCollector,
    LimiterStatsView,
    ReservationView,
    TenantMetrics,
    TokenWeightCollector,
    WeightsView,
)
from gateway.observability.outcome import RequestOutcome
from gateway.workers import worker_index

if TYPE_CHECKING:
    from gateway.config.settings import Settings
    from gateway.replicas.snapshot import ReplicaSnapshot

__all__ = ["METRICS", "SluiceMetrics"]


class SluiceMetrics:
    """All of Sluice's Prometheus objects in one private ``CollectorRegistry``, by domain.

    Label limits start empty (every class and tenant is ``other`` or ``none``) until
    ``set_known_labels`` or ``install`` sets them from the configuration. ``clock`` (monotonic
    seconds) dates replica snapshots. ``worker``: this process's worker index (default: from the
    environment, ``gateway.workers``); with ``PROMETHEUS_MULTIPROC_DIR`` set as well, the exposition
    is the host's, every worker's summed (``multiprocess``); ``budgets_per_worker``: the workers keep
    tenant budgets in memory, each its share, so the tenant gauges are summed. Not thread-safe beyond
    prometheus_client's own locking; call from the event loop.
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        worker: int | None = None,
        budgets_per_worker: bool = False,
    ) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.labels = LabelLimits()
        self.children = Children()
        # Registration order is exposition order.
        self.build_info = register_build_info(r)
        self.requests = RequestMetrics(r, self.children)
        self.prediction = PredictionMetrics(r, self.children)
        self._replica_state = ReplicaCollector(clock)
        self.replicas = ReplicaMetrics(r, self.children, self._replica_state)
        self.tenants = TenantMetrics(r, self.children, self.labels, budgets_per_worker=budgets_per_worker)
        self.reloads = ReloadMetrics(r)
        self._ledger = LedgerCollector()
        r.register(self._ledger)
        self.worker = worker if worker is not None else worker_index()
        self._worker_requests: Callable[[], None] | None = None
        worker_requests = register_worker_requests(r)
        if self.worker is not None:
            self._worker_requests = worker_requests.labels(str(self.worker)).inc
        # Read at scrape time from live objects, once their producers are wired (``track_*``).
        self._step_models = StepModelCollector(self._replica_state.live_names)
        self._corrections = CorrectionCollector(self._replica_state.live_names, clock)
        self._queue = QueueCollector(self.labels)
        self._attainment = AttainmentCollector(self.labels)
        self._size_shares = SizeShareCollector(self.labels)
        self._limiter = LimiterCollector()
        self._token_weights = TokenWeightCollector()
        for collector in (
            self._replica_state,
            self._step_models,
            self._corrections,
            self._queue,
            self._attainment,
            self._size_shares,
            self._limiter,
            self._token_weights,
        ):
            r.register(collector)
        register_runtime(r)
        #: With ``server.workers`` > 1 (``PROMETHEUS_MULTIPROC_DIR`` set and a worker index): this
        #: worker's scrape-time collectors, snapshot for the others (``multiprocess``); else None.
        self.live: LiveSnapshots | None = None
        self._exposed = r
        directory = multiprocess_directory()
        if directory is not None and self.worker is not None:
            self.live = LiveSnapshots(directory, self.worker, r)
            self._exposed = exposition_registry(self.live)

    # -- label limits ------------------------------------------------------------------------------
    def set_known_labels(self, *, classes: Iterable[str] = (), tenants: Iterable[str] = ()) -> None:
        """The class and tenant names that may appear as label values (others become ``other``)."""
        self.labels.set(classes=classes, tenants=tenants)

    def follow_settings(self, settings: Settings) -> None:
        """``set_known_labels`` from a settings snapshot (a ``SettingsStore`` subscriber's job)."""
        self.set_known_labels(classes=configured_classes(settings), tenants=configured_tenants(settings))

    # -- producers ---------------------------------------------------------------------------------
    def observe_outcome(self, outcome: RequestOutcome) -> None:
        """Count one finished request (an ``OutcomeListener``): decision, status, tokens, latencies,
        predictions against observations, SLO result and overhead. Never raises on odd values."""
        cls = self.labels.class_label(text_field(outcome, "request_class"))
        tenant = self.labels.tenant_label(text_field(outcome, "tenant"))
        self.requests.observe(outcome, cls, tenant)
        self.prediction.observe(outcome)
        if self._worker_requests is not None:
            self._worker_requests()

    def observe_snapshot(self, snapshot: ReplicaSnapshot) -> None:
        """Keep the newest snapshot of its replica for the collector and count the scrape."""
        self.replicas.observe_snapshot(snapshot)

    def observe_parse(self, replica: str, cpu_s: float, kept_layout: bool) -> None:
        """One scrape of ``replica`` parsed in ``cpu_s`` CPU seconds (``MetricsScraper.on_parse``)."""
        self.replicas.observe_parse(replica, cpu_s, kept_layout)

    def track_replicas(self, source: ReplicaSource) -> None:
        """Read health, state and in-flight counts from ``source`` at every scrape of /metrics."""
        self._replica_state.source = source

    def track_step_models(self, report_of: FitSource) -> None:
        """Read each replica's step-model fit (``report_of(name)``) at every scrape of /metrics."""
        self._step_models.source = report_of

    def track_corrections(self, state_of: CorrectionSource) -> None:
        """Read each replica's forecast correction (``state_of(name, now)``) at every scrape."""
        self._corrections.source = state_of

    def track_queue(self, lengths: QueueSource) -> None:
        """Read the queue's waiting requests per class (``lengths()``) at every scrape."""
        self._queue.source = lengths

    def track_attainment(self, states: AttainmentSource) -> None:
        """Read the attainment controller's margins and attainment (``states()``) at every scrape."""
        self._attainment.source = states

    def track_size_shares(self, rows: SizeShareSource) -> None:
        """Read each class's admission by prompt-size quartile (``rows()``) at every scrape."""
        self._size_shares.source = rows

    def track_token_weights(
        self,
        weights: Callable[[], WeightsView],
        by_model: Callable[[], Mapping[str, WeightsView]] | None = None,
    ) -> None:
        """Read the token weights budgets charge now (``weights()``) and, with GPU-time weights,
        per model (``by_model()``: each model's replica group's) at every scrape."""
        self._token_weights.source = weights
        self._token_weights.by_model = by_model

    def observe_reservation(self, reservation: ReservationView) -> None:
        """After a ``reserve``: see ``TenantMetrics.observe_reservation``."""
        self.tenants.observe_reservation(reservation)

    def observe_settle(self, reservation: ReservationView, actual_cost_tokens: float) -> None:
        """After a ``settle`` of an allowed reservation: the tokens really charged."""
        self.tenants.observe_settle(reservation, actual_cost_tokens)

    def observe_levels(self, tenant: str, levels: LevelsView) -> None:
        """A tenant's budgets read from the limiter now: see ``TenantMetrics.observe_levels``."""
        self.tenants.observe_levels(tenant, levels)

    def track_limiter(self, stats: LimiterStatsView, *, redis: bool = True) -> None:
        """Export ``stats`` (Redis errors, fail-open/closed decisions, degraded, over-limit cache) at
        every scrape. ``redis`` False (``limits.backend: memory``): there is no storage to report
        on, so those series keep no samples ("no data", not a made-up "Redis up")."""
        self._limiter.stats = stats if redis else None

    def track_ledger(self, stats: LedgerStatsView, remote: Callable[[], Mapping[str, int]]) -> None:
        """Export the replica ledger's ``stats`` and the other gateways' entries per replica
        (``remote()``) at every scrape."""
        self._ledger.stats = stats
        self._ledger.remote = remote

    def observe_reload(self, ok: bool) -> None:
        """One reload attempt: ``ok`` True when the file was valid (applied or unchanged)."""
        self.reloads.observe_reload(ok)

    # -- exposition ----------------------------------------------------------------------------------
    def exposition(self, accept: str | None = None) -> tuple[bytes, str]:
        """The registry's samples and their content type, negotiated from an ``Accept`` header."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self._exposed), content_type


#: The application's ``SluiceMetrics`` (set by ``endpoints.install``).
METRICS = web.AppKey("metrics", SluiceMetrics)
