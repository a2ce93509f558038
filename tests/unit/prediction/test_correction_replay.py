"""Forecasts corrected by measurement, in the replay's virtual time.

The shipped ``AdmissionEngine`` and ``PredictionService`` (``replay.policies.SluicePolicy``) in
front of the emulator's engine with the API server's own work modelled on a shared CPU
(``simulator.apiserver``: the CPU row of docs/emulator.md, scaled up), which the step model
fitted from ``/metrics`` never sees: without the correction the TTFT forecasts of admitted
requests run far low, as in front of a real vLLM on CPU. The error of a request is its forecast
TTFT (the engine's, as corrected at dispatch, before margins) over the TTFT the gateway measured
(dispatch to first token), less one: negative when the forecast was low.
"""

from __future__ import annotations

import functools
import random
import statistics
from dataclasses import dataclass
from typing import Final

import pytest

from bench.goodput.core import FACTS, PROFILE
from gateway.admission import AdmissionSettings
from gateway.admission.decision import Decision
from gateway.prediction.service_config import PredictionConfig
from predictor import Forecast
from predictor.correction import CorrectionConfig
from replay import FleetConfig, Outcome, Targets, TraceRequest, run_gateway_replay
from replay.policies import SluicePolicy
from replay.requests import GatewayRequest
from simulator.apiserver import ApiServerCosts
from simulator.profile import load_profile

TTFT_TARGET_S: Final = 1.0
TPOT_TARGET_S: Final = 0.05
SETTINGS: Final = AdmissionSettings.model_validate(
    {
        "classes": {"plain": {"ttft_target_s": TTFT_TARGET_S, "tpot_target_s": TPOT_TARGET_S}},
        "default_class": "plain",
    }
)
pytestmark = pytest.mark.slow

#: Requests that arrived before this are the warm-up (not scored).
WARM_UP_S: Final = 30.0
#: Bound on the signed median error (a fraction) once corrected.
WITHIN: Final = 0.15


def costs(scale: float) -> ApiServerCosts:
    """docs/emulator.md's measured vLLM-on-CPU costs times ``scale``, on the engine's CPU."""
    return ApiServerCosts(
        per_request_s=0.0045 * scale,
        per_prompt_token_s=3e-6 * scale,
        per_step_s=6e-4 * scale,
        per_output_token_s=7e-5 * scale,
        contention="shared",
    )


def trace(rate: float, duration_s: float, seed: int = 1) -> list[TraceRequest]:
    """Poisson arrivals at ``rate`` per second, prompts of 50 to 1,500 tokens, 16-96 out."""
    rng = random.Random(seed)
    t, out = 0.0, list[TraceRequest]()
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return out
        out.append(TraceRequest(t, rng.choice([50, 200, 600, 1500]), rng.randint(16, 96)))


class Recorder(SluicePolicy):
    """``SluicePolicy`` (``correction`` on or off) that keeps each admitted request's forecast and
    the replica's replica-wide TTFT factor after every scrape, and at ``change_at`` (virtual
    seconds) sets the API server's costs to ``then``."""

    def __init__(
        self, correction: bool, change_at: float | None = None, then: ApiServerCosts | None = None
    ) -> None:
        super().__init__(
            SETTINGS,
            request_class="plain",
            prediction=PredictionConfig(correction=CorrectionConfig(enabled=correction)),
        )
        self.forecasts: dict[int, Forecast] = {}
        self.factors: list[tuple[float, float]] = []
        self.change_at, self.then = change_at, then

    def on_decision(self, request: GatewayRequest, decision: Decision, now: float) -> None:
        if decision.admits and decision.forecast is not None:
            self.forecasts[request.index] = decision.forecast

    def on_arrival(self, request: GatewayRequest, now: float) -> None:
        if self.change_at is not None and now >= self.change_at and self.then is not None:
            # The emulated API server's costs change under the running engine (what the
            # predictor cannot see: it has to learn it from what it measures).
            api = self.fleet.replicas[0].inner.engine._api
            assert api is not None
            api.costs, self.change_at = self.then, None
        super().on_arrival(request, now)

    def on_snapshot(self, replica: str, now: float) -> None:
        super().on_snapshot(replica, now)
        self.factors.append((now, self.service.corrections.overall_factor(replica, "ttft", now)))


@dataclass(frozen=True)
class Run:
    outcomes: tuple[Outcome, ...]
    forecasts: dict[int, Forecast]
    factors: list[tuple[float, float]]


def _replay(policy: Recorder, requests: list[TraceRequest], start: ApiServerCosts) -> Run:
    profile = load_profile(PROFILE).with_api_server(start)
    config = FleetConfig(profile, FACTS, replicas=1, max_tokens=128, tenants=1, jitter=0.0, seed=1)
    result = run_gateway_replay(requests, config, policy, targets=Targets(TTFT_TARGET_S, TPOT_TARGET_S))
    return Run(tuple(result.outcomes), policy.forecasts, policy.factors)


@functools.cache
def steady(correction: bool) -> Run:
    """90 s at 6 requests a second, API-server costs four times the measured CPU's."""
    return _replay(Recorder(correction), trace(6.0, 90.0), costs(4.0))


#: The step change: at ``CHANGE_S`` the API server's work grows sixfold.
CHANGE_S: Final = 60.0


@functools.cache
def step() -> Run:
    return _replay(Recorder(True, CHANGE_S, costs(6.0)), trace(12.0, 180.0), costs(1.0))


def errors(run: Run, since: float, until: float) -> list[float]:
    """Signed relative TTFT errors of the admitted requests that arrived in [since, until)."""
    out = []
    for o in run.outcomes:
        f = run.forecasts.get(o.index)
        if f is None or o.first_token_s is None or o.dispatched_s is None or not since <= o.arrival_s < until:
            continue
        out.append(f.base_ttft_s * f.ttft_factor / (o.first_token_s - o.dispatched_s) - 1.0)
    return out


def test_the_correction_removes_the_api_servers_bias() -> None:
    without = statistics.median(errors(steady(False), WARM_UP_S, float("inf")))
    corrected = errors(steady(True), WARM_UP_S, float("inf"))
    assert len(corrected) >= 300
    assert without <= -0.30, without  # the setting: forecasts run at least 30 % low
    assert abs(statistics.median(corrected)) <= WITHIN, statistics.median(corrected)


def test_a_step_change_is_followed_within_a_minute_without_oscillating() -> None:
    run = step()
    before = errors(run, WARM_UP_S, CHANGE_S)
    assert abs(statistics.median(before)) <= WITHIN
    # Right after the change the forecasts are far low; within a minute they are not.
    assert statistics.median(errors(run, CHANGE_S, CHANGE_S + 10.0)) < -0.3
    for lo in range(int(CHANGE_S) + 40, 180, 20):
        window = errors(run, lo, lo + 20.0)
        assert len(window) >= 50
        assert abs(statistics.median(window)) <= WITHIN, (lo, statistics.median(window))
    # The factor rises to the new level and settles: no swing beyond it and back below.
    after = [f for t, f in run.factors if t >= CHANGE_S]
    settled = statistics.median(f for t, f in run.factors if t >= 150.0)
    assert settled >= 2.0 * statistics.median(f for t, f in run.factors if WARM_UP_S <= t < CHANGE_S)
    assert max(after) <= 1.5 * settled
    late = [f for t, f in run.factors if t >= CHANGE_S + 60.0]
    assert min(late) >= 0.75 * settled
