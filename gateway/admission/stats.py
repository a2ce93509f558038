"""Counters the admission core keeps; ``gateway.observability.metrics`` turns them into Prometheus.

The core never touches ``prometheus_client`` (HOUSE §9): it counts here, and the one metrics module
reads these (monotonic counters, a gauge per class, and observation lists it drains into
histograms). Every label value is bounded: configured class names, ``Outcome``, ``RejectReason``
or ``Blocker`` values, and the enforced flag.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

__all__ = ["OBSERVATIONS_KEPT", "AdmissionStats", "DecisionKey", "Outcome"]


class Outcome(StrEnum):
    """What happened to a request at one admission step."""

    ADMITTED = "admitted"  # sent to a replica at once
    QUEUED = "queued"  # put in Sluice's queue
    DISPATCHED = "dispatched"  # left the queue for a replica
    REJECTED = "rejected"  # refused, at once or from the queue
    CANCELLED = "cancelled"  # its client went away while it was queued


#: Most observations each of ``AdmissionStats``' lists keeps between two drains.
OBSERVATIONS_KEPT: Final = 65536


def _append(observations: list[tuple[str, float]], item: tuple[str, float]) -> None:
    if len(observations) >= OBSERVATIONS_KEPT:
        del observations[: OBSERVATIONS_KEPT // 2]  # amortised O(1) per observation
    observations.append(item)


#: (class, outcome, reason, enforced). ``reason``: "ok" for admitted/dispatched, a ``Blocker``
#: value for queued, a ``RejectReason`` value for rejected, "client_disconnected" for cancelled.
#: ``enforced`` False: a shadow-mode decision (the request was admitted anyway).
DecisionKey = tuple[str, Outcome, str, bool]


@dataclass(slots=True)
class AdmissionStats:
    """Admission counters since start (never reset; exporters read them as counters).

    ``decisions``: count per ``DecisionKey``. ``queue_depth``: requests waiting per class now.
    ``queue_wait_s``: (class, seconds waited) for each request that left the queue, since the last
    ``drain_observations``. ``retry_after_s``: (reason, delay sent) per Retry-After, idem. Each
    list keeps at most ``OBSERVATIONS_KEPT`` (the newest; the oldest half goes when it is full), so
    a process whose lists nobody drains (the live gateway's metrics count outcomes instead) does
    not grow by one entry per 429 under a flood.
    """

    decisions: Counter[DecisionKey] = field(default_factory=Counter)
    queue_depth: dict[str, int] = field(default_factory=dict)
    queue_wait_s: list[tuple[str, float]] = field(default_factory=list)
    retry_after_s: list[tuple[str, float]] = field(default_factory=list)

    def record(self, request_class: str, outcome: Outcome, reason: str, *, enforced: bool = True) -> None:
        """Count one decision."""
        self.decisions[(request_class, outcome, reason, enforced)] += 1

    def observe_retry_after(self, reason: str, delay_s: float) -> None:
        """Keep one Retry-After sent (``retry_after_s``; the oldest go past ``OBSERVATIONS_KEPT``)."""
        _append(self.retry_after_s, (reason, delay_s))

    def observe_queue_wait(self, request_class: str, waited_s: float) -> None:
        """Keep one request's wait in the queue (``queue_wait_s``; bounded like ``retry_after_s``)."""
        _append(self.queue_wait_s, (request_class, waited_s))

    def count(
        self,
        *,
        request_class: str | None = None,
        outcome: Outcome | None = None,
        reason: str | None = None,
        enforced: bool | None = None,
    ) -> int:
        """Sum of the counters matching every given label (``None`` = any)."""
        return sum(
            n
            for (c, o, r, e), n in self.decisions.items()
            if (request_class is None or c == request_class)
            and (outcome is None or o == outcome)
            and (reason is None or r == reason)
            and (enforced is None or e == enforced)
        )

    def drain_observations(self) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
        """(queue waits, Retry-After delays) observed since the last call; clears both lists."""
        waits, retries = self.queue_wait_s, self.retry_after_s
        self.queue_wait_s, self.retry_after_s = [], []
        return waits, retries
