"""TGI's measured step times calibrate the step model directly.

TGI times every forward pass by kind (``tgi_batch_forward_duration{method="decode"|"prefill"}``)
and reports its running batch (``tgi_batch_current_size``): each scrape interval is then a measured
(batch -> step time) pair, no steps/s or ITL inference needed. These tests hand-build TGI-style
snapshots from a known step model and check the fit recovers it from them alone.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from gateway.prediction import PredictionService, ReplicaFacts
from gateway.prediction.state import GaugeMeans, engine_kv_tokens, measured_steps
from gateway.replicas.snapshot import InFlight, ReplicaSnapshot
from predictor import ModelSource, ObservationSource, StepBatch, StepModel, StepParams

#: The "engine" the snapshots come from: 6 ms per step, flat to 256 tokens, 60 us per decoding
#: sequence, 2 ns per KV token read, 30 us per token past the knee.
TRUE = StepModel(
    StepParams(
        base_s=0.006,
        per_token_s=2e-6,
        per_decode_seq_s=60e-6,
        per_compute_token_s=30e-6,
        per_kv_token_s=2e-9,
        per_attn_pair_s=1e-10,
        knee_tokens=256.0,
        attn_pair_tokens=0.0,
    ),
    ModelSource.FITTED,
)
UNKNOWN_HARDWARE = ReplicaFacts(max_num_seqs=128, max_num_batched_tokens=4096, max_model_len=4096)
INTERVAL_S = 1.0


def tgi_interval(
    at: float, batch: int, context: int, *, prefill_tokens: int = 0, prompt: int = 1000, jitter: float = 0.0
) -> ReplicaSnapshot:
    """One scrape interval of a TGI replica running ``batch`` sequences of ``context`` tokens,
    with a prefill step of ``prefill_tokens`` (``prompt``-token requests) when > 0."""
    decode = TRUE.step_time(StepBatch(0.0, batch, batch * context, 0.0)) * (1.0 + jitter)
    decode_steps = INTERVAL_S / decode
    steps = decode_steps
    prefill_s = None
    if prefill_tokens:
        shape = StepBatch(prefill_tokens, batch, batch * context, prefill_tokens * prompt / 2.0)
        prefill_s = TRUE.step_time(shape) * (1.0 + jitter)
        steps += 1.0
    return ReplicaSnapshot(
        name="tgi",
        taken_at=at,
        metrics_at=at,
        dialect="tgi",
        window_s=INTERVAL_S,
        num_running=batch,
        num_waiting=0,
        # TGI's "usage" is the reservation: input + max_new_tokens, here twice what is read.
        kv_cache_usage=min(1.0, 2.0 * batch * context / 100_000),
        kv_capacity_tokens=100_000,
        steps_per_s=steps / INTERVAL_S,
        decode_steps_per_s=decode_steps / INTERVAL_S,
        decode_step_time_mean_s=decode,
        prefill_step_time_mean_s=prefill_s,
        step_time_mean_s=decode,
        itl_mean_s=decode,
        prompt_tokens_per_s=prefill_tokens / INTERVAL_S,
        generation_tokens_per_s=batch * steps / INTERVAL_S,
        mean_prompt_tokens_per_request=float(prompt) if prefill_tokens else None,
        in_flight=tuple(InFlight(f"q{i}", context - 50, 50, at - 5.0, 400) for i in range(batch)),
    )


def with_interval(snapshot: ReplicaSnapshot) -> ReplicaSnapshot:
    """The snapshot as the scraper publishes it: its newest interval attached."""
    return dataclasses.replace(snapshot, last_interval=dataclasses.replace(snapshot, in_flight=()))


def test_a_tgi_interval_gives_a_decode_and_a_prefill_step() -> None:
    s = tgi_interval(10.0, 8, 1200, prefill_tokens=900, prompt=900)
    gauges = GaugeMeans(running=8.0, waiting=0.0, kv_tokens=engine_kv_tokens(s), busy=True)

    decode, prefill = measured_steps(s, gauges)

    assert decode.kind == "decode"
    assert decode.batch == StepBatch(0.0, 8.0, 8 * 1200, 0.0)
    assert decode.step_s == pytest.approx(s.decode_step_time_mean_s)
    assert prefill.kind == "prefill"
    assert prefill.batch.prefill_tokens == pytest.approx(900.0)
    assert prefill.batch.decode_seqs == 8.0
    assert prefill.batch.prefill_attn_pairs == pytest.approx(900 * 900 / 2)
    assert prefill.step_s == pytest.approx(s.prefill_step_time_mean_s)


def test_tgi_kv_is_read_from_the_gateways_requests_not_the_reservation() -> None:
    s = tgi_interval(10.0, 4, 1000)
    assert engine_kv_tokens(s) == pytest.approx(4 * 1000)
    # The reservation gauge says twice that; other engines' usage gauges are what they say.
    vllm = dataclasses.replace(s, dialect="vllm")
    assert engine_kv_tokens(vllm) == pytest.approx(8000)


@pytest.mark.parametrize(
    "s",
    [
        pytest.param(dataclasses.replace(tgi_interval(1.0, 4, 500), stale=True), id="stale"),
        pytest.param(dataclasses.replace(tgi_interval(1.0, 4, 500), window_s=0.0), id="no-window"),
        pytest.param(
            dataclasses.replace(tgi_interval(1.0, 4, 500), decode_step_time_mean_s=None, dialect="vllm"),
            id="vllm-no-step-times",
        ),
    ],
)
def test_no_measured_steps_without_a_window_of_step_times(s: ReplicaSnapshot) -> None:
    assert measured_steps(s, GaugeMeans(4.0, 0.0, 2000.0, True)) == []


def test_a_prefill_without_counted_prompt_tokens_is_skipped() -> None:
    s = dataclasses.replace(tgi_interval(1.0, 4, 500, prefill_tokens=600), prompt_tokens_per_s=0.0)
    kinds = [m.kind for m in measured_steps(s, GaugeMeans(4.0, 0.0, 2000.0, True))]
    assert kinds == ["decode"]


def test_the_fit_recovers_the_step_time_from_tgi_observations_alone() -> None:
    """Unknown hardware (no prior): only the TGI intervals teach the model."""
    svc = PredictionService()
    svc.set_replica("tgi", UNKNOWN_HARDWARE)
    rng = random.Random(7)
    for i in range(80):
        batch = rng.randint(1, 48)
        context = rng.randint(200, 3000)
        prefill = rng.choice([0, 0, rng.randint(100, 2000)])
        snap = tgi_interval(
            float(i + 1),
            batch,
            context,
            prefill_tokens=prefill,
            prompt=max(prefill, 1),
            jitter=rng.gauss(0, 0.02),
        )
        svc.on_snapshot(with_interval(snap))

    report = svc.report("tgi")
    model = svc.step_model("tgi")
    assert report is not None
    assert model is not None
    assert model.valid
    assert model.source == ModelSource.FITTED
    assert report.observations_total > 80  # decode steps plus the prefill steps
    assert report.mdape is not None
    assert report.mdape < 0.1
    for batch, context in ((1, 500), (8, 1000), (32, 2000), (64, 1500)):
        shape = StepBatch(0.0, batch, batch * context, 0.0)
        assert model.step_time(shape) == pytest.approx(TRUE.step_time(shape), rel=0.08), (batch, context)
    mixed = StepBatch(1500, 16, 16 * 1000, 1500 * 1500 / 2)
    assert model.step_time(mixed) == pytest.approx(TRUE.step_time(mixed), rel=0.15)


def test_tgi_observations_are_measured_steps_not_windows() -> None:
    svc = PredictionService()
    svc.set_replica("tgi", UNKNOWN_HARDWARE)
    svc.on_snapshot(with_interval(tgi_interval(1.0, 8, 800)))
    obs = svc.describe()["replicas"]
    assert isinstance(obs, dict)
    last = obs["tgi"]["last_observation"]
    assert last["source"] == str(ObservationSource.STEP)
    assert last["step_s"] == pytest.approx(TRUE.step_time(StepBatch(0.0, 8, 8 * 800, 0.0)))
