"""From parsed scrapes to ``ReplicaSnapshot``: the sliding window and snapshot building.

Synchronous and I/O-free (time is passed in, monotonic seconds). Over the scrapes of the last
``window_s`` seconds, as Prometheus does: counter rates are increases per second with resets
counted; histograms reset together and give means and ``histogram_quantile`` interpolations;
gauges come from the newest scrape.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from gateway.replicas.dialects import CounterName, Dialect, Histogram, HistogramName, Reading, Samples
from gateway.replicas.exposition import ExpositionError, ExpositionParser
from gateway.replicas.snapshot import InFlight, ReplicaSnapshot

DEFAULT_WINDOW_S = 10.0

# Scrape times that differ by less than this are the same instant (float noise of a fake clock).
_TIME_EPSILON_S = 1e-9


# -- counter and histogram arithmetic -------------------------------------------------------------


def counter_increase(previous: float, current: float) -> float:
    """Increase of a counter between two scrapes; after a reset (drop) the current value is it."""
    return current - previous if current >= previous else current


def histogram_reset(previous: Histogram, current: Histogram) -> bool:
    """True when ``current`` cannot follow ``previous``: a count, sum or bucket dropped, or the
    bucket layout changed (the engine restarted, possibly with other buckets)."""
    if previous.bounds != current.bounds:
        return True
    if current.count < previous.count or current.sum < previous.sum:
        return True
    return any(c < p for p, c in zip(previous.cumulative, current.cumulative, strict=True))


def histogram_increase(previous: Histogram, current: Histogram) -> Histogram:
    """Observations added between two scrapes (``current`` itself after a reset)."""
    if histogram_reset(previous, current):
        return current
    return Histogram(
        bounds=current.bounds,
        cumulative=tuple(c - p for p, c in zip(previous.cumulative, current.cumulative, strict=True)),
        sum=current.sum - previous.sum,
        count=current.count - previous.count,
    )


def histogram_add(a: Histogram, b: Histogram) -> Histogram:
    """Sum of two increases with the same bucket layout."""
    if a.bounds != b.bounds:
        raise ValueError("cannot add histograms with different buckets")
    return Histogram(
        bounds=a.bounds,
        cumulative=tuple(x + y for x, y in zip(a.cumulative, b.cumulative, strict=True)),
        sum=a.sum + b.sum,
        count=a.count + b.count,
    )


def histogram_mean(h: Histogram) -> float | None:
    """Mean observation, ``sum / count``; ``None`` without observations."""
    return h.sum / h.count if h.count > 0 else None


def histogram_quantile(q: float, h: Histogram) -> float | None:
    """The ``q``-quantile (0 <= q <= 1) estimated from bucket counts, as PromQL's histogram_quantile.

    Linear interpolation inside the bucket holding rank ``q * total``; the lowest bucket starts at
    0 (if its bound is positive); a rank in the ``+Inf`` bucket returns the highest finite bound.
    ``None`` (PromQL: NaN) without a ``+Inf`` bucket, with fewer than two buckets, or without
    observations.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    bounds, counts = h.bounds, list(h.cumulative)
    if len(bounds) < 2 or not math.isinf(bounds[-1]) or bounds[-1] < 0:
        return None
    # Float rounding can make cumulative counts dip; PromQL forces them monotonic the same way.
    for i in range(1, len(counts)):
        counts[i] = max(counts[i], counts[i - 1])
    total = counts[-1]
    if total <= 0:
        return None
    rank = q * total
    b = bisect.bisect_left(counts, rank)
    if b == len(bounds) - 1:
        return bounds[-2]
    if b == 0 and bounds[0] <= 0:
        return bounds[0]
    start, below = (0.0, 0.0) if b == 0 else (bounds[b - 1], counts[b - 1])
    in_bucket = counts[b] - below
    if in_bucket <= 0:  # only for q == 0 with an empty lowest bucket
        return start
    return start + (bounds[b] - start) * ((rank - below) / in_bucket)


# -- the window ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Point:
    at: float
    reading: Reading


class ScrapeWindow:
    """The readings of one replica's good scrapes in the last ``window_s`` seconds.

    The newest reading is always kept; older ones leave once more than ``window_s`` seconds
    older than the newest. A reading at or before the newest time replaces the newer ones (the
    clock never goes back, so that only happens with a replayed or reset clock).
    """

    def __init__(self, window_s: float = DEFAULT_WINDOW_S) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._points: deque[_Point] = deque()

    def __len__(self) -> int:
        return len(self._points)

    def add(self, at: float, reading: Reading) -> None:
        while self._points and self._points[-1].at >= at:
            self._points.pop()
        self._points.append(_Point(at, reading))
        while self._points[0].at < at - self.window_s - _TIME_EPSILON_S:
            self._points.popleft()

    def newest_interval(self) -> ScrapeWindow | None:
        """A window of the two newest readings only (the last scrape interval); ``None`` with fewer."""
        if len(self._points) < 2:
            return None
        last = ScrapeWindow(self.window_s)
        last._points.extend(list(self._points)[-2:])
        return last

    @property
    def covered_s(self) -> float:
        """Seconds between the oldest and the newest reading (0.0 with fewer than two)."""
        return self._points[-1].at - self._points[0].at if len(self._points) > 1 else 0.0

    def counter_increase(self, name: CounterName) -> tuple[float, float] | None:
        """(increase, seconds it took) over consecutive scrapes that both had the counter."""
        increase, seconds, pairs = 0.0, 0.0, 0
        for prev, cur in _pairs(self._points):
            a, b = prev.reading.counters.get(name), cur.reading.counters.get(name)
            if a is None or b is None:
                continue
            increase += counter_increase(a, b)
            seconds += cur.at - prev.at
            pairs += 1
        return (increase, seconds) if pairs else None

    def counter_rate(self, name: CounterName) -> float | None:
        """Increase per second; ``None`` when unknown (absent, or fewer than two scrapes)."""
        found = self.counter_increase(name)
        return None if found is None or found[1] <= 0 else found[0] / found[1]

    def histogram_increase(self, name: HistogramName) -> tuple[Histogram, float] | None:
        """(observations added, seconds) over consecutive scrapes that both had the histogram.

        A bucket-layout change restarts the sum, since buckets of two layouts cannot be added.
        """
        total: Histogram | None = None
        seconds = 0.0
        for prev, cur in _pairs(self._points):
            a, b = prev.reading.histograms.get(name), cur.reading.histograms.get(name)
            if a is None or b is None:
                continue
            step = histogram_increase(a, b)
            if total is None or total.bounds != step.bounds:
                total, seconds = step, 0.0
            else:
                total = histogram_add(total, step)
            seconds += cur.at - prev.at
        return None if total is None else (total, seconds)


def _pairs(points: Sequence[_Point]) -> list[tuple[_Point, _Point]]:
    return list(zip(points, list(points)[1:], strict=False))


# -- snapshots --------------------------------------------------------------------------------------


class SnapshotBuilder:
    """Turns one replica's scrapes into ``ReplicaSnapshot`` values; keeps its window between them.

    Call ``observe_text`` (or ``observe`` with pre-parsed samples) for each scrape body and
    ``fail`` for each failed scrape; each returns the new snapshot. A failure never touches the
    window: the next good scrape continues it (older readings age out by time as usual).
    """

    def __init__(self, name: str, dialect: Dialect, *, window_s: float = DEFAULT_WINDOW_S) -> None:
        self.name = name
        self.dialect = dialect
        self._window = ScrapeWindow(window_s)
        self._last_good: ReplicaSnapshot | None = None
        self._parser = ExpositionParser()

    @property
    def last_good(self) -> ReplicaSnapshot | None:
        """The snapshot of the newest good scrape, ``None`` before the first one."""
        return self._last_good

    def observe_text(self, text: str, now: float, in_flight: Sequence[InFlight] = ()) -> ReplicaSnapshot:
        """Parse ``text`` (``ExpositionParser``: this replica's scrapes) and build the snapshot at
        ``now``; stale if it does not parse."""
        try:
            samples = self._parser.parse(text)
        except ExpositionError as exc:
            return self.fail(str(exc), now, in_flight)
        return self.observe(samples, now, in_flight)

    def observe(self, samples: Samples, now: float, in_flight: Sequence[InFlight] = ()) -> ReplicaSnapshot:
        """Add a parsed scrape taken at ``now``; stale if it holds no metric this dialect knows."""
        reading = self.dialect.read(samples)
        if reading.is_empty():
            reason = f"no {self.dialect.name} metric in the scrape ({len(samples)} other names)"
            return self.fail(reason, now, in_flight)
        self._window.add(now, reading)
        snapshot = build_snapshot(self.name, self.dialect.name, now, reading, self._window, in_flight)
        self._last_good = snapshot
        return snapshot

    def fail(self, reason: str, now: float, in_flight: Sequence[InFlight] = ()) -> ReplicaSnapshot:
        """A stale snapshot at ``now``: the last good metrics (if any), ``reason``, current in-flight."""
        if self._last_good is None:
            return ReplicaSnapshot(
                name=self.name,
                taken_at=now,
                stale=True,
                stale_reason=reason,
                dialect=self.dialect.name,
                in_flight=tuple(in_flight),
            )
        return replace(
            self._last_good, taken_at=now, stale=True, stale_reason=reason, in_flight=tuple(in_flight)
        )


def build_snapshot(
    name: str,
    dialect: str,
    now: float,
    reading: Reading,
    window: ScrapeWindow,
    in_flight: Sequence[InFlight] = (),
    *,
    with_interval: bool = True,
) -> ReplicaSnapshot:
    """A fresh snapshot: gauges from ``reading`` (the newest scrape), the rest from ``window``.

    ``with_interval``: also fill ``last_interval``, the same statistics over the newest scrape
    interval alone.
    """
    interval = window.newest_interval() if with_interval else None
    last = (
        None
        if interval is None
        else build_snapshot(name, dialect, now, reading, interval, (), with_interval=False)
    )
    gauges = reading.gauges
    iteration = window.histogram_increase(HistogramName.ITERATION_TOKENS)
    itl = _histogram_stats(window, HistogramName.INTER_TOKEN_LATENCY)
    ttft = _histogram_stats(window, HistogramName.TTFT)
    steps = engine_steps(window, reading)
    decode_steps = window.histogram_increase(HistogramName.DECODE_STEP_TIME)
    return ReplicaSnapshot(
        name=name,
        taken_at=now,
        stale=False,
        stale_reason=None,
        dialect=dialect,
        metrics_at=now,
        window_s=window.covered_s,
        model_names=reading.model_names,
        num_running=gauges.num_running,
        num_waiting=gauges.num_waiting,
        kv_cache_usage=gauges.kv_cache_usage,
        kv_cache_usage_max=gauges.kv_cache_usage_max,
        kv_capacity_tokens=gauges.kv_capacity_tokens,
        block_size=gauges.block_size,
        prompt_tokens_per_s=window.counter_rate(CounterName.PROMPT_TOKENS),
        computed_prompt_tokens_per_s=computed_prompt_rate(window),
        generation_tokens_per_s=window.counter_rate(CounterName.GENERATION_TOKENS),
        steps_per_s=steps.per_s,
        steps_estimated=steps.estimated,
        requests_finished_per_s=window.counter_rate(CounterName.REQUESTS_FINISHED),
        preemptions_per_s=window.counter_rate(CounterName.PREEMPTIONS),
        admission_rejections_per_s=window.counter_rate(CounterName.ADMISSION_REJECTIONS),
        prefix_cache_hit_rate=prefix_cache_hit_rate(window),
        mean_tokens_per_step=None if iteration is None else histogram_mean(iteration[0]),
        tokens_per_step_buckets=() if iteration is None else histogram_buckets(iteration[0]),
        itl_mean_s=itl.mean,
        itl_p50_s=itl.p50,
        itl_p90_s=itl.p90,
        ttft_mean_s=ttft.mean,
        ttft_p50_s=ttft.p50,
        ttft_p90_s=ttft.p90,
        queue_time_mean_s=_histogram_stats(window, HistogramName.QUEUE_TIME).mean,
        e2e_mean_s=_histogram_stats(window, HistogramName.E2E).mean,
        mean_prompt_tokens_per_request=_histogram_stats(window, HistogramName.REQUEST_PROMPT_TOKENS).mean,
        mean_generation_tokens_per_request=_histogram_stats(
            window, HistogramName.REQUEST_GENERATION_TOKENS
        ).mean,
        step_time_mean_s=steps.mean_s,
        decode_step_time_mean_s=_histogram_stats(window, HistogramName.DECODE_STEP_TIME).mean,
        prefill_step_time_mean_s=_histogram_stats(window, HistogramName.PREFILL_STEP_TIME).mean,
        request_prefill_step_time_mean_s=request_prefill_step_s(window),
        decode_steps_per_s=observations_per_s(decode_steps),
        engine_decode_tokens_per_s=gauges.decode_tokens_per_s,
        sources=tuple(sorted({**reading.sources, **steps.sources}.items())),
        in_flight=tuple(in_flight),
        last_interval=last,
    )


@dataclass(frozen=True, slots=True)
class EngineSteps:
    """Steps per second and mean step seconds over a window, and where each came from."""

    per_s: float | None = None
    mean_s: float | None = None
    sources: dict[str, str] = field(default_factory=dict)
    #: ``per_s`` is an estimate of decode steps alone (old SGLang), not a count of every step.
    estimated: bool = False


def engine_steps(window: ScrapeWindow, reading: Reading) -> EngineSteps:
    """How many engine steps the window saw per second, and how long one took, from the best
    signal the dialect found, in order:

    1. the tokens-per-step histogram (vLLM): one observation per step, no step time;
    2. a measured step-time histogram (TGI): count rate and mean;
    3. step and busy-seconds counters (recent SGLang): rate, and busy seconds / steps;
    4. the engine's decode throughput over its running requests (old SGLang): decode steps only,
       an estimate (each running request gains one token per decode step), and only when the
       window saw inter-token latencies (those gauges keep their last values while idle).
    """
    iteration = window.histogram_increase(HistogramName.ITERATION_TOKENS)
    if iteration is not None:
        return EngineSteps(observations_per_s(iteration))
    timed = window.histogram_increase(HistogramName.STEP_TIME)
    if timed is not None:
        return EngineSteps(observations_per_s(timed), histogram_mean(timed[0]))
    counted = window.counter_increase(CounterName.STEPS)
    if counted is not None and counted[1] > 0:
        busy = window.counter_increase(CounterName.STEP_SECONDS)
        mean = busy[0] / counted[0] if busy is not None and counted[0] > 0 else None
        return EngineSteps(counted[0] / counted[1], mean)
    gauges = reading.gauges
    # The gauges behind the estimate hold their last values while the engine idles: use them
    # only when the window saw tokens being generated.
    itl = window.histogram_increase(HistogramName.INTER_TOKEN_LATENCY)
    decoded = itl is not None and itl[0].count > 0
    if decoded and gauges.decode_tokens_per_s is not None and gauges.num_running:
        per_s = gauges.decode_tokens_per_s / gauges.num_running
        return EngineSteps(
            per_s, None, {"steps_per_s": "decode_tokens_per_s / num_running (estimate)"}, estimated=True
        )
    return EngineSteps()


@dataclass(frozen=True, slots=True)
class HistogramStats:
    """Mean, median and 90th percentile of a histogram's window increase; ``None`` where unknown."""

    mean: float | None = None
    p50: float | None = None
    p90: float | None = None


def _histogram_stats(window: ScrapeWindow, name: HistogramName) -> HistogramStats:
    found = window.histogram_increase(name)
    if found is None:
        return HistogramStats()
    h = found[0]
    return HistogramStats(histogram_mean(h), histogram_quantile(0.5, h), histogram_quantile(0.9, h))


def request_prefill_step_s(window: ScrapeWindow) -> float | None:
    """Mean seconds of the step that prefilled each request over ``window``; ``None`` without
    prefill steps timed and requests-per-batch counted (``HistogramName.PREFILL_BATCH_REQUESTS``).

    An engine that times its prefill steps (TGI) gives their mean per step; a request's own time
    to first token holds the step that prefilled it, and a step that started ``n`` requests counts
    ``n`` times in their mean. Such a step also takes longer: it is taken as the decode step it
    rides along (``c``, the window's mean decode step) plus an equal share per request it
    started, so that over the window's steps ``mean(step) = c + b E[n]``, and over its requests
    ``c + b E[n^2] / E[n]``: the mean step stretched by ``E[n^2] / E[n]^2`` beyond ``c``.
    Without a decode step time ``c`` is 0 (the whole step grows with ``n``); how close this comes
    on a mixed fleet is in docs/engines.md.
    """
    prefill = _histogram_stats(window, HistogramName.PREFILL_STEP_TIME).mean
    found = window.histogram_increase(HistogramName.PREFILL_BATCH_REQUESTS)
    if prefill is None or found is None:
        return None
    moments = histogram_moments(found[0])
    if moments is None:
        return None
    m1, m2 = moments
    decode = _histogram_stats(window, HistogramName.DECODE_STEP_TIME).mean
    c = min(max(decode or 0.0, 0.0), prefill)
    return c + (prefill - c) * max(1.0, m2 / (m1 * m1))


def histogram_moments(h: Histogram) -> tuple[float, float] | None:
    """(mean, mean square) of a histogram's observations, each taken at its bucket's upper bound
    (exact for buckets of one integer each, as TGI's batch sizes), those past the last finite
    bound at their mean; ``None`` without observations, buckets or a positive mean."""
    if h.count <= 0 or not h.bounds:
        return None
    square = total = 0.0
    previous = 0.0
    for bound, cumulative in zip(h.bounds, h.cumulative, strict=True):
        if math.isinf(bound):
            break
        n = max(0.0, cumulative - previous)
        previous = max(previous, cumulative)
        square += n * bound * bound
        total += n * bound
    rest = h.count - previous
    if rest > 0:
        beyond = max(h.sum - total, 0.0) / rest
        square += rest * beyond * beyond
    mean = h.sum / h.count
    if mean <= 0.0:
        return None
    return mean, square / h.count


def histogram_buckets(h: Histogram) -> tuple[tuple[float, float], ...]:
    """A histogram's ``(le, cumulative count)`` pairs; empty when it has no buckets or no count."""
    if h.count <= 0 or not h.bounds:
        return ()
    return tuple(zip(h.bounds, h.cumulative, strict=True))


def observations_per_s(found: tuple[Histogram, float] | None) -> float | None:
    """Observations per second of a histogram's window increase (steps/s for iteration tokens)."""
    if found is None or found[1] <= 0:
        return None
    return found[0].count / found[1]


def computed_prompt_rate(window: ScrapeWindow) -> float | None:
    """Prompt tokens computed per second: the engine's own split when exposed, else prompt tokens
    minus prefix-cache hits (clamped at 0: the two are counted at different moments)."""
    direct = window.counter_rate(CounterName.COMPUTED_PROMPT_TOKENS)
    if direct is not None:
        return direct
    prompt = window.counter_rate(CounterName.PROMPT_TOKENS)
    hits = window.counter_rate(CounterName.PREFIX_CACHE_HITS)
    return None if prompt is None or hits is None else max(prompt - hits, 0.0)


def prefix_cache_hit_rate(window: ScrapeWindow) -> float | None:
    """Prefix-cache hits / queries over the window, 0-1; ``None`` without queries in it."""
    queries = window.counter_increase(CounterName.PREFIX_CACHE_QUERIES)
    hits = window.counter_increase(CounterName.PREFIX_CACHE_HITS)
    if queries is None or hits is None or queries[0] <= 0:
        return None
    return min(hits[0] / queries[0], 1.0)
