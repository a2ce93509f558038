"""The goodput bench's metrics, defined on ``gateway.replay_admission.Outcome`` lists.

Every function takes the outcomes of the *scored* requests (those that arrived in the measured
span) and the class targets; times are virtual seconds.

* **goodput**: scored requests that met both targets (``Outcome.met``: finished, TTFT from
  arrival at the gateway <= TTFT target, mean TPOT <= TPOT target) per second of the span.
* **token goodput**: prompt + output tokens of those requests per second (a policy that favours
  short requests raises the request goodput more than this one).
* **attainment**: met / offered (every scored request, rejected ones included).
* **rejection rate**: rejected / offered (refused at once, or dropped from a gateway queue).
* **wasted GPU time**: engine busy time attributed to scored requests that were *served* (sent
  to a replica) and missed a target, as a fraction of the busy time attributed to all scored
  requests. Attribution: each engine step's duration is split over the requests it computed,
  in proportion to the tokens it computed for each (a prefill chunk's tokens, 1 per decode), so
  recomputation after a preemption counts too. A request still running when the replay stopped
  (a certain TTFT miss) counts with the time it had used by then.
* **recovery time** after a spike: the pre-spike level is the *lowest* attainment of any
  ``window_s``-long window (sliding by 1 s) of arrivals that ends at least ``guard_s`` before the
  spike starts (requests that arrive just before it are still decoding when it hits, so they
  already show its harm); the policy has recovered at the first second t >= the spike's end
  from which every such window starting at t or later (and ending by the end of the span) has
  attainment >= ``tolerance`` x that level (the bench uses 0.9: one miss in a window must not
  count as not recovered when the level is 100 %). Reported as t - spike end (0 = never fell
  below); ``None`` when it never recovers within the span.
* **rejections stop**: the first second t >= the spike's end after which no scored request is
  rejected, minus the spike's end (0 when none are rejected after it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.replay_admission import Outcome, Targets

__all__ = [
    "Score",
    "attainment_series",
    "recovery_time_s",
    "rejections_stop_s",
    "score",
    "wasted_gpu_fraction",
]


@dataclass(frozen=True, slots=True)
class Score:
    """One cell's numbers (rates per second, fractions 0-1)."""

    offered: int
    met: int
    rejected: int
    span_s: float
    wasted: float
    busy_s: float
    #: Prompt + output tokens of the requests that met their targets (a size-neutral goodput).
    met_tokens: int = 0

    @property
    def offered_rate(self) -> float:
        return self.offered / self.span_s

    @property
    def goodput(self) -> float:
        return self.met / self.span_s

    @property
    def token_goodput(self) -> float:
        """Prompt + output tokens per second of the requests that met their targets."""
        return self.met_tokens / self.span_s

    @property
    def attainment(self) -> float:
        return self.met / self.offered if self.offered else math.nan

    @property
    def rejection_rate(self) -> float:
        return self.rejected / self.offered if self.offered else math.nan


def wasted_gpu_fraction(outcomes: Sequence[Outcome], targets: Targets) -> float:
    """Busy time of served requests that missed a target / busy time of all of them (0 if none)."""
    total = sum(o.busy_s for o in outcomes)
    if total <= 0:
        return 0.0
    wasted = sum(o.busy_s for o in outcomes if o.served and not o.met(targets))
    return wasted / total


def score(outcomes: Sequence[Outcome], targets: Targets, span_s: float) -> Score:
    """The cell's score over the scored ``outcomes`` that arrived in a span of ``span_s`` seconds."""
    if span_s <= 0:
        raise ValueError(f"span_s must be > 0, got {span_s}")
    return Score(
        offered=len(outcomes),
        met=sum(1 for o in outcomes if o.met(targets)),
        rejected=sum(1 for o in outcomes if o.rejected),
        span_s=span_s,
        wasted=wasted_gpu_fraction(outcomes, targets),
        busy_s=sum(o.busy_s for o in outcomes),
        met_tokens=sum(o.prompt_tokens + o.output_tokens for o in outcomes if o.met(targets)),
    )


def attainment_series(
    outcomes: Sequence[Outcome], targets: Targets, start_s: float, end_s: float
) -> list[tuple[float, int, int, int]]:
    """Per 1-s bin of arrival time from ``start_s`` to ``end_s``: (bin start, offered, met, rejected)."""
    bins = max(0, math.ceil(end_s - start_s - 1e-9))
    offered, met, rejected = [0] * bins, [0] * bins, [0] * bins
    for o in outcomes:
        k = math.floor(o.arrival_s - start_s)
        if 0 <= k < bins:
            offered[k] += 1
            met[k] += o.met(targets)
            rejected[k] += o.rejected
    return [(start_s + k, offered[k], met[k], rejected[k]) for k in range(bins)]


def _window_attainment(series: Sequence[tuple[float, int, int, int]], first: int, width: int) -> float:
    part = series[first : first + width]
    offered = sum(p[1] for p in part)
    return sum(p[2] for p in part) / offered if offered else 1.0


def recovery_time_s(
    series: Sequence[tuple[float, int, int, int]],
    spike_start_s: float,
    spike_end_s: float,
    *,
    window_s: int = 5,
    guard_s: float = 0.0,
    tolerance: float = 1.0,
) -> float | None:
    """Seconds after ``spike_end_s`` until the windowed attainment stays >= its pre-spike minimum.

    ``series``: ``attainment_series`` output (1-s bins). See the module docstring.
    """
    starts = [s for s, *_ in series]
    pre = [i for i, s in enumerate(starts) if s + window_s <= spike_start_s - guard_s + 1e-9]
    if not pre:
        raise ValueError("no full window before the spike")
    level = min(_window_attainment(series, i, window_s) for i in pre)
    post = [i for i, s in enumerate(starts) if s >= spike_end_s - 1e-9 and i + window_s <= len(series)]
    if not post:
        return None
    ok = [_window_attainment(series, i, window_s) >= tolerance * level - 1e-12 for i in post]
    if not ok[-1]:
        return None
    k = len(ok) - 1
    while k > 0 and ok[k - 1]:
        k -= 1
    return starts[post[k]] - spike_end_s


def rejections_stop_s(series: Sequence[tuple[float, int, int, int]], spike_end_s: float) -> float:
    """Seconds after ``spike_end_s`` until the last 1-s bin with a rejection ends (0 if none)."""
    last = spike_end_s
    for start, _, _, rejected in series:
        if start >= spike_end_s - 1e-9 and rejected:
            last = start + 1.0
    return last - spike_end_s
