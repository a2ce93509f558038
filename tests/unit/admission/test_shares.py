"""Per-class loads on a replica, decode slots from the step model, and views after an admission."""

from __future__ import annotations

import math

import pytest

from gateway.admission import StreamingRequest
from gateway.admission.shares import class_load, decode_slot_capacity, slot_share_limit
from predictor import StepBatch, forecast_request
from tests.unit.admission.fleet import MODEL, UNKNOWN, request, state, streams, view


def stream(tpot: float, remaining: int, prompt: int = 1000) -> StreamingRequest:
    return StreamingRequest("batch", prompt, 0, float(remaining), tpot)


def test_class_load_aggregates_projected_kv_and_finish_times() -> None:
    load = class_load([stream(0.02, 100), stream(0.05, 10), stream(0.03, 1000, prompt=500)])
    assert load.seqs == 3
    assert load.kv_tokens == pytest.approx(1100 + 1010 + 1500)
    assert load.max_tpot_s == pytest.approx(0.05)
    assert load.finish_s == pytest.approx((0.5, 2.0, 30.0))
    # Streams above 25 ms/token: the 30 ms one (30 s left) and the 50 ms one (0.5 s left).
    assert load.wait_for_tpot_below_s(0.025) == pytest.approx(30.0)
    assert load.wait_for_tpot_below_s(0.04) == pytest.approx(0.5)
    assert load.wait_for_tpot_below_s(0.06) == 0.0
    assert load.wait_for_kv_s(1010) == pytest.approx(0.5)
    assert load.wait_for_kv_s(1011) == pytest.approx(2.0)
    assert load.wait_for_kv_s(10**9) == pytest.approx(30.0)
    assert load.wait_for_finishes_s(2) == pytest.approx(2.0)


def test_streams_are_floored_at_the_current_step() -> None:
    load = class_load([stream(0.001, 10)], step_s=0.04)
    assert load.max_tpot_s == pytest.approx(0.04)


@pytest.mark.parametrize(
    ("target_s", "context", "max_num_seqs", "expected"),
    [
        # below the knee: (20 ms - 6.99 ms) / (5 us + 2000 x 48.9 ns) = 126.5
        pytest.param(0.02, 2000, 1024, 126, id="tpot-bound-below-knee"),
        pytest.param(0.1, 2000, 256, 256, id="capped-by-max-num-seqs"),
        pytest.param(0.005, 2000, 256, 1, id="target-below-empty-step"),
    ],
)
def test_decode_slot_capacity(target_s: float, context: int, max_num_seqs: int, expected: int) -> None:
    replica = state(max_num_seqs=max_num_seqs)
    slots = decode_slot_capacity(MODEL, replica, target_s, context)
    assert slots == expected
    if 1 < slots < max_num_seqs:
        at = MODEL.step_time(StepBatch(decode_seqs=slots, kv_tokens_read=slots * context))
        over = MODEL.step_time(StepBatch(decode_seqs=slots + 1, kv_tokens_read=(slots + 1) * context))
        assert at <= target_s < over


def test_decode_slots_past_the_knee_use_the_compute_slope() -> None:
    # Short contexts: the batch passes the knee (~185 tokens) before the target is reached.
    slots = decode_slot_capacity(MODEL, state(max_num_seqs=4096), 0.02, 10)
    assert slots > MODEL.params.knee_tokens
    assert MODEL.step_time(StepBatch(decode_seqs=slots, kv_tokens_read=slots * 10)) <= 0.02
    assert MODEL.step_time(StepBatch(decode_seqs=slots + 1, kv_tokens_read=(slots + 1) * 10)) > 0.02


def test_without_a_model_slots_are_max_num_seqs() -> None:
    assert decode_slot_capacity(UNKNOWN, state(max_num_seqs=77), 0.02, 2000) == 77
    assert slot_share_limit(0.001, 77) == 1


def test_view_after_an_admission_sees_its_prompt_its_stream_and_what_it_inflicts() -> None:
    before = view("a", state(32), streams(32, tpot_s=0.05))
    r = request(4000)
    f = forecast_request(r.candidate(before.state.max_model_len), before.state, MODEL)
    after = before.with_admitted(r, f)
    assert after.state.queued_prefill_tokens == 4000
    assert after.state.num_waiting == 1
    assert after.gateway_streams == 33
    assert after.loads["interactive"].seqs == 33
    assert after.loads["interactive"].kv_tokens == pytest.approx(
        before.loads["interactive"].kv_tokens + 4000 + 200
    )
    assert after.extra_tpot_s == pytest.approx(f.inflicted_tpot_s)
    # The streams' effective TPOT grew by what it inflicts.
    assert after.loads["interactive"].max_tpot_s + after.extra_tpot_s == pytest.approx(
        0.05 + f.inflicted_tpot_s
    )
    assert math.isclose(before.extra_tpot_s, 0.0)
