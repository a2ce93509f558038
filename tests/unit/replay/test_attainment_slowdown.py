"""The attainment controller in virtual time: the emulator slowed 2x mid-run.

The replay (``replay.run_gateway_replay``) runs the shipped ``AdmissionEngine`` and
``PredictionService`` in front of one emulated H100 serving Llama-3-8B. Mid-run every step of
the emulator's engine takes twice as long (its cost model is swapped for one twice as slow, the
only hook the test needs; the predictor never sees the emulator). One class, targets only.

*Blind*: the step model is fitted once and the measured correction is off, so the forecasts
stay those of the old speed: only the controller can hold attainment. *Full*: everything on,
as shipped (the fit and the correction learn the new speed; the controller must not get in
their way). *Light*: a load the slowed engine still serves far inside the targets.
"""

from __future__ import annotations

import functools
import itertools
import random
from dataclasses import dataclass
from typing import Final

from bench.goodput.core import FACTS, PROFILE
from gateway.admission import AdmissionSettings
from gateway.prediction import PredictionConfig
from predictor.correction import CorrectionConfig
from replay import FleetConfig, Outcome, Targets, TraceRequest, run_gateway_replay
from replay.loop import Fleet
from replay.policies import SluicePolicy
from replay.requests import GatewayRequest
from simulator.costmodel import CostModel, StepShape
from simulator.profile import load_profile

TARGETS: Final = Targets(1.0, 0.05)
CLASS: Final = "plain"
#: The replica's name in the replay's fleet.
REPLICA: Final = "r0"
END_S: Final = 90.0
SLOW_AT_S: Final = 30.0
#: Attainment is judged over the requests arriving this long after the slowdown, to the end.
RECOVERY_S: Final = 20.0


class _TwiceAsSlow(CostModel):
    """The emulator's cost model with every step twice as long."""

    def step_time_s(self, shape: StepShape) -> float:
        return 2.0 * super().step_time_s(shape)


class _Slowing(SluicePolicy):
    """Sluice, slowing every engine of the fleet at ``slow_at`` (virtual seconds) and noting its
    class's margin on the replica at every arrival."""

    def __init__(
        self, settings: AdmissionSettings, slow_at: float, prediction: PredictionConfig | None
    ) -> None:
        super().__init__(settings, request_class=CLASS, prediction=prediction)
        self.slow_at = slow_at
        self.margins: list[tuple[float, float]] = []
        self._engines: Fleet | None = None

    def bind(self, fleet: Fleet) -> None:
        super().bind(fleet)
        self._engines = fleet

    def on_arrival(self, request: GatewayRequest, now: float) -> None:
        if now >= self.slow_at and self._engines is not None:
            for handle in self._engines.replicas:
                engine = handle.inner.engine
                engine.cost_model = _TwiceAsSlow(engine.profile)
            self._engines = None
        self.margins.append((now, self.engine.attainment.margin(CLASS, REPLICA, now)))
        super().on_arrival(request, now)


@dataclass(frozen=True)
class Run:
    outcomes: tuple[Outcome, ...]
    margins: tuple[tuple[float, float], ...]


def _settings(controller: bool) -> AdmissionSettings:
    return AdmissionSettings.model_validate(
        {
            "classes": {
                CLASS: {
                    "ttft_target_s": TARGETS.ttft_s,
                    "tpot_target_s": TARGETS.tpot_s,
                    "max_queue_wait_s": TARGETS.ttft_s,
                }
            },
            "default_class": CLASS,
            "attainment": {"enabled": controller},
        }
    )


@functools.cache
def replay(rate: float, *, controller: bool, blind: bool, slow_at: float = SLOW_AT_S) -> Run:
    """Poisson arrivals at ``rate`` per second for ``END_S`` seconds (prompts 100-1000 tokens,
    outputs 20-120), the engine slowed 2x at ``slow_at`` (cached: the tests only read it)."""
    rng = random.Random(3)
    trace, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= END_S:
            break
        trace.append(TraceRequest(t, rng.randint(100, 1000), rng.randint(20, 120)))
    config = FleetConfig(load_profile(PROFILE), FACTS, replicas=1, max_tokens=120, tenants=1, seed=1)
    prediction = None
    if blind:
        prediction = PredictionConfig(refit_interval_s=1e9, correction=CorrectionConfig(enabled=False))
    policy = _Slowing(_settings(controller), slow_at, prediction)
    result = run_gateway_replay(trace, config, policy, targets=TARGETS)
    return Run(result.outcomes, tuple(policy.margins))


def attainment(run: Run, start: float, end: float = END_S) -> float:
    """Share of the requests admitted (and finished) that arrived in [start, end) meeting both targets."""
    served = [o for o in run.outcomes if start <= o.arrival_s < end and o.served and o.finished_s is not None]
    assert len(served) >= 100
    return sum(o.met(TARGETS) for o in served) / len(served)


def turns(margins: tuple[tuple[float, float], ...]) -> int:
    """How often the margin's moves change direction."""
    moves = [b - a for (_, a), (_, b) in itertools.pairwise(margins) if b != a]
    return sum(1 for x, y in itertools.pairwise(moves) if (x > 0) != (y > 0))


def test_blind_forecasts_the_controller_brings_attainment_back() -> None:
    held = replay(30.0, controller=True, blind=True)
    free = replay(30.0, controller=False, blind=True)
    assert attainment(held, 0.0, SLOW_AT_S) >= 0.95
    assert attainment(free, SLOW_AT_S + RECOVERY_S) < 0.95  # the forecasts alone miss
    assert attainment(held, SLOW_AT_S + RECOVERY_S) >= 0.95


def test_blind_forecasts_the_margin_settles_without_oscillating() -> None:
    run = replay(30.0, controller=True, blind=True)
    margins = run.margins
    base = _settings(True).forecast_margin
    assert all(m == base for t, m in margins if t < SLOW_AT_S)
    after = [m for t, m in margins if t >= SLOW_AT_S]
    peak, final = max(after), after[-1]
    assert final > base  # it tightened to meet the slower engine
    assert 1.0 + peak <= 1.5 * (1.0 + final)  # overshoot bounded
    assert turns(margins) <= 4
    late = [m for t, m in margins if t >= END_S - 20.0]
    assert (1.0 + max(late)) / (1.0 + min(late)) <= 1.3  # late on, about one step of swing at most


def test_full_prediction_attainment_holds_through_the_slowdown() -> None:
    run = replay(20.0, controller=True, blind=False)
    assert attainment(run, 0.0, SLOW_AT_S) >= 0.95
    assert attainment(run, SLOW_AT_S + RECOVERY_S) >= 0.95
    assert turns(run.margins) <= 4


def test_light_load_the_controller_neither_tightens_nor_refuses() -> None:
    run = replay(12.0, controller=True, blind=True)
    base = _settings(True).forecast_margin
    assert max(m for _, m in run.margins) <= base
    assert not [o.index for o in run.outcomes if o.rejected]
    assert attainment(run, 0.0) >= 0.95
