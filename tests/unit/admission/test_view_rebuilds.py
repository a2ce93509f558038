"""When the admission engine rebuilds a replica's view: once per engine step, not once per stream.

A busy gateway relays one engine step's tokens over several milliseconds (a flood of requests
between them). A view is current until a request whose token of the view's step had landed
when it was built gets another one (the next step), or any request gets two; a request whose
token of that step was still on its way adds it without a rebuild. Real ``LiveAdmission``,
registry and prediction service on an injected clock; no sockets (the scraper is never started).
"""

from __future__ import annotations

from typing import Any, cast

from gateway.admission.live import LiveAdmission
from gateway.admission.views import TrackedStream
from gateway.app import LIVE_PREDICTION
from gateway.config.store import SettingsStore
from gateway.prediction.live import LivePredictions
from gateway.prediction.service import PredictionService
from gateway.replicas.registry import LiveRequest, ReplicaRegistry
from gateway.replicas.scraper import MetricsScraper
from tests.unit.gateway.fakes import H100_LLAMA3_8B, gateway_settings


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _admission(clock: Clock) -> tuple[LiveAdmission, ReplicaRegistry]:
    store = SettingsStore(gateway_settings({"r1": "http://127.0.0.1:9"}, hardware=H100_LLAMA3_8B))
    registry = ReplicaRegistry(store)
    scraper = MetricsScraper(cast(Any, None), interval_s=1.0, timeout_s=1.0, window_s=5.0)
    predictions = LivePredictions(registry, scraper, PredictionService(config=LIVE_PREDICTION))
    return LiveAdmission(store, registry, predictions, clock=clock), registry


def _decoding(admission: LiveAdmission, clock: Clock, count: int) -> list[LiveRequest]:
    """``count`` streams on r1, each with 3 tokens of one step landed just now."""
    streams = []
    for i in range(count):
        live = LiveRequest(f"req-{i}", 100, clock.now - 0.05, 64)
        live.tokens_streamed, live.last_token_at = 3, clock.now
        tracked = TrackedStream(live, "interactive", 64.0, 0.01, 0.05)
        admission.engine.view_cache.track("r1", live, tracked)
        streams.append(live)
    return streams


def _token(live: LiveRequest, clock: Clock) -> None:
    live.tokens_streamed += 1
    live.last_token_at = clock.now


def test_one_rebuild_per_engine_step_when_its_tokens_are_relayed_apart() -> None:
    clock = Clock()
    admission, registry = _admission(clock)
    (replica,) = registry.replicas()
    a, b, c = _decoding(admission, clock, 3)
    b.last_token_at = c.last_token_at = clock.now - 0.015  # their tokens of this step: on the way
    b.tokens_streamed = c.tokens_streamed = 2

    first = admission.engine.views_for("m", [replica], clock.now)[0]
    # The rest of the step's tokens land 3 and 6 ms later: the same view.
    for stream in (b, c):
        clock.now += 0.003
        _token(stream, clock)
        assert admission.engine.views_for("m", [replica], clock.now)[0] is first
    # The next step: a's token (it had the view's step's already) makes a new view ...
    clock.now += 0.010
    _token(a, clock)
    second = admission.engine.views_for("m", [replica], clock.now)[0]
    assert second is not first
    assert second.built_at == clock.now
    # ... and b's and c's of that step, relayed later, do not.
    for stream in (b, c):
        clock.now += 0.004
        _token(stream, clock)
        assert admission.engine.views_for("m", [replica], clock.now)[0] is second


def test_two_tokens_of_a_lagging_stream_make_a_new_view() -> None:
    clock = Clock()
    admission, registry = _admission(clock)
    (replica,) = registry.replicas()
    _, b = _decoding(admission, clock, 2)
    b.last_token_at = clock.now - 0.02
    first = admission.engine.views_for("m", [replica], clock.now)[0]
    clock.now += 0.002
    _token(b, clock)
    assert admission.engine.views_for("m", [replica], clock.now)[0] is first
    clock.now += 0.002
    _token(b, clock)  # a second one: a later step than the view's, whatever a did
    assert admission.engine.views_for("m", [replica], clock.now)[0] is not first
