"""The decision's cheap paths give the answers of the plain ones.

* the margins: the ``Forecast`` a decision carries (built from the predictor's numbers for the
  replica chosen only) is ``dataclasses.replace`` of ``forecast_request``'s with the five times
  multiplied, every other field as it was;
* the "is retrying hopeless?" memo (one forecast on an idle replica per request size, limits and
  step model) answers as a fresh admitter does, and a new step model is never answered from it.
"""

from __future__ import annotations

import dataclasses
import random

from gateway.admission import Admit, Reject, RejectReason, RetryAfterPolicy, SloAdmitter
from gateway.admission.config import AdmissionSettings
from predictor import Forecast, StepModel, forecast_request
from predictor.forecast import forecast_of, forecast_values
from tests.unit.admission.fleet import MODEL, SETTINGS, request, settings, state, view

#: The prior with its token and attention costs cut 50-fold: an idle replica serves a 100K-token
#: prompt within the TTFT target, a backlog of 900K tokens ahead still does not let it.
FAST = StepModel(
    dataclasses.replace(
        MODEL.params,
        per_token_s=MODEL.params.per_token_s / 50,
        per_compute_token_s=MODEL.params.per_compute_token_s / 50,
        per_attn_pair_s=MODEL.params.per_attn_pair_s / 50,
    )
)
BACKLOG = state(8, queued=[300_000] * 3)


def _admitter(config: AdmissionSettings = SETTINGS) -> SloAdmitter:
    return SloAdmitter(config, RetryAfterPolicy(config.retry_after, random.Random(1)))


def _scaled(f: Forecast, scale: float) -> Forecast:
    times = ("ttft_s", "tpot_s", "inflicted_tpot_s", "inflicted_stall_s", "admission_wait_s")
    return dataclasses.replace(f, **{name: getattr(f, name) * scale for name in times})


def test_the_scaled_forecast_is_replace_with_the_times_scaled() -> None:
    candidate = request(3000).candidate(BACKLOG.max_model_len)
    f = forecast_request(candidate, BACKLOG, MODEL)
    assert f.prefill_batch is not None
    assert forecast_of(forecast_values(candidate, BACKLOG, MODEL), 1.15) == _scaled(f, 1.15)
    assert forecast_of(forecast_values(candidate, BACKLOG, MODEL)) == f
    # forecast_values covers every field forecast_request sets (``overhead_s`` and ``made_at`` are
    # the caller's; the base times, correction factors, TTFT spread, cached tokens and wait share
    # are ``forecast_of``'s).
    assert len(dataclasses.fields(Forecast)) == 21


def test_the_decision_carries_the_forecast_with_its_margin() -> None:
    config = settings(forecast_margin=0.2)
    decision = _admitter(config).decide(request(500), [view("a", state(4))], 1000.0)
    assert isinstance(decision, Admit)
    raw = forecast_request(request(500).candidate(state(4).max_model_len), state(4), MODEL)
    assert decision.forecast == _scaled(raw, 1.2)


def _hopeless(decision: object) -> bool:
    assert isinstance(decision, Reject)
    assert decision.reason == RejectReason.SLO_UNATTAINABLE
    return decision.retry_after is None


def test_the_hopeless_memo_answers_as_a_fresh_admitter_does() -> None:
    kept = _admitter()
    cases = [
        (100_000, MODEL, True),  # not even an idle replica meets the TTFT target
        (100_000, FAST, False),  # same request and limits, another step model: not from the memo
        (100_000, MODEL, True),
        (20_000, FAST, False),
    ]
    for prompt, model, hopeless in cases:
        views = [view("a", BACKLOG, model=model)]
        assert _hopeless(kept.decide(request(prompt), views, 1000.0)) is hopeless
        assert _hopeless(_admitter().decide(request(prompt), views, 1000.0)) is hopeless
