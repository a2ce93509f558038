"""The SLO admitter under the attainment controller's margins (``ReplicaView.margins``)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from gateway.admission import Admit, Blocker, RetryAfterPolicy, SloAdmitter
from gateway.admission.config import AdmissionSettings
from gateway.admission.decision import Decision
from gateway.admission.views import ReplicaView
from tests.unit.admission.fleet import SETTINGS, request, state, streams, view, with_class

NOW = 1000.0
BASE_SCALE = 1.0 + SETTINGS.forecast_margin


def decide(v: ReplicaView, config: AdmissionSettings, request_class: str = "interactive") -> Decision:
    admitter = SloAdmitter(config, RetryAfterPolicy(config.retry_after, random.Random(1)))
    return admitter.decide(request(500, request_class=request_class), [v], NOW)


def test_no_margins_is_forecast_margin() -> None:
    busy = view("a", state(16), streams(16))
    plain = decide(busy, SETTINGS)
    other = decide(replace(busy, margins={"batch": 3.0}), SETTINGS)
    assert plain == other  # another class's margin changes nothing for this one


def test_the_class_margin_scales_its_own_forecasts() -> None:
    """A first token forecast within the target at forecast_margin is late at margin 1."""
    busy = view("a", state(16), streams(16))
    plain = decide(busy, SETTINGS)
    assert isinstance(plain, Admit)
    assert plain.forecast is not None
    config = with_class("interactive", ttft_target_s=1.2 * plain.forecast.ttft_s)
    assert isinstance(decide(busy, config), Admit)

    tight = decide(replace(busy, margins={"interactive": 1.0}), config)

    assert not tight.admits
    assert tight.blocker == Blocker.TTFT  # type: ignore[union-attr]
    assert tight.forecast is not None
    assert tight.forecast.ttft_s == pytest.approx(plain.forecast.ttft_s / BASE_SCALE * 2.0)
    assert tight.forecast.tpot_s == pytest.approx(plain.forecast.tpot_s / BASE_SCALE * 2.0)


def test_the_streaming_class_margin_scales_what_a_newcomer_inflicts_on_it() -> None:
    """A batch newcomer next to interactive streams 0.1 ms inside their TPOT target: fits at
    forecast_margin, blocked once interactive's margin there is 3 (inflicted x 4 / 1.15)."""
    config = with_class("interactive", stall_budget_horizon=None)
    busy = view("a", state(32), streams(32, tpot_s=0.0999, generated=100, expected=300))

    assert isinstance(decide(busy, config, "batch"), Admit)
    blocked = decide(replace(busy, margins={"interactive": 3.0}), config, "batch")

    assert not blocked.admits
    assert blocked.blocker == Blocker.STREAMS_TPOT  # type: ignore[union-attr]


def test_an_unloaded_replica_is_judged_at_forecast_margin() -> None:
    """A margin learned under load does not outlive it: a replica with none of the gateway's
    requests and nothing waiting ignores it."""
    plain = decide(view("a", state()), SETTINGS)
    tight = decide(replace(view("a", state()), margins={"interactive": 3.0}), SETTINGS)
    assert isinstance(tight, Admit)
    assert tight == plain
