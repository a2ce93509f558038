"""The other gateways' dispatches a gateway cannot have seen yet.

A ledger message reaches the other gateways some milliseconds after its dispatch (Redis's round
trip and pub/sub; more across zones). Meanwhile the replica holds prefills none of them counts:
in steady state as many as the others' dispatch rate times that delay. Their finishes come as
late, so the count of in-flight requests stays about right; what is missing is the prefills,
the work that stalls the running streams. ``UnseenDispatches`` estimates them per replica from
the entries it is told arrived: ``round(rate x lag)`` stand-ins shaped like the latest arrivals,
dispatched half the lag ago, no token yet. Pure: times are passed in (monotonic seconds, and
the reader's wall minus monotonic ``offset`` to read the senders' wall-clock dispatch times).
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Final

from gateway.admission.shares import StreamingRequest
from gateway.ledger.state import Entry
from gateway.replicas.snapshot import InFlight

__all__ = ["MAX_LAG_S", "WINDOW_S", "UnseenDispatches"]

#: Seconds of arrivals the rate and the lag are taken over.
WINDOW_S: Final = 1.0
#: The largest lag believed, seconds: beyond, a sender's clock is off (wall clocks of different
#: hosts) or the message was held up, and counting more stand-ins would only refuse traffic.
MAX_LAG_S: Final = 0.5


class UnseenDispatches:
    """Per replica, the other gateways' recent arrivals and the stand-ins they imply."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        if not window_s > 0.0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._recent: dict[str, deque[tuple[float, float, Entry]]] = {}

    def arrived(self, entry: Entry, now: float, offset: float) -> None:
        """Another gateway's new entry was received at monotonic ``now``; its lag is ``now +
        offset - entry.dispatched_at``, within [0, ``MAX_LAG_S``]."""
        lag = min(max(now + offset - entry.dispatched_at, 0.0), MAX_LAG_S)
        recent = self._recent.setdefault(entry.replica, deque())
        recent.append((now, lag, entry))
        self._prune(recent, now)

    def expected(self, replica: str, now: float, offset: float) -> tuple[Entry, ...]:
        """Stand-ins for the dispatches to ``replica`` made but not received by monotonic
        ``now``: the arrivals' rate over the window times their median lag, rounded, each a copy
        of one of the latest arrivals with key ``unseen/<replica>/<i>``, no tokens, dispatched
        half the lag before ``now`` (wall-clock, by ``offset``). Empty when none is expected."""
        recent = self._recent.get(replica)
        if not recent:
            return ()
        self._prune(recent, now)
        if not recent:
            del self._recent[replica]
            return ()
        lags = sorted(lag for _, lag, _ in recent)
        lag = lags[len(lags) // 2]
        count = min(int(len(recent) / self.window_s * lag + 0.5), len(recent))
        if count <= 0:
            return ()
        dispatched_at = now + offset - lag / 2.0
        latest = list(recent)[-count:]
        return tuple(
            replace(
                entry,
                key=f"unseen/{replica}/{i}",
                dispatched_at=dispatched_at,
                first_token_at=None,
                tokens=0,
                version=0,
            )
            for i, (_, _, entry) in enumerate(latest)
        )

    def in_flight(
        self, replica: str, held: tuple[InFlight, ...], now: float, offset: float
    ) -> tuple[InFlight, ...]:
        """``held`` (the entries received, as ``RemoteLedger.in_flight``) with the stand-ins'."""
        unseen = self.expected(replica, now, offset)
        return held + tuple(e.in_flight(offset) for e in unseen) if unseen else held

    def streams(
        self, replica: str, held: tuple[StreamingRequest, ...], now: float, offset: float
    ) -> tuple[StreamingRequest, ...]:
        """``held`` (as ``RemoteLedger.streams``) with the stand-ins' that carry a TPOT forecast."""
        unseen = self.expected(replica, now, offset)
        if not unseen:
            return held
        made = (e.streaming() for e in unseen)
        return held + tuple(s for s in made if s is not None)

    def forget(self) -> None:
        """Drop every arrival (the ledger was cleared)."""
        self._recent.clear()

    def _prune(self, recent: deque[tuple[float, float, Entry]], now: float) -> None:
        start = now - self.window_s
        while recent and recent[0][0] <= start:
            recent.popleft()
