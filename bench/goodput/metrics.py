"""The goodput bench's metrics, defined on ``replay.Outcome`` lists.

Every function takes the outcomes of the *scored* requests (those that arrived in the measured
span) and the class targets; times are virtual seconds.

* **goodput**: scored requests that met both targets (``Outcome.met``: finished, TTFT from
  arrival at the gateway <= TTFT target, mean TPOT <= TPOT target) per second of the span.
* **token goodput**: prompt + output tokens of those requests per second (a policy that favours
  short requests raises the request goodput more than this one).
* **attainment**: met / offered (every scored request, rejected ones included).
* **rejection rate**: rejected / offered (refused at once, or dropped from a gateway queue).
* **refusals by prompt-size quartile**: per quartile of prompt size, not served / offered, where
  *not served* is any request never sent to a replica for good (rejected by the gateway, expired
  in its queue, refused by a replica and not placed again, or still waiting when the replay
  stopped). The quartile edges come from the whole trace (``prompt_quartile_edges``), so every
  policy and load is binned alike; a policy that wins by refusing long prompts shows a high
  top-quartile rate.
* **wasted GPU time**: engine busy time attributed to scored requests that were *served* (sent
  to a replica) and missed a target, as a fraction of the busy time attributed to all scored
  requests. Attribution: each engine step's duration is split over the requests it computed,
  in proportion to the tokens it computed for each (a prefill chunk's tokens, 1 per decode), so
  recomputation after a preemption counts too. A request still running when the replay stopped
  (a certain TTFT miss) counts with the time it had used by then.
* **per tenant**: goodput, token goodput, attainment and rejection rate of each tenant's own
  requests (``score_by_tenant``), to show that budgets and fair share leave no tenant behind.
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
* **forecast accuracy** (opt-in, Sluice only: ``forecast_accuracy``): per scored request that was
  served, finished and had a forecast at dispatch, the forecast's TTFT against the engine's
  (dispatch -> first token: the forecast counts from the decision, so gateway queueing is not in
  it) and its TPOT against the engine's mean TPOT; absolute percentage error |pred - meas| / meas,
  median and p90, as ``bench.predictor_accuracy`` scores them (an absolute error under 5 ms
  counts as met).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from bench.predictor_accuracy import ErrorStats, error_stats
from replay import Outcome, Targets

__all__ = [
    "DispatchForecast",
    "ForecastAccuracy",
    "PromptQuartiles",
    "Score",
    "attainment_series",
    "forecast_accuracy",
    "prompt_quartile",
    "prompt_quartile_edges",
    "recovery_time_s",
    "refusals_by_prompt_quartile",
    "rejections_stop_s",
    "score",
    "score_by_tenant",
    "wasted_gpu_fraction",
]


def prompt_quartile_edges(prompt_tokens: Iterable[int]) -> tuple[int, int, int]:
    """The 25th, 50th and 75th percentile prompt sizes (tokens), nearest rank: the
    ``ceil(k * n / 4)``-th smallest for k = 1, 2, 3, always a size that occurs.

    Quartile k holds the sizes in (edge k-1, edge k] (``prompt_quartile``). With ties, or fewer
    than four requests, quartiles hold unequal counts and some may be empty: when every prompt
    has one size, all requests fall in the first quartile. Raises ``ValueError`` on no requests.
    """
    sizes = sorted(prompt_tokens)
    n = len(sizes)
    if n == 0:
        raise ValueError("no prompt sizes: quartiles need at least one request")
    q1, q2, q3 = (sizes[math.ceil(k * n / 4) - 1] for k in (1, 2, 3))
    return q1, q2, q3


def prompt_quartile(prompt_tokens: int, edges: Sequence[int]) -> int:
    """The quartile (0 = shortest .. 3 = longest) a prompt of ``prompt_tokens`` falls in: the
    number of ``edges`` strictly below it, so a size equal to an edge goes to the lower quartile."""
    return bisect.bisect_left(edges, prompt_tokens)


@dataclass(frozen=True, slots=True)
class PromptQuartiles:
    """Offered and not-served request counts per prompt-size quartile (shortest first).

    ``edges``: the quartile edges in tokens (``prompt_quartile_edges`` of the whole trace).
    """

    edges: tuple[int, int, int]
    offered: tuple[int, int, int, int]
    refused: tuple[int, int, int, int]

    @property
    def rates(self) -> tuple[float, float, float, float]:
        """refused / offered per quartile, 0-1; NaN for a quartile with no request."""
        r = [f / o if o else math.nan for f, o in zip(self.refused, self.offered, strict=True)]
        return r[0], r[1], r[2], r[3]


def refusals_by_prompt_quartile(outcomes: Iterable[Outcome], edges: tuple[int, int, int]) -> PromptQuartiles:
    """Bin ``outcomes`` by prompt size with ``edges``; a request counts as refused when it was not
    served (``not Outcome.served``: rejected, expired in a queue, or never placed)."""
    offered, refused = [0] * 4, [0] * 4
    for o in outcomes:
        k = prompt_quartile(o.prompt_tokens, edges)
        offered[k] += 1
        refused[k] += not o.served
    return PromptQuartiles(
        edges,
        (offered[0], offered[1], offered[2], offered[3]),
        (refused[0], refused[1], refused[2], refused[3]),
    )


@dataclass(frozen=True, slots=True)
class Score:
    """One cell's numbers (rates per second, fractions 0-1)."""

    offered: int
    met: int
    rejected: int
    span_s: float
    wasted: float
    busy_s: float
    #: Prompt + output tokens of the requests that met both targets (a size-neutral goodput).
    met_tokens: int = 0
    #: Refusals per prompt-size quartile (``None`` when scored without the trace's edges).
    by_prompt: PromptQuartiles | None = None

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


def score(
    outcomes: Sequence[Outcome],
    targets: Targets,
    span_s: float,
    prompt_edges: tuple[int, int, int] | None = None,
) -> Score:
    """The cell's score over the scored ``outcomes`` that arrived in a span of ``span_s`` seconds;
    ``prompt_edges``: the trace's prompt-size quartile edges, to count refusals per quartile."""
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
        by_prompt=None if prompt_edges is None else refusals_by_prompt_quartile(outcomes, prompt_edges),
    )


def score_by_tenant(outcomes: Sequence[Outcome], targets: Targets, span_s: float) -> dict[str, Score]:
    """``score`` of each tenant's own scored ``outcomes`` (goodput, token goodput, attainment,
    rejections per tenant; no prompt quartiles), by tenant name in sorted order."""
    tenants = sorted({o.tenant for o in outcomes})
    return {name: score([o for o in outcomes if o.tenant == name], targets, span_s) for name in tenants}


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


@dataclass(frozen=True, slots=True)
class DispatchForecast:
    """The predictor's own forecast for one request when admission sent it (seconds).

    ``ttft_s``: from the dispatch to the first token, engine side; ``tpot_s``: mean time per
    output token after the first. Both without admission's margins: ``scale`` is the multiplier
    admission applied to them (``1 + forecast_margin``, times ``1 + stale_margin`` on a stale
    replica) in the ``Forecast`` its decision carried, which is what the live gateway's
    ``x-sluice-predicted-*`` headers show (plus its learned dispatch overhead, 0 in the replay).
    """

    ttft_s: float
    tpot_s: float
    scale: float
    stale: bool = False


@dataclass(frozen=True, slots=True)
class ForecastAccuracy:
    """How close the dispatch forecasts of one cell's served requests came to what they measured.

    ``served``: scored requests sent to a replica that finished. ``no_forecast``: of those, how
    many had no usable forecast (no step model yet, or non-finite numbers): not scored.
    ``stale``: of the scored ones, how many were forecast on a replica with stale metrics.
    ``ttft`` / ``tpot``: errors of the predictor's own forecast (margins removed);
    ``ttft_with_margin`` / ``tpot_with_margin``: of the forecast as the decision carried it.
    """

    served: int
    no_forecast: int
    stale: int
    ttft: ErrorStats
    tpot: ErrorStats
    ttft_with_margin: ErrorStats
    tpot_with_margin: ErrorStats


def forecast_accuracy(
    outcomes: Sequence[Outcome], forecasts: Mapping[int, DispatchForecast]
) -> ForecastAccuracy:
    """Score ``forecasts`` (by ``Outcome.index``) against the scored ``outcomes``.

    Only requests that were served and finished count. TTFT pairs need a first token after the
    dispatch (measured > 0); TPOT pairs need the engine's TPOT (two tokens or more, > 0) and a
    finite forecast TPOT.
    """
    served = [o for o in outcomes if o.served and o.finished_s is not None]
    ttft: list[tuple[float, float]] = []
    tpot: list[tuple[float, float]] = []
    ttft_margin: list[tuple[float, float]] = []
    tpot_margin: list[tuple[float, float]] = []
    no_forecast = stale = 0
    for o in served:
        f = forecasts.get(o.index)
        if f is None or not math.isfinite(f.ttft_s):
            no_forecast += 1
            continue
        stale += int(f.stale)
        if o.first_token_s is not None and o.dispatched_s is not None:
            measured = o.first_token_s - o.dispatched_s
            if measured > 0:
                ttft.append((f.ttft_s, measured))
                ttft_margin.append((f.ttft_s * f.scale, measured))
        if o.tpot_s is not None and o.tpot_s > 0 and math.isfinite(f.tpot_s):
            tpot.append((f.tpot_s, o.tpot_s))
            tpot_margin.append((f.tpot_s * f.scale, o.tpot_s))
    return ForecastAccuracy(
        served=len(served),
        no_forecast=no_forecast,
        stale=stale,
        ttft=error_stats(ttft),
        tpot=error_stats(tpot),
        ttft_with_margin=error_stats(ttft_margin),
        tpot_with_margin=error_stats(tpot_margin),
    )
