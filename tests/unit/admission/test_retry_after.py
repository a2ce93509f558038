"""Retry-After: from the predicted drain, jittered within bounds, capped at 60 s, deterministic
with a seed, as integer seconds plus milliseconds."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from gateway.admission import RetryAfterPolicy, RetryAfterSettings
from gateway.admission.retry_after import decode_drain_s, ttft_excess_s
from gateway.http.errors import refusal_headers
from tests.unit.admission.fleet import MODEL, state

DEFAULT = RetryAfterSettings()


def policy(seed: int = 0, **overrides: float) -> RetryAfterPolicy:
    return RetryAfterPolicy(RetryAfterSettings(**overrides), random.Random(seed))


@pytest.mark.parametrize(
    ("base_s", "low", "high"),
    [
        pytest.param(0.0, 0.1, 0.15, id="nothing-to-drain-floored-at-min"),
        pytest.param(0.05, 0.1, 0.15, id="below-min-floored"),
        pytest.param(0.46, 0.46, 0.69, id="within-range"),
        pytest.param(12.0, 12.0, 18.0, id="seconds"),
        pytest.param(40.0, 40.0, 60.0, id="jitter-reaches-the-cap"),
        pytest.param(500.0, 40.0, 60.0, id="long-drain-capped-and-still-spread"),
        pytest.param(math.inf, 40.0, 60.0, id="unknown-drain-capped"),
    ],
)
def test_delay_lies_between_the_drain_and_the_drain_plus_jitter(
    base_s: float, low: float, high: float
) -> None:
    p = policy()
    for _ in range(200):
        r = p.after(base_s)
        assert low - 1e-9 <= r.delay_s <= high + 1e-9
        assert r.delay_s <= 60.0
        assert r.base_s == base_s


@pytest.mark.parametrize("delay", [0.1, 0.999, 1.0, 1.001, 59.2, 60.0])
def test_integer_seconds_and_milliseconds(delay: float) -> None:
    r = policy(jitter_fraction=0.0).after(delay)
    assert r.delay_s == pytest.approx(delay)
    assert r.seconds == max(1, math.ceil(delay))
    assert r.milliseconds == max(1, math.ceil(delay * 1000))
    assert refusal_headers(r) == {"Retry-After": str(r.seconds), "retry-after-ms": str(r.milliseconds)}


def test_same_seed_same_delays_and_different_seeds_differ() -> None:
    first = [policy(seed=3).after(5.0).delay_s for _ in range(1)]
    a, b, c = policy(seed=3), policy(seed=3), policy(seed=4)
    seq_a = [a.after(5.0).delay_s for _ in range(20)]
    seq_b = [b.after(5.0).delay_s for _ in range(20)]
    seq_c = [c.after(5.0).delay_s for _ in range(20)]
    assert seq_a == seq_b
    assert seq_a != seq_c
    assert seq_a[0] == first[0]


def test_clients_rejected_together_come_back_spread_out() -> None:
    p = policy(seed=11)
    delays = sorted(p.after(4.0).delay_s for _ in range(100))
    assert len(set(delays)) == 100
    assert delays[0] >= 4.0
    assert delays[-1] <= 6.0
    assert delays[-1] - delays[0] > 0.8 * 2.0  # they cover most of [4, 6]
    # At most a few land in any 100 ms window.
    windows = np.histogram(delays, bins=np.arange(4.0, 6.1, 0.1))[0]
    assert windows.max() <= 15


def test_a_numpy_generator_is_an_accepted_source() -> None:
    p = RetryAfterPolicy(DEFAULT, np.random.default_rng(5))
    q = RetryAfterPolicy(DEFAULT, np.random.default_rng(5))
    assert [p.after(2.0).delay_s for _ in range(5)] == [q.after(2.0).delay_s for _ in range(5)]


def test_configured_cap_below_60_holds() -> None:
    p = policy(max_s=30.0)
    assert max(p.after(1000.0).delay_s for _ in range(100)) <= 30.0


def test_no_replica_delay_is_the_configured_one_jittered() -> None:
    r = policy(no_replica_s=3.0).no_replica()
    assert 3.0 <= r.delay_s <= 4.5


@pytest.mark.parametrize(
    ("predicted", "budget", "excess"),
    [pytest.param(2.5, 2.0, 0.5, id="over"), pytest.param(1.0, 2.0, 0.0, id="fits")],
)
def test_ttft_excess_is_what_the_backlog_must_drain(predicted: float, budget: float, excess: float) -> None:
    assert ttft_excess_s(predicted, budget) == pytest.approx(excess)


def test_decode_drain_grows_with_the_excess_and_is_infinite_when_hopeless() -> None:
    replica = state(256, context=4000, kv_capacity=2_000_000)
    step = 0.06
    small, large = decode_drain_s(replica, MODEL, 0.002, step), decode_drain_s(replica, MODEL, 0.02, step)
    assert decode_drain_s(replica, MODEL, 0.0, step) == 0.0
    assert 0 < small < large < math.inf
    assert decode_drain_s(replica, MODEL, 1.0, step) == math.inf  # more than the whole batch costs
    # Known remaining output shortens the drain proportionally (memoryless finishing times).
    shorter = decode_drain_s(
        state(256, context=4000, kv_capacity=2_000_000, mean_remaining=64.0), MODEL, 0.02, step
    )
    assert shorter == pytest.approx(large * 64 / 256)
