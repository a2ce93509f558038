"""``ReplicaRecord``: everything ``PredictionService`` keeps about one replica, and its limits.

A mutable record with no behaviour of its own beyond reading it: ``scrape_learning`` fills it
from scrapes, ``finish_learning`` from finished requests, ``forecasting`` and ``admin_view`` read
it. Times are the caller's monotonic seconds; ``None`` means not seen yet. ``limits_of`` gives a
replica's limits, never binding where unknown (``None`` record: a replica the service does not
know); ``gauge_means`` the means of its recent good scrapes' gauges.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Final

from gateway.prediction.facts import ReplicaFacts
from gateway.prediction.state import GaugeMeans, Limits, Load
from gateway.replicas.snapshot import ReplicaSnapshot
from predictor import FitReport, Observation, StepCalibrator, StepModel
from predictor.steady import SteadyState

__all__ = ["UNKNOWN_LIMITS", "ReplicaRecord", "gauge_means", "limits_of"]

# Stand-ins for limits nobody has told us yet: large enough never to bind.
_UNKNOWN_KV_CAPACITY: Final = 1 << 40
_UNKNOWN_MAX_MODEL_LEN: Final = 1 << 30
#: Limits of a replica the service does not know (never binding).
UNKNOWN_LIMITS: Final = Limits(_UNKNOWN_KV_CAPACITY, 1, 1, _UNKNOWN_MAX_MODEL_LEN)


@dataclass(slots=True)
class ReplicaRecord:
    """Everything the service keeps about one replica."""

    facts: ReplicaFacts
    calibrator: StepCalibrator
    model: StepModel
    report: FitReport
    snapshot: ReplicaSnapshot | None = None
    #: (taken_at, running, waiting, kv tokens) of recent good scrapes, for window means.
    gauges: deque[tuple[float, float, float, float]] = field(default_factory=deque)
    load: Load = field(default_factory=Load)
    last_observation: Observation | None = None
    last_fit_at: float | None = None
    #: (window end, step stretch 1 / (1 - prefill share)) of recent windows, for the long-run mean.
    shares: deque[tuple[float, float]] = field(default_factory=deque)
    #: Newest time a token of any request on it was seen to land (a step boundary).
    last_token_at: float | None = None
    snapshots: int = 0
    stale_snapshots: int = 0
    #: (first token at, TTFT the caller measured) of recent requests, seconds, for the overhead.
    ttfts: deque[tuple[float, float]] = field(default_factory=deque)
    #: EWMA of (caller-measured TTFT - the replica's own TTFT) per scrape window, seconds; may
    #: be < 0 (noise), the forecast adds ``max(0, ...)`` of it.
    overhead_ewma_s: float = 0.0
    overhead_windows: int = 0
    #: EWMAs of (caller-measured TTFT - forecast TTFT), seconds: over all its requests, and by the
    #: API they came through, with that API's count (``PredictionService.api_residual_s``).
    residual_s: float = 0.0
    api_residuals: dict[str, float] = field(default_factory=dict)
    api_requests: dict[str, int] = field(default_factory=dict)
    #: (finished at, prompt tokens, output tokens) of the caller's recent requests there.
    finishes: deque[tuple[float, int, int]] = field(default_factory=deque)
    #: (interval end, requests finished, seconds) of recent scrape intervals it had requests
    #: waiting at both ends of (full), for its capacity (``scrape_learning.full_finish_rate``).
    full_intervals: deque[tuple[float, float, float]] = field(default_factory=deque)
    #: When the service first saw a snapshot of it (the start of its finish history), seconds.
    first_seen_at: float | None = None
    #: The steady state under the recent traffic (``None``: unknown or overloaded).
    steady: SteadyState | None = None
    #: It timed its own prefill steps in some window (TGI): a property of the engine, kept when a
    #: later window had no prefill step to time.
    times_prefills: bool = False

    @property
    def overhead_s(self) -> float:
        """Seconds the caller's TTFT adds to the engine's (transport, the server's own work)."""
        return max(0.0, self.overhead_ewma_s)


def limits_of(r: ReplicaRecord | None) -> Limits:
    """``r``'s limits: its facts' batch limits, its latest snapshot's KV capacity, its facts'
    context length; a limit nobody has told (or ``r`` ``None``) never binds."""
    if r is None:
        return Limits(_UNKNOWN_KV_CAPACITY, 1, 1, _UNKNOWN_MAX_MODEL_LEN)
    f, s = r.facts, r.snapshot
    capacity = s.kv_capacity_tokens if s is not None and s.kv_capacity_tokens else _UNKNOWN_KV_CAPACITY
    return Limits(
        kv_capacity_tokens=capacity,
        max_num_seqs=f.max_num_seqs,
        max_num_batched_tokens=f.max_num_batched_tokens,
        max_model_len=f.max_model_len or _UNKNOWN_MAX_MODEL_LEN,
    )


def gauge_means(r: ReplicaRecord, since: float) -> GaugeMeans:
    """Means of the gauges of the good scrapes taken at ``since`` or later (the newest included)."""
    kept = [g for g in r.gauges if g[0] >= since - 1e-9] or [r.gauges[-1]]
    n = len(kept)
    return GaugeMeans(
        running=sum(g[1] for g in kept) / n,
        waiting=sum(g[2] for g in kept) / n,
        kv_tokens=sum(g[3] for g in kept) / n,
        busy=all(g[1] + g[2] > 0 for g in kept),
    )
