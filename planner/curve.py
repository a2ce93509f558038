"""Latency against utilisation: TTFT and TPOT p50/p99 of one replica as its load climbs.

Each point replays the workload's requests, in order and re-timed to ``load x`` one replica's
saturated throughput (``replay.at_rate``: the burst shape kept), on ONE replica with no admission
(``admission.policy: none``: every request is served, so the latencies are the engine's own, as
behind a plain load balancer). A point covers the workload's duration, or fewer seconds when it
runs out of requests (loads above 1). Utilisation here is that load: offered requests per second
over the saturated throughput.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from gateway.admission import AdmissionSettings
from planner.replicas import ClassTarget, replay_at
from planner.workload import Workload
from replay.traces import at_rate
from simulator.profile import Profile

__all__ = ["DEFAULT_LOADS", "CurvePoint", "utilisation_curve"]

#: Loads (fractions of one replica's saturated throughput) the curve is drawn at.
DEFAULT_LOADS: Final = (0.2, 0.4, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1)
#: Fewest requests a point replays (low loads would otherwise have a handful).
_MIN_REQUESTS: Final = 50


@dataclass(frozen=True, slots=True)
class CurvePoint:
    """One load: the offered rate (req/s), requests replayed, TTFT and TPOT p50/p99 (seconds) of
    the requests that finished, the share that met the first class's targets, preemptions."""

    load: float
    rate_per_s: float
    requests: int
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    attainment: float
    preemptions: int


def utilisation_curve(
    workload: Workload,
    profile: Profile,
    capacity_rps: float,
    target: ClassTarget,
    *,
    loads: Sequence[float] = DEFAULT_LOADS,
    seed: int = 0,
    max_tokens: int = 1000,
) -> tuple[CurvePoint, ...]:
    """The curve at ``loads`` (see the module docstring); ``target``'s targets score attainment."""
    settings = AdmissionSettings(policy="none")
    only = ClassTarget(settings.default_class, target.ttft_s, target.tpot_s, target.attainment)
    points: list[CurvePoint] = []
    for load in loads:
        rate = load * capacity_rps
        n = min(len(workload.requests), max(_MIN_REQUESTS, round(rate * workload.duration_s)))
        timed = at_rate(workload.requests[:n], rate)
        span = n / rate
        sliced = Workload(tuple(timed), workload.source, span)
        score = replay_at(
            sliced, profile, settings, [only], 1, seed=seed, max_tokens=max_tokens, to_the_end=True
        )
        c = score.classes[0]
        points.append(
            CurvePoint(
                load,
                rate,
                n,
                c.ttft_p50_s,
                c.ttft_p99_s,
                c.tpot_p50_s,
                c.tpot_p99_s,
                c.attainment,
                score.preemptions,
            )
        )
    return tuple(points)
