"""A budget 429's Retry-After, in virtual time: from when the budget really frees, jittered.

A token or request bucket frees when it has refilled to this request's cost (the limiter's exact
wait); a ``max_concurrent`` slot when the tenant's earliest running request is predicted to end
(``predicted_end``: its forecast TTFT, then one token per forecast TPOT up to its predicted
output), or after a typical request's duration when nothing running here says (``SlotClock``).
Either wait is spread by the one Retry-After function: drawn in ``[d, d x 1.5]``.
"""

from __future__ import annotations

import math
import random

import pytest

from gateway.admission.budget import BudgetRefused, Hold, SlotClock, budget_retry_after, predicted_end
from gateway.admission.config import RetryAfterSettings
from gateway.admission.engine import AdmissionEngine
from gateway.admission.results import Ending, Submitted
from gateway.admission.retry_after import UNMEASURED_WAIT_S, RefusalReason
from gateway.admission.views import TrackedStream
from gateway.limits.base import Reservation, TenantLimits
from gateway.limits.memory import MemoryLimiter
from gateway.replicas.registry import LiveRequest
from gateway.replicas.snapshot import InFlight
from gateway.tenants.pricing import DEFAULT_WEIGHTS
from replay.budget import MemoryBudget
from tests.unit.admission.test_policies import Fleet, Predictions, new_entry, policy_settings
from tests.unit.limits.fakes import FakeClock

SETTINGS = RetryAfterSettings()
JITTER = SETTINGS.jitter_fraction
#: Admission admits everything and forecasts each request (TTFT, TPOT, output): the tenant's
#: budget is the only thing that refuses.
ADMIT_ALL = policy_settings("admit_all")


def stream(
    started_at: float, ttft: float, tpot: float, output: float, tokens: int = 0
) -> TrackedStream[InFlight]:
    live = LiveRequest("r", 100, started_at, 1000)
    if tokens:
        live.tokens_streamed = tokens
        live.first_token_at = started_at + ttft
        live.last_token_at = started_at + ttft + (tokens - 1) * tpot
    return TrackedStream(live, "interactive", output, tpot, ttft)


# -- predicted_end -------------------------------------------------------------------------------------


def test_a_request_before_its_first_token_ends_after_its_ttft_and_its_output() -> None:
    # First token 0.5 s after dispatch at 10 s, then 99 more at 20 ms: 10.5 + 1.98.
    assert predicted_end(stream(10.0, 0.5, 0.02, 100.0), now=10.1) == pytest.approx(12.48)


def test_a_request_late_for_its_first_token_counts_from_now() -> None:
    assert predicted_end(stream(10.0, 0.5, 0.02, 100.0), now=11.0) == pytest.approx(11.0 + 1.98)


def test_a_streaming_request_ends_after_its_remaining_output() -> None:
    # 40 of 100 tokens relayed: 60 more at 20 ms.
    assert predicted_end(stream(10.0, 0.5, 0.02, 100.0, tokens=40), now=11.3) == pytest.approx(11.3 + 1.2)


def test_a_request_past_its_predicted_output_ends_one_token_later() -> None:
    assert predicted_end(stream(10.0, 0.5, 0.02, 100.0, tokens=130), now=13.0) == pytest.approx(13.02)


@pytest.mark.parametrize(("ttft", "tpot"), [(math.nan, 0.02), (0.5, 0.0), (math.inf, 0.02), (0.5, math.inf)])
def test_no_forecast_no_end(ttft: float, tpot: float) -> None:
    assert predicted_end(stream(10.0, ttft, tpot, 100.0), now=10.0) is None


# -- budget_retry_after ----------------------------------------------------------------------------------


def refused(limits: TenantLimits, *, held: int, cost: float = 10.0) -> Reservation:
    """A reservation refused under ``limits`` after ``held`` allowed ones of ``cost`` tokens."""
    limiter = MemoryLimiter(clock=FakeClock())
    for index in range(held):
        assert limiter.reserve_now("t", cost_tokens=cost, limits=limits, request_id=f"h{index}").allowed
    answer = limiter.reserve_now("t", cost_tokens=cost, limits=limits, request_id="refused")
    assert not answer.allowed
    return answer


def test_a_token_bucket_refusal_waits_for_the_refill_of_this_requests_cost() -> None:
    # 60 tokens a minute (1 a second), burst 25: two of 10 leave 5, a third needs 5 more: 5 s.
    answer = refused(TenantLimits(tokens_per_minute=60.0, token_burst=25.0), held=2)
    retry = budget_retry_after(answer, slot_wait_s=99.0, settings=SETTINGS, rng=random.Random(1))
    assert retry is not None
    assert retry.base_s == pytest.approx(5.0)  # the slot wait is no part of it: no slot is missing
    assert 5.0 <= retry.delay_s <= 5.0 * (1 + JITTER)


def test_a_request_bucket_refusal_waits_for_one_request() -> None:
    # 6 requests a minute, burst 2: the third waits 10 s for one more.
    answer = refused(TenantLimits(requests_per_minute=6.0, request_burst=2.0), held=2)
    retry = budget_retry_after(answer, slot_wait_s=0.0, settings=SETTINGS, rng=random.Random(1))
    assert retry is not None
    assert retry.base_s == pytest.approx(10.0)


def test_a_concurrency_refusal_waits_for_the_slot() -> None:
    answer = refused(TenantLimits(max_concurrent=2), held=2)
    assert answer.retry_after_s is None
    retry = budget_retry_after(answer, slot_wait_s=3.25, settings=SETTINGS, rng=random.Random(1))
    assert retry is not None
    assert retry.base_s == 3.25
    assert 3.25 <= retry.delay_s <= 3.25 * (1 + JITTER)


def test_a_refusal_by_a_bucket_and_a_slot_waits_for_both() -> None:
    limits = TenantLimits(tokens_per_minute=60.0, token_burst=25.0, max_concurrent=2)
    answer = refused(limits, held=2)
    assert answer.blocked_by == {"tokens", "concurrency"}
    later = budget_retry_after(answer, slot_wait_s=8.0, settings=SETTINGS, rng=random.Random(1))
    sooner = budget_retry_after(answer, slot_wait_s=1.0, settings=SETTINGS, rng=random.Random(1))
    assert later is not None
    assert sooner is not None
    assert later.base_s == 8.0
    assert sooner.base_s == pytest.approx(5.0)


def test_an_oversize_request_is_never_told_to_retry() -> None:
    answer = refused(TenantLimits(tokens_per_minute=60.0, token_burst=5.0), held=0)
    assert answer.oversize
    assert budget_retry_after(answer, 1.0, SETTINGS, random.Random(1)) is None


def test_refusals_of_one_instant_spread_over_the_jitter_window() -> None:
    answer = refused(TenantLimits(max_concurrent=1), held=1)
    rng = random.Random(7)
    delays = []
    for _ in range(30):
        retry = budget_retry_after(answer, slot_wait_s=2.0, settings=SETTINGS, rng=rng)
        assert retry is not None
        delays.append(retry.delay_s)
    assert len(set(delays)) == 30
    assert all(2.0 <= d <= 2.0 * (1 + JITTER) for d in delays)
    assert max(delays) - min(delays) > 0.7 * 2.0 * JITTER  # most of [2, 3]


def test_a_wait_past_the_cap_is_spread_below_sixty_seconds() -> None:
    answer = refused(TenantLimits(max_concurrent=1), held=1)
    retry = budget_retry_after(answer, slot_wait_s=300.0, settings=SETTINGS, rng=random.Random(1))
    assert retry is not None
    assert SETTINGS.max_s / (1 + JITTER) <= retry.delay_s <= SETTINGS.max_s


# -- SlotClock and the engine ------------------------------------------------------------------------------


def test_with_nothing_running_the_slot_wait_is_the_typical_duration() -> None:
    clock = SlotClock()
    assert clock.wait_s("t", 0.0) == UNMEASURED_WAIT_S
    engine, _ = engine_with(TenantLimits(max_concurrent=5))
    a = send(engine, "a", 0.0)
    b = send(engine, "b", 0.0)
    engine.finished(a.key, 10, 4.0)
    engine.finished(b.key, 10, 2.0)
    slots = ledger_slots(engine)
    # Durations 4 s then 2 s: the average starts at the first and moves a fifth of the way.
    assert slots.typical_s == pytest.approx(4.0 + 0.2 * (2.0 - 4.0))
    assert slots.wait_s("acme", 5.0) == pytest.approx(slots.typical_s)
    assert slots.holding("acme") == 0


def test_a_running_request_without_a_forecast_ends_a_typical_duration_after_its_reservation() -> None:
    limits = TenantLimits(max_concurrent=3)
    limiter = MemoryLimiter(clock=FakeClock())
    clock = SlotClock()

    def hold(rid: str, at: float, running: TrackedStream[InFlight] | None) -> Hold:
        answer = limiter.reserve_now("t", cost_tokens=0.0, limits=limits, request_id=rid)
        held = Hold(answer, DEFAULT_WEIGHTS, 100, 10, 1, reserved_at=at)
        held.stream = running
        clock.held(held)
        return held

    first = hold("a", 0.0, None)
    clock.released(first, 3.0)  # typical: 3 s
    hold("queued", 0.0, None)  # not running: no end of its own
    hold("unforecast", 1.0, stream(1.0, math.nan, 0.0, 100.0))
    assert clock.wait_s("t", 2.5) == pytest.approx(1.0 + 3.0 - 2.5)
    hold("forecast", 2.45, stream(2.45, 0.1, 0.01, 50.0))  # ends at 2.55 + 0.49, before 4.0
    assert clock.wait_s("t", 2.5) == pytest.approx(3.04 - 2.5)
    assert clock.holding("t") == 3


def engine_with(limits: TenantLimits) -> tuple[AdmissionEngine, MemoryBudget]:
    budget = MemoryBudget({"acme": limits}, weights=DEFAULT_WEIGHTS)
    engine = AdmissionEngine(
        ADMIT_ALL, Fleet(["r0"]), Predictions(), rng=random.Random(5), new_entry=new_entry, budget=budget
    )
    return engine, budget


def submit(engine: AdmissionEngine, rid: str, now: float) -> Submitted | BudgetRefused:
    req = engine.request(
        rid, "m", prompt_tokens=100, max_tokens=300, request_class="interactive", arrival_s=now, tenant="acme"
    )
    result = engine.submit(req, "m", now)
    assert isinstance(result, Submitted | BudgetRefused)
    return result


def send(engine: AdmissionEngine, rid: str, now: float) -> Submitted:
    sent = submit(engine, rid, now)
    assert isinstance(sent, Submitted)
    assert sent.replica == "r0"
    return sent


def ledger_slots(engine: AdmissionEngine) -> SlotClock:
    ledger = engine._budget
    assert ledger is not None
    return ledger.slots


def end_of(sent: Submitted, now: float) -> float:
    """``sent``'s predicted end at ``now`` from its decision's forecast, computed here."""
    forecast = sent.decision.forecast
    assert forecast is not None
    assert sent.entry is not None
    assert forecast.tpot_s > 0
    assert math.isfinite(forecast.ttft_s)
    produced = sent.entry.tokens_streamed
    if produced == 0:
        first = max(sent.entry.started_at + forecast.ttft_s, now)
        return first + (forecast.output_tokens_used - 1) * forecast.tpot_s
    return now + max(forecast.output_tokens_used - produced, 1) * forecast.tpot_s


def test_a_concurrency_refusal_waits_for_the_tenants_earliest_predicted_end() -> None:
    engine, budget = engine_with(TenantLimits(max_concurrent=2))
    a = send(engine, "a", 0.0)
    b = send(engine, "b", 0.5)

    refused = submit(engine, "c", 1.0)
    assert isinstance(refused, BudgetRefused)
    assert refused.answer.blocked_by == {"concurrency"}
    retry = refused.retry_after
    assert retry is not None
    expected = min(end_of(a, 1.0), end_of(b, 1.0)) - 1.0
    assert expected > 0.0
    assert retry.base_s == pytest.approx(expected)
    assert retry.base_s <= retry.delay_s <= retry.base_s * (1 + JITTER)

    # b streams ahead: 190 of its 200 predicted tokens are out, so it now ends first.
    assert b.entry is not None
    assert isinstance(b.entry, LiveRequest)
    b.entry.tokens_streamed, b.entry.first_token_at, b.entry.last_token_at = 190, 0.6, 1.9
    refused = submit(engine, "d", 2.0)
    assert isinstance(refused, BudgetRefused)
    assert refused.retry_after is not None
    assert end_of(b, 2.0) < end_of(a, 2.0)
    assert refused.retry_after.base_s == pytest.approx(end_of(b, 2.0) - 2.0)

    # b ends: its slot is free.
    engine.finish(b.key, Ending(produced_tokens=200, learn=False), 2.1)
    assert isinstance(submit(engine, "e", 2.1), Submitted)
    assert budget.stats.rejected_total == {"concurrency": 2}


def test_a_request_placed_again_does_not_count_as_running() -> None:
    """A placement its replica refused keeps its slot but runs nowhere until placed again."""
    engine, _ = engine_with(TenantLimits(max_concurrent=1))
    a = send(engine, "a", 0.0)
    engine.replica_refused(a.key, 1.0, "busy", 0.0, placed_again=True)
    engine.finished(a.key, 0, 0.0)
    slots = ledger_slots(engine)
    assert slots.holding("acme") == 1
    assert slots.wait_s("acme", 0.0) == pytest.approx(slots.typical_s)


def test_refusals_of_one_instant_come_back_spread() -> None:
    engine, _ = engine_with(TenantLimits(max_concurrent=1))
    send(engine, "a", 0.0)
    delays = []
    base = math.nan
    for index in range(26):
        refused = submit(engine, f"r{index}", 0.25)
        assert isinstance(refused, BudgetRefused)
        assert refused.retry_after is not None
        assert refused.reason is RefusalReason.RATE_LIMITED
        delays.append(refused.retry_after.delay_s)
        base = refused.retry_after.base_s
    assert len(set(delays)) == 26
    assert min(delays) >= base
    assert max(delays) - min(delays) > 0.5 * base * JITTER
