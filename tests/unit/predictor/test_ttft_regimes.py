"""The TTFT correction's load regimes: how a request reaches the engine, not only the batch.

A queue deeper than the engine's slots is where a step model's TTFT error grows with the depth;
the TTFT regimes part requests that wait for a slot (behind at most one engine-full of requests,
or more) from those that find one free, and those from an idle engine, so a correction learned in
one applies there only.
"""

from __future__ import annotations

import pytest

from predictor.correction import CorrectionLearner, ttft_regime, ttft_regime_label
from predictor.forecast import forecast_request
from tests.unit.predictor.test_forecast import MODEL, request, state_of


@pytest.mark.parametrize(
    ("decodes", "waves", "label"),
    [
        pytest.param(0.0, 0.0, "prompt<256,idle", id="idle"),
        pytest.param(3.0, 0.0, "prompt<256,free-slot", id="free-slot"),
        pytest.param(4.0, 0.25, "prompt<256,slot-wait<=1", id="short-queue"),
        pytest.param(4.0, 1.0, "prompt<256,slot-wait<=1", id="one-engine-full"),
        pytest.param(4.0, 1.5, "prompt<256,slot-wait>1", id="deep-queue"),
        pytest.param(0.0, 2.0, "prompt<256,slot-wait>1", id="wait-whatever-the-batch"),
    ],
)
def test_regimes(decodes: float, waves: float, label: str) -> None:
    assert ttft_regime_label(ttft_regime(100, decodes, waves)) == label


def test_a_deep_queue_learns_its_own_factor() -> None:
    """Requests behind two engine-fulls came 1.7x late, those that found a slot free 0.7x: each
    regime learns its own, and neither moves an idle engine's."""
    learner = CorrectionLearner()
    for i in range(60):
        at = float(i)
        learner.observe("r", at=at, prompt_tokens=100, decode_seqs=4, slot_waves=2.0, ttft=(1.7, 1.0, 1.0))
        learner.observe("r", at=at, prompt_tokens=100, decode_seqs=3, slot_waves=0.0, ttft=(0.7, 1.0, 1.0))
    c = learner.correction("r", 60.0)
    deep, free, idle = c.factors(100, 4, 2.0)[0], c.factors(100, 3, 0.0)[0], c.factors(100, 0, 0.0)[0]
    assert deep == pytest.approx(1.7, rel=0.05)
    assert free == pytest.approx(0.7, rel=0.05)
    assert idle == pytest.approx(1.0)


def test_the_forecast_says_how_many_engine_fulls_are_ahead_of_its_slot() -> None:
    """Four slots, all taken, six waiting: the newcomer needs seven to leave, 1.75 engine-fulls;
    on an idle engine or with a slot free, none."""
    full = state_of([500] * 4, [200] * 6, max_num_seqs=4)
    assert forecast_request(request(200), full, MODEL).slot_waves == pytest.approx(7 / 4)
    free = state_of([500] * 3, [], max_num_seqs=4)
    assert forecast_request(request(200), free, MODEL).slot_waves == 0.0
    assert forecast_request(request(200), state_of([], []), MODEL).slot_waves == 0.0
