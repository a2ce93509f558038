"""``with_queued``: one more request in the engine's queue, and nothing else about the replica changed.

It builds the new ``ReplicaState`` positionally (``dataclasses.replace`` costs several times more
on the hot path), so a field added to ``ReplicaState`` later would silently fall back to its
default there: the step in progress, the recent prefill share, the finish rate and the steady
step were once dropped that way, which made every probe and every re-evaluated dispatch forecast
a replica without its step in progress. This test walks every field."""

from __future__ import annotations

import dataclasses

from gateway.admission.views import with_queued
from predictor import ReplicaState

#: The fields ``with_queued`` changes (the newcomer's prompt joins the queue).
QUEUE_FIELDS = {
    "num_waiting",
    "queued_prefill_tokens",
    "queued_requests",
    "queued_prefill_attn_pairs",
    "slot_steps",
}


def _busy() -> ReplicaState:
    """A state whose every field differs from its default."""
    return ReplicaState(
        num_running=3,
        num_waiting=2,
        decode_seqs=3,
        kv_tokens_in_use=4000,
        kv_capacity_tokens=200_000,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        max_model_len=8192,
        queued_prefill_tokens=900,
        queued_requests=2,
        queued_prefill_attn_pairs=250_000.0,
        mean_remaining_output_tokens=120.0,
        release_steps=(10.0, 40.0, 90.0),
        release_kv_cumulative=(1000.0, 2500.0, 4000.0),
        background_prefill_tokens_per_step=35.0,
        stale=True,
        step_remaining_s=0.0042,
        prefill_share=0.2,
        finish_rate_per_s=3.5,
        steady_step_s=0.011,
        arriving_prompt_tokens_per_s=9000.0,
        full_finish_rate_per_s=6.0,
        slot_steps=(12.0, 40.0, 90.0),
    )


def test_every_field_but_the_queue_is_kept() -> None:
    before = _busy()
    for f in dataclasses.fields(ReplicaState):
        if f.init:
            assert getattr(before, f.name) != f.default, f"the fixture leaves {f.name} at its default"
    after = with_queued(before, prompt_tokens=500, cached_prompt_tokens=100)
    for f in dataclasses.fields(ReplicaState):
        if f.init and f.name not in QUEUE_FIELDS:
            assert getattr(after, f.name) == getattr(before, f.name), f.name


def test_the_uncached_prompt_joins_the_queue() -> None:
    before = _busy()
    after = with_queued(before, prompt_tokens=500, cached_prompt_tokens=100)
    assert after.num_waiting == before.num_waiting + 1
    assert after.queued_requests == before.queued_requests + 1
    assert after.queued_prefill_tokens == before.queued_prefill_tokens + 400
    # 400 uncomputed tokens after 100 cached ones: each attends to the cached prefix and, on
    # average, half of the new tokens before it.
    assert before.queued_prefill_attn_pairs is not None
    assert after.queued_prefill_attn_pairs == before.queued_prefill_attn_pairs + 400 * (200.0 + 100)


def test_a_pinned_newcomer_takes_the_first_slot_to_free() -> None:
    """Its output pinned, it holds the slot freed at 12 for 50 steps; not pinned, the schedule
    behind it is no longer known."""
    before = _busy()
    assert with_queued(before, 500, 0, output_tokens=50).slot_steps == (40.0, 62.0, 90.0)
    assert with_queued(before, 500, 0, output_tokens=100).slot_steps == (40.0, 90.0, 112.0)
    assert with_queued(before, 500, 0).slot_steps == ()
