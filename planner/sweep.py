"""Engine settings that maximise goodput per replica: a grid of ``max_num_seqs`` x
``max_num_batched_tokens``, each replayed on ONE replica offered more than it can serve.

Each point replays the workload's first requests, re-timed to ``load x`` the replica's saturated
throughput at the profile's own settings, for at most ``max_seconds``, through the admission
engine under the given settings (Sluice's ``slo`` policy by default: it refuses what would miss,
so goodput measures what a replica delivers within the targets when offered too much). The
replica's facts carry the point's limits, so the predictor knows them, as an operator would write
them. The KV cache keeps the profile's size at every point: a larger token budget's extra
activation memory is not taken from it (an optimistic simplification for large budgets).

The knee, per axis: the smallest value whose goodput is within ``KNEE_SHARE`` of the best along
that axis (the other setting at its best), with the TTFT and TPOT p99 on either side, so the
report says what the next step up buys and costs.
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

__all__ = ["KNEE_SHARE", "Knee", "Sweep", "SweepPoint", "engine_sweep"]

#: A setting is at the knee once its goodput is within this share of the best on its axis.
KNEE_SHARE: Final = 0.98


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One setting: goodput (met requests and output tokens per second, one replica), the share of
    offered requests that met every class's targets, TTFT and TPOT p99 of the finished requests
    (seconds, first class), preemptions."""

    max_num_seqs: int
    max_num_batched_tokens: int
    goodput_rps: float
    goodput_output_tps: float
    attainment: float
    ttft_p99_s: float
    tpot_p99_s: float
    preemptions: int


@dataclass(frozen=True, slots=True)
class Knee:
    """Along ``axis`` (``max_num_seqs`` or ``max_num_batched_tokens``), with the other setting
    fixed at the best point's: the points in order, and the knee's value."""

    axis: str
    fixed: int
    points: tuple[SweepPoint, ...]
    knee: int


@dataclass(frozen=True, slots=True)
class Sweep:
    """The grid replayed at ``rate_per_s`` (``load`` x the saturated throughput) for
    ``seconds`` of arrivals; ``best``: the highest goodput (ties: the smaller settings)."""

    load: float
    rate_per_s: float
    seconds: float
    points: tuple[SweepPoint, ...]
    best: SweepPoint
    knees: tuple[Knee, ...]


def _value(p: SweepPoint, axis: str) -> int:
    return p.max_num_seqs if axis == "max_num_seqs" else p.max_num_batched_tokens


def _knee(points: Sequence[SweepPoint], best: SweepPoint, axis: str) -> Knee:
    other = "max_num_batched_tokens" if axis == "max_num_seqs" else "max_num_seqs"
    fixed = _value(best, other)
    line = sorted((p for p in points if _value(p, other) == fixed), key=lambda p: _value(p, axis))
    top = max(p.goodput_rps for p in line)
    knee = next(p for p in line if p.goodput_rps >= KNEE_SHARE * top)
    return Knee(axis, fixed, tuple(line), _value(knee, axis))


def engine_sweep(
    workload: Workload,
    profile: Profile,
    settings: AdmissionSettings,
    classes: Sequence[ClassTarget],
    capacity_rps: float,
    seqs: Sequence[int],
    budgets: Sequence[int],
    *,
    load: float = 1.5,
    max_seconds: float = 30.0,
    seed: int = 0,
    max_tokens: int = 1000,
) -> Sweep:
    """Replay every ``(max_num_seqs, max_num_batched_tokens)`` of ``seqs`` x ``budgets`` (see the
    module docstring). ``ValueError`` for an empty grid or a setting the profile refuses."""
    if not seqs or not budgets or capacity_rps <= 0:
        raise ValueError("the sweep needs at least one max_num_seqs, one budget and a capacity > 0")
    rate = load * capacity_rps
    n = min(len(workload.requests), max(1, round(rate * min(max_seconds, workload.duration_s))))
    timed = at_rate(workload.requests[:n], rate)
    offered = Workload(tuple(timed), workload.source, n / rate)
    points: list[SweepPoint] = []
    for s in sorted(set(seqs)):
        for b in sorted(set(budgets)):
            variant = profile.with_engine(max_num_seqs=s, max_num_batched_tokens=b)
            score = replay_at(offered, variant, settings, classes, 1, seed=seed, max_tokens=max_tokens)
            offered_n = sum(c.offered for c in score.classes)
            met = sum(c.met for c in score.classes)
            first = score.classes[0]
            points.append(
                SweepPoint(
                    s,
                    b,
                    score.goodput_rps,
                    score.goodput_output_tps,
                    met / offered_n if offered_n else 1.0,
                    first.ttft_p99_s,
                    first.tpot_p99_s,
                    score.preemptions,
                )
            )
    best = max(points, key=lambda p: (p.goodput_rps, -p.max_num_seqs, -p.max_num_batched_tokens))
    knees = (_knee(points, best, "max_num_seqs"), _knee(points, best, "max_num_batched_tokens"))
    return Sweep(load, rate, offered.duration_s, tuple(points), best, knees)
