"""The per-stream stall budget (``stall_budget_horizon``): a newcomer's prefill pause, plus the
prefill already queued, must fit the room every running stream has left to end within its TPOT
target, counting what its decode has already taken."""

from __future__ import annotations

import dataclasses
import random

import pytest
from pydantic import ValidationError

from gateway.admission import (
    AdmissionSettings,
    Admit,
    Blocker,
    ClassSettings,
    Queue,
    Reject,
    RetryAfterPolicy,
    SloAdmitter,
    StreamingRequest,
)
from gateway.admission.config import INTERACTIVE_STALL_BUDGET_HORIZON
from gateway.admission.shares import class_load
from tests.unit.admission.fleet import FakeClock, request, state, view, with_class
from tests.unit.admission.test_invariants import random_fleet

#: Interactive (100 ms TPOT target) with a loose TTFT target and the stall budget on.
TARGET_S = 0.1


def budget_config(horizon: float | None = 0.5) -> AdmissionSettings:
    return with_class("interactive", ttft_target_s=30.0, max_queue_wait_s=30.0, stall_budget_horizon=horizon)


def admitter(config: AdmissionSettings) -> SloAdmitter:
    return SloAdmitter(config, RetryAfterPolicy(config.retry_after, random.Random(1)))


def stream(generated: int, expected: float, elapsed: float | None, tpot_s: float = 0.02) -> StreamingRequest:
    return StreamingRequest("interactive", 1500, generated, expected, tpot_s, elapsed)


# -- the arithmetic ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("streams", "horizon", "step", "expected"),
    [
        # 99 intervals took 2 s; 200 tokens expected left, half assumed: 100 x (50 - 20) ms of room.
        pytest.param([stream(100, 300, 2.0)], 0.5, 0.02, 0.05 * 99 - 2.0 + 100 * 0.03, id="fresh"),
        pytest.param([stream(100, 300, 2.0)], 1.0, 0.02, 0.05 * 99 - 2.0 + 200 * 0.03, id="full-horizon"),
        # Past its expected output: it may end after one more token.
        pytest.param([stream(100, 80, 2.0)], 0.5, 0.02, 0.05 * 99 - 2.0 + 0.03, id="past-expected"),
        # Elapsed unknown: taken as its predicted 20 ms per token so far.
        pytest.param([stream(100, 300, None)], 0.5, 0.02, 0.05 * 99 - 1.98 + 100 * 0.03, id="unknown"),
        # Not started: no interval yet, its whole expected output ahead.
        pytest.param([stream(0, 300, None)], 0.5, 0.02, 150 * 0.03, id="not-started"),
        # The tightest of several.
        pytest.param(
            [stream(100, 300, 2.0), stream(100, 80, 4.5), stream(10, 300, 0.2)],
            0.5,
            0.02,
            0.05 * 99 - 4.5 + 0.03,
            id="min-of-several",
        ),
        # Already past saving (budget < 0): it does not count.
        pytest.param([stream(100, 80, 6.0), stream(100, 300, 2.0)], 0.5, 0.02, 5.95, id="doomed-ignored"),
        pytest.param([stream(100, 80, 6.0)], 0.5, 0.02, float("inf"), id="only-doomed"),
        pytest.param([], 0.5, 0.02, float("inf"), id="no-streams"),
    ],
)
def test_min_stall_budget(
    streams: list[StreamingRequest], horizon: float, step: float, expected: float
) -> None:
    load = class_load(streams)
    assert load.min_stall_budget_s(0.05, horizon, step) == pytest.approx(expected)
    # Memoised: the same answer again.
    assert load.min_stall_budget_s(0.05, horizon, step) == pytest.approx(expected)


def test_a_newly_admitted_stream_brings_its_own_budget() -> None:
    load = class_load([stream(100, 300, 4.9)]).with_stream(2000.0, 0.02, 10.0)
    # The known stream: 4.95 - 4.9 + 100 x 0.03 = 3.05; the new one: 5 x 0.03 = 0.15.
    assert load.min_stall_budget_s(0.05, 0.5, 0.02) == pytest.approx(0.15)


# -- the decision --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("running", "queued", "prompt", "expected"),
    [
        # A fresh stream (20 ms per token so far, 200 tokens expected left): ~17 s of budget.
        pytest.param([stream(100, 300, 1.98)], (), 20_000, Admit, id="fresh-stream-takes-a-long-prefill"),
        # 96 ms per token so far and at its expected end: ~0.49 s left, a 20K prefill pauses ~0.85 s.
        pytest.param([stream(100, 100, 9.5)], (), 20_000, Queue, id="suffering-stream-holds-a-long-prefill"),
        pytest.param([stream(100, 100, 9.5)], (), 2_000, Admit, id="suffering-stream-takes-a-short-one"),
        # Past saving already: refusing the newcomer cannot help it.
        pytest.param([stream(100, 100, 12.0)], (), 20_000, Admit, id="doomed-stream-does-not-block"),
        # The prefill already queued will pause it too: one 8K prompt fits with a 2K one, two do not.
        pytest.param([stream(100, 100, 9.5)], (8_000,), 2_000, Admit, id="queued-prefill-fits"),
        pytest.param([stream(100, 100, 9.5)], (8_000, 8_000), 2_000, Queue, id="queued-prefill-counts"),
    ],
)
def test_stall_budget_decides(
    running: list[StreamingRequest], queued: tuple[int, ...], prompt: int, expected: type
) -> None:
    # 32 decodes on the replica (a ~10 ms step); the stream(s) under test are the gateway's.
    views = [view("a", state(32, queued=queued), running)]
    decision = admitter(budget_config()).decide(request(prompt), views, 1000.0)
    assert isinstance(decision, expected)
    if isinstance(decision, Queue):
        assert decision.blocker == Blocker.STREAMS_STALL
    # Off, the same streams let everything through (their predicted 20 ms is far from 100 ms).
    assert isinstance(admitter(budget_config(None)).decide(request(prompt), views, 1000.0), Admit)


def test_budget_shrinks_as_a_stream_nears_its_end() -> None:
    # A stream whose tokens come exactly at its 100 ms target has no slack from its past: its
    # budget is the room of its remaining steps (~90 ms each), which shrinks as it nears its
    # expected 200 tokens. The same 8K prompt (~0.29 s of pause) is admitted early, held late.
    clock = FakeClock()
    first_token = clock.now
    decisions: list[type] = []
    for _ in range(7):
        clock.advance(3.0)
        elapsed = clock.now - first_token
        running = [stream(1 + round(elapsed / TARGET_S), 200, elapsed)]
        views = [view("a", state(32), running)]
        decisions.append(type(admitter(budget_config()).decide(request(8_000), views, clock.now)))
    assert decisions[:5] == [Admit] * 5
    assert decisions[-1] is Queue


@pytest.mark.parametrize("horizon", [0.0, -0.5, 1.5])
def test_horizon_must_be_a_fraction(horizon: float) -> None:
    with pytest.raises(ValidationError):
        ClassSettings(stall_budget_horizon=horizon)


def test_off_by_default() -> None:
    assert ClassSettings().stall_budget_horizon is None


def test_on_for_the_built_in_interactive_class() -> None:
    classes = AdmissionSettings().classes
    assert classes["interactive"].stall_budget_horizon == INTERACTIVE_STALL_BUDGET_HORIZON
    assert classes["batch"].stall_budget_horizon is None


@pytest.mark.parametrize(
    ("share", "horizon", "admits"),
    [
        # 32 decodes step ~10 ms; a replica that spent 95 % of its recent time on prefill makes the
        # forecast ~0.2 s per token, past the 100 ms target.
        pytest.param(None, 0.5, True, id="no-prefill-share"),
        pytest.param(0.95, None, False, id="budget-off-prices-the-prefill-share"),
        # With the budget on, later prefill must fit this request's own budget once it streams:
        # its own TPOT is its decode step, not the replica's recent prefill share on top.
        pytest.param(0.95, 0.5, True, id="budget-on-judges-its-decode-step"),
    ],
)
def test_own_tpot_with_a_budget(share: float | None, horizon: float | None, admits: bool) -> None:
    replica = dataclasses.replace(state(32), prefill_share=share)
    decision = admitter(budget_config(horizon)).decide(request(2_000), [view("a", replica)], 1000.0)
    assert decision.admits == admits
    if not admits:
        assert isinstance(decision, Queue | Reject)
        assert decision.blocker == Blocker.TPOT
        assert decision.forecast is not None
        assert decision.forecast.tpot_s > TARGET_S


@pytest.mark.parametrize("seed", range(20))
def test_shipped_defaults_admit_only_what_fits_the_budgets(seed: int) -> None:
    """The shipped configuration (interactive budget on) over seeded random fleets: an admitted
    request's first token is forecast by its deadline, and on its replica the pause its prefill
    adds, plus the prefill already queued there, fits every budgeted stream's budget."""
    rng = random.Random(seed)
    config = AdmissionSettings(forecast_margin=0.0)
    horizon = config.classes["interactive"].stall_budget_horizon
    assert horizon is not None
    decide = admitter(config)
    for _ in range(25):
        views = random_fleet(rng)
        name = rng.choice(["interactive", "batch"])
        r = request(rng.choice([50, 500, 4000, 20_000]), float(rng.randint(10, 800)), request_class=name)
        decision = decide.decide(r, views, 1000.0)
        if not isinstance(decision, Admit) or decision.forecast is None:
            continue
        f = decision.forecast
        assert 1000.0 + f.ttft_s <= r.first_token_deadline_s(config.classes[name]) + 1e-9
        target = next(v for v in views if v.name == decision.replica)
        load = target.loads.get("interactive")
        if load is None or not target.model.valid or target.stale:
            continue  # (stale: margins scale the numbers; the arithmetic is checked fresh)
        step = decide._slack._step_with_s(target, r.prompt_tokens + f.output_tokens_used / 2.0)
        budget = load.min_stall_budget_s(config.classes["interactive"].tpot_target_s, horizon, step)
        assert decide._slack._pending_stall_s(target) + f.inflicted_stall_s <= budget + 1e-9
