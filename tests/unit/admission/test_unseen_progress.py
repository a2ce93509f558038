"""A non-streamed request's progress, as admission estimates it (``TrackedStream.tokens_at``).

The gateway sees a non-streamed response only when it ends, so ``tokens_streamed`` stays 0 while
the replica decodes it. Taken at face value, every such request in flight would be a prompt still
waiting for its prefill, and each newcomer's forecast would queue behind all of them however long
they had run. Admission estimates their tokens from their own forecast at dispatch instead; a
stream's tokens are the ones relayed, whatever the clock says.
"""

from __future__ import annotations

import math

import pytest

from gateway.admission.views import TrackedStream
from gateway.prediction.state import Limits, Load, replica_state
from gateway.replicas.registry import LiveRequest
from gateway.replicas.snapshot import InFlight
from predictor import GPUS, MODELS, ReplicaState, roofline_prior

STARTED = 100.0
TTFT_S = 0.2
TPOT_S = 0.02


def _tracked(
    *, streamed: bool, max_tokens: int | None = 256, ttft_s: float = TTFT_S
) -> tuple[LiveRequest, TrackedStream[InFlight]]:
    live = LiveRequest("r", 1000, STARTED, max_tokens, streamed=streamed)
    return live, TrackedStream(live, "interactive", 120.0, TPOT_S, ttft_s)


#: (name, seconds after dispatch, output cap, the tokens estimated)
CASES = [
    ("before-its-first-token", 0.1, 256, 0),
    ("its-first-token", TTFT_S, 256, 1),
    ("ten-steps-later", TTFT_S + 10 * TPOT_S + 1e-9, 256, 11),
    ("long-past-its-cap-it-is-still-running", 60.0, 256, 255),
    ("no-cap", 60.0, None, 1 + int((60.0 - TTFT_S) / TPOT_S)),
]


@pytest.mark.parametrize(("name", "after_s", "cap", "tokens"), CASES, ids=[c[0] for c in CASES])
def test_a_non_streamed_request_progresses_at_its_forecast(
    name: str, after_s: float, cap: int | None, tokens: int
) -> None:
    _, tracked = _tracked(streamed=False, max_tokens=cap)
    now = STARTED + after_s
    assert tracked.tokens_at(now) == tokens
    assert tracked.in_flight(now).tokens_streamed == tokens
    assert tracked.streaming(now).generated_tokens == tokens
    # No token was seen: nothing about the step cycle is claimed, and the stall budget counts
    # its tokens at its predicted TPOT.
    assert tracked.in_flight(now).last_token_at is None
    assert tracked.streaming(now).decode_elapsed_s is None


def test_a_stream_counts_only_the_tokens_relayed() -> None:
    live, tracked = _tracked(streamed=True)
    assert tracked.tokens_at(STARTED + 60.0) == 0
    live.tokens_streamed, live.last_token_at = 3, STARTED + 0.3
    assert tracked.tokens_at(STARTED + 60.0) == 3
    assert tracked.in_flight(STARTED + 60.0) == live.freeze()


def test_without_a_forecast_nothing_is_assumed() -> None:
    _, tracked = _tracked(streamed=False, ttft_s=math.nan)
    assert tracked.tokens_at(STARTED + 60.0) == 0


def test_long_running_non_streamed_requests_are_not_queued_prefill() -> None:
    """The replica's state with 16 non-streamed requests dispatched 5 s ago: decoding, not 16
    prompts of prefill queued ahead of the next request."""
    model = roofline_prior(MODELS["Llama-3-8B"], GPUS["H100-SXM"])
    limits = Limits(
        kv_capacity_tokens=400_000, max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=8192
    )
    tracked = [_tracked(streamed=False)[1] for _ in range(16)]
    now = STARTED + 5.0

    def state(in_flight: list[InFlight]) -> ReplicaState:
        return replica_state(
            in_flight,
            None,
            limits=limits,
            load=Load(),
            remaining=lambda generated, caps: [max(0.0, 120.0 - g) for g in generated],
            stale=False,
            model=model,
            now=now,
            last_boundary=None,
        )

    as_seen = state([t.live.freeze() for t in tracked])  # what admission used to take
    estimated = state([t.in_flight(now) for t in tracked])
    assert as_seen.queued_prefill_tokens == 16 * 1000
    assert estimated.queued_prefill_tokens == 0
    assert estimated.decode_seqs == 16
