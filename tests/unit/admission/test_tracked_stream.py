"""``TrackedStream`` keeps a stream's immutable forms between view rebuilds, never stale ones.

Whatever the proxy does to a ``LiveRequest`` between two rebuilds (tokens streamed, the real
prompt size arriving, a token's time), ``in_flight()`` equals a fresh ``freeze()`` and
``streaming()`` a fresh ``StreamingRequest``; while nothing changed they are the same objects.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.admission.shares import StreamingRequest, decode_elapsed_s
from gateway.admission.views import TrackedStream
from gateway.replicas.registry import LiveRequest
from gateway.replicas.snapshot import InFlight

#: One change the proxy makes to a live entry: (field, value).
CHANGES = st.lists(
    st.one_of(
        st.tuples(st.just("token"), st.floats(min_value=0.0, max_value=1e6, allow_nan=False)),
        st.tuples(st.just("prompt"), st.integers(min_value=1, max_value=100_000)),
        st.tuples(st.just("nothing"), st.just(0)),
    ),
    max_size=40,
)


def fresh_streaming(live: LiveRequest) -> StreamingRequest:
    elapsed = decode_elapsed_s(live.first_token_at, live.last_token_at)
    return StreamingRequest("standard", live.prompt_tokens, live.tokens_streamed, 120.0, 0.03, elapsed)


# No per-example deadline: hypothesis's default 200 ms is a wall-clock bound a shared host can miss.
@settings(deadline=None)
@given(CHANGES)
def test_its_forms_always_equal_a_fresh_build(changes: list[tuple[str, float]]) -> None:
    live = LiveRequest("req-1", 500, 10.0, max_tokens=256)
    tracked: TrackedStream[InFlight] = TrackedStream(live, "standard", 120.0, 0.03)
    for kind, value in changes:
        before_frozen, before_streaming = tracked.in_flight(), tracked.streaming()
        if kind == "token":
            live.tokens_streamed += 1
            live.last_token_at = value
            if live.first_token_at is None:
                live.first_token_at = value
        elif kind == "prompt":
            live.prompt_tokens = int(value)
        assert tracked.in_flight() == live.freeze()
        assert tracked.streaming() == fresh_streaming(live)
        if kind == "nothing":
            assert tracked.in_flight() is before_frozen
            assert tracked.streaming() is before_streaming


def test_a_token_at_the_same_instant_still_counts() -> None:
    live = LiveRequest("req-2", 50, 1.0)
    tracked: TrackedStream[InFlight] = TrackedStream(live, "batch", 10.0, 0.05)
    live.tokens_streamed, live.last_token_at = 1, 2.0
    first = tracked.in_flight()
    live.tokens_streamed += 1  # same clock reading (coarse clocks): the count alone changed
    assert tracked.in_flight() == live.freeze()
    assert tracked.in_flight() is not first
    assert tracked.streaming().generated_tokens == 2
