"""``policy: concurrency_cap``: at most N requests per replica, the rest in a FIFO queue with a TTL.

TGI's ``--max-concurrent-requests`` / vllm-router style, with the queue TTL llm-d and LiteLLM
have. The queue keeps arrival order under this policy and refuses a request ``queue_ttl_s``
after its arrival (``AdmissionQueue.push``); a class that does not queue (``queue_capacity: 0``)
is refused ``overloaded`` at once when every replica is full.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gateway.admission.config import AdmissionSettings
from gateway.admission.decision import Admit, Blocker, Decision, Queue
from gateway.admission.policies._pick import least_busy, no_replica
from gateway.admission.request import AdmissionRequest
from gateway.admission.retry_after import UNMEASURED_WAIT_S, RetryAfterPolicy
from gateway.admission.views import ReplicaView

__all__ = ["ConcurrencyCapAdmitter"]


class ConcurrencyCapAdmitter:
    """Admits to the replica with the fewest of Sluice's requests while it holds fewer than
    ``concurrency_cap.max_in_flight``; otherwise ``Queue`` (blocker ``concurrency``). No
    forecasts: decisions carry ``forecast=None``."""

    def __init__(self, settings: AdmissionSettings, retry: RetryAfterPolicy) -> None:
        self._cap = settings.concurrency_cap.max_in_flight
        self._retry = retry

    def decide(
        self, request: AdmissionRequest, views: Sequence[ReplicaView], now: float, *, queued: bool = False
    ) -> Decision:
        view = least_busy(views)
        if view is None:
            return no_replica(self._retry)
        if view.gateway_streams < self._cap:
            return Admit(view.name, None, math.nan)
        # When a slot frees is not predicted: a finish re-evaluates the queue at once.
        return Queue(Blocker.CONCURRENCY, UNMEASURED_WAIT_S, None, None)
