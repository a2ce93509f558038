"""The replica ledger shared by gateways (``gateway.ledger``): up or down, what it published and
applied, entries dropped at the cap, gateways expired, and the other gateways' in-flight requests
per replica. Read at scrape time from the ledger's stats; no samples while no ledger is wired
(``ledger.enabled`` false).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class LedgerStatsView(Protocol):
    """What the collector reads (``gateway.ledger.live.LedgerStats``)."""

    up: bool
    transitions_total: int
    errors_total: int
    published_total: int
    publish_calls_total: int
    publish_seconds_total: float
    applied_total: int
    dropped_total: int
    unpublished_total: int
    expired_gateways_total: int


class LedgerCollector(Collector):
    """The ledger's series, read from ``stats`` and ``remote()`` (entries per replica) at every
    scrape; none while ``stats`` is ``None``."""

    def __init__(self) -> None:
        self.stats: LedgerStatsView | None = None
        self.remote: Callable[[], Mapping[str, int]] | None = None

    def describe(self) -> Iterable[Metric]:
        return _families()

    def collect(self) -> Iterator[Metric]:
        families = _families()
        up, transitions, errors, published, calls, seconds, applied, dropped, unpublished, expired, remote = (
            families
        )
        stats = self.stats
        if stats is not None:
            up.add_metric([], 1.0 if stats.up else 0.0)
            transitions.add_metric([], float(stats.transitions_total))
            errors.add_metric([], float(stats.errors_total))
            published.add_metric([], float(stats.published_total))
            calls.add_metric([], float(stats.publish_calls_total))
            seconds.add_metric([], stats.publish_seconds_total)
            applied.add_metric([], float(stats.applied_total))
            dropped.add_metric([], float(stats.dropped_total))
            unpublished.add_metric([], float(stats.unpublished_total))
            expired.add_metric([], float(stats.expired_gateways_total))
            if self.remote is not None:
                for replica, count in sorted(self.remote().items()):
                    remote.add_metric([replica], float(count))
        yield from families


def _families() -> tuple[
    GaugeMetricFamily,
    CounterMetricFamily,
    CounterMetricFamily,
    CounterMetricFamily,
    CounterMetricFamily,
    CounterMetricFamily,
    CounterMetricFamily,
    CounterMetricFamily,
    CounterMetricFamily,
    CounterMetricFamily,
    GaugeMetricFamily,
]:
    return (
        GaugeMetricFamily(
            "sluice_ledger_up",
            "1 while the replica ledger (Redis) answers; 0 while admission falls back to this gateway's "
            "requests and the scrapes, with ledger.unavailable_margin.",
        ),
        CounterMetricFamily("sluice_ledger_transitions", "Changes between ledger up and down, both ways."),
        CounterMetricFamily("sluice_ledger_errors", "Ledger Redis calls that failed or timed out."),
        CounterMetricFamily(
            "sluice_ledger_published",
            "Entry changes (dispatch, first token, progress, finish) this gateway published.",
        ),
        CounterMetricFamily(
            "sluice_ledger_publish_calls", "Publish round trips (pipelines) this gateway made."
        ),
        CounterMetricFamily("sluice_ledger_publish_seconds", "Seconds the publish round trips took, summed."),
        CounterMetricFamily("sluice_ledger_applied", "Other gateways' entry changes this gateway applied."),
        CounterMetricFamily(
            "sluice_ledger_dropped",
            "Other gateways' entries not kept: their replica held ledger.max_entries_per_replica already.",
        ),
        CounterMetricFamily(
            "sluice_ledger_unpublished",
            "Own requests not published: this gateway had ledger.max_entries_per_replica on their replica.",
        ),
        CounterMetricFamily(
            "sluice_ledger_expired_gateways", "Gateways whose heartbeat expired while they held entries here."
        ),
        GaugeMetricFamily(
            "sluice_ledger_remote_in_flight",
            "Other gateways' in-flight requests on the replica, as this gateway counts them.",
            labels=["replica"],
        ),
    )
