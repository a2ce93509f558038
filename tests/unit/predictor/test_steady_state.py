"""The expected-future-load term of the TPOT forecast: Little's law closed over the step model
(``steady_state``), the traffic mix it reads, and the blend toward it over a request's decode."""

from __future__ import annotations

import dataclasses
import math

import pytest

from predictor.forecast import forecast_request
from predictor.forecast_inputs import CandidateRequest, ReplicaState
from predictor.hardware import GPUS
from predictor.model import MODELS
from predictor.steady import SteadyState, TrafficMix, steady_state, steady_weight
from predictor.step_model import StepModel, StepParams, roofline_prior, unknown_step_model

#: 10 ms a step plus 0.5 ms per decoding sequence; prompts cost nothing (no token, KV or
#: attention cost): T = a / (1 - lambda c_d E[O - 1]) by hand.
DECODE_ONLY = StepModel(StepParams(0.01, 0.0, 0.0005, 0.0, 0.0, 0.0, knee_tokens=1e9))
#: The same plus 10 us per token through the GEMMs (no knee within reach).
WITH_TOKENS = StepModel(StepParams(0.01, 1e-5, 0.0005, 0.0, 0.0, 0.0, knee_tokens=1e9))
LIMITS = {"max_num_seqs": 1024, "max_num_batched_tokens": 8192, "kv_capacity_tokens": 1e9}


def test_steady_batch_is_littles_law_by_hand() -> None:
    # lambda = 10/s, 100 decode steps each, 0.5 ms per sequence: T = 0.01 / (1 - 10 x 0.0005 x 100)
    # = 20 ms, and the batch N = lambda E[O - 1] T = 10 x 100 x 0.02 = 20 sequences.
    mix = TrafficMix(10.0, (100.0,), 100.0, 200.0)
    steady = steady_state(mix, DECODE_ONLY, **LIMITS)  # type: ignore[arg-type]
    assert steady is not None
    assert steady.step_s == pytest.approx(0.02, rel=1e-4)
    assert steady.decode_seqs == pytest.approx(20.0, rel=1e-4)
    assert steady.prefill_share == 0.0


def test_arrivals_prefill_takes_its_share_of_the_time() -> None:
    # Each 1000-token prompt rides on decode steps at 10 us a token: 10 ms per arrival, 10 per s,
    # so prefill takes s = 0.1 of the time. T = (0.01 + (1e-5 + 5e-4) N) / (1 - 0.1) with
    # N = 1000 T: 0.9 T = 0.01 + 0.51 T, T = 0.01 / 0.39.
    mix = TrafficMix(10.0, (1000.0,), 100.0, 1100.0)
    steady = steady_state(mix, WITH_TOKENS, **LIMITS)  # type: ignore[arg-type]
    assert steady is not None
    assert steady.step_s == pytest.approx(0.01 / 0.39, rel=1e-4)
    assert steady.decode_seqs == pytest.approx(1000.0 * 0.01 / 0.39, rel=1e-4)
    assert steady.prefill_share == pytest.approx(0.1, rel=1e-4)


def test_a_prompt_longer_than_a_step_is_priced_in_chunks() -> None:
    # No decodes (one-token outputs): a 3000-token prompt at a 1024-token budget is 3 chunks,
    # 3 x 10 us x 1000 tokens = 30 ms of prefill per arrival whatever the chunking (no knee);
    # 5 arrivals a second: share 0.15, T = 0.01 / 0.85.
    mix = TrafficMix(5.0, (3000.0,), 0.0, 0.0)
    limits = {**LIMITS, "max_num_batched_tokens": 1024}
    steady = steady_state(mix, WITH_TOKENS, **limits)  # type: ignore[arg-type]
    assert steady is not None
    assert steady.decode_seqs == 0.0
    assert steady.prefill_share == pytest.approx(0.15, rel=1e-6)
    assert steady.step_s == pytest.approx(0.01 / 0.85, rel=1e-6)


@pytest.mark.parametrize(
    ("mix", "model", "limits"),
    [
        (TrafficMix(0.0, (100.0,), 100.0, 200.0), DECODE_ONLY, LIMITS),  # nothing arrives
        (TrafficMix(10.0, (), 100.0, 200.0), DECODE_ONLY, LIMITS),  # no sizes known
        (TrafficMix(10.0, (100.0,), 100.0, 200.0), unknown_step_model("x"), LIMITS),  # no model
        # lambda c_d E[O - 1] = 10 x 0.0005 x 200 = 1: the batch grows without bound.
        (TrafficMix(10.0, (100.0,), 200.0, 300.0), DECODE_ONLY, LIMITS),
        # The Little's-law batch (20) does not fit 16 sequences, or 16 x 200 KV tokens.
        (TrafficMix(10.0, (100.0,), 100.0, 200.0), DECODE_ONLY, {**LIMITS, "max_num_seqs": 16}),
        (TrafficMix(10.0, (100.0,), 100.0, 200.0), DECODE_ONLY, {**LIMITS, "kv_capacity_tokens": 3200.0}),
    ],
)
def test_no_steady_state_without_arrivals_a_model_or_room(
    mix: TrafficMix, model: StepModel, limits: dict[str, float]
) -> None:
    assert steady_state(mix, model, **limits) is None  # type: ignore[arg-type]


def test_steady_step_grows_with_the_arrival_rate() -> None:
    model = roofline_prior(MODELS["Llama-3-8B"], GPUS["H100-SXM"])
    prompts = (200.0, 600.0, 1500.0, 4000.0)
    steps = []
    for rate in (1.0, 5.0, 10.0):
        steady = steady_state(TrafficMix(rate, prompts, 250.0, 1500.0), model, **LIMITS)  # type: ignore[arg-type]
        assert steady is not None
        # The fixed point: the batch is Little's law at the step time found.
        assert steady.decode_seqs == pytest.approx(rate * 250.0 * steady.step_s, rel=1e-6)
        steps.append(steady.step_s)
    assert steps == sorted(steps)
    assert steps[0] < steps[-1]
    # 20/s: prefill and decodes would need more than all the time (overload: no steady state).
    assert steady_state(TrafficMix(20.0, prompts, 250.0, 1500.0), model, **LIMITS) is None  # type: ignore[arg-type]


def test_mix_from_requests_by_hand() -> None:
    # Decode steps 10 and 20 (mean 15); contexts over them 100 + 11/2 and 300 + 21/2, weighted by
    # the steps: (10 x 105.5 + 20 x 310.5) / 30.
    mix = TrafficMix.from_requests(4.0, [(300, 21), (100, 11)])
    assert mix.rate_per_s == 4.0
    assert mix.prompt_tokens == (100.0, 300.0)
    assert mix.decode_steps == pytest.approx(15.0)
    assert mix.decode_context == pytest.approx((10 * 105.5 + 20 * 310.5) / 30)
    many = TrafficMix.from_requests(1.0, [(p, 1) for p in range(1, 1001)])
    assert len(many.prompt_tokens) == 16  # quantiles of the sample
    assert many.prompt_tokens[0] < 100
    assert many.prompt_tokens[-1] > 900
    assert (many.decode_steps, many.decode_context) == (0.0, 0.0)
    assert TrafficMix.from_requests(1.0, []).prompt_tokens == ()


@pytest.mark.parametrize(
    ("steps", "relax", "expected"),
    [(0.0, 100.0, 1.0), (100.0, 100.0, 1.0 - math.exp(-1.0)), (300.0, 100.0, (1.0 - math.exp(-3.0)) / 3.0)],
)
def test_steady_weight_is_the_mean_of_an_exponential_relaxation(
    steps: float, relax: float, expected: float
) -> None:
    assert steady_weight(steps, relax) == pytest.approx(expected)


def _state(**overrides: object) -> ReplicaState:
    state = ReplicaState(
        num_running=40,
        num_waiting=0,
        decode_seqs=40,
        kv_tokens_in_use=40 * 800,
        kv_capacity_tokens=10**7,
        max_num_seqs=1024,
        max_num_batched_tokens=8192,
        max_model_len=10**7,
        mean_remaining_output_tokens=200.0,
        prefill_share=0.2,
    )
    return dataclasses.replace(state, **overrides)  # type: ignore[arg-type]


MODEL = roofline_prior(MODELS["Llama-3-8B"], GPUS["H100-SXM"])


def test_forecast_blends_toward_the_steady_state_over_its_decode() -> None:
    request = CandidateRequest(500, 1000, 201.0)
    today = forecast_request(request, _state(), MODEL)
    steady_s = 3.0 * today.tpot_s
    blended = forecast_request(request, _state(steady_step_s=steady_s), MODEL)
    # 200 decode steps against a batch that relaxes over 200 (its mean remaining output).
    w = 1.0 - math.exp(-1.0)
    assert blended.tpot_s == pytest.approx(w * today.tpot_s + (1.0 - w) * steady_s)
    # Nothing else moves.
    assert (blended.ttft_s, blended.inflicted_tpot_s) == (today.ttft_s, today.inflicted_tpot_s)


def test_one_token_output_and_no_steady_state_keep_todays_forecast() -> None:
    one = CandidateRequest(500, 1, 1.0)
    assert forecast_request(one, _state(steady_step_s=1.0), MODEL) == forecast_request(one, _state(), MODEL)
    long = CandidateRequest(500, 1000, 400.0)
    assert forecast_request(long, _state(steady_step_s=None), MODEL) == forecast_request(
        long, _state(), MODEL
    )


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_a_steady_step_that_is_not_a_positive_time_is_a_bad_state(bad: float) -> None:
    f = forecast_request(CandidateRequest(500, 1000, 100.0), _state(steady_step_s=bad), MODEL)
    assert (f.valid, f.reason) == (False, "bad_state")


def test_steady_state_is_a_plain_value() -> None:
    assert SteadyState(0.02, 20.0, 0.0) == SteadyState(0.02, 20.0, 0.0)
