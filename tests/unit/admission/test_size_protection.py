"""A starved prompt size is protected: queued instead of refused while only the load blocks it,
first in the queue, holding the class's others back, never sent past a limit (pure)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gateway.admission import AdmissionController, Admit, Blocker, Queue, Reject, RejectReason, ReplicaView
from tests.unit.admission.fleet import controller, request, state, streams, view, with_class

T0 = 1000.0
LONG, SHORT = 3000, 100
#: One class, TTFT 1 s, queueing as long.
ON = with_class("interactive", ttft_target_s=1.0, max_queue_wait_s=1.0)
OFF = with_class("interactive", ttft_target_s=1.0, max_queue_wait_s=1.0, size_fairness={"enabled": False})


def loaded() -> list[ReplicaView]:
    """32 streams at their TPOT target for 4 s more: every newcomer's wait forecast is past its
    first-token deadline, though its own TTFT now (about 0.1 s for ``LONG``) holds."""
    return [view("a", state(32), streams(32, tpot_s=0.1, generated=100, expected=140))]


def idle() -> list[ReplicaView]:
    return [view("a", state())]


def starved(
    config: object = ON, admits: Callable[[int, int], bool] = lambda i, size: size != LONG
) -> AdmissionController:
    """A controller whose class decided 200 requests of four sizes over the last 2 s, the ``i``-th
    of ``size`` tokens admitted when ``admits(i, size)`` (by default every size but the longest)."""
    ctl = controller(config)  # type: ignore[arg-type]
    for i in range(200):
        size = (SHORT, 500, 1000, LONG)[i % 4]
        ctl.size_shares.record("interactive", size, admits(i, size), T0 - 2.0 + i * 0.01)
    return ctl


def test_without_protection_the_load_refuses_every_size() -> None:
    for ctl in (controller(ON), starved(OFF)):
        for prompt in (SHORT, LONG):
            decision = ctl.submit(request(prompt, arrival=T0), loaded(), T0)
            assert isinstance(decision, Reject), decision
            assert decision.reason == RejectReason.SLO_UNATTAINABLE
            assert decision.blocker == Blocker.STREAMS_TPOT


def test_a_starved_size_waits_first_and_holds_the_others_back() -> None:
    ctl = starved()
    short = ctl.submit(request(SHORT, arrival=T0, request_id="short"), loaded(), T0)
    assert isinstance(short, Reject)  # its size is not starved: refused as before
    long = ctl.submit(request(LONG, arrival=T0, request_id="long"), loaded(), T0)
    assert isinstance(long, Queue), long
    assert long.blocker == Blocker.STREAMS_TPOT
    assert long.entry_id is not None
    entry = ctl.queue.entry(long.entry_id)
    assert entry is not None
    assert entry.request.size_protected
    assert ctl.queue.holds_back(0)
    # A short request that fits an idle replica waits behind it.
    held = ctl.submit(request(SHORT, arrival=T0 + 0.01, request_id="held"), idle(), T0 + 0.01)
    assert isinstance(held, Queue)
    assert held.blocker == Blocker.HELD_BACK
    # Still loaded: it stays, and so do the ones held back.
    result = ctl.reevaluate(T0 + 0.02, loaded())
    assert result.dispatched == []
    assert result.rejected == []
    # The streams are gone: it leaves first, then the others.
    result = ctl.reevaluate(T0 + 0.05, idle())
    assert [e.request.request_id for e, _ in result.dispatched] == ["long", "held"]
    assert all(isinstance(d, Admit) for _, d in result.dispatched)
    assert not ctl.queue.holds_back(0)


def test_the_most_starved_size_goes_first() -> None:
    # min_share 0.8: the third quartile (at 0.6 of the best) and the fourth (at 0) both starved.
    ctl = starved(
        with_class("interactive", ttft_target_s=1.0, max_queue_wait_s=1.0, size_fairness={"min_share": 0.8}),
        admits=lambda i, size: size < 1000 or (size == 1000 and i % 20 < 12),  # 1000: 3 of 5
    )
    # The third quartile's request comes first and is the shorter job: without standings it would
    # leave first and, staying queued, keep the fourth's behind it.
    mid = ctl.submit(request(1000, arrival=T0, request_id="mid"), loaded(), T0)
    long = ctl.submit(request(LONG, arrival=T0 + 0.01, request_id="long"), loaded(), T0 + 0.01)
    assert isinstance(mid, Queue)
    assert isinstance(long, Queue)
    standings = {}
    for decision in (mid, long):
        assert decision.entry_id is not None
        entry = ctl.queue.entry(decision.entry_id)
        assert entry is not None
        assert entry.request.size_protected
        standings[entry.request.request_id] = entry.request.size_standing
    assert standings == {"mid": pytest.approx(0.6), "long": 0.0}
    result = ctl.reevaluate(T0 + 0.05, idle())
    assert [e.request.request_id for e, _ in result.dispatched] == ["long", "mid"]


def test_it_is_refused_once_its_own_first_token_would_be_late() -> None:
    ctl = starved()
    long = ctl.submit(request(LONG, arrival=T0, request_id="long"), loaded(), T0)
    assert isinstance(long, Queue)
    # 0.95 s after arrival a ~0.1 s TTFT misses the 1 s target: refused, the others let go.
    result = ctl.reevaluate(T0 + 0.95, loaded())
    assert [e.request.request_id for e, _ in result.rejected] == ["long"]
    assert result.rejected[0][1].reason == RejectReason.DEADLINE_EXCEEDED
    assert len(ctl.queue) == 0
    assert not ctl.queue.holds_back(0)


def test_its_outcomes_count_towards_its_band() -> None:
    ctl = starved()
    ctl.submit(request(LONG, arrival=T0, request_id="long"), loaded(), T0)
    ctl.reevaluate(T0 + 0.05, idle())
    shares = ctl.size_shares.as_json(T0 + 2.0)["interactive"]
    offered, admitted = shares["offered"], shares["admitted"]
    assert isinstance(offered, list)
    assert isinstance(admitted, list)
    assert (sum(offered), sum(admitted)) == (201, 151)


def test_a_reload_turns_it_off_and_keeps_the_window() -> None:
    ctl = starved()
    ctl.reconfigure(OFF)
    decision = ctl.submit(request(LONG, arrival=T0), loaded(), T0)
    assert isinstance(decision, Reject)  # no longer protected
    ctl.reconfigure(ON)
    decision = ctl.submit(request(LONG, arrival=T0 + 0.01), loaded(), T0 + 0.01)
    assert isinstance(decision, Queue)  # the window kept its starved band
