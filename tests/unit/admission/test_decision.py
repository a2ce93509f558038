"""The per-request decision: routing by slack, targets, running streams, batch isolation, stale
replicas, deadlines, prompt limits, unhealthy and uncalibrated replicas, shadow mode."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from gateway.admission import (
    AdmissionSettings,
    Admit,
    Blocker,
    Queue,
    Reject,
    RejectReason,
    ReplicaView,
    RetryAfterPolicy,
    ShadowSettings,
    SloAdmitter,
    make_admitter,
)
from gateway.admission.retry_after import decode_drain_s
from predictor import StepModel, forecast_request
from predictor.correction import Correction
from tests.unit.admission.fleet import (
    MODEL,
    SETTINGS,
    UNKNOWN,
    FakeClock,
    request,
    settings,
    state,
    streams,
    view,
    with_class,
)

NOW = 1000.0
#: Interactive with a loose TTFT target, so only the rule under test can block.
LOOSE_TTFT = with_class("interactive", ttft_target_s=30.0, max_queue_wait_s=30.0)


def admitter(config: AdmissionSettings = SETTINGS, seed: int = 1) -> SloAdmitter:
    return SloAdmitter(config, RetryAfterPolicy(config.retry_after, random.Random(seed)))


def decide(views: list[ReplicaView], prompt: int = 500, config: AdmissionSettings = SETTINGS, **kw: object):
    return admitter(config).decide(request(prompt, **kw), views, NOW)  # type: ignore[arg-type]


# -- routing -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("views", "expected"),
    [
        pytest.param([view("busy", state(128)), view("idle", state())], "idle", id="idle-beats-busy"),
        pytest.param(
            [view("long-queue", state(8, queued=[8000] * 3)), view("short-queue", state(8, queued=[1000]))],
            "short-queue",
            id="short-prefill-queue-beats-long",
        ),
        pytest.param(
            [view("busy", state(64)), view("idle-down", state(), healthy=False)],
            "busy",
            id="unhealthy-never-chosen",
        ),
        pytest.param(
            [view("a", state(16)), view("b", state(16, context=8000))],
            "a",
            id="less-kv-to-read-means-faster-tpot",
        ),
        pytest.param(
            [view("no-model", state(), model=UNKNOWN), view("modelled", state(64))],
            "modelled",
            id="modelled-replica-preferred-over-uncalibrated",
        ),
    ],
)
def test_routes_to_the_replica_with_the_most_slack(views: list[ReplicaView], expected: str) -> None:
    decision = decide(views)
    assert isinstance(decision, Admit)
    assert decision.replica == expected


@pytest.mark.parametrize(
    ("gateway_streams", "expected"),
    [
        pytest.param((3, 0), "second", id="fewer-gateway-requests-wins-a-tie"),
        pytest.param((0, 3), "first", id="whichever-is-listed"),
        pytest.param((0, 0), "first", id="a-full-tie-keeps-the-listed-order"),
    ],
)
def test_equal_slacks_go_to_the_replica_with_fewer_gateway_requests(
    gateway_streams: tuple[int, int], expected: str
) -> None:
    """Replicas whose forecasts come out equal (the gateway's newest requests not yet running
    there: nothing in the replica's state tells them apart) are balanced by the gateway's own
    count, not all sent to the first one listed."""
    first = replace(view("first", state()), gateway_streams=gateway_streams[0])
    second = replace(view("second", state()), gateway_streams=gateway_streams[1])

    decision = decide([first, second])

    assert isinstance(decision, Admit)
    assert decision.replica == expected


#: A step model 50 % slower than ``MODEL`` in every coefficient: a replica whose fit is still its
#: prior, or came from a few windows on a busy host, next to replicas fitted from their traffic.
SLOW_FIT = StepModel(MODEL.params.with_coefficients([1.5 * c for c in MODEL.params.coefficients()]))


@pytest.mark.parametrize("position", [0, 1, 2])
@pytest.mark.parametrize(
    ("ttft_target_s", "expected"),
    [
        # 5 s: the first tokens differ by ~8 ms (26 against 18), 0.15 % of the target, within
        # ``_SLACK_TIE`` (1 %).
        pytest.param(5.0, "idle-slow-fit", id="comparable-slacks-go-to-the-least-loaded"),
        # 0.5 s: the same ~8 ms is 1.5 % of the target: the most slack decides.
        pytest.param(0.5, "busy", id="a-clear-slack-difference-still-decides"),
    ],
)
def test_comparable_slacks_go_to_the_replica_with_fewest_gateway_requests(
    ttft_target_s: float, expected: str, position: int
) -> None:
    """An idle replica whose step model forecasts a little slower than the others' (first token
    ~8 ms later, far inside a 5 s target) gets the request rather than replicas already holding
    eight of the gateway's streams: ranked on such differences alone it would get none, ever, and
    so never the traffic that corrects its fit (the mixed-fleet test's vLLM served 3 of 754
    requests). Where the difference matters against the target, the most slack still wins. The
    choice does not depend on where the idle replica is listed."""
    config = with_class("interactive", ttft_target_s=ttft_target_s, tpot_target_s=50.0, max_queue_wait_s=0.0)
    views = [view(f"busy-{i}", state(8), streams(8)) for i in range(2)]
    views.insert(position, view("idle-slow-fit", state(), model=SLOW_FIT))

    decision = decide(views, config=config)

    assert isinstance(decision, Admit)
    assert decision.replica.startswith(expected), decision.replica


def test_slack_is_the_tightest_constraint_as_a_fraction_of_its_target() -> None:
    replica = state(16)
    f = forecast_request(request(500).candidate(replica.max_model_len), replica, MODEL)
    cls = SETTINGS.classes["interactive"]
    expected = min(
        (cls.ttft_target_s - f.ttft_s) / cls.ttft_target_s, (cls.tpot_target_s - f.tpot_s) / cls.tpot_target_s
    )
    decision = decide([view("a", replica)])
    assert isinstance(decision, Admit)
    assert decision.slack == pytest.approx(expected)
    assert decision.forecast == f


def test_time_already_waited_counts_against_the_ttft_target() -> None:
    # The same replica admits a fresh request but not one that arrived 1.9 s ago.
    views = [view("a", state(8, queued=[8192] * 3))]
    fresh = admitter().decide(request(500, arrival=NOW), views, NOW)
    late = admitter().decide(request(500, arrival=NOW - 1.9), views, NOW)
    assert isinstance(fresh, Admit)
    assert isinstance(late, Reject)
    assert late.blocker == Blocker.TTFT


# -- the request's own targets -----------------------------------------------------------------


def test_ttft_miss_is_rejected_at_once_with_retry_after_from_the_excess() -> None:
    replica = state(8, queued=[8192] * 8)
    decision = decide([view("a", replica)])
    assert isinstance(decision, Reject)
    assert decision.reason == RejectReason.SLO_UNATTAINABLE
    assert decision.blocker == Blocker.TTFT
    assert decision.forecast is not None
    excess = decision.forecast.ttft_s - SETTINGS.classes["interactive"].ttft_target_s
    assert excess > 0
    assert decision.retry_after is not None
    assert decision.retry_after.base_s == pytest.approx(excess)


def test_tpot_miss_waits_for_the_decode_batch_to_drain() -> None:
    config = with_class("interactive", tpot_target_s=0.05, ttft_target_s=30.0, max_queue_wait_s=30.0)
    replica = state(256, context=4000, kv_capacity=2_000_000)
    decision = decide([view("a", replica)], config=config)
    assert isinstance(decision, Queue)
    assert decision.blocker == Blocker.TPOT
    f = forecast_request(request(500).candidate(replica.max_model_len), replica, MODEL)
    assert decision.earliest_retry_s == pytest.approx(
        decode_drain_s(replica, MODEL, f.tpot_s - 0.05, f.tpot_s)
    )
    assert 0 < decision.earliest_retry_s < 30


def test_tpot_target_below_an_empty_step_is_not_retryable() -> None:
    config = with_class("interactive", tpot_target_s=0.005)  # an empty step takes ~7 ms
    decision = decide([view("a", state(8))], config=config)
    assert isinstance(decision, Reject)
    assert decision.reason == RejectReason.SLO_UNATTAINABLE
    assert decision.retry_after is None
    assert "idle replica" in decision.message


def test_tpot_over_target_from_the_replicas_steady_state_waits_it_out() -> None:
    """A replica whose recent arrivals settle it at long steps (its steady state: 120 ms, a
    burst's) forecasts a TPOT over a 50 ms target that no number of its 8 running decodes leaving
    would cure, while an idle copy serves it at ~7 ms a step. Not hopeless: the load passes as
    its requests are replaced. Before, the infinite drain refused it at once, "not attainable
    even on an idle replica", with no Retry-After."""
    config = with_class("interactive", tpot_target_s=0.05, ttft_target_s=30.0, max_queue_wait_s=30.0)
    busy = replace(state(8, mean_remaining=100.0), steady_step_s=0.12)
    f = forecast_request(request(500).candidate(busy.max_model_len), busy, MODEL)
    assert f.tpot_s > 0.05  # the steady state's step, blended in, breaks the target
    assert math.isinf(decode_drain_s(busy, MODEL, f.tpot_s - 0.05, f.tpot_s))
    decision = decide([view("a", busy)], config=config)
    assert isinstance(decision, Queue)
    assert decision.blocker == Blocker.TPOT
    # A typical running request's remaining duration at the forecast TPOT.
    assert decision.earliest_retry_s == pytest.approx(100.0 * f.tpot_s)
    # With a first-token target the wait cannot fit: refused, with a Retry-After, not as hopeless.
    tight = with_class("interactive", tpot_target_s=0.05, ttft_target_s=1.0, max_queue_wait_s=1.0)
    refused = decide([view("a", busy)], config=tight)
    assert isinstance(refused, Reject)
    assert refused.retry_after is not None
    assert "idle replica" not in refused.message


def test_prompt_too_long_for_the_ttft_target_even_when_idle_is_not_retryable() -> None:
    decision = decide([view("a", state())], prompt=100_000)
    assert isinstance(decision, Reject)
    assert decision.reason == RejectReason.SLO_UNATTAINABLE
    assert decision.retry_after is None


# -- protecting running streams ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        pytest.param(500, Admit, id="short-prompt-admitted"),
        pytest.param(5_000, Admit, id="medium-prompt-admitted"),
        pytest.param(100_000, Queue, id="long-prompt-held"),
    ],
)
def test_newcomer_must_keep_running_streams_within_their_tpot_target(prompt: int, expected: type) -> None:
    # 32 interactive streams predicted at 90 ms/token against a 100 ms target: 10 ms headroom.
    # A 100K prompt's 13 prefill steps add ~37 ms/token on average over their window.
    tight = [view("tight", state(32), streams(32, tpot_s=0.09))]
    decision = decide(tight, prompt=prompt, config=LOOSE_TTFT)
    assert isinstance(decision, expected)
    if isinstance(decision, Queue):
        assert decision.blocker == Blocker.STREAMS_TPOT
        # The blocking streams have 200 tokens left at 90 ms each.
        assert decision.earliest_retry_s == pytest.approx(200 * 0.09)


def test_every_sequence_a_request_decodes_is_forecast() -> None:
    """A list of prompts or ``n`` choices decodes one sequence each: the forecast joins them all to
    the batch, and the running streams' headroom that one sequence leaves, many use up."""
    tight = [view("tight", state(32), streams(32, tpot_s=0.09))]
    one = decide(tight, prompt=500, config=LOOSE_TTFT)
    assert isinstance(one, Admit)
    assert one.forecast is not None
    many = admitter(LOOSE_TTFT).decide(replace(request(500), choices=512), tight, NOW)
    assert isinstance(many, Queue | Reject)
    assert many.forecast is not None
    assert many.forecast.tpot_s > one.forecast.tpot_s
    with pytest.raises(ValueError, match="choices"):
        replace(request(500), choices=0)


def test_long_prompt_goes_where_it_hurts_least() -> None:
    tight = view("tight", state(32), streams(32, tpot_s=0.09))
    roomy = view("roomy", state(32, queued=[8000]), streams(32, tpot_s=0.02))
    decision = decide([tight, roomy], prompt=100_000, config=LOOSE_TTFT)
    assert isinstance(decision, Admit)
    assert decision.replica == "roomy"


def test_streams_of_a_looser_class_tolerate_more() -> None:
    # The same streams, but batch ones (500 ms target): the long prompt fits.
    loose = [view("a", state(32), streams(32, "batch", tpot_s=0.09))]
    assert isinstance(decide(loose, prompt=100_000, config=LOOSE_TTFT), Admit)


def test_a_stream_already_past_its_target_blocks_the_replica() -> None:
    over = [view("a", state(32), streams(1, tpot_s=0.15, expected=150))]
    decision = decide(over, prompt=500, config=LOOSE_TTFT)
    assert isinstance(decision, Queue)
    assert decision.blocker == Blocker.STREAMS_TPOT


def test_streams_tpot_is_floored_at_the_replica_current_step() -> None:
    # Predicted 1 ms at admission, but the replica's decode step is now ~86 ms: 14 ms headroom left,
    # less than the ~37 ms a 100K prompt inflicts.
    replica = state(256, context=6000, kv_capacity=2_000_000)
    decision = decide([view("a", replica, streams(4, tpot_s=0.001))], prompt=100_000, config=LOOSE_TTFT)
    assert isinstance(decision, Queue)
    assert decision.blocker == Blocker.STREAMS_TPOT


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [pytest.param(2_000, Admit, id="short-stall-ok"), pytest.param(20_000, Queue, id="long-stall-held")],
)
def test_max_stall_bounds_the_pause_a_prefill_adds(prompt: int, expected: type) -> None:
    config = with_class("interactive", max_stall_s=0.5, ttft_target_s=30.0, max_queue_wait_s=30.0)
    decision = decide([view("a", state(32), streams(32, tpot_s=0.02))], prompt=prompt, config=config)
    assert isinstance(decision, expected)
    if isinstance(decision, Queue):
        assert decision.blocker == Blocker.STREAMS_STALL


# -- batch cannot hurt interactive -------------------------------------------------------------


@pytest.mark.parametrize(
    ("replica", "running", "prompt", "expected", "blocker"),
    [
        # kv_share 0.5 of 400K tokens = 200K; each stream projects 1700 + 300 = 2000 tokens.
        pytest.param(
            state(90),
            streams(90, "batch", prompt=1700, expected=300),
            1800,
            Admit,
            None,
            id="kv-within-share",
        ),
        pytest.param(
            state(100),
            streams(100, "batch", prompt=1700, expected=300),
            500,
            Queue,
            Blocker.KV_SHARE,
            id="kv-share-full",
        ),
        # slot_share 0.5 of 64 slots (max_num_seqs caps the step-model slots) = 32.
        pytest.param(
            state(31, max_num_seqs=64), streams(31, "batch"), 500, Admit, None, id="slot-within-share"
        ),
        pytest.param(
            state(32, max_num_seqs=64),
            streams(32, "batch"),
            500,
            Queue,
            Blocker.SLOT_SHARE,
            id="slot-share-full",
        ),
        pytest.param(
            state(32, max_num_seqs=64),
            streams(32, "interactive"),
            500,
            Admit,
            None,
            id="interactive-slots-not-counted",
        ),
        # A 60K batch prompt would delay a typical interactive arrival's first token by ~2.3 s.
        pytest.param(state(32), [], 60_000, Queue, Blocker.YIELD_TTFT, id="long-batch-prompt-yields-ttft"),
        # 256 decodes of 6000 tokens: interactive TPOT ~88 ms, within 100 ms but not within 80 %.
        pytest.param(
            state(256, context=6000, kv_capacity=2_000_000),
            [],
            500,
            Queue,
            Blocker.YIELD_TPOT,
            id="batch-yields-tpot",
        ),
    ],
)
def test_batch_shares_and_yield(
    replica, running, prompt: int, expected: type, blocker: Blocker | None
) -> None:
    decision = decide([view("a", replica, running)], prompt=prompt, request_class="batch")
    assert isinstance(decision, expected)
    if blocker is not None:
        assert isinstance(decision, Queue)
        assert decision.blocker == blocker


def test_interactive_is_not_held_by_batch_rules() -> None:
    replica = state(256, context=6000, kv_capacity=2_000_000)
    batch_full = streams(100, "batch", prompt=1700, expected=300)
    assert isinstance(decide([view("a", replica, batch_full)], prompt=500), Admit)


def test_decode_slots_come_from_the_step_model_when_tighter_than_max_num_seqs() -> None:
    # A 20 ms tightest TPOT target leaves room for 126 decodes of 2000 tokens (7 ms base + 0.103 ms
    # each), not max_num_seqs' 256: batch may hold 63 of them.
    config = with_class("interactive", tpot_target_s=0.02)
    admit = decide([view("a", state(62), streams(62, "batch"))], request_class="batch", config=config)
    held = decide([view("a", state(63), streams(63, "batch"))], request_class="batch", config=config)
    assert isinstance(admit, Admit)
    assert isinstance(held, Queue)
    assert held.blocker == Blocker.SLOT_SHARE


def test_batch_request_larger_than_its_whole_kv_share_is_refused_for_good() -> None:
    config = with_class("batch", kv_share=0.1)  # 40K of 400K tokens
    decision = decide([view("a", state())], prompt=50_000, request_class="batch", config=config)
    assert isinstance(decision, Reject)
    assert decision.retry_after is None


# -- stale replicas ----------------------------------------------------------------------------


def test_stale_replica_predictions_carry_the_safety_margin() -> None:
    replica = state(16)
    raw = forecast_request(request(500).candidate(replica.max_model_len), replica, MODEL)
    decision = decide([view("a", replica, stale=True)])
    assert isinstance(decision, Admit)
    assert decision.forecast is not None
    assert decision.forecast.ttft_s == pytest.approx(raw.ttft_s * 1.5)
    assert decision.forecast.tpot_s == pytest.approx(raw.tpot_s * 1.5)


@pytest.mark.parametrize(
    ("forecast_margin", "stale", "scale"),
    [
        pytest.param(0.0, False, 1.0, id="none"),
        pytest.param(0.15, False, 1.15, id="fresh-replica"),
        pytest.param(0.15, True, 1.15 * 1.5, id="stale-replica-both-margins"),
    ],
)
def test_forecast_margin_scales_every_forecast(forecast_margin: float, stale: bool, scale: float) -> None:
    replica = state(16)
    raw = forecast_request(request(500).candidate(replica.max_model_len), replica, MODEL)
    config = settings(forecast_margin=forecast_margin)
    decision = decide([view("a", replica, stale=stale)], config=config)
    assert isinstance(decision, Admit)
    assert decision.forecast is not None
    assert decision.forecast.ttft_s == pytest.approx(raw.ttft_s * scale)
    assert decision.forecast.tpot_s == pytest.approx(raw.tpot_s * scale)


def test_forecast_margin_turns_a_borderline_admit_into_a_reject() -> None:
    # Predicted a little under the TTFT target as it is, over it with a 15 % margin.
    replica = state(16, queued=[8000] * 2)
    raw = forecast_request(request(500).candidate(replica.max_model_len), replica, MODEL)
    target = raw.ttft_s * 1.07
    trusting = with_class("interactive", ttft_target_s=target, max_queue_wait_s=0.0)
    careful = AdmissionSettings.model_validate({**trusting.model_dump(), "forecast_margin": 0.15})
    assert isinstance(decide([view("a", replica)], config=trusting), Admit)
    assert isinstance(decide([view("a", replica)], config=careful), Reject)


@pytest.mark.parametrize(
    ("stale_flag_on", "expected"),
    [pytest.param("view", "fresh", id="view-flag"), pytest.param("state", "fresh", id="state-flag")],
)
def test_margin_can_send_traffic_to_a_fresh_replica(stale_flag_on: str, expected: str) -> None:
    # Equal load; the stale one looks 50 % slower, so the fresh one has more slack.
    stale_view = view("stale", state(16, stale=stale_flag_on == "state"), stale=stale_flag_on == "view")
    decision = decide([stale_view, view("fresh", state(16))])
    assert isinstance(decision, Admit)
    assert decision.replica == expected


def test_margin_can_turn_an_admit_into_a_reject() -> None:
    replica = state(8, queued=[8192] * 5)
    assert isinstance(decide([view("a", replica)]), Admit)
    config = settings(stale_margin=1.0)
    decision = decide([view("a", replica, stale=True)], config=config)
    assert isinstance(decision, Reject)
    assert decision.blocker == Blocker.TTFT


# -- deadlines ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("deadline_after_s", "reason", "retryable"),
    [
        pytest.param(0.1, RejectReason.DEADLINE_EXCEEDED, True, id="client-deadline-before-first-token"),
        pytest.param(0.0, RejectReason.DEADLINE_EXCEEDED, False, id="zero-deadline-never-attainable"),
        pytest.param(10.0, RejectReason.SLO_UNATTAINABLE, True, id="later-deadline-does-not-loosen-target"),
    ],
)
def test_deadline_rejected_at_once(deadline_after_s: float, reason: RejectReason, retryable: bool) -> None:
    clock = FakeClock(NOW)
    queued = [8192] * 2 if deadline_after_s < 1 else [8192] * 8
    decision = admitter().decide(
        request(500, arrival=clock.now, deadline=clock.now + deadline_after_s),
        [view("a", state(8, queued=queued))],
        clock.now,
    )
    assert isinstance(decision, Reject)
    assert decision.reason == reason
    assert (decision.retry_after is not None) == retryable


def test_earlier_client_deadline_admits_when_it_holds() -> None:
    decision = decide([view("a", state())], deadline=NOW + 0.5)
    assert isinstance(decision, Admit)


def test_deadline_counts_the_predicted_wait_for_streams() -> None:
    # Held by streams that finish in ~18 s: with a 30 s TTFT target it queues, with a 5 s client
    # deadline its first token would come too late, so it is rejected at once.
    tight = [view("tight", state(32), streams(32, tpot_s=0.09))]
    assert isinstance(decide(tight, prompt=100_000, config=LOOSE_TTFT), Queue)
    decision = decide(tight, prompt=100_000, config=LOOSE_TTFT, deadline=NOW + 5.0)
    assert isinstance(decision, Reject)
    assert decision.reason == RejectReason.DEADLINE_EXCEEDED


# -- prompt size, health, calibration ----------------------------------------------------------


@pytest.mark.parametrize(
    ("views", "prompt", "max_tokens", "config", "expected"),
    [
        pytest.param(
            [view("a", state())],
            5_000,
            1024,
            with_class("interactive", max_prompt_tokens=4096),
            "reject",
            id="over-class-limit",
        ),
        pytest.param(
            [view("a", state(max_len=8192))],
            8_000,
            1024,
            SETTINGS,
            "reject",
            id="prompt-plus-cap-over-max-model-len",
        ),
        pytest.param(
            [view("a", state(max_len=8192))], 8_000, None, SETTINGS, "a", id="no-cap-fills-the-context"
        ),
        pytest.param(
            [view("a", state(max_len=8192))], 8_192, None, SETTINGS, "reject", id="no-room-for-one-token"
        ),
        pytest.param(
            [view("small", state(max_len=8192)), view("big", state(64))],
            8_000,
            1024,
            SETTINGS,
            "big",
            id="routed-to-replica-it-fits",
        ),
        pytest.param(
            [view("a", state(kv_capacity=5_000))], 6_000, 1024, SETTINGS, "reject", id="over-kv-capacity"
        ),
        pytest.param(
            [view("small", state(max_len=8192)), view("big-down", state(), healthy=False)],
            8_000,
            1024,
            SETTINGS,
            "no_healthy",
            id="fits-only-an-unhealthy-replica",
        ),
    ],
)
def test_prompt_too_large(
    views, prompt: int, max_tokens: int | None, config: AdmissionSettings, expected: str
) -> None:
    decision = decide(views, prompt=prompt, config=config, max_tokens=max_tokens)
    if expected == "reject":
        assert isinstance(decision, Reject)
        assert decision.reason == RejectReason.PROMPT_TOO_LARGE
        assert decision.retry_after is None
    elif expected == "no_healthy":
        assert isinstance(decision, Reject)
        assert decision.reason == RejectReason.NO_HEALTHY_REPLICA
    else:
        assert isinstance(decision, Admit)
        assert decision.replica == expected


@pytest.mark.parametrize(
    ("fewest", "expected"),
    [
        pytest.param(None, "reject", id="counted-over-the-context"),
        pytest.param(1_500, "admit", id="estimated-over-the-context-but-may-fit"),
        pytest.param(8_000, "reject", id="even-the-fewest-plausible-over"),
    ],
)
def test_an_estimate_alone_never_refuses_a_prompt_as_too_long(fewest: int | None, expected: str) -> None:
    """A prompt estimated at 24,000 tokens on an 8,192-token replica: refused only when exact or
    when even its fewest plausible tokens (plus the cap) do not fit; the refusal names the size."""
    estimated = replace(request(24_000, max_tokens=256), fewest_prompt_tokens=fewest)
    decision = admitter(LOOSE_TTFT).decide(estimated, [view("a", state(max_len=8192))], NOW)
    if expected == "admit":
        assert decision.admits
        assert decision.replica == "a"
        return
    assert isinstance(decision, Reject)
    assert (decision.reason, decision.retry_after) == (RejectReason.PROMPT_TOO_LARGE, None)
    assert decision.message.startswith(
        "24000 prompt tokens" if fewest is None else f"at least {fewest} prompt"
    )


def test_the_fewest_plausible_prompt_tokens_must_be_within_the_estimate() -> None:
    with pytest.raises(ValueError, match="fewest_prompt_tokens"):
        replace(request(500), fewest_prompt_tokens=501)


def test_no_healthy_replica_gets_a_jittered_retry() -> None:
    decision = decide([view("a", state(), healthy=False), view("b", state(), healthy=False)])
    assert isinstance(decision, Reject)
    assert decision.reason == RejectReason.NO_HEALTHY_REPLICA
    assert decision.retry_after is not None
    no_replica = SETTINGS.retry_after.no_replica_s
    assert (
        no_replica <= decision.retry_after.delay_s <= no_replica * (1 + SETTINGS.retry_after.jitter_fraction)
    )


@pytest.mark.parametrize(
    ("gateway_streams", "expected"),
    [pytest.param(0, Admit, id="below-cap"), pytest.param(4, Reject, id="at-cap")],
)
def test_uncalibrated_replica_is_a_capped_last_resort(gateway_streams: int, expected: type) -> None:
    config = with_class("interactive", max_queue_wait_s=0.0)
    views = [
        view("no-model", state(), streams(gateway_streams), model=UNKNOWN),
        view("saturated", state(8, queued=[8192] * 8)),
    ]
    decision = decide(views, config=config)
    assert isinstance(decision, expected)
    if isinstance(decision, Admit):
        assert decision.replica == "no-model"
        assert math.isnan(decision.slack)
        assert decision.forecast is None


# -- shadow mode -------------------------------------------------------------------------------


SATURATED = [view("a", state(8, queued=[8192] * 8))]
TIGHT = [view("a", state(32), streams(32, tpot_s=0.09))]
BATCH_FULL = [view("a", state(100), streams(100, "batch", prompt=1700, expected=300))]


@pytest.mark.parametrize(
    ("shadow", "views", "kw", "would_be"),
    [
        pytest.param({"slo": True}, SATURATED, {}, RejectReason.SLO_UNATTAINABLE, id="slo"),
        pytest.param(
            {"protect_streams": True}, TIGHT, {"prompt": 100_000}, Blocker.STREAMS_TPOT, id="streams"
        ),
        pytest.param(
            {"batch_isolation": True}, BATCH_FULL, {"request_class": "batch"}, Blocker.KV_SHARE, id="batch"
        ),
    ],
)
def test_shadowed_rule_decides_but_admits(shadow: dict[str, bool], views, kw, would_be) -> None:
    base = LOOSE_TTFT if "prompt" in kw else SETTINGS
    shadowed_config = base.model_copy(update={"shadow": ShadowSettings(**shadow)})
    enforced = admitter(base).decide(request(**kw), views, NOW)
    shadowed = admitter(shadowed_config).decide(request(**kw), views, NOW)
    assert not isinstance(enforced, Admit)
    assert enforced.enforced
    assert not isinstance(shadowed, Admit)
    assert not shadowed.enforced
    assert shadowed.admits
    assert shadowed.replica == "a"
    got = shadowed.reason if isinstance(shadowed, Reject) else shadowed.blocker
    assert got == would_be


def test_shadowed_prompt_limit_admits_a_prompt_over_the_class_limit() -> None:
    data = with_class("interactive", max_prompt_tokens=4096).model_dump()
    data["shadow"] = {"prompt_size": True}
    decision = admitter(AdmissionSettings.model_validate(data)).decide(
        request(5_000), [view("a", state())], NOW
    )
    assert isinstance(decision, Reject)
    assert decision.reason == RejectReason.PROMPT_TOO_LARGE
    assert not decision.enforced
    assert decision.admits
    assert decision.replica == "a"


def test_shadowing_one_rule_still_enforces_the_others() -> None:
    # Streams block it; only the SLO rule is in shadow: still held.
    config = LOOSE_TTFT.model_copy(update={"shadow": ShadowSettings(slo=True)})
    decision = admitter(config).decide(request(100_000), TIGHT, NOW)
    assert isinstance(decision, Queue)
    assert decision.enforced
    assert decision.blocker == Blocker.STREAMS_TPOT


def test_admit_all_policy_routes_by_slack_and_admits_everything() -> None:
    config = settings(policy="admit_all")
    policy = make_admitter(config, RetryAfterPolicy(config.retry_after, random.Random(0)))
    views = [view("worse", state(8, queued=[8192] * 9)), view("better", state(8, queued=[8192] * 8))]
    decision = policy.decide(request(500), views, NOW)
    assert decision.admits
    assert not decision.enforced
    assert decision.replica == "better"


# -- the replica's dispatch overhead -------------------------------------------------------------


def _with_overhead(v: ReplicaView, overhead_s: float) -> ReplicaView:
    return replace(v, dispatch_overhead_s=overhead_s)


def test_dispatch_overhead_counts_against_the_first_token_deadline() -> None:
    """On an idle replica the whole overhead comes on top of the engine's TTFT: a deadline the
    engine alone would meet with 5 ms to spare is missed once the replica's 10 ms way in and
    back is counted; the prediction the response carries is the engine's (the proxy adds its
    own overhead estimate to it)."""
    idle = view("a", state())
    plain = decide([idle])
    assert isinstance(plain, Admit)
    assert plain.forecast is not None
    deadline = NOW + plain.forecast.ttft_s + 0.005
    assert isinstance(decide([idle], deadline=deadline), Admit)
    late = decide([_with_overhead(idle, 0.010)], deadline=deadline)
    assert isinstance(late, Reject)
    assert late.reason == RejectReason.DEADLINE_EXCEEDED
    roomy = decide([_with_overhead(idle, 0.010)])
    assert isinstance(roomy, Admit)
    assert roomy.forecast == plain.forecast


def test_the_ttft_correction_scales_the_overhead_with_the_engines_ttft() -> None:
    """The TTFT correction is learned on all that was forecast, the engine's TTFT and the
    overhead it added, so admission applies it to both: with a 100 ms overhead and a factor of
    0.5, the first token is due at half of (engine + 100 ms), well before engine / 2 + 100 ms."""
    idle = view("a", state())
    plain = decide([idle])
    assert isinstance(plain, Admit)
    assert plain.forecast is not None
    halved = replace(_with_overhead(idle, 0.100), correction=Correction(ttft=(0.5,) * 16, tpot=(1.0,) * 16))
    due = (plain.forecast.ttft_s + 0.100) * 0.5
    assert due < plain.forecast.ttft_s * 0.5 + 0.100 - 0.04
    assert isinstance(decide([halved], deadline=NOW + due + 0.002), Admit)
    late = decide([halved], deadline=NOW + due - 0.002)
    assert isinstance(late, Reject)
    assert late.reason == RejectReason.DEADLINE_EXCEEDED


def test_dispatch_overhead_routes_to_the_nearer_replica() -> None:
    """Two idle replicas alike but for their overhead, 60 ms apart; the client's 300 ms deadline
    makes TTFT the binding slack, where 60 ms is more than the slack tie (1 % of the 2 s target):
    the request goes to the one whose first token comes back sooner, whichever is listed first."""
    far, near = _with_overhead(view("far", state()), 0.080), _with_overhead(view("near", state()), 0.020)
    for views in ([far, near], [near, far]):
        decision = decide(views, deadline=NOW + 0.3)
        assert isinstance(decision, Admit)
        assert decision.replica == "near"


def test_the_ttft_is_judged_at_the_class_quantile_of_its_regime_on_a_loaded_replica() -> None:
    """The correction's spread (how far above the median the quantile of what was measured lies)
    multiplies the TTFT admission holds against the deadline at the class's attainment target
    (0.95 by default; 0.9 read from the grid). The admitted forecast says so in ``ttft_spread``
    and keeps the median TTFT (what its headers, the metrics and the correction compare with the
    measured one); a refusal cites the TTFT as judged. The TPOT is left alone. An unloaded
    replica gets no spread, as no attainment margin."""
    spreads = tuple((s,) * 16 for s in (1.1, 1.2, 1.5, 2.0))  # at 0.8, 0.9, 0.95, 0.99
    corrected = Correction(ttft=(1.0,) * 16, tpot=(1.0,) * 16, ttft_spreads=spreads)
    busy = view("a", state(decodes=8), streams(8))
    plain = decide([busy])
    assert isinstance(plain, Admit)
    assert plain.forecast is not None
    judged = decide([replace(busy, correction=corrected)])
    assert isinstance(judged, Admit)
    assert judged.forecast is not None
    assert judged.forecast.ttft_s == pytest.approx(plain.forecast.ttft_s)
    assert (judged.forecast.ttft_spread, judged.forecast.ttft_factor) == (1.5, 1.0)
    assert judged.forecast.tpot_s == pytest.approx(plain.forecast.tpot_s)
    looser = decide(
        [replace(busy, correction=corrected)], config=with_class("interactive", attainment_target=0.9)
    )
    assert isinstance(looser, Admit)
    assert looser.forecast is not None
    assert looser.forecast.ttft_spread == pytest.approx(1.2)
    assert looser.forecast.ttft_s == pytest.approx(plain.forecast.ttft_s)
    # A deadline between the median's first token and the quantile's: admitted by the one only.
    deadline = NOW + plain.forecast.ttft_s * 1.25
    assert isinstance(decide([busy], deadline=deadline), Admit)
    late = decide([replace(busy, correction=corrected)], deadline=deadline)
    assert isinstance(late, Reject)
    assert late.reason == RejectReason.DEADLINE_EXCEEDED
    assert late.forecast is not None
    assert late.forecast.ttft_s == pytest.approx(plain.forecast.ttft_s * 1.5)
    idle = view("a", state())
    unloaded = decide([replace(idle, correction=corrected)])
    assert isinstance(unloaded, Admit)
    assert unloaded.forecast is not None
    assert unloaded.forecast.ttft_spread == 1.0
