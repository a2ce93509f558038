"""Replicas as Sluice sees them: scrape and parse counters fed by the scraper, and health, state,
in-flight counts and the last snapshot's figures read at scrape time.

``ReplicaCollector`` reads ``ReplicaSource`` (the registry) when /metrics is scraped: every
configured replica, then the draining ones; snapshot figures appear only for replicas scraped at
least once, and a removed replica's series disappear with it. No samples while no source is wired.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Final, Protocol

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.observability.metrics.children import Children

if TYPE_CHECKING:
    from gateway.replicas.registry import Replica
    from gateway.replicas.snapshot import ReplicaSnapshot

REPLICA_STATES: Final = ("unknown", "healthy", "unhealthy", "draining")


class ReplicaSource(Protocol):
    """What the replica collector reads (``gateway.replicas.registry.ReplicaRegistry``)."""

    def replicas(self) -> list[Replica]: ...

    def draining(self) -> list[Replica]: ...


class ReplicaMetrics:
    """The scraper's counters, registered in ``registry`` at construction (in exposition order)."""

    def __init__(self, registry: CollectorRegistry, children: Children, state: ReplicaCollector) -> None:
        self._children = children
        self._state = state
        r = registry
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

    def observe_snapshot(self, snapshot: ReplicaSnapshot) -> None:
        """Keep the newest snapshot of its replica for the collector and count the scrape."""
        self._state.snapshots[snapshot.name] = snapshot
        self.replica_scrapes.labels(snapshot.name, "stale" if snapshot.stale else "ok").inc()

    def observe_parse(self, replica: str, cpu_s: float, kept_layout: bool) -> None:
        """One scrape of ``replica`` parsed in ``cpu_s`` CPU seconds (``MetricsScraper.on_parse``)."""
        parser = "kept_layout" if kept_layout else "library"
        self._children.child(self.replica_scrape_parse_seconds, replica, parser).inc(cpu_s)
        self._children.child(self.replica_scrape_parses, replica, parser).inc()


class ReplicaCollector(Collector):
    """Gauges read at scrape time from ``source`` and the newest snapshot of each replica;
    ``clock`` (monotonic seconds) dates the snapshots' metrics."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.source: ReplicaSource | None = None
        self.snapshots: dict[str, ReplicaSnapshot] = {}

    def describe(self) -> Iterable[Metric]:
        # Lets the registry check names at registration without touching the live objects.
        return self._families()

    def live_names(self) -> list[str]:
        """Names of the live replicas, each once (configured first, then draining)."""
        return [name for name, _ in self._live_replicas()]

    def _live_replicas(self) -> list[tuple[str, str]]:
        """(name, state) of every configured replica, then the draining ones.

        A replica replaced under the same name (its URL changed) drains beside its successor:
        the name is listed once, with the successor's state (series must be unique).
        """
        if self.source is None:
            return []
        live = [(r.name, str(r.state)) for r in self.source.replicas()]
        names = {name for name, _ in live}
        return live + [(r.name, "draining") for r in self.source.draining() if r.name not in names]

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, ...]:
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

    def collect(self) -> Iterator[Metric]:
        replicas = self._live_replicas()
        healthy, state, in_flight, stale, age, kv, running, waiting = self._families()
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
        if self.source is None:
            return {}
        counts: dict[str, int] = {}
        for replica in [*self.source.replicas(), *self.source.draining()]:
            counts[replica.name] = counts.get(replica.name, 0) + replica.outstanding
        return counts

    def _forget_removed(self, names: set[str]) -> None:
        if self.source is not None:
            for gone in set(self.snapshots) - names:
                del self.snapshots[gone]
