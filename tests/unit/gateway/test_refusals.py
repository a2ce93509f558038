"""Every refusal, one table: reason -> status, type, code, Retry-After rule, headers.

``retry_after`` is the one function that computes a delay (load-driven reasons jittered within
``[d, d x (1 + jitter)]``, exact ones not); ``Refused`` (``gateway.http.errors``) the one map to the
answer. A seeded source makes the jittered delays reproducible.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from typing import Literal

import pytest

from gateway.admission.config import RetryAfterSettings
from gateway.admission.retry_after import (
    EXACT_REASONS,
    UNMEASURED_WAIT_S,
    RefusalReason,
    RetryAfter,
    retry_after,
)
from gateway.http.errors import SHOULD_RETRY, Refused, error_response

SETTINGS = RetryAfterSettings()  # jitter 0.5, min 0.1 s, max 60 s
JITTER = SETTINGS.jitter_fraction


@dataclass(frozen=True)
class Case:
    """One reason's contract: its answer and its Retry-After rule (``jittered`` from the wait,
    ``exact``: the wait itself, ``never``: not retryable, no delay is ever computed)."""

    id: str
    reason: RefusalReason
    status: int
    error_type: str
    code: str
    rule: Literal["jittered", "exact", "never"]


_503 = "service_unavailable_error"
CASES = [
    Case("budget", RefusalReason.RATE_LIMITED, 429, "rate_limit_exceeded", "rate_limit_exceeded", "jittered"),
    Case(
        "budget-store-down", RefusalReason.LIMITER_UNAVAILABLE, 503, _503, "rate_limit_unavailable", "exact"
    ),
    Case("admission-overloaded", RefusalReason.OVERLOADED, 429, "overloaded", "overloaded", "jittered"),
    Case(
        "slo-unattainable",
        RefusalReason.SLO_UNATTAINABLE,
        429,
        "slo_unattainable",
        "slo_unattainable",
        "jittered",
    ),
    Case(
        "deadline", RefusalReason.DEADLINE_EXCEEDED, 429, "deadline_exceeded", "deadline_exceeded", "jittered"
    ),
    Case("no-replica", RefusalReason.NO_HEALTHY_REPLICA, 503, _503, "no_healthy_replica", "jittered"),
    Case("replica-overload", RefusalReason.REPLICAS_SATURATED, 429, "overloaded", "overloaded", "jittered"),
    Case("shutdown", RefusalReason.SHUTTING_DOWN, 503, _503, "server_shutting_down", "exact"),
    Case(
        "prompt-too-large",
        RefusalReason.PROMPT_TOO_LARGE,
        400,
        "invalid_request_error",
        "prompt_too_large",
        "never",
    ),
]
RETRYABLE = [c for c in CASES if c.rule != "never"]
JITTERED = [c for c in CASES if c.rule == "jittered"]


def _id(case: Case) -> str:
    return case.id


def test_the_table_covers_every_reason() -> None:
    assert {c.reason for c in CASES} == set(RefusalReason)
    assert {c.reason for c in CASES if c.rule == "exact"} == EXACT_REASONS


@pytest.mark.parametrize("case", RETRYABLE, ids=_id)
@pytest.mark.parametrize("wait_s", [0.0, 0.4, 2.5, 39.0, 75.0, math.inf])
def test_the_delay_follows_the_reasons_rule(case: Case, wait_s: float) -> None:
    """Jittered: never before the wait (floored at ``min_s``), at most ``1 + jitter`` times it,
    never past 60 s. Exact: the wait itself, capped at 60 s, whatever the source would draw."""
    rng = random.Random(7)
    for _ in range(50):
        r = retry_after(case.reason, wait_s, SETTINGS, rng)
        assert 1 <= r.seconds <= 60
        assert 1 <= r.milliseconds <= 60_000
        assert r.seconds == max(1, math.ceil(r.delay_s))
        assert r.milliseconds == max(1, math.ceil(r.delay_s * 1000))
        assert r.base_s == wait_s
        if case.rule == "jittered":
            d = min(max(wait_s, SETTINGS.min_s), SETTINGS.max_s / (1 + JITTER))
            assert d - 1e-9 <= r.delay_s <= min(d * (1 + JITTER), SETTINGS.max_s) + 1e-9
        else:
            assert r.delay_s == min(wait_s, 60.0)


@pytest.mark.parametrize("case", JITTERED, ids=_id)
def test_load_driven_delays_spread_and_repeat_with_a_seed(case: Case) -> None:
    first = [retry_after(case.reason, 4.0, SETTINGS, random.Random(3)).delay_s for _ in range(1)]
    rng_a, rng_b = random.Random(3), random.Random(3)
    a = [retry_after(case.reason, 4.0, SETTINGS, rng_a).delay_s for _ in range(40)]
    b = [retry_after(case.reason, 4.0, SETTINGS, rng_b).delay_s for _ in range(40)]
    assert a == b
    assert a[0] == first[0]
    assert len(set(a)) == 40
    assert max(a) - min(a) > 0.7 * 4.0 * JITTER  # they cover most of [4, 6]


@pytest.mark.parametrize("reason", sorted(EXACT_REASONS))
def test_an_exact_wait_draws_nothing_and_needs_no_source(reason: RefusalReason) -> None:
    """The budget store's next probe and a shutdown are exact: no jitter; nothing is drawn, so
    no source is needed."""

    class Refuses:
        def random(self) -> float:
            raise AssertionError("an exact wait drew from the source")

    assert retry_after(reason, 2.25, SETTINGS, Refuses()).delay_s == 2.25
    assert retry_after(reason, 2.25).milliseconds == 2250


def test_a_jittered_wait_without_a_source_is_an_error() -> None:
    with pytest.raises(ValueError, match="uniform source"):
        retry_after(RefusalReason.OVERLOADED, 1.0)


def test_the_unmeasured_wait_is_one_second() -> None:
    assert retry_after(RefusalReason.SHUTTING_DOWN, UNMEASURED_WAIT_S).seconds == 1


RETRY = RetryAfter(delay_s=2.2, seconds=3, milliseconds=2200, base_s=2.0)


@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("retryable", [True, False], ids=["retryable", "not-retryable"])
def test_each_refusal_maps_to_status_headers_and_body(case: Case, retryable: bool) -> None:
    err = Refused(case.reason, "no", retry_after=RETRY if retryable else None)
    response = error_response(err)
    assert response.status == case.status
    headers = {k: v for k, v in response.headers.items() if k != "Content-Type"}
    if retryable:
        assert headers == {"Retry-After": "3", "retry-after-ms": "2200"}
        assert err.retry_after_s == 2.2
    else:
        assert headers == {SHOULD_RETRY: "false"}
        assert err.retry_after_s is None
    assert response.body is not None
    body = json.loads(bytes(response.body))  # type: ignore[arg-type]
    assert body == {"error": {"message": "no", "type": case.error_type, "param": None, "code": case.code}}
