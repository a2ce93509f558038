"""The ledger's pure state: entries on the wire, the outbox's coalescing and progress rate, the
remote ledger's apply, versions, tombstones, cap, reconcile and expiry. Times are plain numbers."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from gateway.ledger.config import LedgerSettings
from gateway.ledger.state import (
    Entry,
    Outbox,
    RemoteLedger,
    decode_entry,
    decode_message,
    encode_entry,
    encode_message,
    widen,
)
from gateway.replicas.snapshot import InFlight

OFFSET = 1_000.0  # wall minus monotonic seconds


def entry(
    key: str = "g2/1", *, gateway: str = "g2", replica: str = "r0", version: int = 1, tokens: int = 0
) -> Entry:
    return Entry(gateway, key, replica, 100, 50.0, 64, "interactive", 1_010.0, None, tokens, version)


@dataclass
class FakeLive:
    """A request as ``TrackedStream.in_flight`` shows it (monotonic times)."""

    tokens: int = 0
    first_token_at: float | None = None
    request_class: str = "batch"
    expected_output_tokens: float = 40.0
    predicted_tpot_s: float = 0.02
    cached: int = 0

    def in_flight(self, now: float) -> InFlight:
        return InFlight(
            "req", 200, self.tokens, 5.0, 64, first_token_at=self.first_token_at, cached_tokens=self.cached
        )

    __hash__ = object.__hash__


# -- wire ------------------------------------------------------------------------------------------


def test_an_entry_survives_the_wire() -> None:
    e = replace(
        entry(), first_token_at=1_011.25, tokens=7, predicted_output=None, max_tokens=None, cached_tokens=64
    )
    assert decode_entry(encode_entry(e)) == e
    # A gateway of an earlier version sends no cached_tokens, or no TPOT forecast: read as none.
    assert decode_entry(encode_entry(e).removesuffix(",64,null]") + "]") == replace(e, cached_tokens=0)
    timed = replace(e, predicted_tpot_s=0.025)
    assert decode_entry(encode_entry(timed)) == timed
    assert decode_entry(encode_entry(timed).removesuffix(",0.025]") + "]") == e


@pytest.mark.parametrize(
    "text",
    [pytest.param("", id="empty"), pytest.param("[1,2]", id="short"), pytest.param('{"a":1}', id="object")],
)
def test_a_malformed_entry_is_none(text: str) -> None:
    assert decode_entry(text) is None


def test_a_message_carries_puts_deletes_and_saturations() -> None:
    text = encode_message("g2", [("put", entry()), ("del", entry("g2/0"))], [("r1", 1.5)])
    message = decode_message(text)
    assert message is not None
    assert message.gateway == "g2"
    assert [(kind, e.key, e.replica) for kind, e in message.ops] == [
        ("put", "g2/1", "r0"),
        ("del", "g2/0", "r0"),
    ]
    assert message.ops[0][1] == entry()
    assert message.saturations == [("r1", 1.5)]
    assert decode_message(b"not json") is None


def test_in_flight_moves_times_to_the_readers_clock() -> None:
    e = replace(entry(), first_token_at=1_012.0, tokens=3)
    frozen = e.in_flight(OFFSET)
    assert (frozen.started_at, frozen.first_token_at, frozen.tokens_streamed) == (10.0, 12.0, 3)
    assert frozen.last_token_at is None
    assert (frozen.prompt_tokens, frozen.max_tokens, frozen.cached_tokens) == (100, 64, 0)


# -- outbox ----------------------------------------------------------------------------------------


def outbox(cap: int = 10) -> Outbox:
    return Outbox("g1", progress_interval_s=0.25, max_entries_per_replica=cap)


def test_a_dispatch_is_one_put_with_wall_times() -> None:
    box, live = outbox(), FakeLive(cached=128)
    box.dispatched("r0", live, live, now=6.0, offset=OFFSET)
    (op,) = box.drain(6.0)
    kind, e = op
    assert kind == "put"
    assert (e.gateway, e.key, e.replica, e.prompt_tokens, e.max_tokens) == ("g1", "g1/1", "r0", 200, 64)
    assert (e.dispatched_at, e.request_class, e.predicted_output, e.cached_tokens, e.predicted_tpot_s) == (
        1_005.0,
        "batch",
        40.0,
        128,
        0.02,
    )
    assert box.drain(6.1) == []


def test_a_request_that_ends_before_a_drain_is_never_sent() -> None:
    box, live = outbox(), FakeLive()
    box.dispatched("r0", live, live, now=6.0, offset=OFFSET)
    box.finished(live)
    assert box.drain(6.0) == []
    assert box.entries() == []


def test_a_published_request_that_ends_is_deleted() -> None:
    box, live = outbox(), FakeLive()
    box.dispatched("r0", live, live, now=6.0, offset=OFFSET)
    box.drain(6.0)
    box.finished(live)
    assert [(k, e.key) for k, e in box.drain(6.1)] == [("del", "g1/1")]
    box.finished(live)  # twice: nothing more
    assert box.drain(6.2) == []


def test_first_token_at_once_then_progress_at_most_every_interval() -> None:
    box, live = outbox(), FakeLive()
    box.dispatched("r0", live, live, now=6.0, offset=OFFSET)
    box.drain(6.0)
    live.tokens, live.first_token_at = 1, 6.01
    box.tick(6.02, OFFSET)
    ((kind, e),) = box.drain(6.02)
    assert (kind, e.tokens, e.first_token_at, e.version) == ("put", 1, 1_006.01, 2)
    live.tokens = 5
    box.tick(6.1, OFFSET)  # 0.08 s after the last: too soon
    assert box.drain(6.1) == []
    box.tick(6.3, OFFSET)
    ((_, e),) = box.drain(6.3)
    assert (e.tokens, e.version) == (5, 3)
    box.tick(6.9, OFFSET)  # no change: nothing
    assert box.drain(6.9) == []


def test_undelivered_ops_are_requeued_unless_superseded() -> None:
    box, a, b = outbox(), FakeLive(), FakeLive()
    box.dispatched("r0", a, a, now=6.0, offset=OFFSET)
    box.dispatched("r0", b, b, now=6.0, offset=OFFSET)
    lost = box.drain(6.0)
    box.finished(a)  # a's delete is pending: a's lost put must not come back
    box.requeue(lost)
    assert sorted((k, e.key) for k, e in box.drain(6.1)) == [("del", "g1/1"), ("put", "g1/2")]


def test_beyond_the_cap_a_request_is_not_published() -> None:
    box = outbox(cap=2)
    lives = [FakeLive() for _ in range(3)]
    for live in lives:
        box.dispatched("r0", live, live, now=6.0, offset=OFFSET)
    other = FakeLive()
    box.dispatched("r1", other, other, now=6.0, offset=OFFSET)
    assert len(box.drain(6.0)) == 3
    assert box.unpublished == 1
    box.finished(lives[0])
    late = FakeLive()
    box.dispatched("r0", late, late, now=6.1, offset=OFFSET)  # room again
    assert len(box.drain(6.1)) == 2


# -- remote ledger -----------------------------------------------------------------------------------


def remote(cap: int = 10) -> RemoteLedger:
    return RemoteLedger("g1", max_entries_per_replica=cap)


def test_put_keeps_the_highest_version_and_ignores_its_own() -> None:
    ledger = remote()
    assert ledger.put(entry(version=2, tokens=4), 1.0)
    assert not ledger.put(entry(version=1, tokens=1), 1.1)  # older: reordered or a stale read
    assert not ledger.put(entry(version=2, tokens=9), 1.1)  # same: a duplicate
    assert ledger.put(entry(version=3, tokens=6), 1.2)
    assert [f.tokens_streamed for f in ledger.in_flight("r0", OFFSET)] == [6]
    assert not ledger.put(entry("g1/1", gateway="g1"), 1.3)
    assert ledger.counts() == {"r0": 1}


def test_a_removed_entry_does_not_come_back() -> None:
    ledger = remote()
    ledger.put(entry(), 1.0)
    assert ledger.remove("r0", "g2/1", 1.1)
    assert not ledger.put(entry(version=5), 1.2)  # a put delivered late, or an old snapshot
    assert ledger.in_flight("r0", OFFSET) == ()
    assert not ledger.remove("r0", "g2/1", 1.3)


def test_at_the_cap_new_entries_are_dropped_and_counted() -> None:
    ledger = remote(cap=2)
    assert ledger.put(entry("g2/1"), 1.0)
    assert ledger.put(entry("g3/1", gateway="g3"), 1.0)
    assert not ledger.put(entry("g2/2"), 1.0)
    assert ledger.dropped == 1
    assert ledger.put(entry("g2/1", version=2, tokens=3), 1.1)  # a held one still updates
    assert ledger.put(entry("g2/3", replica="r1"), 1.1)  # per replica
    assert ledger.counts() == {"r0": 2, "r1": 1}


def test_reconcile_adds_what_was_missed_and_drops_what_ended_unseen() -> None:
    ledger = remote()
    ledger.put(entry("g2/1"), 1.0)  # ended, its delete lost
    ledger.put(entry("g2/2"), 5.0)  # put after the read was sent: kept although the read lacks it
    read = [entry("g2/3"), entry("g2/4", replica="r1")]
    assert ledger.reconcile("r0", read, asked_at=4.0, now=6.0)
    assert sorted(e.key for e in ledger.entries("r0")) == ["g2/2", "g2/3"]
    assert not ledger.reconcile("r0", [entry("g2/3")], asked_at=4.5, now=6.0)


def test_expire_drops_dead_gateways_entries() -> None:
    ledger = remote()
    ledger.put(entry("g2/1"), 1.0)
    ledger.put(entry("g3/1", gateway="g3", replica="r1"), 1.0)
    assert ledger.gateways() == {"g2", "g3"}
    assert ledger.expire({"g1", "g3"}, 2.0) == ["r0"]
    assert ledger.counts() == {"r1": 1}
    assert ledger.by_gateway("r1") == {"g3": 1}
    assert ledger.clear() == ["r1"]
    assert ledger.counts() == {}


def test_in_flight_is_built_once_per_change() -> None:
    ledger = remote()
    ledger.put(entry(), 1.0)
    first = ledger.in_flight("r0", OFFSET)
    assert ledger.in_flight("r0", OFFSET) is first
    ledger.put(entry(version=2), 1.1)
    assert ledger.in_flight("r0", OFFSET) is not first


def test_entries_with_a_tpot_forecast_are_streams_to_protect() -> None:
    """The other gateways' requests join the streams admission holds newcomers to (their class's
    TPOT target), once per change; one without a TPOT forecast only loads the replica."""
    ledger = remote()
    ledger.put(replace(entry(), predicted_tpot_s=0.03, tokens=5, request_class="batch"), 1.0)
    ledger.put(replace(entry(key="g2/9"), request_class=None), 1.0)  # no forecast made
    (stream,) = ledger.streams("r0")
    assert (stream.request_class, stream.generated_tokens, stream.predicted_tpot_s) == ("batch", 5, 0.03)
    assert ledger.streams("r0") is ledger.streams("r0")
    ledger.put(replace(entry(key="g2/10"), predicted_tpot_s=0.02, request_class=None), 1.1)
    assert [s.request_class for s in ledger.streams("r0")] == ["batch", ""]  # "": the default's
    assert ledger.streams("r1") == ()


# -- margins and settings ----------------------------------------------------------------------------


def test_widen_scales_every_class_only_while_down() -> None:
    extra = [0.0]
    margins = widen(
        lambda r, now: {"batch": 0.5}, lambda: ["batch", "interactive"], lambda: 0.1, lambda: extra[0]
    )
    assert margins("r0", 0.0) == {"batch": 0.5}
    extra[0] = 0.2
    widened = margins("r0", 0.0)
    assert widened["batch"] == pytest.approx(1.5 * 1.2 - 1)
    assert widened["interactive"] == pytest.approx(1.1 * 1.2 - 1)


def test_settings_default_off_and_expiry_outlasts_two_heartbeats() -> None:
    assert LedgerSettings().enabled is False
    with pytest.raises(ValueError, match="expiry_s: must be at least 2 x heartbeat_s"):
        LedgerSettings(heartbeat_s=1.0, expiry_s=1.5)
    with pytest.raises(ValueError, match="Extra inputs"):
        LedgerSettings.model_validate({"enabled": True, "ttl": 3})


def test_the_ledger_needs_the_limiters_redis() -> None:
    from gateway.config.settings import Settings

    replicas = [{"name": "r0", "url": "http://127.0.0.1:8000"}]
    with pytest.raises(ValueError, match=r"ledger.enabled: needs limits.redis"):
        Settings.model_validate({"replicas": replicas, "ledger": {"enabled": True}})
    ok = Settings.model_validate(
        {
            "replicas": replicas,
            "ledger": {"enabled": True},
            "limits": {"redis": {"url": "redis://127.0.0.1:6379/0"}},
        }
    )
    assert ok.ledger.enabled
