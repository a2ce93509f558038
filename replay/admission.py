"""Score admission policies: replay a trace through a gateway policy (``replay.policies``,
``replay.baselines``) on the one virtual-time loop (``replay.loop``) and report every request's
outcome.

``replay.forecasts`` runs the same loop to score forecasts instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from replay.loop import Fleet, GatewayPolicy, ReplicaHandle, VirtualTimeLoop
from replay.requests import FleetConfig, GatewayRequest, Outcome, Targets, gateway_requests
from replay.traces import TraceRequest

__all__ = [
    "Fleet",
    "FleetConfig",
    "GatewayPolicy",
    "GatewayReplayResult",
    "GatewayRequest",
    "Outcome",
    "ReplicaHandle",
    "Targets",
    "run_gateway_replay",
]


@dataclass(frozen=True, slots=True)
class GatewayReplayResult:
    """Every request's outcome in arrival order, and the replay's length and work."""

    outcomes: tuple[Outcome, ...]
    end_s: float
    steps: int
    busy_s: float
    policy: str
    describe: dict[str, object] = field(default_factory=dict)


def run_gateway_replay(
    trace: Sequence[TraceRequest],
    config: FleetConfig,
    policy: GatewayPolicy,
    *,
    targets: Targets,
    scored: tuple[float, float] | None = None,
) -> GatewayReplayResult:
    """Replay ``trace`` (arrival order; every request must fit ``max_model_len``) through ``policy``.

    ``scored``: the (first, last) arrival times whose requests are scored (default: all). The
    replay stops once every scored request is decided: finished, rejected, or without a first
    token past ``targets.ttft_s`` (a certain miss; it is then left running, and ``finished_s`` is
    ``None``). Arrivals after the scored span keep the load up meanwhile. Deterministic for a
    given input, config and policy.
    """
    requests = gateway_requests(trace, config)
    first, last = scored if scored is not None else (-math.inf, math.inf)
    inside = [r.index for r in requests if first <= r.arrival_s < last]
    # In arrival order the scored requests are contiguous: the first to the last inside the span.
    scored_indices = range(inside[0], inside[-1] + 1) if inside else range(0)
    loop = VirtualTimeLoop(config, policy)
    pending = set(scored_indices)
    last_scored = max((requests[i].arrival_s for i in scored_indices), default=0.0)
    checked_at = -math.inf

    def decided() -> bool:
        """Every scored request decided; checked every 0.25 virtual s after the last one arrived."""
        nonlocal pending, checked_at
        at = loop.now
        if at > last_scored and at - checked_at >= 0.25:
            checked_at = at
            pending = {i for i in pending if loop.unresolved(i, targets.ttft_s)}
            return not pending
        return False

    loop.run(requests, [t.output_tokens for t in trace], decided)
    outcomes = tuple(loop.outcome(r.index) for r in requests)
    service = policy.prediction_service
    describe = service.describe() if service is not None else {}
    return GatewayReplayResult(outcomes, loop.now, loop.steps, loop.busy_s, policy.name, describe)
