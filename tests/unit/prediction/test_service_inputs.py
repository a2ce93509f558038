"""PredictionService's public inputs: ``replica_inputs`` and ``expected_output`` give what
``forecast`` uses, so a caller that builds a replica's state once and forecasts many requests on it
(admission) gets the same numbers as a ``forecast`` call per request."""

from __future__ import annotations

import dataclasses

from gateway.prediction import PredictionService, ReplicaFacts
from gateway.replicas.snapshot import InFlight
from predictor import CandidateRequest, ForecastReason, forecast_request

MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"
H100 = ReplicaFacts(
    gpu="H100-SXM", model=MODEL, max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=8192
)


def _service() -> PredictionService:
    svc = PredictionService(output_quantile=0.7)
    svc.set_replica("r0", H100)
    for n in (120, 300, 80, 450, 260, 700, 150, 90, 510, 330) * 5:
        svc.on_finished(
            replica="r0",
            model=MODEL,
            tenant=None,
            prompt_chars=4000,
            prompt_tokens=1000,
            completion_tokens=n,
            finished_at=9.95,
        )
    return svc


def _in_flight() -> list[InFlight]:
    decoding = [InFlight(f"d{i}", 700 + 50 * i, 20 + i, 1.0 + i, 512, 9.98) for i in range(12)]
    pending = [InFlight(f"p{i}", 1500, 0, 9.9 + 0.01 * i, None, None) for i in range(3)]
    return decoding + pending


def test_a_forecast_on_replica_inputs_is_the_services_forecast() -> None:
    svc = _service()
    cases = [(_in_flight(), 800, 256), (_in_flight(), 4000, 1024), (_in_flight(), 50, 8)]
    cases.append((_in_flight()[:3], 800, 256))  # a few requests: looked up one by one
    for in_flight, prompt, max_tokens in cases:
        expected = svc.forecast(
            "r0",
            model=MODEL,
            tenant=None,
            prompt_tokens=prompt,
            max_tokens=max_tokens,
            in_flight=in_flight,
            now=10.0,
        )
        model, state = svc.replica_inputs("r0", model=MODEL, tenant=None, in_flight=in_flight, now=10.0)
        tokens, quantile = svc.expected_output(MODEL, None, max_tokens)
        got = forecast_request(CandidateRequest(prompt, max_tokens, tokens, quantile), state, model)
        assert expected.valid
        assert got.valid
        # The service stamps when it was made; everything else is the same computation.
        assert dataclasses.replace(got, made_at=10.0) == expected
        assert state.num_running + state.num_waiting == len(in_flight)


def test_expected_output_is_the_learned_length_capped_and_names_its_quantile() -> None:
    svc = _service()
    uncapped, quantile = svc.expected_output(MODEL, None, None)
    capped, _ = svc.expected_output(MODEL, None, 100)
    assert quantile == svc.output_quantile == 0.7
    assert 150.0 < uncapped <= 700.0  # the 70th percentile of the lengths seen
    assert capped == 100.0


def test_an_unknown_replica_has_no_step_model_and_never_binding_limits() -> None:
    svc = _service()
    model, state = svc.replica_inputs("nowhere", model=MODEL, tenant=None, in_flight=_in_flight(), now=10.0)
    assert not model.valid
    assert state.kv_capacity_tokens >= 1 << 40
    assert state.max_model_len >= 1 << 30
    forecast = forecast_request(CandidateRequest(100, 10, 10.0), state, model)
    assert forecast.reason == ForecastReason.NO_STEP_MODEL


def test_the_estimates_follow_what_each_finished_request_teaches() -> None:
    svc = _service()
    before, _ = svc.expected_output(MODEL, None, None)
    chars_before = svc.estimate_prompt_tokens(MODEL, 8000)
    assert svc.expected_output(MODEL, None, None)[0] == before  # asked again, nothing new learned
    for _ in range(200):
        svc.on_finished(
            replica="r0",
            model=MODEL,
            tenant=None,
            prompt_chars=8000,
            prompt_tokens=4000,  # 2 characters per token, not the ~4 seen so far
            completion_tokens=3000,
        )
    after, _ = svc.expected_output(MODEL, None, None)
    assert after > 2 * before
    assert svc.estimate_prompt_tokens(MODEL, 8000) > 1.5 * chars_before
