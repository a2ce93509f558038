"""Token-bucket arithmetic (gateway.limits.bucket) and TenantLimits, case by case."""

from __future__ import annotations

import math

import pytest

from gateway.limits import bucket
from gateway.limits.base import (
    BucketState,
    TenantLimits,
    overall_retry_after,
    request_bucket_state,
    token_bucket_state,
)

# rate 2 tokens/s, capacity 10 tokens throughout.
RATE, CAP = 2.0, 10.0


@pytest.mark.parametrize(
    ("full_at", "now", "expected"),
    [
        pytest.param(-math.inf, 100.0, 10.0, id="never-used-is-full"),
        pytest.param(99.0, 100.0, 10.0, id="full-in-the-past"),
        pytest.param(100.0, 100.0, 10.0, id="full-right-now"),
        pytest.param(102.0, 100.0, 6.0, id="two-seconds-short"),
        pytest.param(105.0, 100.0, 0.0, id="empty"),
        pytest.param(110.0, 100.0, -10.0, id="in-debt"),
    ],
)
def test_level_at(full_at: float, now: float, expected: float) -> None:
    assert bucket.level_at(full_at, now, RATE, CAP) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("level", "expected"),
    [
        pytest.param(10.0, 100.0, id="full-is-now"),
        pytest.param(12.0, 100.0, id="above-capacity-is-now"),
        pytest.param(6.0, 102.0, id="four-short"),
        pytest.param(-10.0, 110.0, id="debt"),
    ],
)
def test_full_at_for_inverts_level_at(level: float, expected: float) -> None:
    full_at = bucket.full_at_for(level, 100.0, RATE, CAP)
    assert full_at == pytest.approx(expected)
    assert bucket.level_at(full_at, 100.0, RATE, CAP) == pytest.approx(min(level, CAP))


@pytest.mark.parametrize(
    ("need", "level", "expected_s"),
    [
        pytest.param(4.0, 6.0, 0.0, id="fits-now"),
        pytest.param(6.0, 6.0, 0.0, id="fits-exactly"),
        pytest.param(8.0, 6.0, 1.0, id="two-short"),
        pytest.param(1.0, -5.0, 3.0, id="pay-off-debt-first"),
    ],
)
def test_wait_for(need: float, level: float, expected_s: float) -> None:
    assert bucket.wait_for(need, level, RATE) == pytest.approx(expected_s)


@pytest.mark.parametrize(
    ("level", "expected_s"),
    [
        pytest.param(10.0, 0.0, id="full"),
        pytest.param(4.0, 3.0, id="six-short"),
        pytest.param(-2, 6.0, id="debt"),
    ],
)
def test_reset_after(level: float, expected_s: float) -> None:
    assert bucket.reset_after(level, RATE, CAP) == pytest.approx(expected_s)


@pytest.mark.parametrize(
    ("level", "diff", "expected"),
    [
        pytest.param(5.0, -3.0, 8.0, id="refund"),
        pytest.param(5.0, -30.0, 10.0, id="refund-capped-at-capacity"),
        pytest.param(5.0, 8.0, -3.0, id="charge-into-debt"),
        pytest.param(5.0, 0.0, 5.0, id="exact-estimate"),
    ],
)
def test_settled_level(level: float, diff: float, expected: float) -> None:
    assert bucket.settled_level(level, diff, CAP) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("limit", "share", "expected"),
    [
        pytest.param(10, 1.0, 10, id="whole"),
        pytest.param(10, 0.5, 5, id="half"),
        pytest.param(10, 1 / 3, 4, id="third-rounds-up"),
        pytest.param(9, 1 / 3, 3, id="third-exact-despite-float"),
        pytest.param(1, 0.1, 1, id="never-zero"),
    ],
)
def test_scaled_concurrency(limit: int, share: float, expected: int) -> None:
    assert bucket.scaled_concurrency(limit, share) == expected


@pytest.mark.parametrize(
    ("limits", "token_capacity", "request_capacity"),
    [
        pytest.param(TenantLimits(), None, None, id="unlimited"),
        pytest.param(TenantLimits(tokens_per_minute=600), 600, None, id="token-burst-defaults-to-a-minute"),
        pytest.param(TenantLimits(tokens_per_minute=600, token_burst=50), 50, None, id="token-burst-set"),
        pytest.param(TenantLimits(requests_per_minute=0.5), None, 1.0, id="request-bucket-holds-one"),
        pytest.param(TenantLimits(requests_per_minute=30, request_burst=5), None, 5, id="request-burst-set"),
        pytest.param(TenantLimits(token_burst=50), None, None, id="burst-without-rate-limits-nothing"),
    ],
)
def test_capacities(
    limits: TenantLimits, token_capacity: float | None, request_capacity: float | None
) -> None:
    assert (limits.token_capacity, limits.request_capacity) == (token_capacity, request_capacity)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param(
            {"tokens_per_minute": 0}, "tokens_per_minute must be a finite number > 0", id="zero-rate"
        ),
        pytest.param({"requests_per_minute": -1}, "requests_per_minute must be", id="negative-rate"),
        pytest.param({"token_burst": math.inf}, "token_burst must be", id="infinite-burst"),
        pytest.param(
            {"request_burst": 0.5}, "request_burst must be a finite number >= 1", id="burst-below-one"
        ),
        pytest.param({"max_concurrent": 0}, "max_concurrent must be >= 1", id="no-concurrency"),
    ],
)
def test_invalid_limits(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TenantLimits(**kwargs)  # type: ignore[arg-type]


def test_scaled_limits_are_a_share_of_every_budget() -> None:
    limits = TenantLimits(tokens_per_minute=600, requests_per_minute=60, max_concurrent=10, token_burst=300)
    assert limits.scaled(0.25) == TenantLimits(
        tokens_per_minute=150, requests_per_minute=15, max_concurrent=3, token_burst=75, request_burst=15
    )
    assert limits.scaled(1.0) is limits
    assert TenantLimits(requests_per_minute=2).scaled(0.1).request_capacity == 1.0


@pytest.mark.parametrize(
    ("blocked", "oversize", "token_wait", "request_wait", "expected"),
    [
        pytest.param(frozenset(), False, 0.0, 0.0, 0.0, id="allowed"),
        pytest.param(frozenset({"tokens"}), False, 3.0, 0.0, 3.0, id="tokens"),
        pytest.param(frozenset({"tokens", "requests"}), False, 3.0, 7.0, 7.0, id="both-buckets-longest"),
        pytest.param(frozenset({"concurrency"}), False, 0.0, 0.0, None, id="concurrency-unknown"),
        pytest.param(frozenset({"tokens", "concurrency"}), False, 3.0, 0.0, 3.0, id="lower-bound"),
        pytest.param(frozenset({"tokens"}), True, math.inf, 0.0, None, id="oversize-never"),
    ],
)
def test_overall_retry_after(
    blocked: frozenset[str], oversize: bool, token_wait: float, request_wait: float, expected: float | None
) -> None:
    tokens = BucketState(
        limit_per_minute=60, capacity=60, remaining=0, reset_after_s=60, retry_after_s=token_wait
    )
    requests = BucketState(
        limit_per_minute=6, capacity=6, remaining=0, reset_after_s=60, retry_after_s=request_wait
    )
    assert overall_retry_after(blocked, oversize, tokens, requests) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("level", "need", "blocked", "oversize", "remaining", "reset_after_s", "retry_after_s"),
    [
        pytest.param(40.0, 10.0, False, False, 40.0, 20.0, 0.0, id="allowed"),
        pytest.param(4.0, 10.0, True, False, 4.0, 56.0, 6.0, id="blocked"),
        pytest.param(60.0, 100.0, True, True, 60.0, 0.0, math.inf, id="oversize"),
    ],
)
def test_token_bucket_state(
    level: float,
    need: float,
    blocked: bool,
    oversize: bool,
    remaining: float,
    reset_after_s: float,
    retry_after_s: float,
) -> None:
    limits = TenantLimits(tokens_per_minute=60)  # 1 token/s, capacity 60
    state = token_bucket_state(limits, level, need, blocked=blocked, oversize=oversize)
    assert state == BucketState(60, 60, remaining, pytest.approx(reset_after_s), retry_after_s)  # type: ignore[arg-type]


def test_unlimited_buckets_have_no_state() -> None:
    assert token_bucket_state(TenantLimits(), math.inf, 5, blocked=False) is None
    assert request_bucket_state(TenantLimits(max_concurrent=3), math.inf, blocked=False) is None
