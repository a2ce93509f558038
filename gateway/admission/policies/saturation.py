"""``policy: saturation``: shed load when every replica is saturated (the Kubernetes Gateway API
Inference Extension's detector, defaults queue 5 and KV 0.8).

A replica is saturated when its engine's waiting queue holds more than ``queue_threshold``
requests or its KV-cache use is above ``kv_threshold``, as its view says: the last snapshot plus
the requests Sluice sent since (a stale view is judged on Sluice's own accounting). Never queues.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gateway.admission.config import AdmissionSettings, SaturationSettings
from gateway.admission.decision import Admit, Blocker, Decision, Reject, RejectReason
from gateway.admission.policies._pick import least_busy, no_replica
from gateway.admission.request import AdmissionRequest
from gateway.admission.retry_after import UNMEASURED_WAIT_S, RetryAfterPolicy
from gateway.admission.views import ReplicaView

__all__ = ["SaturationAdmitter", "kv_usage", "saturated"]


def kv_usage(view: ReplicaView) -> float:
    """The replica's KV-cache use, a fraction of its capacity in [0, 1] (0 when unknown)."""
    capacity = view.state.kv_capacity_tokens
    return min(1.0, view.state.kv_tokens_in_use / capacity) if capacity > 0 else 0.0


def saturated(num_waiting: int, kv_cache_usage: float, knobs: SaturationSettings) -> bool:
    """GAIE's per-replica rule: waiting queue or KV use strictly over its threshold."""
    return num_waiting > knobs.queue_threshold or kv_cache_usage > knobs.kv_threshold


class SaturationAdmitter:
    """Admits to the unsaturated replica with the fewest waiting requests (then the least KV use);
    ``Reject(overloaded)`` with blocker ``saturated`` when every replica is saturated. No
    forecasts: decisions carry ``forecast=None``."""

    def __init__(self, settings: AdmissionSettings, retry: RetryAfterPolicy) -> None:
        self._knobs = settings.saturation
        self._retry = retry

    def decide(
        self, request: AdmissionRequest, views: Sequence[ReplicaView], now: float, *, queued: bool = False
    ) -> Decision:
        if not any(v.healthy for v in views):
            return no_replica(self._retry)
        knobs = self._knobs
        free = [v for v in views if not saturated(v.state.num_waiting, kv_usage(v), knobs)]
        view = least_busy(free, key=lambda v: (float(v.state.num_waiting), kv_usage(v)))
        if view is not None:
            return Admit(view.name, None, math.nan)
        return Reject(
            RejectReason.OVERLOADED,
            self._retry.after(UNMEASURED_WAIT_S),
            None,
            f"every replica is saturated (waiting queue > {knobs.queue_threshold} "
            f"or KV-cache use > {knobs.kv_threshold:g})",
            Blocker.SATURATED,
        )
