"""docs/metrics.md is the reference ``gateway.observability.metrics.reference`` renders from the
metrics Sluice registers, and what it says a scrape shows is what a scrape shows."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.metrics import MetricWrapperBase

from gateway.observability.metrics import SluiceMetrics
from gateway.observability.metrics.reference import DOMAINS, families, render

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "metrics.md"
REGENERATE = "python -m gateway.observability.metrics.reference > docs/metrics.md"


def test_the_committed_reference_is_current() -> None:
    assert DOC.read_text(encoding="utf-8") == render(), f"docs/metrics.md is out of date: run `{REGENERATE}`"


def test_every_registered_family_has_one_row_under_its_domain() -> None:
    found = families()
    names = [f.name for f in found]
    assert len(names) == len(set(names)) > 60
    text = render()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert len(rows) == len(found)
    for family in found:
        assert family.domain in DOMAINS
        (row,) = [r for r in rows if r.startswith(f"| `{family.scraped[0]}`")]
        assert f"| {family.kind} |" in row
    # Known ones, in their domain, with their labels.
    by_name = {f.name: f for f in found}
    assert by_name["sluice_requests"].domain == "requests"
    assert by_name["sluice_requests"].labels == ("class", "tenant", "decision", "reason")
    assert by_name["sluice_replica_healthy"].domain == "replicas"
    assert by_name["sluice_model_token_weight"].labels == ("model", "token")
    assert by_name["sluice_redis_degraded"].domain == "tenants"


def test_what_the_reference_calls_scraped_is_what_a_scrape_shows() -> None:
    """Give every labelled metric one child (histograms one observation), scrape, and compare the
    sample names with the reference's; ``_created`` is prometheus_client's own."""
    metrics = SluiceMetrics()
    for collector in list(metrics.registry._collector_to_names):
        if not isinstance(collector, MetricWrapperBase):
            continue
        child = (
            collector.labels(*("x" for _ in collector._labelnames)) if collector._labelnames else collector
        )
        if hasattr(child, "observe"):
            child.observe(0.5)
        elif hasattr(child, "set"):  # a gauge (some, multiprocess_mode mostrecent, refuse inc)
            child.set(1)
        elif hasattr(child, "inc"):
            child.inc()
    body, _ = metrics.exposition()
    scraped = {
        m.group(1)
        for line in body.decode().splitlines()
        if (m := re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{| )", line))
    }
    documented = {name for f in families(metrics) for name in f.scraped}
    assert scraped - documented == {n for n in scraped if n.endswith("_created")}
    histograms = [f for f in families(metrics) if f.kind == "histogram"]
    assert histograms
    assert all(set(f.scraped) <= scraped for f in histograms)
    assert "sluice_prediction_error_ratio_sum" not in scraped | documented  # negative buckets
