"""The baselines' decisions and the virtual-time driver, on hand-built arrivals against real engines.

Every test drives ``replay.run_gateway_replay`` with the emulator's engine (the
ground truth; nothing faked): requests arriving together at t = 0 make each policy's rule visible.
"""

from __future__ import annotations

import itertools

import pytest

from bench.goodput.core import FACTS, PROFILE, ForecastRecorder, admission_settings
from replay import (
    FleetConfig,
    GatewayReplayResult,
    Targets,
    TraceRequest,
    load_mooncake_trace,
    piecewise_rate,
    run_gateway_replay,
)
from replay.baselines import (
    ConcurrencyCap,
    NoAdmission,
    SaturationShedding,
    TenantRateLimit,
    TokenBucket,
)
from replay.policies import SluicePolicy
from simulator.profile import load_profile

TARGETS = Targets(ttft_s=1.0, tpot_s=0.05)


def fleet(replicas: int = 1, tenants: int = 1) -> FleetConfig:
    return FleetConfig(load_profile(PROFILE), FACTS, replicas=replicas, tenants=tenants, jitter=0.0)


def burst(n: int, *, prompt: int = 500, output: int = 200, at: float = 0.0) -> list[TraceRequest]:
    return [TraceRequest(at, prompt, output) for _ in range(n)]


def decided(result: GatewayReplayResult) -> list[str]:
    """Per request: ``served on rX`` or ``rejected: reason``."""
    return [f"rejected: {o.reason}" if o.rejected else f"served on {o.replica}" for o in result.outcomes]


def test_no_admission_sends_everything_at_once_least_outstanding_first() -> None:
    result = run_gateway_replay(burst(5), fleet(replicas=2), NoAdmission(), targets=TARGETS)
    assert decided(result) == ["served on r0", "served on r1", "served on r0", "served on r1", "served on r0"]
    assert all(o.dispatched_s == 0.0 for o in result.outcomes)
    assert all(o.finished_s is not None and o.output_tokens == 200 for o in result.outcomes)


def test_concurrency_cap_queues_fifo_and_drops_what_waited_past_the_timeout() -> None:
    # Two slots; the first two requests decode 200 tokens (well over 0.5 s), so the other three
    # wait in the FIFO queue and are dropped when they have waited 0.5 s.
    result = run_gateway_replay(burst(5), fleet(), ConcurrencyCap(2, queue_timeout_s=0.5), targets=TARGETS)
    assert decided(result) == ["served on r0"] * 2 + ["rejected: deadline_exceeded"] * 3
    assert [o.finished_s for o in result.outcomes[2:]] == [0.5, 0.5, 0.5]


def test_concurrency_cap_dispatches_queued_requests_in_arrival_order_as_slots_free() -> None:
    trace = [
        TraceRequest(0.0, 100, 50),
        TraceRequest(0.0, 100, 2),
        TraceRequest(0.01, 100, 2),
        TraceRequest(0.02, 100, 2),
    ]
    result = run_gateway_replay(trace, fleet(), ConcurrencyCap(2), targets=TARGETS)
    served = result.outcomes
    assert not any(o.rejected for o in served)
    # Request 1 finishes first (two tokens); its slot goes to request 2, then to request 3.
    first_free = served[1].finished_s
    assert first_free is not None
    assert served[2].dispatched_s == pytest.approx(first_free)
    assert served[2].dispatched_s is not None
    assert served[3].dispatched_s is not None
    assert served[3].dispatched_s >= served[2].dispatched_s
    assert served[0].dispatched_s == served[1].dispatched_s == 0.0


def test_saturation_shedding_refuses_once_every_replica_is_over_its_queue_threshold() -> None:
    # Threshold 0: a replica is saturated as soon as one request waits in its engine queue. The
    # engine's view counts a request sent since the last scrape as waiting (as live), so after one
    # request each replica is saturated.
    policy = SaturationShedding(queue_threshold=0)
    one = run_gateway_replay(burst(4), fleet(), policy, targets=TARGETS)
    assert decided(one) == ["served on r0"] + ["rejected: overloaded"] * 3
    two = run_gateway_replay(
        burst(5), fleet(replicas=2), SaturationShedding(queue_threshold=0), targets=TARGETS
    )
    assert decided(two) == ["served on r0", "served on r1"] + ["rejected: overloaded"] * 3


def test_saturation_rule_is_strictly_greater_than_either_threshold() -> None:
    policy = SaturationShedding()  # GAIE's defaults: queue 5, KV 0.8
    assert not policy.saturated(5, 0.8)
    assert policy.saturated(6, 0.0)
    assert policy.saturated(0, 0.81)
    with pytest.raises(ValueError, match="kv_threshold"):
        SaturationShedding(kv_threshold=0.0)


def test_saturation_shedding_reads_kv_use_after_a_scrape() -> None:
    # A KV threshold no prompt of 4,000 tokens stays under: once a scrape (every second) has told
    # the KV capacity, the replica is full.
    trace = [TraceRequest(0.0, 4000, 500), TraceRequest(1.5, 100, 5)]
    result = run_gateway_replay(trace, fleet(), SaturationShedding(kv_threshold=0.001), targets=TARGETS)
    assert decided(result) == ["served on r0", "rejected: overloaded"]


def test_token_bucket_refills_to_its_capacity_and_may_go_negative() -> None:
    bucket = TokenBucket.full(rate_per_s=2.0, capacity=4.0)
    assert bucket.refill(10.0) == 4.0  # full stays full
    bucket.charge(10.0, 10.0)
    assert bucket.level == pytest.approx(-6.0)
    assert bucket.refill(12.0) == pytest.approx(-2.0)
    assert bucket.refill(100.0) == 4.0
    with pytest.raises(ValueError, match="> 0"):
        TokenBucket.full(0.0, 1.0)


def test_rate_limit_refuses_a_tenant_past_its_request_bucket() -> None:
    # 60 rpm with a 2-s burst: two requests at once pass, the third is refused; one second later
    # one more fits.
    trace = [*burst(3), TraceRequest(1.0, 100, 5)]
    result = run_gateway_replay(trace, fleet(), TenantRateLimit(60.0, 1e9, burst_s=2.0), targets=TARGETS)
    assert decided(result) == ["served on r0", "served on r0", "rejected: rate_limited", "served on r0"]


def test_rate_limit_buckets_are_per_tenant() -> None:
    # Two tenants (round robin): each has its own two-request burst.
    result = run_gateway_replay(
        burst(5), fleet(tenants=2), TenantRateLimit(60.0, 1e9, burst_s=2.0), targets=TARGETS
    )
    assert [o.tenant for o in result.outcomes] == ["t0", "t1", "t0", "t1", "t0"]
    assert decided(result) == ["served on r0"] * 4 + ["rejected: rate_limited"]


def test_rate_limit_charges_tokens_after_the_fact() -> None:
    # 600 tokens per minute = 10/s, burst 2 s = 20 tokens: the first request passes (the bucket is
    # not empty), its 105 tokens are charged when it ends, and a request after that is refused.
    trace = [TraceRequest(0.0, 100, 5), TraceRequest(5.0, 100, 5)]
    result = run_gateway_replay(trace, fleet(), TenantRateLimit(600.0, 600.0, burst_s=2.0), targets=TARGETS)
    assert decided(result) == ["served on r0", "rejected: rate_limited"]


def test_busy_time_is_fully_attributed_to_the_requests() -> None:
    result = run_gateway_replay(burst(6, prompt=2000), fleet(replicas=2), NoAdmission(), targets=TARGETS)
    assert sum(o.busy_s for o in result.outcomes) == pytest.approx(result.busy_s)
    assert all(o.busy_s > 0 for o in result.outcomes)


def test_sluice_admits_everything_at_light_load_and_meets_the_targets() -> None:
    # 4 requests/s for 30 s on one replica (its capacity for these sizes is tens per second).
    trace = [TraceRequest(0.25 * i, 800, 100) for i in range(120)]
    policy = SluicePolicy(admission_settings())
    result = run_gateway_replay(trace, fleet(), policy, targets=TARGETS)
    assert len(result.outcomes) == 120
    assert not any(o.rejected for o in result.outcomes)
    assert all(o.met(TARGETS) for o in result.outcomes)


def test_sluice_refuses_a_burst_it_cannot_serve_in_time_and_serves_the_rest_in_time() -> None:
    # 60 requests of 7,000 prompt tokens at once: prefill alone is ~0.9 s per 8,192-token step on
    # one H100, so a TTFT target of 1 s holds for the first few only; the rest are refused at
    # once (or after a short wait in the queue), never sent to miss.
    trace = [TraceRequest(0.0, 7000, 20) for _ in range(60)]
    policy = SluicePolicy(admission_settings())
    result = run_gateway_replay(trace, fleet(), policy, targets=TARGETS)
    served = [o for o in result.outcomes if not o.rejected]
    rejected = [o for o in result.outcomes if o.rejected]
    assert served
    assert rejected
    assert all(o.reason in {"slo_unattainable", "overloaded", "deadline_exceeded"} for o in rejected)
    assert sum(o.met(TARGETS) for o in served) >= 0.8 * len(served)


def test_forecast_recorder_decides_as_sluice_and_keeps_the_predictors_own_forecasts() -> None:
    # 20 requests/s with prompts of 800 to 7,830 tokens on one replica: more than it can serve in
    # time, so Sluice refuses some; only those it sent get a forecast.
    trace = [TraceRequest(0.05 * i, 800 + 370 * (i % 20), 50 + 13 * (i % 11)) for i in range(200)]
    settings = admission_settings((("forecast_margin", 0.25),))
    recorder = ForecastRecorder(settings)
    recorded = run_gateway_replay(trace, fleet(), recorder, targets=TARGETS)
    plain = run_gateway_replay(trace, fleet(), SluicePolicy(settings), targets=TARGETS)
    assert recorded.outcomes == plain.outcomes
    served = {o.index for o in recorded.outcomes if o.served}
    assert 0 < len(served) < len(trace)
    assert set(recorder.forecasts) == served
    forecasts = recorder.forecasts.values()
    assert all(f.scale == pytest.approx(1.25) and not f.stale for f in forecasts)
    # The margin divided out: admission held 1.25 x the TTFT against the target (every request
    # here was sent on arrival). Its TPOT is the forecast's, prefill share included, which a class
    # with a stall budget does not hold against the target (its decode step stands in).
    assert all(0.0 < 1.25 * f.ttft_s <= 1.0 and f.tpot_s > 0.0 for f in forecasts)


def test_mooncake_slots_are_spread_over_their_three_seconds() -> None:
    rows = load_mooncake_trace(count=40)
    assert rows[0].arrival_s == 0.0
    assert all(b.arrival_s >= a.arrival_s for a, b in itertools.pairwise(rows))
    # The first slot (timestamp 0) holds several requests: they are 3 s / n apart, not all at 0.
    firsts = [r for r in rows if r.arrival_s < 3.0]
    assert len(firsts) > 1
    assert len({r.arrival_s for r in firsts}) == len(firsts)
    raw = load_mooncake_trace(count=40, spread=False)
    assert sum(1 for r in raw if r.arrival_s == 0.0) == len(firsts)


def test_piecewise_rate_runs_each_phase_at_its_rate() -> None:
    base = [TraceRequest(float(i), 100, 10) for i in range(1000)]
    out = piecewise_rate(base, [(10.0, 5.0), (5.0, 20.0), (10.0, 5.0)])
    phase = [sum(1 for r in out if a <= r.arrival_s < b) for a, b in ((0, 10), (10, 15), (15, 25))]
    assert phase == [50, 100, 50]
    assert all(b.arrival_s >= a.arrival_s for a, b in itertools.pairwise(out))
    with pytest.raises(ValueError, match="phases"):
        piecewise_rate(base, [(0.0, 1.0)])
