"""Sluice's queue: priority, shortest job first with aging, deadlines, disconnects, bounds, holding
back for a long-waiting request, and re-evaluation that never over-fills or sends late work."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from gateway.admission import (
    AdmissionController,
    AdmissionSettings,
    Admit,
    Blocker,
    Outcome,
    Queue,
    QueueEntry,
    Reject,
    RejectReason,
    ReplicaView,
)
from tests.unit.admission.fleet import (
    UNKNOWN,
    FakeClock,
    controller,
    request,
    settings,
    state,
    streams,
    view,
    with_class,
)

T0 = 1000.0


def blocked() -> list[ReplicaView]:
    """One replica whose streams sit exactly at their TPOT target and finish in 0.2 s: every
    newcomer waits a little (blocked by streams_tpot), then fits."""
    return [view("a", state(32), streams(32, tpot_s=0.1, generated=100, expected=102))]


def open_() -> list[ReplicaView]:
    """The same replica, idle: everything fits."""
    return [view("a", state())]


def queued(ctl: AdmissionController, now: float, prompt: int = 500, **kw: object) -> Queue:
    decision = ctl.submit(request(prompt, arrival=now, **kw), blocked(), now)  # type: ignore[arg-type]
    assert isinstance(decision, Queue), decision
    assert decision.entry_id is not None
    return decision


def ids(result_items: Sequence[tuple[QueueEntry, object]]) -> list[str]:
    return [entry.request.request_id for entry, _ in result_items]


def loose(**queue: object) -> AdmissionSettings:
    """Interactive with long targets (30 s), and queue settings overridden."""
    data = with_class("interactive", ttft_target_s=30.0, max_queue_wait_s=30.0).model_dump()
    data["queue"].update(queue)
    return AdmissionSettings.model_validate(data)


def test_higher_priority_leaves_first() -> None:
    ctl = controller()
    queued(ctl, T0, request_class="batch", request_id="batch")
    queued(ctl, T0, request_id="interactive")
    result = ctl.reevaluate(T0 + 0.05, open_())
    assert ids(result.dispatched) == ["interactive", "batch"]
    assert all(isinstance(d, Admit) for _, d in result.dispatched)


def test_shortest_predicted_job_first_within_a_priority() -> None:
    ctl = controller()
    for prompt, name in [(8000, "big"), (500, "small"), (2000, "mid")]:
        queued(ctl, T0, prompt=prompt, request_id=name)
    queued(ctl, T0, prompt=500, output=900.0, request_id="small-prompt-long-output")
    result = ctl.reevaluate(T0 + 0.05, open_())
    assert ids(result.dispatched) == ["small", "mid", "small-prompt-long-output", "big"]


def test_equal_jobs_leave_in_arrival_order() -> None:
    ctl = controller()
    for name in "abc":
        queued(ctl, T0, request_id=name)
    assert ids(ctl.reevaluate(T0 + 0.05, open_()).dispatched) == ["a", "b", "c"]


@pytest.mark.parametrize(
    ("aging_rate", "starves"),
    [
        pytest.param(1.0, False, id="aging-lets-the-long-job-run"),
        pytest.param(0.0, True, id="no-aging-starves-it"),
    ],
)
def test_aging_lets_a_long_job_overtake_newer_short_ones(aging_rate: float, starves: bool) -> None:
    # One dispatch per event (max_examined=1) while a short job arrives every 100 ms.
    ctl = controller(loose(aging_rate=aging_rate, max_examined=1))
    clock = FakeClock(T0)
    queued(ctl, clock.now, prompt=20_000, request_id="long")  # size 0.62 s; a short one 0.035 s
    dispatched: list[str] = []
    for i in range(40):
        queued(ctl, clock.now, request_id=f"short-{i}")
        dispatched += ids(ctl.reevaluate(clock.now, open_()).dispatched)
        clock.advance(0.1)
    assert ("long" not in dispatched) == starves
    if not starves:
        # It goes once it has waited about its own size minus a short job's.
        assert dispatched.index("long") <= 8


def test_entry_past_its_queue_deadline_is_rejected() -> None:
    ctl = controller()  # interactive: max_queue_wait 1 s
    entry = queued(ctl, T0)
    assert ctl.next_deadline_s() == pytest.approx(T0 + 1.0)
    assert ctl.reevaluate(T0 + 0.5, [view("b", state(), healthy=False)]).rejected == []
    result = ctl.reevaluate(T0 + 1.2, [view("b", state(), healthy=False)])
    assert [e.id for e, _ in result.rejected] == [entry.entry_id]
    reject = result.rejected[0][1]
    assert reject.reason == RejectReason.DEADLINE_EXCEEDED
    assert reject.retry_after is not None
    assert len(ctl.queue) == 0
    assert ctl.next_deadline_s() is None


def test_entry_whose_first_token_would_come_too_late_is_rejected_early() -> None:
    ctl = controller()
    queued(ctl, T0)
    # Now the streams ahead will take 20 s to finish: its first token cannot come within 2 s.
    slow = [view("a", state(32), streams(32, tpot_s=0.1, generated=100, expected=300))]
    result = ctl.reevaluate(T0 + 0.1, slow)
    assert len(result.rejected) == 1
    assert result.rejected[0][1].reason == RejectReason.DEADLINE_EXCEEDED
    assert result.dispatched == []


def test_never_dispatched_to_a_replica_that_can_no_longer_meet_its_ttft() -> None:
    ctl = controller()
    queued(ctl, T0)
    # "late" is free but its TTFT (~1.7 s) no longer fits after 0.5 s of waiting; "a" will free up.
    late = view("late", state(8, queued=[8192] * 6))
    result = ctl.reevaluate(T0 + 0.5, [late, *blocked()])
    assert result.dispatched == []
    assert result.rejected == []
    result = ctl.reevaluate(T0 + 0.6, [late])
    assert result.dispatched == []
    assert [r.reason for _, r in result.rejected] == [RejectReason.DEADLINE_EXCEEDED]


def test_disconnected_client_is_dropped() -> None:
    ctl = controller()
    gone = queued(ctl, T0, request_id="gone")
    queued(ctl, T0, request_id="stays")
    assert ctl.queue.depth("interactive") == 2
    entry = ctl.cancel(gone.entry_id or 0, T0 + 0.1)
    assert entry is not None
    assert entry.request.request_id == "gone"
    assert ctl.cancel(gone.entry_id or 0, T0 + 0.1) is None
    assert ctl.stats.queue_depth["interactive"] == 1
    assert ctl.stats.count(outcome=Outcome.CANCELLED) == 1
    assert ids(ctl.reevaluate(T0 + 0.2, open_()).dispatched) == ["stays"]


def test_each_class_queue_is_bounded() -> None:
    ctl = controller(with_class("interactive", queue_capacity=2))
    queued(ctl, T0)
    queued(ctl, T0)
    full = ctl.submit(request(500, arrival=T0), blocked(), T0)
    assert isinstance(full, Reject)
    assert full.reason == RejectReason.OVERLOADED
    assert full.blocker == Blocker.QUEUE_FULL
    assert full.retry_after is not None
    queued(ctl, T0, request_class="batch")  # another class's bound is separate
    assert ctl.stats.queue_depth == {"interactive": 2, "batch": 1}


def test_class_that_does_not_queue_is_rejected_at_once() -> None:
    ctl = controller(with_class("interactive", max_queue_wait_s=0.0))
    decision = ctl.submit(request(500, arrival=T0), blocked(), T0)
    assert isinstance(decision, Reject)
    assert decision.reason == RejectReason.OVERLOADED
    assert decision.retry_after is not None


def test_dispatches_update_the_views_so_a_replica_is_not_overfilled() -> None:
    # Batch may hold 32 of 64 slots; 31 are taken: of three queued batch requests one fits.
    ctl = controller()
    for name in "xyz":
        queued(ctl, T0, request_class="batch", request_id=name)
    nearly_full = [view("a", state(31, max_num_seqs=64), streams(31, "batch"))]
    result = ctl.reevaluate(T0 + 0.1, nearly_full)
    assert ids(result.dispatched) == ["x"]
    assert len(ctl.queue) == 2
    assert result.views[0].loads["batch"].seqs == 32
    remaining = [ctl.queue.entry(i) for i in (1, 2)]
    assert all(e is not None and e.blocker == Blocker.SLOT_SHARE for e in remaining)


def test_long_waiting_request_holds_back_its_priority_and_below() -> None:
    ctl = controller(loose(reserve_after_s=1.0))
    tight = [view("a", state(32), streams(32, tpot_s=0.09, generated=100, expected=130))]
    clock = FakeClock(T0)
    long_entry = ctl.submit(request(100_000, arrival=clock.now, request_id="long"), tight, clock.now)
    assert isinstance(long_entry, Queue)
    assert long_entry.blocker == Blocker.STREAMS_TPOT
    clock.advance(3.1)  # a short job queued now sorts after the long one (size 3.02 s)
    queued(ctl, clock.now, request_id="short")
    result = ctl.reevaluate(clock.now, tight)
    assert result.dispatched == []  # "short" fits "tight", but the long one goes first
    assert ctl.queue.holds_back(0)
    fresh = ctl.submit(request(500, arrival=clock.now), tight, clock.now)
    assert isinstance(fresh, Queue)
    assert fresh.blocker == Blocker.HELD_BACK
    batch = ctl.submit(request(500, arrival=clock.now, request_class="batch"), tight, clock.now)
    assert isinstance(batch, Queue)
    assert batch.blocker == Blocker.HELD_BACK
    clock.advance(3.0)  # the streams have finished
    result = ctl.reevaluate(clock.now, open_())
    assert ids(result.dispatched)[:2] == ["long", "short"]
    assert not ctl.queue.holds_back(0)


def test_many_cancellations_keep_the_queue_consistent() -> None:
    ctl = controller(with_class("interactive", queue_capacity=2000))
    entries = [queued(ctl, T0 + i * 1e-4, request_id=str(i)) for i in range(600)]
    for e in entries[:-3]:
        assert ctl.cancel(e.entry_id or 0, T0 + 0.1) is not None
    assert len(ctl.queue) == 3
    assert ctl.next_deadline_s() == pytest.approx(T0 + 597e-4 + 1.0)
    assert ids(ctl.reevaluate(T0 + 0.1, open_()).dispatched) == ["597", "598", "599"]
    assert len(ctl.queue) == 0


def test_no_healthy_replica_keeps_entries_until_their_deadline() -> None:
    ctl = controller()
    queued(ctl, T0)
    down = [view("a", state(), healthy=False)]
    result = ctl.reevaluate(T0 + 0.5, down)
    assert result.dispatched == []
    assert result.rejected == []
    assert len(ctl.queue) == 1


def test_reevaluation_counts_dispatches_and_queue_waits() -> None:
    ctl = controller()
    queued(ctl, T0)
    ctl.reevaluate(T0 + 0.25, open_())
    assert ctl.stats.count(outcome=Outcome.QUEUED) == 1
    assert ctl.stats.count(outcome=Outcome.DISPATCHED) == 1
    waits, _ = ctl.stats.drain_observations()
    assert [name for name, _ in waits] == ["interactive"]
    assert waits[0][1] == pytest.approx(0.25)
    assert ctl.stats.queue_depth["interactive"] == 0


def test_uncalibrated_replica_cap_holds_within_one_reevaluation() -> None:
    ctl = controller(settings(unmodelled_max_in_flight=2))
    for name in "xyz":
        queued(ctl, T0, request_id=name)
    result = ctl.reevaluate(T0 + 0.1, [view("no-model", state(), model=UNKNOWN)])
    assert ids(result.dispatched) == ["x", "y"]
    assert result.views[0].gateway_streams == 2
    remaining = ctl.queue.entry(2)
    assert remaining is not None
    assert remaining.blocker == Blocker.UNMODELLED
