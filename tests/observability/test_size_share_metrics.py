"""Admission by prompt-size quartile, exported per class: decided, admitted share, protected."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from gateway.admission.config import AdmissionSettings
from gateway.admission.size_share import SizeShares
from gateway.observability.metrics import SluiceMetrics


def _samples(metrics: SluiceMetrics) -> dict[str, float]:
    """``name{labels}`` -> value of every sample line."""
    text = generate_latest(metrics.registry).decode()
    lines = [line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#")]
    return {name: float(value) for name, value in lines}


def test_no_samples_until_tracked() -> None:
    assert not any(k.startswith("sluice_admission_prompt_quartile") for k in _samples(SluiceMetrics()))


def test_quartiles_per_class_with_the_starved_one_protected() -> None:
    metrics = SluiceMetrics()
    metrics.set_known_labels(classes=["interactive"])
    settings = AdmissionSettings()
    by_route = [SizeShares(settings), SizeShares(settings)]  # two models: summed per class
    for shares in by_route:
        for i in range(100):
            size = (100, 500, 1000, 3000)[i % 4]
            shares.record("interactive", size, size != 3000 or i % 8 == 3, i * 0.01)
        shares.record("unlisted", 100, True, 1.0)
    metrics.track_size_shares(lambda: [row for s in by_route for row in s.rows(2.0)])
    got = _samples(metrics)

    def at(q: int, cls: str = "interactive") -> str:
        return f'{{class="{cls}",quartile="{q}"}}'

    assert [got[f"sluice_admission_prompt_quartile_decided{at(q)}"] for q in (1, 2, 3, 4)] == [50.0] * 4
    ratios = [got[f"sluice_admission_prompt_quartile_admitted_ratio{at(q)}"] for q in (1, 2, 3, 4)]
    assert ratios == pytest.approx([1.0, 1.0, 1.0, 0.52])
    assert [got[f"sluice_admission_prompt_quartile_protected{at(q)}"] for q in (1, 2, 3, 4)] == [0, 0, 0, 0]
    # A class not configured is exported as ``other``; an empty quartile has no ratio.
    assert got[f"sluice_admission_prompt_quartile_decided{at(1, 'other')}"] == 2.0
    assert f"sluice_admission_prompt_quartile_admitted_ratio{at(4, 'other')}" not in got


def test_a_quartile_below_its_share_is_flagged_protected() -> None:
    metrics = SluiceMetrics()
    metrics.set_known_labels(classes=["interactive"])
    shares = SizeShares(AdmissionSettings())
    for i in range(100):
        size = (100, 500, 1000, 3000)[i % 4]
        shares.record("interactive", size, size != 3000, i * 0.01)
    metrics.track_size_shares(lambda: shares.rows(2.0))
    got = _samples(metrics)
    assert got['sluice_admission_prompt_quartile_protected{class="interactive",quartile="4"}'] == 1.0
    assert got['sluice_admission_prompt_quartile_admitted_ratio{class="interactive",quartile="4"}'] == 0.0
