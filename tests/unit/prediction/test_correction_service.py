"""The correction through ``PredictionService`` and ``SluiceMetrics``: learned in ``on_finished``
against the uncorrected forecast, read by ``correction``, shown by ``describe`` and /metrics."""

from __future__ import annotations

import dataclasses

from gateway.config.settings import Settings
from gateway.config.store import SettingsStore
from gateway.observability.metrics import SluiceMetrics
from gateway.prediction import ReplicaFacts
from gateway.prediction.live import follow_correction
from gateway.prediction.service import PredictionService
from gateway.prediction.service_config import PredictionConfig
from gateway.replicas.config import ReplicaSettings
from gateway.replicas.registry import ReplicaRegistry
from predictor import Forecast, StepBatch
from predictor.correction import CorrectionConfig

FACTS = ReplicaFacts(
    gpu="H100-SXM",
    model="meta-llama/Meta-Llama-3-8B-Instruct",
    max_num_seqs=256,
    max_num_batched_tokens=8192,
    max_model_len=8192,
)
MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"


def forecast(ttft_factor: float = 1.0) -> Forecast:
    """What admission dispatched with: 50 ms TTFT and 10 ms TPOT from the step model, the margin
    (1.15) and ``ttft_factor`` applied, on an idle engine."""
    return Forecast(
        0.05 * 1.15 * ttft_factor,
        0.01 * 1.15,
        0.0,
        True,
        None,
        32.0,
        0.5,
        prefill_steps=1,
        prefill_batch=StepBatch(100.0, 0.0, 0.0),
        base_ttft_s=0.05,
        base_tpot_s=0.01,
        ttft_factor=ttft_factor,
    )


def finish(
    svc: PredictionService, at: float, f: Forecast, ttft_s: float = 0.1, tpot_s: float = 0.015
) -> None:
    """A request measured at ``ttft_s`` and ``tpot_s``: by default twice the forecast TTFT and 1.5
    times its TPOT."""
    svc.on_finished(
        replica="r0",
        model=MODEL,
        tenant=None,
        prompt_chars=None,
        prompt_tokens=100,
        completion_tokens=32,
        finished_at=at,
        forecast=f,
        ttft_s=ttft_s,
        relayed_ttft_s=ttft_s,
        relayed_tpot_s=tpot_s,
    )


def learned(config: PredictionConfig | None = None) -> PredictionService:
    svc = PredictionService(config=config)
    svc.set_replica("r0", FACTS)
    for i in range(200):
        finish(svc, 0.1 * i, forecast())
    return svc


def test_the_service_learns_measured_over_uncorrected_forecast() -> None:
    svc = learned()
    ttft, tpot = svc.correction("r0", 20.0).factors(100, 0)
    assert 1.95 < ttft <= 2.0
    assert 1.45 < tpot <= 1.5
    # A forecast already corrected teaches the same ratio (learned against its base), and its
    # residual after the correction is 0.
    for i in range(200):
        finish(svc, 100.0 + 0.1 * i, forecast(ttft_factor=2.0))
    assert 1.95 < svc.correction("r0", 120.0).factors(100, 0)[0] <= 2.0
    shown = svc.describe(120.0)["replicas"]["r0"]["correction"]  # type: ignore[index]
    assert shown["ttft"]["residuals"]["after_median"] == 0.0
    assert shown["ttft"]["residuals"]["before_median"] == 1.0
    assert shown["ttft"]["regimes"][0]["regime"] == "prompt<256,idle"


def test_the_ttft_is_learned_against_the_engine_and_the_overhead_together() -> None:
    # Dispatched with 30 ms of overhead on top of the engine's 50 ms: a measured 40 ms is half of
    # what was forecast. Learned against the engine's part alone less the overhead, it would be
    # 10 / 50 and clamped at the floor.
    svc = PredictionService()
    svc.set_replica("r0", FACTS)
    f = forecast()
    with_overhead = f.with_overhead(f.ttft_s + 0.03, 0.03, 0.0)
    for i in range(200):
        finish(svc, 0.1 * i, with_overhead, ttft_s=0.04)
    assert abs(svc.correction("r0", 20.0).factors(100, 0)[0] - 0.5) < 0.01


def test_off_learns_nothing_and_a_new_configuration_forgets() -> None:
    off = learned(PredictionConfig(correction=CorrectionConfig(enabled=False)))
    assert off.correction("r0", 20.0).factors(100, 0) == (1.0, 1.0)
    svc = learned()
    svc.configure_correction(CorrectionConfig(enabled=False))
    assert svc.correction("r0", 20.0).factors(100, 0) == (1.0, 1.0)
    svc.configure_correction(CorrectionConfig())
    assert svc.correction("r0", 20.0).factors(100, 0)[0] > 1.9
    svc.set_replica("r0", dataclasses.replace(FACTS, max_num_seqs=16))
    assert svc.correction("r0", 20.0).factors(100, 0) == (1.0, 1.0)


def test_metrics_export_the_factor_and_the_residuals() -> None:
    svc = learned()
    now = [20.0]
    metrics = SluiceMetrics(clock=lambda: now[0])
    store = SettingsStore(Settings(replicas=[ReplicaSettings(name="r0", url="http://127.0.0.1:1")]))
    metrics.track_replicas(ReplicaRegistry(store))
    metrics.track_corrections(svc.corrections.state)
    factor = metrics.registry.get_sample_value(
        "sluice_forecast_correction_factor", {"replica": "r0", "kind": "ttft", "regime": "all"}
    )
    assert factor is not None
    assert 1.95 < factor <= 2.0
    residual = metrics.registry.get_sample_value(
        "sluice_forecast_residual_ratio",
        {"replica": "r0", "kind": "tpot", "forecast": "uncorrected", "stat": "median"},
    )
    assert residual is not None
    assert abs(residual - 0.5) < 1e-9
    samples = metrics.registry.get_sample_value(
        "sluice_forecast_correction_samples_total", {"replica": "r0", "kind": "ttft"}
    )
    assert samples == 200.0
    regime = svc.corrections.state("r0", 20.0).ttft.regimes[0]
    spread = metrics.registry.get_sample_value(
        "sluice_forecast_correction_spread", {"replica": "r0", "regime": regime.regime, "quantile": "0.95"}
    )
    assert spread is not None
    assert spread == regime.upper[2] >= 1.0


def test_the_yaml_knobs_follow_reloads() -> None:
    svc = learned()
    replicas = [{"name": "r0", "url": "http://127.0.0.1:1"}]
    off = Settings.model_validate({"replicas": replicas, "prediction": {"correction": {"enabled": False}}})
    store = SettingsStore(off)
    follow_correction(svc, store)
    assert svc.correction("r0", 20.0).factors(100, 0) == (1.0, 1.0)
    slower = {"correction": {"half_life_s": 30.0}}
    store.swap(Settings.model_validate({"replicas": replicas, "prediction": slower}))
    assert svc.corrections.config.half_life_s == 30.0
    assert svc.correction("r0", 20.0).factors(100, 0)[0] > 1.9
