"""The limiter's repair counters (``LimiterStats.repairs_*``) on ``/metrics``."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from gateway.limits.base import LimiterStats
from gateway.observability.metrics import SluiceMetrics


def samples(metrics: SluiceMetrics) -> dict[str, float]:
    body, _ = metrics.exposition()
    return {
        s.name: float(s.value)
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
        if s.name.startswith("sluice_redis_repairs")
    }


def test_repairs_started_abandoned_and_pending_are_exported() -> None:
    metrics = SluiceMetrics()
    stats = LimiterStats()
    metrics.track_limiter(stats)
    stats.repairs_total, stats.repairs_abandoned_total, stats.repairs_pending = 5, 1, 2
    assert samples(metrics) == {
        "sluice_redis_repairs_total": 5.0,
        "sluice_redis_repairs_abandoned_total": 1.0,
        "sluice_redis_repairs_pending": 2.0,
    }


def test_a_memory_limiter_exports_no_repairs() -> None:
    metrics = SluiceMetrics()
    metrics.track_limiter(LimiterStats(), redis=False)
    assert samples(metrics) == {}
