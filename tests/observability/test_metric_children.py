"""``SluiceMetrics.child`` memoises ``labels``: the same child, so the same series, every time."""

from __future__ import annotations

import math

from gateway.observability.metrics import SluiceMetrics


def test_child_is_the_child_labels_returns_and_counts_into_its_series() -> None:
    metrics = SluiceMetrics()
    first = metrics.children.child(metrics.requests.requests, "standard", "acme", "admitted", "ok")
    assert first is metrics.requests.requests.labels("standard", "acme", "admitted", "ok")
    assert metrics.children.child(metrics.requests.requests, "standard", "acme", "admitted", "ok") is first
    first.inc()
    metrics.children.child(metrics.requests.requests, "standard", "acme", "admitted", "ok").inc(2)
    other = metrics.children.child(metrics.requests.requests, "standard", "acme", "rejected", "overloaded")
    assert other is not first
    other.inc()
    sample = metrics.registry.get_sample_value
    labels = {"class": "standard", "tenant": "acme", "decision": "admitted", "reason": "ok"}
    assert sample("sluice_requests_total", labels) == 3.0
    assert sample("sluice_requests_total", {**labels, "decision": "rejected", "reason": "overloaded"}) == 1.0


def test_children_of_different_metrics_with_the_same_labels_stay_apart() -> None:
    metrics = SluiceMetrics()
    metrics.children.child(metrics.requests.ttft, "standard").observe(0.2)
    metrics.children.child(metrics.requests.duration, "standard").observe(3.0)
    sample = metrics.registry.get_sample_value
    assert sample("sluice_ttft_seconds_count", {"class": "standard"}) == 1.0
    assert sample("sluice_ttft_seconds_sum", {"class": "standard"}) == 0.2
    assert sample("sluice_request_duration_seconds_sum", {"class": "standard"}) == 3.0


def _series(metrics: SluiceMetrics, name: str, labels: dict[str, str]) -> dict[str, float]:
    """Every sample of ``name``'s series with ``labels`` (buckets by ``le``, sum, count)."""
    found = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            if sample.name.startswith(name) and all(sample.labels.get(k) == v for k, v in labels.items()):
                found[f"{sample.name}{sample.labels.get('le', '')}"] = sample.value
    return found


def test_observer_counts_as_observe_does() -> None:
    """Bounds exactly, between, below the first, negative, huge, then +Inf and NaN: the same
    buckets, sum and count as prometheus_client's ``observe`` on a twin series."""
    metrics = SluiceMetrics()
    observe = metrics.children.observer(metrics.requests.duration, "fast")
    assert metrics.children.observer(metrics.requests.duration, "fast") is observe
    twin = metrics.children.child(metrics.requests.duration, "slow")
    bounds = [float(b) for b in twin._upper_bounds]
    finite = [*bounds[:-1], *(b * 1.001 for b in bounds[:-1]), 0.0, -1.0, 1e-9, 1e12]
    for amounts in (finite, [float("inf"), float("nan")]):
        for amount in amounts:
            observe(amount)
            twin.observe(amount)
        fast = _series(metrics, "sluice_request_duration_seconds", {"class": "fast"})
        slow = _series(metrics, "sluice_request_duration_seconds", {"class": "slow"})
        assert len(fast) == len(bounds) + 3  # the buckets, count, sum and created
        for key, value in fast.items():
            if not key.endswith("_created"):
                assert value == slow[key] or (math.isnan(value) and math.isnan(slow[key])), key


def test_counter_adds_to_the_series_of_its_labels() -> None:
    metrics = SluiceMetrics()
    inc = metrics.children.counter(metrics.requests.responses, "standard", "429")
    assert metrics.children.counter(metrics.requests.responses, "standard", "429") is inc
    inc(1)
    inc(1)
    metrics.children.child(metrics.requests.responses, "standard", "429").inc()
    metrics.children.counter(metrics.requests.responses, "standard", "200")(1)
    sample = metrics.registry.get_sample_value
    assert sample("sluice_responses_total", {"class": "standard", "status": "429"}) == 3.0
    assert sample("sluice_responses_total", {"class": "standard", "status": "200"}) == 1.0
