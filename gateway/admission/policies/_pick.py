"""What the simple policies share: the least busy replica, and the refusal when there is none."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gateway.admission.decision import Blocker, Reject, RejectReason
from gateway.admission.retry_after import RetryAfterPolicy
from gateway.admission.views import ReplicaView

__all__ = ["least_busy", "no_replica"]


def least_busy(
    views: Sequence[ReplicaView], key: Callable[[ReplicaView], tuple[float, ...]] | None = None
) -> ReplicaView | None:
    """The healthy view with the smallest ``key`` (default: fewest of Sluice's requests there);
    ties go to the earlier view (the fleet's order). ``None``: no healthy view."""
    best: ReplicaView | None = None
    best_key: tuple[float, ...] = ()
    for view in views:
        if not view.healthy:
            continue
        k = key(view) if key is not None else (float(view.gateway_streams),)
        if best is None or k < best_key:
            best, best_key = view, k
    return best


def no_replica(retry: RetryAfterPolicy) -> Reject:
    """The refusal when no replica is healthy (jittered ``no_replica_s``)."""
    return Reject(
        RejectReason.NO_HEALTHY_REPLICA, retry.no_replica(), None, "no healthy replica", Blocker.NO_REPLICA
    )
