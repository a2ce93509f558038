"""``SluiceMetrics.child`` memoises ``labels``: the same child, so the same series, every time."""

from __future__ import annotations

from gateway.observability.metrics import SluiceMetrics


def test_child_is_the_child_labels_returns_and_counts_into_its_series() -> None:
    metrics = SluiceMetrics()
    first = metrics.child(metrics.requests, "standard", "acme", "admitted", "ok")
    assert first is metrics.requests.labels("standard", "acme", "admitted", "ok")
    assert metrics.child(metrics.requests, "standard", "acme", "admitted", "ok") is first
    first.inc()
    metrics.child(metrics.requests, "standard", "acme", "admitted", "ok").inc(2)
    other = metrics.child(metrics.requests, "standard", "acme", "rejected", "overloaded")
    assert other is not first
    other.inc()
    sample = metrics.registry.get_sample_value
    labels = {"class": "standard", "tenant": "acme", "decision": "admitted", "reason": "ok"}
    assert sample("sluice_requests_total", labels) == 3.0
    assert sample("sluice_requests_total", {**labels, "decision": "rejected", "reason": "overloaded"}) == 1.0


def test_children_of_different_metrics_with_the_same_labels_stay_apart() -> None:
    metrics = SluiceMetrics()
    metrics.child(metrics.ttft, "standard").observe(0.2)
    metrics.child(metrics.duration, "standard").observe(3.0)
    sample = metrics.registry.get_sample_value
    assert sample("sluice_ttft_seconds_count", {"class": "standard"}) == 1.0
    assert sample("sluice_ttft_seconds_sum", {"class": "standard"}) == 0.2
    assert sample("sluice_request_duration_seconds_sum", {"class": "standard"}) == 3.0
