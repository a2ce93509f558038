"""The attainment controller's gauges: margin, attainment, samples and target per class and replica."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from gateway.admission.attainment import AttainmentController
from gateway.admission.config import AdmissionSettings
from gateway.observability.metrics import SluiceMetrics


def _exposition(metrics: SluiceMetrics) -> str:
    return generate_latest(metrics.registry).decode()


def _samples(metrics: SluiceMetrics) -> dict[str, float]:
    """``name{labels}`` -> value of every sample line."""
    lines = [line.rsplit(" ", 1) for line in _exposition(metrics).splitlines() if not line.startswith("#")]
    return {name: float(value) for name, value in lines}


def test_no_samples_until_tracked() -> None:
    assert "sluice_admission_margin{" not in _exposition(SluiceMetrics())


def test_margin_attainment_samples_and_target_per_class_and_replica() -> None:
    metrics = SluiceMetrics()
    metrics.set_known_labels(classes=["interactive"])
    ctl = AttainmentController(AdmissionSettings())
    for i in range(20):  # half missed: the margin tightens by a full step (0.25)
        ctl.observe("interactive", "r0", i - 1.0, float(i), i % 2 == 0)
    ctl.observe("unlisted", "r0", 0.0, 1.0, True)
    metrics.track_attainment(lambda: list(ctl.states(20.0)))
    got = _samples(metrics)
    at = '{class="interactive",replica="r0"}'
    assert got[f"sluice_admission_margin{at}"] == pytest.approx(1.15 * 1.25 - 1)
    assert got[f"sluice_admission_attainment_ratio{at}"] == 0.5
    assert got[f"sluice_admission_attainment_samples{at}"] == 20.0
    assert got['sluice_admission_attainment_target_ratio{class="interactive"}'] == 0.95
    # A class not configured is exported as ``other``.
    assert got['sluice_admission_margin{class="other",replica="r0"}'] == pytest.approx(0.15)
