"""The attainment controller: windows, confidence, steps, anti-windup, decay, reload (pure)."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from gateway.admission.attainment import AttainmentController, met_targets, wilson_interval
from gateway.admission.config import AdmissionSettings

BASE = 0.15


def settings(**attainment: object) -> AdmissionSettings:
    return AdmissionSettings.model_validate({"attainment": attainment})


def feed(ctl: AttainmentController, t: float, met: list[bool], *, cls: str = "interactive") -> float:
    """Outcomes one per 0.1 s from ``t``, each admitted 1 s before it ends; the last instant."""
    for m in met:
        t += 0.1
        ctl.observe(cls, "a", t - 1.0, t, m)
    return t


@pytest.mark.parametrize(
    ("met", "samples", "lower", "upper"),
    [
        pytest.param(0, 0, 0.0, 1.0, id="no samples"),
        pytest.param(20, 20, 20 / (20 + 1.2815515655446004**2), 1.0, id="all met"),
        pytest.param(10, 20, 0.3623, 0.6377, id="half"),
    ],
)
def test_wilson_interval(met: int, samples: int, lower: float, upper: float) -> None:
    lo, hi = wilson_interval(met, samples, 1.2815515655446004)
    assert lo == pytest.approx(lower, abs=1e-4)
    assert hi == pytest.approx(upper, abs=1e-4)


@pytest.mark.parametrize(
    ("first", "tpot", "met"),
    [
        pytest.param(2.0, 0.1, True, id="both on the limit"),
        pytest.param(2.01, 0.05, False, id="late first token"),
        pytest.param(1.0, 0.11, False, id="slow tokens"),
        pytest.param(1.0, None, True, id="one token: no TPOT"),
    ],
)
def test_met_targets(first: float, tpot: float | None, met: bool) -> None:
    assert met_targets(first, 2.0, tpot, 0.1) is met


def test_starts_and_stays_at_forecast_margin_without_evidence() -> None:
    ctl = AttainmentController(settings())
    assert ctl.margin("interactive", "a", 0.0) == BASE
    feed(ctl, 0.0, [False] * 19)  # below min_samples: no move however bad
    assert ctl.margin("interactive", "a", 2.0) == pytest.approx(BASE)
    assert ctl.margins("a", 2.0) == {}


def test_a_few_misses_do_not_tighten() -> None:
    ctl = AttainmentController(settings())
    feed(ctl, 0.0, [True] * 19 + [False])  # 95 %: upper bound 0.978 >= 0.95 + 0.02
    assert ctl.margin("interactive", "a", 3.0) == pytest.approx(BASE)


def test_clear_misses_tighten_by_a_bounded_step_then_wait_for_fresh_evidence() -> None:
    ctl = AttainmentController(settings())
    t = feed(ctl, 0.0, [True] * 10 + [False] * 10)  # 50 %: gain x 0.45 = 0.9, capped at 0.25
    assert ctl.margin("interactive", "a", t) == pytest.approx(1.15 * 1.25 - 1)
    # The misses still in the window were admitted before the move: no second step on them.
    t = feed(ctl, t, [True] * 5)
    assert ctl.margin("interactive", "a", t) == pytest.approx(1.15 * 1.25 - 1)
    (state,) = ctl.states(t)
    # Admitted 1 s before they ended: these five predate the move.
    assert (state.samples, state.evidence, state.attainment) == (25, 0, 15 / 25)
    t = feed(ctl, t + 1.0, [True] * 19)
    (state,) = ctl.states(t)
    assert state.evidence == 19
    assert state.margin == pytest.approx(1.15 * 1.25 - 1)


def test_tightening_is_capped_at_max_margin() -> None:
    ctl = AttainmentController(settings(max_margin=0.5, min_samples=5))
    t = 0.0
    for _ in range(10):
        t = feed(ctl, t + 2.0, [False] * 5)
    assert ctl.margin("interactive", "a", t) == pytest.approx(0.5)


def test_never_loosens_while_not_refusing() -> None:
    ctl = AttainmentController(settings())
    t = feed(ctl, 0.0, [True] * 100)
    assert ctl.margin("interactive", "a", t) == pytest.approx(BASE)


def test_loosens_with_room_to_spare_while_refusing_down_to_the_floor() -> None:
    ctl = AttainmentController(settings(min_margin=0.0))
    ctl.refused("interactive", "a", 0.0)
    t = feed(ctl, 0.0, [True] * 19)  # all met, but below min_samples
    assert ctl.margin("interactive", "a", t) == pytest.approx(BASE)
    t = feed(ctl, t, [True])  # 20: lower bound 0.966 -> gain x 0.05 = 0.1
    assert ctl.margin("interactive", "a", t) == pytest.approx(1.15 / 1.1 - 1)
    ctl.refused("interactive", "a", t)
    t = feed(ctl, t + 1.0, [True] * 40)
    assert ctl.margin("interactive", "a", t) == 0.0  # floored


def test_deadband_holds_near_the_target() -> None:
    ctl = AttainmentController(settings(min_samples=200, window_requests=200))
    ctl.refused("interactive", "a", 0.0)
    t = feed(ctl, 0.0, ([True] * 65 + [False]) * 3 + [True] * 2)  # 98.5 %, lower bound > 0.95 ...
    ctl2 = AttainmentController(settings(min_samples=200, window_requests=200, deadband=0.04))
    ctl2.refused("interactive", "a", 0.0)
    feed(ctl2, 0.0, ([True] * 65 + [False]) * 3 + [True] * 2)
    assert ctl.margin("interactive", "a", t) < BASE  # ... and 0.985 >= 0.95 + 0.02: loosens
    assert ctl2.margin("interactive", "a", t) == pytest.approx(BASE)  # 0.985 < 0.95 + 0.04


def test_refusals_expire_after_the_window() -> None:
    ctl = AttainmentController(settings(window_s=10.0))
    ctl.refused("interactive", "a", 0.0)
    t = feed(ctl, 20.0, [True] * 40)
    assert ctl.margin("interactive", "a", t) == pytest.approx(BASE)


def test_decays_back_while_refusing_with_the_window_empty() -> None:
    """Locked out: the class is refused there and nothing ends, so the margin comes back."""
    ctl = AttainmentController(settings(window_s=10.0, decay_half_life_s=5.0))
    t = feed(ctl, 0.0, [False] * 20)
    high = ctl.margin("interactive", "a", t)
    assert high == pytest.approx(1.15 * 1.25 - 1)
    ctl.refused("interactive", "a", t + 1.0)
    assert ctl.margin("interactive", "a", t + 10.0) == pytest.approx(high)  # window not yet empty
    half = ctl.margin("interactive", "a", t + 15.0)
    assert math.log1p(half) - math.log1p(BASE) == pytest.approx(math.log(1.25) / 2)
    assert ctl.margin("interactive", "a", t + 100.0) == BASE
    (state,) = ctl.states(t + 100.0)
    assert (state.samples, state.attainment) == (0, None)


def test_keeps_the_margin_through_an_idle_spell() -> None:
    """No request of the class comes: nothing is refused, the margin stays as learned; once
    refusals start, it decays from then, not from when the window emptied."""
    ctl = AttainmentController(settings(window_s=10.0, decay_half_life_s=5.0))
    t = feed(ctl, 0.0, [False] * 20)
    high = ctl.margin("interactive", "a", t)
    assert high > BASE
    assert ctl.margin("interactive", "a", t + 300.0) == pytest.approx(high)
    ctl.refused("interactive", "a", t + 300.0)
    assert ctl.margin("interactive", "a", t + 300.0) == pytest.approx(high)
    half = ctl.margin("interactive", "a", t + 305.0)
    assert math.log1p(half) - math.log1p(BASE) == pytest.approx(math.log(1.25) / 2)
    # An outcome ends the refusing spell: idle again after it, the margin holds.
    feed(ctl, t + 306.0, [True])
    kept = ctl.margin("interactive", "a", t + 307.0)
    assert ctl.margin("interactive", "a", t + 600.0) == pytest.approx(kept)


def test_classes_and_replicas_are_apart() -> None:
    ctl = AttainmentController(settings())
    t = feed(ctl, 0.0, [False] * 20)
    assert ctl.margin("batch", "a", t) == BASE
    assert ctl.margin("interactive", "b", t) == BASE
    assert set(ctl.margins("a", t)) == {"interactive"}
    assert ctl.margins("b", t) == {}
    ctl.forget("a")
    assert ctl.margin("interactive", "a", t) == BASE


def test_class_target_is_its_own() -> None:
    lax = AdmissionSettings.model_validate({"classes": {"interactive": {"attainment_target": 0.5}}})
    ctl = AttainmentController(lax)
    t = feed(ctl, 0.0, [True] * 10 + [False] * 10)
    assert ctl.margin("interactive", "a", t) == pytest.approx(BASE)


def test_state_as_json() -> None:
    ctl = AttainmentController(settings())
    t = feed(ctl, 0.0, [True] * 10)
    (state,) = ctl.states(t)
    assert state.as_json() == {
        "class": "interactive",
        "replica": "a",
        "margin": 0.15,
        "attainment": 1.0,
        "samples": 10,
        "lower": round(10 / (10 + 0.8416212335729143**2), 4),
        "upper": 1.0,
        "evidence": 10,
        "refusing": False,
        "target": 0.95,
    }


def test_disabled_reports_the_configured_margin_but_measures() -> None:
    ctl = AttainmentController(settings(enabled=False))
    t = feed(ctl, 0.0, [False] * 20)
    assert ctl.margin("interactive", "a", t) == BASE
    (state,) = ctl.states(t)
    assert (state.margin, state.attainment, state.samples) == (BASE, 0.0, 20)


def test_reload_keeps_state_and_clamps() -> None:
    ctl = AttainmentController(settings())
    t = feed(ctl, 0.0, [False] * 20)
    ctl.reconfigure(settings(max_margin=0.2))
    assert ctl.margin("interactive", "a", t) == pytest.approx(0.2)
    (state,) = ctl.states(t)
    assert state.samples == 20


def test_floor_above_cap_is_refused() -> None:
    with pytest.raises(ValidationError, match="min_margin: must not exceed max_margin"):
        settings(min_margin=2.0, max_margin=1.0)


def test_a_loosening_that_went_too_far_halves_the_next_ones() -> None:
    ctl = AttainmentController(settings(window_requests=20))
    ctl.refused("interactive", "a", 0.0)
    t = feed(ctl, 0.0, [True] * 20)  # loosen by gain x 0.05 = 0.1
    assert ctl.margin("interactive", "a", t) == pytest.approx(1.15 / 1.1 - 1)
    t = feed(ctl, t + 1.0, [False] * 20)  # tighten, full step 0.25
    tight = 1.15 / 1.1 * 1.25
    assert ctl.margin("interactive", "a", t) == pytest.approx(tight - 1)
    ctl.refused("interactive", "a", t)
    t = feed(ctl, t + 1.0, [True] * 20)  # the misses pushed out of the window; half a step
    assert ctl.margin("interactive", "a", t) == pytest.approx(tight / 1.05 - 1)


def test_no_loosening_while_the_window_still_holds_the_misses() -> None:
    ctl = AttainmentController(settings())
    t = feed(ctl, 0.0, [False] * 20)  # tighten
    tight = ctl.margin("interactive", "a", t)
    ctl.refused("interactive", "a", t)
    t = feed(ctl, t + 1.0, [True] * 40)  # fresh evidence all met, but 20 misses of 60 in view
    assert ctl.margin("interactive", "a", t) == pytest.approx(tight)


def test_loosening_waits_as_long_as_the_longest_request_took() -> None:
    ctl = AttainmentController(settings(window_requests=25))
    ctl.observe("interactive", "a", 0.0, 30.0, True)  # a request that took 30 s
    t = feed(ctl, 30.0, [False] * 20)  # tighten at 32 s
    tight = ctl.margin("interactive", "a", t)
    ctl.refused("interactive", "a", t)
    # All met, the misses out of the 25-outcome window, but not 30 s since the move: hold.
    assert ctl.margin("interactive", "a", feed(ctl, t, [True] * 40)) == pytest.approx(tight)
    ctl.refused("interactive", "a", t + 31.0)
    assert ctl.margin("interactive", "a", feed(ctl, t + 31.0, [True] * 20)) < tight
