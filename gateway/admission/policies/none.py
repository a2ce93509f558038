"""``policy: none``: no admission control; every request goes to the least busy replica at once."""

from __future__ import annotations

import math
from collections.abc import Sequence

from gateway.admission.config import AdmissionSettings
from gateway.admission.decision import Admit, Decision
from gateway.admission.policies._pick import least_busy, no_replica
from gateway.admission.request import AdmissionRequest
from gateway.admission.retry_after import RetryAfterPolicy
from gateway.admission.views import ReplicaView

__all__ = ["PassThroughAdmitter"]


class PassThroughAdmitter:
    """Admits every request to the replica with the fewest of Sluice's requests (vLLM behind a
    plain load balancer: the engines' own queues absorb overload). Refuses only when no replica is
    healthy. A request queued under another policy (hot reload) is sent at once."""

    def __init__(self, settings: AdmissionSettings, retry: RetryAfterPolicy) -> None:
        self._retry = retry

    def decide(
        self, request: AdmissionRequest, views: Sequence[ReplicaView], now: float, *, queued: bool = False
    ) -> Decision:
        view = least_busy(views)
        if view is None:
            return no_replica(self._retry)
        return Admit(view.name, None, math.nan)
