"""The live gateway's streams carry what their decode has really taken (``decode_elapsed_s``),
so the per-stream stall budget judges them as the replay does.

The proxy stamps a ``LiveRequest``'s first and latest relayed token (monotonic seconds);
``TrackedStream.streaming()`` turns them into ``StreamingRequest.decode_elapsed_s``. Driven
here on a fake clock, as the proxy would drive the entry, token by token.
"""

from __future__ import annotations

import random

import pytest

from gateway.admission import Admit, Blocker, Queue, RetryAfterPolicy, SloAdmitter
from gateway.admission.shares import decode_elapsed_s
from gateway.admission.views import TrackedStream
from gateway.replicas.registry import LiveRequest
from gateway.replicas.snapshot import InFlight
from tests.unit.admission.fleet import FakeClock, request, state, view, with_class

#: The forecast TPOT the stream was admitted with (seconds): far below the 100 ms target.
PREDICTED_TPOT_S = 0.02


def relay_tokens(live: LiveRequest, clock: FakeClock, count: int, every_s: float) -> None:
    """What the proxy does per content-carrying event: count it, stamp it (the first one too)."""
    for _ in range(count):
        clock.advance(every_s)
        live.tokens_streamed += 1
        live.last_token_at = clock.now
        if live.first_token_at is None:
            live.first_token_at = clock.now


def tracked(clock: FakeClock) -> tuple[LiveRequest, TrackedStream[InFlight]]:
    live = LiveRequest("req-1", 1500, clock.now, max_tokens=1024)
    return live, TrackedStream(live, "interactive", 100.0, PREDICTED_TPOT_S)


def test_elapsed_is_first_to_latest_token() -> None:
    clock = FakeClock()
    live, stream = tracked(clock)
    assert stream.streaming().decode_elapsed_s == 0.0  # no token yet
    relay_tokens(live, clock, 1, 0.4)  # the first token, after 0.4 s of prefill
    assert stream.streaming().decode_elapsed_s == 0.0  # TTFT is not decode time
    relay_tokens(live, clock, 10, 0.05)
    assert stream.streaming().decode_elapsed_s == pytest.approx(0.5)
    assert stream.streaming().generated_tokens == 11
    clock.advance(3.0)  # no token: nothing the gateway saw changed
    same = stream.streaming()
    assert stream.streaming() is same
    assert same.decode_elapsed_s == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("first", "last", "expected"),
    [(None, None, 0.0), (5.0, None, 0.0), (None, 5.0, 0.0), (5.0, 5.0, 0.0), (5.0, 7.5, 2.5)],
)
def test_decode_elapsed_rule(first: float | None, last: float | None, expected: float) -> None:
    assert decode_elapsed_s(first, last) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("every_s", "expected"),
    [
        # Tokens as forecast (20 ms): plenty of slack earned, a 20K prompt's pause fits.
        pytest.param(0.02, Admit, id="on-forecast-stream-takes-a-long-prefill"),
        # Tokens at 96 ms (the replica got busier than forecast): its real pace leaves ~0.5 s of
        # budget, a 20K prefill pauses it ~0.85 s. Judged by the forecast alone it would pass.
        pytest.param(0.096, Queue, id="slow-stream-holds-a-long-prefill"),
    ],
)
def test_live_stream_pace_decides(every_s: float, expected: type) -> None:
    clock = FakeClock()
    live, stream = tracked(clock)
    relay_tokens(live, clock, 1, 0.3)
    relay_tokens(live, clock, 99, every_s)
    config = with_class("interactive", ttft_target_s=30.0, max_queue_wait_s=30.0, stall_budget_horizon=0.5)
    admitter = SloAdmitter(config, RetryAfterPolicy(config.retry_after, random.Random(1)))
    views = [view("a", state(32), [stream.streaming()])]
    decision = admitter.decide(request(20_000), views, clock.now)
    assert isinstance(decision, expected)
    if isinstance(decision, Queue):
        assert decision.blocker == Blocker.STREAMS_STALL
