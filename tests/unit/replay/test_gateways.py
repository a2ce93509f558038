"""Several gateways in virtual time (``replay.gateways``): how arrivals are split, and the
delayed ledger each gateway's views read the others' in-flight requests from."""

from __future__ import annotations

from collections import Counter

import pytest

from gateway.admission.views import TrackedStream
from gateway.ledger.config import LedgerSettings
from gateway.replicas.registry import LiveRequest
from replay.gateways import DelayedLedger, Split


@pytest.mark.parametrize(
    ("split", "first_twelve"),
    [
        pytest.param(Split(1), [0] * 12, id="one gateway takes all"),
        pytest.param(Split(3), [0, 1, 2] * 4, id="round robin"),
        pytest.param(Split(3, 0.5), [1, 0, 2, 0, 1, 0, 2, 0, 1, 0, 2, 0], id="half to one, rest alternate"),
        pytest.param(Split(4, 0.25), [1, 2, 3, 0] * 3, id="a fair share is round robin"),
        pytest.param(Split(2, 0.75), [1, 0, 0, 0] * 3, id="three quarters to one"),
    ],
)
def test_split_assigns_arrivals(split: Split, first_twelve: list[int]) -> None:
    assert [split.gateway(k) for k in range(12)] == first_twelve


@pytest.mark.parametrize(("n", "share"), [(2, 0.5), (4, 0.5), (8, 0.5), (8, 0.3), (5, 0.1)])
def test_skewed_split_gives_the_one_its_share_and_the_others_equal_parts(n: int, share: float) -> None:
    arrivals = 1000 * (n - 1) * 10
    counts = Counter(Split(n, share).gateway(k) for k in range(arrivals))
    assert set(counts) == set(range(n))
    assert abs(counts[0] - share * arrivals) <= 1
    others = [counts[g] for g in range(1, n)]
    assert max(others) - min(others) <= 1


@pytest.mark.parametrize(
    ("gateways", "share"), [(0, None), (1, 0.5), (3, 0.0), (3, 1.0)], ids=["none", "one", "zero", "all"]
)
def test_split_refuses_impossible_shapes(gateways: int, share: float | None) -> None:
    with pytest.raises(ValueError, match="must be"):
        Split(gateways, share)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def stream(prompt: int, now: float) -> tuple[LiveRequest, TrackedStream[object]]:
    live = LiveRequest("r", prompt, now, 100, streamed=True)
    return live, TrackedStream(live, "interactive", 50.0, 0.02)


def test_a_dispatch_reaches_the_other_gateways_after_the_delay_and_never_its_own() -> None:
    clock, changes = Clock(), list[tuple[int, str, bool]]()
    ledger = DelayedLedger(3, 0.01, clock, lambda g, r, freed: changes.append((g, r, freed)))
    live, s = stream(300, 0.0)
    ledger.listener(1).tracked("r0", live, s)

    assert ledger.next_event() == pytest.approx(0.01)
    clock.now = 0.009
    ledger.run(clock.now)
    assert [ledger.in_flight(g, "r0") for g in range(3)] == [(), (), ()]  # still on its way

    clock.now = 0.01
    ledger.run(clock.now)
    held = [ledger.in_flight(g, "r0") for g in range(3)]
    assert held[1] == ()  # its own requests are counted from its own streams, not the ledger
    for g in (0, 2):
        (entry,) = held[g]
        assert (entry.prompt_tokens, entry.tokens_streamed, entry.started_at) == (300, 0, 0.0)
    assert sorted(changes) == [(0, "r0", False), (2, "r0", False)]
    assert ledger.in_flight(0, "r1") == ()


def test_its_end_frees_the_replica_in_every_other_view_after_the_delay() -> None:
    clock, changes = Clock(), list[tuple[int, str, bool]]()
    ledger = DelayedLedger(2, 0.1, clock, lambda g, r, freed: changes.append((g, r, freed)))
    live, s = stream(100, 0.0)
    ledger.listener(0).tracked("r0", live, s)
    clock.now = 0.1
    ledger.run(clock.now)
    assert len(ledger.in_flight(1, "r0")) == 1

    clock.now = 0.5
    ledger.listener(0).forgotten("r0", live)
    ledger.run(0.55)
    assert len(ledger.in_flight(1, "r0")) == 1  # as it stood 0.1 s ago
    ledger.run(0.6)
    assert ledger.in_flight(1, "r0") == ()
    assert changes[-1] == (1, "r0", True)


def test_an_end_sent_before_the_dispatch_arrived_follows_it_in_order() -> None:
    clock = Clock()
    ledger = DelayedLedger(2, 0.1, clock, lambda g, r, freed: None)
    live, s = stream(100, 0.0)
    ledger.listener(0).tracked("r0", live, s)
    clock.now = 0.05
    ledger.listener(0).forgotten("r0", live)  # its put is still on its way: the delete follows it
    counted = []
    for at in (0.1, 0.12, 0.16):
        ledger.run(at)
        counted.append(len(ledger.in_flight(1, "r0")))
    assert counted == [1, 1, 0]
    assert ledger.next_event() is None


def test_progress_is_published_at_the_first_token_and_then_every_progress_interval() -> None:
    clock = Clock()
    settings = LedgerSettings(enabled=True, progress_interval_s=0.25)
    ledger = DelayedLedger(2, 0.001, clock, lambda g, r, freed: None, settings=settings)
    live, s = stream(100, 0.0)
    ledger.listener(0).tracked("r0", live, s)

    def seen_at(t: float) -> int:
        clock.now = t
        due = ledger.next_event()
        while due is not None and due <= t:
            ledger.run(due)
            due = ledger.next_event()
        ledger.run(t)
        (entry,) = ledger.in_flight(1, "r0")
        return entry.tokens_streamed

    assert ledger.tick_s == pytest.approx(0.05)
    assert seen_at(0.2) == 0
    live.first_token_at = live.last_token_at = 0.21
    live.tokens_streamed = 1
    assert seen_at(0.26) == 1  # the first token at the next tick
    live.tokens_streamed, live.last_token_at = 9, 0.3
    assert seen_at(0.4) == 1  # later tokens wait for progress_interval_s
    assert seen_at(0.56) == 9


def test_no_timer_while_nothing_is_in_flight_or_on_its_way() -> None:
    ledger = DelayedLedger(4, 0.01, Clock(), lambda g, r, freed: None)
    assert ledger.next_event() is None
    with pytest.raises(ValueError, match="delay_s"):
        DelayedLedger(2, -0.001, Clock(), lambda g, r, freed: None)
