"""The admitter's per-view forecast memo (``SloAdmitter._forecast``) changes no decision.

A flood of alike requests is decided against views that live for many decisions; the admitter
keeps each view's forecasts by request. Every case here decides a sequence of requests with one
admitter (the memo warm, shared across the sequence) and each request again with a fresh admitter
(no memo), both seeded alike per request, under a fake clock: the decisions must be equal, field
for field (Retry-After jitter, message, forecast numbers). A view rebuilt on a new state, a refit
(new step model) and a stale view of the same state must not reuse a forecast made for another.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from gateway.admission import AdmissionRequest, Decision, ReplicaView
from gateway.admission.retry_after import RetryAfterPolicy
from gateway.admission.slo_admitter import SloAdmitter
from predictor import GPUS, MODELS, roofline_prior
from tests.unit.admission.fleet import SETTINGS, FakeClock, request, state, streams, view

#: Another step model for the same replica (a refit gives a new object with other numbers).
REFIT = roofline_prior(MODELS["Llama-3-8B"], GPUS["A100-80GB-SXM"])


class _Seeded:
    """A uniform source whose next draws are reset per decision (both admitters draw alike)."""

    def __init__(self) -> None:
        self.rng = random.Random(0)

    def reseed(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def random(self) -> float:
        return self.rng.random()


def _admitter(source: _Seeded) -> SloAdmitter:
    return SloAdmitter(SETTINGS, RetryAfterPolicy(SETTINGS.retry_after, source))


def _fields(decision: Decision) -> dict[str, object]:
    return {f.name: getattr(decision, f.name) for f in dataclasses.fields(decision)}


FULL = view("full", state(250, context=3000, queued=[6000, 6000]), streams(8))
BUSY = view("busy", state(64, context=2000, queued=[2000]), streams(4))
IDLE = view("idle", state())
FULL_AGAIN = view("full", state(250, context=3000, queued=[6000]), streams(8))  # rebuilt: new state
FULL_REFIT = dataclasses.replace(FULL, model=REFIT)  # same state object, new step model
FULL_STALE = dataclasses.replace(FULL, stale=True)  # same state and model, stale margin applies


def _flood(n: int, **kw: object) -> list[AdmissionRequest]:
    return [request(request_id=f"f{i}", **kw) for i in range(n)]  # type: ignore[arg-type]


CASES: list[tuple[str, list[tuple[AdmissionRequest, list[ReplicaView]]]]] = [
    (
        "alike-rejections",
        [(r, [FULL]) for r in _flood(5, prompt=40, max_tokens=16, deadline=1000.05)],
    ),
    (
        "alike-on-two-replicas",
        [(r, [FULL, BUSY]) for r in _flood(4, prompt=300, deadline=1000.05)],
    ),
    (
        "sizes-interleaved",
        [
            (request(prompt=p, request_id=f"s{p}", deadline=1000.05), [FULL, BUSY])
            for p in (40, 800, 40, 800, 40)
        ],
    ),
    (
        "admitted-then-rejected",
        [
            (request(prompt=40, request_id="a"), [IDLE]),
            (request(prompt=40, request_id="b", deadline=1000.001), [IDLE]),
        ],
    ),
    (
        "view-rebuilt",
        [
            (request(prompt=40, request_id="x", deadline=1000.05), [FULL]),
            (request(prompt=40, request_id="y", deadline=1000.05), [FULL_AGAIN]),
            (request(prompt=40, request_id="z", deadline=1000.05), [FULL]),
        ],
    ),
    (
        "refit-same-state",
        [
            (request(prompt=40, request_id="x", deadline=1000.05), [FULL]),
            (request(prompt=40, request_id="y", deadline=1000.05), [FULL_REFIT]),
        ],
    ),
    (
        "stale-same-state",
        [
            (request(prompt=40, request_id="x", deadline=1000.05), [FULL]),
            (request(prompt=40, request_id="y", deadline=1000.05), [FULL_STALE]),
            (request(prompt=40, request_id="z", deadline=1000.05), [FULL]),
        ],
    ),
    (
        "batch-class",
        [(request(prompt=2000, request_class="batch", request_id=f"b{i}"), [FULL, BUSY]) for i in range(3)],
    ),
]


@pytest.mark.parametrize(("sequence"), [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_memoised_decisions_equal_fresh_ones(
    sequence: list[tuple[AdmissionRequest, list[ReplicaView]]],
) -> None:
    clock = FakeClock()
    warm_source, fresh_source = _Seeded(), _Seeded()
    warm = _admitter(warm_source)
    for i, (req, views) in enumerate(sequence):
        now = clock.advance(0.0005)
        warm_source.reseed(i)
        fresh_source.reseed(i)
        got = warm.decide(req, views, now)
        want = _admitter(fresh_source).decide(req, views, now)
        assert type(got) is type(want)
        assert _fields(got) == _fields(want)


def test_alike_requests_share_one_forecast_per_view() -> None:
    """The memo is used: alike requests on one view get the very same ``Forecast`` object, and a
    rebuilt view (new state) a new one."""
    admitter = _admitter(_Seeded())
    first = admitter.decide(request(prompt=40, deadline=1000.05), [FULL], 1000.0)
    again = admitter.decide(request(prompt=40, request_id="other", deadline=1000.05), [FULL], 1000.001)
    rebuilt = admitter.decide(request(prompt=40, deadline=1000.05), [FULL_AGAIN], 1000.002)
    assert first.forecast is not None
    assert again.forecast is first.forecast
    assert rebuilt.forecast is not first.forecast
