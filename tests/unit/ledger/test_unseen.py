"""The other gateways' dispatches not heard of yet: rate times lag, stand-ins shaped like the
latest arrivals, gone when the arrivals stop. Times are plain numbers."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gateway.ledger.state import Entry, RemoteLedger
from gateway.ledger.unseen import MAX_LAG_S, UnseenDispatches

OFFSET = 1_000.0  # wall minus monotonic seconds


def sent(i: int, at: float, *, replica: str = "r0", prompt: int = 100) -> Entry:
    """Another gateway's ``i``-th dispatch, at wall-clock ``at``."""
    return Entry("g2", f"g2/{i}", replica, prompt, 50.0, 64, "interactive", at, None, 0, 1, 0, 0.02)


def feed(unseen: UnseenDispatches, *, rate: float, lag: float, until: float) -> None:
    """Arrivals at ``rate`` per second up to monotonic ``until``, each received ``lag`` after its dispatch."""
    n = int(rate * until)
    for i in range(n):
        now = (i + 1) / rate
        unseen.arrived(sent(i, now + OFFSET - lag, prompt=100 + i), now, OFFSET)


def test_rate_times_lag_stand_ins_like_the_latest_arrivals() -> None:
    unseen = UnseenDispatches(window_s=1.0)
    feed(unseen, rate=40.0, lag=0.1, until=2.0)
    got = unseen.expected("r0", 2.0, OFFSET)
    assert len(got) == 4  # 40 per second x 0.1 s
    assert [e.prompt_tokens for e in got] == [176, 177, 178, 179]  # the latest four arrivals
    assert {e.key for e in got} == {f"unseen/r0/{i}" for i in range(4)}
    assert all(e.tokens == 0 and e.first_token_at is None for e in got)
    assert all(e.dispatched_at == pytest.approx(2.0 + OFFSET - 0.05) for e in got)
    # Their InFlight: still in prefill, half the lag old on the reader's clock.
    assert all(e.in_flight(OFFSET).started_at == pytest.approx(1.95) for e in got)
    assert unseen.expected("r1", 2.0, OFFSET) == ()


def test_a_short_lag_or_a_slow_rate_expects_none() -> None:
    fast = UnseenDispatches()
    feed(fast, rate=40.0, lag=0.001, until=2.0)
    assert fast.expected("r0", 2.0, OFFSET) == ()
    slow = UnseenDispatches()
    feed(slow, rate=2.0, lag=0.1, until=2.0)
    assert slow.expected("r0", 2.0, OFFSET) == ()


def test_the_stand_ins_go_when_the_arrivals_stop() -> None:
    unseen = UnseenDispatches(window_s=1.0)
    feed(unseen, rate=40.0, lag=0.1, until=2.0)
    assert unseen.expected("r0", 2.5, OFFSET)
    assert unseen.expected("r0", 3.01, OFFSET) == ()
    feed(unseen, rate=40.0, lag=0.1, until=2.0)
    unseen.forget()
    assert unseen.expected("r0", 2.0, OFFSET) == ()


def test_a_skewed_clock_counts_at_most_the_largest_lag_believed() -> None:
    # The sender's wall clock runs 5 s behind: its dispatches look 5 s old on arrival.
    unseen = UnseenDispatches(window_s=1.0)
    feed(unseen, rate=10.0, lag=5.0, until=2.0)
    assert len(unseen.expected("r0", 2.0, OFFSET)) == round(10.0 * MAX_LAG_S)
    # Ahead instead (negative lag): none.
    ahead = UnseenDispatches(window_s=1.0)
    feed(ahead, rate=40.0, lag=-1.0, until=2.0)
    assert ahead.expected("r0", 2.0, OFFSET) == ()


def test_the_remote_ledger_knows_held_and_deleted_keys() -> None:
    remote = RemoteLedger("g1", max_entries_per_replica=10)
    first = sent(1, 1_001.0)
    assert not remote.knows(first)
    remote.put(first, 1.0)
    assert remote.knows(first)
    assert remote.knows(replace(first, version=2, tokens=5))
    remote.remove("r0", first.key, 2.0)
    assert remote.knows(first)  # a late put of a deleted entry is no new dispatch
    assert not remote.knows(sent(2, 1_001.5))
