"""A full replica whose outputs are all known (clients that pin them: ``ignore_eos`` with
``max_tokens``): when each slot frees behind the waiting queue, and the wait a newcomer is
forecast.

A finish rate is the recent past's: after a spell of short outputs it says slots free fast while
the requests now running hold theirs for hundreds of steps. Pinned outputs make the schedule
exact (``slot_schedule``); the forecast never waits less than it says.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from predictor.forecast import forecast_request
from predictor.forecast_inputs import CandidateRequest, ReplicaState, slot_schedule
from predictor.hardware import GPUS
from predictor.model import MODELS
from predictor.step_model import StepBatch, roofline_prior

MODEL = roofline_prior(MODELS["Llama-3-8B"], GPUS["H100-SXM"])
LIMITS = {
    "kv_capacity_tokens": 10**7,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 8192,
    "max_model_len": 8192,
}


def step_by_step(rests: list[int], free: int, waiting: list[int]) -> list[int]:
    """The oracle: an engine of ``len(rests) + free`` slots run one step at a time. At each step
    the waiting requests take the free slots in order, then every occupied slot emits a token;
    a slot is free again after its request's last token. Returns the steps at which the slots
    free once the queue is placed (0 for a slot still free then), ascending."""
    slots: list[int | None] = [*rests, *([None] * free)]  # tokens still to emit, None: free
    queue = list(waiting)
    t = 0
    while True:
        for i, left in enumerate(slots):
            if left is None and queue:
                slots[i] = max(queue.pop(0), 1)
        if not queue:
            return sorted(t + (left or 0) for left in slots)
        t += 1
        slots = [None if left is None or left <= 1 else left - 1 for left in slots]


def test_the_queue_takes_the_first_slots_to_free() -> None:
    # Slots free at 3, 10, 20, 40; the first waiting request (5 tokens) takes the one at 3 and
    # frees it at 8, the second (100) takes that one: 108.
    assert slot_schedule([3, 10, 20, 40], 0, [5, 100]) == (10.0, 20.0, 40.0, 108.0)
    # Free slots go first, at step 0; those left free stay at 0.
    assert slot_schedule([3], 2, [5]) == (0.0, 3.0, 5.0)
    assert slot_schedule([7, 2], 0, []) == (2.0, 7.0)


@pytest.mark.parametrize("seed", range(30))
def test_the_schedule_is_the_step_by_step_engines(seed: int) -> None:
    rng = random.Random(seed)
    running = rng.randint(1, 8)
    rests = [rng.randint(1, 300) for _ in range(running)]
    free = rng.choice([0, 0, 1, 3])
    waiting = [rng.randint(1, 300) for _ in range(rng.randint(0, 20))]
    assert slot_schedule(rests, free, waiting) == tuple(float(s) for s in step_by_step(rests, free, waiting))


def full_replica(
    remaining: list[float], waiting: list[int], *, rate: float | None, exact: bool
) -> ReplicaState:
    """Four slots, each running a decode of a 1,000-token prompt with ``remaining`` tokens to go
    (their outputs known when ``exact``), ``waiting`` outputs queued (prompts of 500), the
    finish rate of the recent window ``rate``."""
    rows = [(1000, 1000, 10, 10 + r) for r in remaining]
    state = ReplicaState.from_rows(
        rows,
        [500] * len(waiting),
        **LIMITS,  # type: ignore[arg-type]
        finish_rate_per_s=rate,
        waiting_outputs=[float(w) for w in waiting] if exact else None,
    )
    return state


def decode_step(running: int) -> float:
    return MODEL.step_time(StepBatch(decode_seqs=running, kv_tokens_read=running * 1010))


def test_long_outputs_running_hold_their_slots_whatever_the_recent_rate() -> None:
    """Four requests with 200 tokens to go, one waiting with 50: a newcomer waits for the first
    of them to finish then the waiting one's 50 tokens, 250 steps, although the last window
    (short outputs) finished ten a second."""
    state = full_replica([200, 210, 220, 230], [50], rate=10.0, exact=True)
    assert state.slot_steps == (210.0, 220.0, 230.0, 250.0)
    f = forecast_request(CandidateRequest(500, 100, 100.0), state, MODEL)
    assert f.admission_wait_s == pytest.approx(210 * decode_step(4), rel=1e-9)
    unknown = forecast_request(
        CandidateRequest(500, 100, 100.0), dataclasses.replace(state, slot_steps=()), MODEL
    )
    assert unknown.admission_wait_s == pytest.approx(2 / 10.0, rel=1e-9)  # the rate's: two slots
    assert f.ttft_s - unknown.ttft_s == pytest.approx(210 * decode_step(4) - 0.2, rel=1e-9)


def test_a_slower_rate_still_binds() -> None:
    """The schedule is a floor: a finish rate that says slots free slower than it still binds."""
    state = full_replica([2, 3, 4, 5], [1], rate=0.5, exact=True)
    f = forecast_request(CandidateRequest(500, 100, 100.0), state, MODEL)
    assert f.admission_wait_s == pytest.approx(2 / 0.5, rel=1e-9)


def test_without_a_rate_the_schedule_is_the_wait() -> None:
    """The first running request frees its slot at 200, the waiting one (5 tokens) takes it and
    frees it at 205: the newcomer's. Expected outputs alone (the running requests') say 300."""
    state = full_replica([200, 300, 400, 500], [5], rate=None, exact=True)
    f = forecast_request(CandidateRequest(500, 100, 100.0), state, MODEL)
    assert f.admission_wait_s == pytest.approx(205 * decode_step(4), rel=1e-9)
    unknown = forecast_request(
        CandidateRequest(500, 100, 100.0), dataclasses.replace(state, slot_steps=()), MODEL
    )
    assert unknown.admission_wait_s == pytest.approx(300 * decode_step(4), rel=1e-9)


def test_outputs_not_known_or_a_free_slot_leave_no_schedule() -> None:
    assert full_replica([200, 210, 220, 230], [50], rate=10.0, exact=False).slot_steps == ()
    room = ReplicaState.from_rows([(1000, 1000, 10, 210.0)], [], **LIMITS, waiting_outputs=[])  # type: ignore[arg-type]
    assert room.slot_steps == ()
    with pytest.raises(ValueError, match="waiting_outputs"):
        ReplicaState.from_rows([], [500], **LIMITS, waiting_outputs=[])  # type: ignore[arg-type]


def test_a_request_of_several_sequences_waits_for_as_many_slots() -> None:
    state = full_replica([200, 210, 220, 230], [], rate=10.0, exact=True)
    f = forecast_request(CandidateRequest(500, 100, 100.0, sequences=3), state, MODEL)
    assert f.admission_wait_s == pytest.approx(220 * decode_step(4), rel=1e-9)
