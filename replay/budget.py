"""The tenants' budgets in a replay: the gateway's in-memory limiter on the virtual clock.

``MemoryBudget`` is the admission engine's ``TenantBudget`` port over
``gateway.limits.memory.MemoryLimiter``, the limiter a gateway without Redis runs: the same
bucket arithmetic, concurrency leases and over-limit answers, read at the virtual instant the
engine passes in. Tenants without an entry in ``limits`` have no budget.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Final

from gateway.admission.budget import BudgetAnswer
from gateway.admission.fairness import TokenWeights
from gateway.admission.request import AdmissionRequest
from gateway.limits.base import LimiterStats, Reservation, TenantLimits
from gateway.limits.config import LimitsSettings
from gateway.limits.memory import MemoryLimiter
from gateway.tenants.pricing import PLAIN_WEIGHTS, configured_weights

__all__ = ["DEFAULT_WEIGHTS", "MemoryBudget"]

#: The weights a reservation is priced with unless given: the gateway's own default
#: (``limits.token_weights`` left at its default: plain tokens, prompt + output).
DEFAULT_WEIGHTS: Final = configured_weights(LimitsSettings()) or PLAIN_WEIGHTS


class MemoryBudget:
    """``TenantBudget`` over a ``MemoryLimiter`` on the virtual clock (see the module).

    ``limits``: each budgeted tenant's limits. ``weights``: what a weighted token is (prompt and
    output token weights). ``stats``: the limiter's counters (reserves, rejections, settles);
    ``limiter``: the limiter itself, on the same virtual clock."""

    def __init__(
        self, limits: Mapping[str, TenantLimits], *, weights: TokenWeights = DEFAULT_WEIGHTS
    ) -> None:
        self._limits = dict(limits)
        self._weights = weights
        self._now = 0.0
        self.stats = LimiterStats()
        self._limiter = MemoryLimiter(clock=self._clock, stats=self.stats, name="replay")
        self.limiter: Final = self._limiter
        self._ids = itertools.count()

    def _clock(self) -> float:
        return self._now

    def weights(self, model: str | None = None) -> TokenWeights:
        return self._weights

    def reserve(self, request: AdmissionRequest, cost_tokens: float, now: float) -> BudgetAnswer | None:
        tenant = request.tenant
        limits = None if tenant is None else self._limits.get(tenant)
        if tenant is None or limits is None:
            return None
        self._now = now
        # A fresh id per reservation, as live: a request placed twice is two reservations.
        rid = f"{request.request_id}#{next(self._ids)}"
        answer = self._limiter.reserve_now(tenant, cost_tokens=cost_tokens, limits=limits, request_id=rid)
        self.stats.count_reserve(answer)
        return answer

    def settle(self, answer: BudgetAnswer, actual_cost_tokens: float, now: float) -> None:
        if not isinstance(answer, Reservation):
            raise TypeError(f"not this budget's reservation: {answer!r}")
        self._now = now
        self.stats.count_settle(self._limiter.settle_now(answer, actual_cost_tokens=actual_cost_tokens))
