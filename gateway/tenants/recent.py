"""Recent refusals: how many 429s each tenant got, by reason, over the last few minutes.

``RecentRefusals`` counts in fixed slots (``slot_s`` seconds each, ``slots`` of them: the window
is ``slot_s * slots``) on an injectable monotonic clock, so memory is bounded by tenants x
reasons x slots, and both are capped (``max_keys``; further pairs count under ``other``). Fed
with each request's outcome (an ``OutcomeListener``); read by the tenants admin API.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final

from gateway.observability.outcome import RequestOutcome

__all__ = ["RecentRefusals"]

#: The reason counted for pairs beyond ``max_keys``, and for a 429 that names none.
OTHER: Final = "other"


class RecentRefusals:
    """429s per (tenant, reason) over a sliding window of ``slots`` slots of ``slot_s`` seconds.

    ``observe`` is O(1); ``by_reason`` is O(reasons x slots). Counts are exact per slot, so the
    window is between ``(slots - 1) * slot_s`` and ``slots * slot_s`` seconds long.
    """

    def __init__(
        self,
        *,
        slot_s: float = 60.0,
        slots: int = 5,
        max_keys: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if slot_s <= 0 or slots < 1 or max_keys < 1:
            raise ValueError("slot_s must be > 0, slots and max_keys >= 1")
        self.slot_s = slot_s
        self.slots = slots
        self._max_keys = max_keys
        self._clock = clock
        #: (tenant, reason) -> {slot number: count}; slot number = floor(time / slot_s).
        self._counts: dict[tuple[str, str], dict[int, int]] = {}

    @property
    def window_s(self) -> float:
        """The window's length in seconds (``slot_s * slots``)."""
        return self.slot_s * self.slots

    def observe(self, outcome: RequestOutcome) -> None:
        """Count ``outcome`` when it is a 429 of a tenant (an ``OutcomeListener``)."""
        if outcome.status == 429 and outcome.tenant is not None:
            self.count(outcome.tenant, outcome.reason or OTHER)

    def count(self, tenant: str, reason: str) -> None:
        """Count one refusal of ``tenant`` for ``reason`` now."""
        slot = int(self._clock() // self.slot_s)
        key = (tenant, reason)
        counts = self._counts.get(key)
        if counts is None:
            if len(self._counts) >= self._max_keys:
                self._prune(slot)
            if len(self._counts) >= self._max_keys:
                key = (tenant, OTHER)
            counts = self._counts.setdefault(key, {})
        counts[slot] = counts.get(slot, 0) + 1
        if len(counts) > self.slots:
            for old in [s for s in counts if s <= slot - self.slots]:
                del counts[old]

    def by_reason(self, tenant: str) -> dict[str, int]:
        """``tenant``'s refusals within the window, by reason (reasons with none left out)."""
        first = int(self._clock() // self.slot_s) - self.slots + 1
        found: dict[str, int] = {}
        for (name, reason), counts in self._counts.items():
            if name == tenant:
                total = sum(n for s, n in counts.items() if s >= first)
                if total:
                    found[reason] = total
        return found

    def _prune(self, slot: int) -> None:
        """Drop the pairs with no count left in the window."""
        first = slot - self.slots + 1
        for key in [k for k, counts in self._counts.items() if all(s < first for s in counts)]:
            del self._counts[key]
