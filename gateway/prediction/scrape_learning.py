"""A replica's learning from its scrapes: gauges, dispatch overhead, load, prefill share, the fit.

``observe_snapshot`` takes one ``ReplicaSnapshot`` of a known replica into its ``ReplicaRecord``
(``PredictionService.on_snapshot`` finds the record). Times are the snapshot's monotonic seconds,
shares fractions of a step (0-1); ``None`` in a snapshot field means the engine does not export it,
and what cannot be measured from a window leaves the record's value as it was. Pure, synchronous.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

from gateway.prediction.record import ReplicaRecord, gauge_means, limits_of
from gateway.prediction.service_config import PredictionConfig
from gateway.prediction.state import GaugeMeans, Load, engine_kv_tokens, measured_steps, window_stats
from gateway.replicas.snapshot import ReplicaSnapshot
from predictor import WindowStats, observation_from_window, prefill_share
from predictor.steady import TrafficMix, steady_state

__all__ = ["full_finish_rate", "observe_overhead", "observe_snapshot"]


def observe_snapshot(r: ReplicaRecord, snapshot: ReplicaSnapshot, config: PredictionConfig) -> None:
    """Take one scrape's snapshot: keep it, feed its window to the fit, refit when due.

    The fit learns from the newest scrape interval: for an engine that times its steps by kind
    (TGI) from its measured decode and prefill steps (``state.measured_steps``), otherwise from
    the interval as a window (``observe_window``).

    Stale snapshots are kept (their in-flight and staleness matter) but teach nothing.

    **An idle replica forgets its recent traffic** (``_idle``: the scrape saw nothing running
    or waiting and the caller has nothing in flight there): the load a newcomer is forecast
    to share steps with (others' prefill share and tokens per step, arriving prompts) becomes
    none, and the prefill-share history restarts from that idle window. Those terms are
    measured from inter-token latencies and token rates, which an idle window does not have:
    without this, what a burst taught stayed in every forecast after it, and a caller that
    refused on those forecasts never sent the traffic that could correct them (a lock-out).
    What the step model and the dispatch overhead learned is kept (they describe the engine,
    not its traffic), and so is the steady state (``PredictionConfig.steady_state``), whose
    finishes age out of ``arrival_memory_s`` by themselves.
    """
    r.snapshot = snapshot
    r.snapshots += 1
    if snapshot.prefill_step_time_mean_s is not None:
        r.times_prefills = True
    if r.first_seen_at is None:
        r.first_seen_at = snapshot.taken_at
    if snapshot.stale:
        r.stale_snapshots += 1
        return
    _learn(r, snapshot, config)
    if _idle(snapshot):
        at = snapshot.metrics_at if snapshot.metrics_at is not None else snapshot.taken_at
        r.shares.clear()
        r.shares.append((at, 1.0))
        r.load = Load(
            0.0,
            0.0,
            snapshot.requests_finished_per_s,
            r.load.steady_step_s,
            0.0,
            r.load.full_finish_rate_per_s,
        )


def _learn(r: ReplicaRecord, snapshot: ReplicaSnapshot, config: PredictionConfig) -> None:
    """``observe_snapshot``'s learning from a fresh ``snapshot`` of ``r``: gauges, overhead, load,
    capacity, fit."""
    before = r.gauges[-1] if r.gauges else None
    _remember_gauges(r, snapshot)
    _observe_capacity(r, snapshot, before, config)
    observe_overhead(r, snapshot, config)
    gauges = gauge_means(r, snapshot.taken_at - snapshot.window_s)
    window = window_stats(snapshot, gauges)
    if window is not None:
        seen = observation_from_window(window, r.calibrator.prior.params.knee_tokens)
        if seen.valid:
            share = _prefill_share(r, window, gauges, config)
            r.load = Load(
                seen.batch.prefill_tokens,
                share,
                snapshot.requests_finished_per_s,
                r.load.steady_step_s,
                window.prompt_tokens_per_s,
            )
    capacity = full_finish_rate(r, config)
    if capacity != r.load.full_finish_rate_per_s:
        r.load = dataclasses.replace(r.load, full_finish_rate_per_s=capacity)
    # The fit learns from the newest scrape interval alone: consecutive windows overlap
    # almost entirely, intervals do not, and their differing mixes identify the coefficients.
    interval = snapshot.last_interval
    stats = None
    if interval is not None:
        stats = window_stats(interval, gauge_means(r, interval.taken_at - interval.window_s))
    if stats is None or interval is None:
        _update_steady(r, snapshot.taken_at, config)
        return
    # An engine that times its steps by kind (TGI) gives (batch -> step time) pairs outright;
    # the window's steps/s and ITL are then only a blurrier view of the same steps.
    direct = measured_steps(interval, gauge_means(r, interval.taken_at - interval.window_s))
    if direct:
        for step in direct:
            obs = r.calibrator.observe_step(step.at_s, step.batch, step.step_s)
    else:
        obs = r.calibrator.observe_window(stats)
    r.last_observation = obs
    now = stats.at_s
    due = r.last_fit_at is None or now - r.last_fit_at >= config.refit_interval_s
    if obs.valid and due:
        fitted = r.calibrator.fit(now)
        r.model, r.report, r.last_fit_at = fitted.model, fitted.report, now
    _update_steady(r, snapshot.taken_at, config)


def _update_steady(r: ReplicaRecord, now: float, config: PredictionConfig) -> None:
    """Recompute ``r``'s steady state (and the ``Load`` forecasts see) from its recent finishes.

    Once per scrape: the arrival rate is the rate the caller's requests finished there over
    the last ``arrival_memory_s`` seconds (in a steady state as many finish as arrive), their
    usage the sizes. Requests of other clients are not in it.
    """
    cfg = config
    steady = None
    finishes = r.finishes
    while finishes and finishes[0][0] < now - cfg.arrival_memory_s:
        finishes.popleft()
    span = min(cfg.arrival_memory_s, now - (r.first_seen_at if r.first_seen_at is not None else now))
    if cfg.steady_state and finishes and span >= cfg.arrival_min_span_s:
        mix = TrafficMix.from_requests(len(finishes) / span, [(p, o) for _, p, o in finishes])
        limits = limits_of(r)
        steady = steady_state(
            mix,
            r.model,
            max_num_seqs=limits.max_num_seqs,
            max_num_batched_tokens=limits.max_num_batched_tokens,
            kv_capacity_tokens=float(limits.kv_capacity_tokens),
        )
    r.steady = steady
    step_s = None if steady is None else steady.step_s
    if r.load.steady_step_s != step_s:
        r.load = dataclasses.replace(r.load, steady_step_s=step_s)


def _prefill_share(
    r: ReplicaRecord, window: WindowStats, gauges: GaugeMeans, config: PredictionConfig
) -> float | None:
    """The prefill share to expect: the window's, shrunk toward the long-run mean.

    How much prefill the next seconds bring depends on arrivals not yet made; the last
    window's share predicts it only weakly (bursts pass), the replica's longer-run mean
    share is the better part of the guess (``PredictionConfig.prefill_share_weight``).
    """
    if window.mean_itl_s is None:
        return r.load.prefill_share
    # The batch in running requests: the unit the in-flight list counts in.
    share = prefill_share(r.model, window.mean_itl_s, gauges.running, gauges.kv_tokens)
    if share is None:
        return r.load.prefill_share
    # Averaged as stretch factors 1 / (1 - share), the unit TPOT scales with (a mean of
    # shares would under-price the windows with much prefill).
    history = r.shares
    history.append((window.at_s, 1.0 / (1.0 - share)))
    while history and history[0][0] < window.at_s - config.prefill_share_memory_s:
        history.popleft()
    usual = statistics.median(h[1] for h in history)
    # A queue in the engine is prefill work already there: the near future is like the
    # recent past, not like the long-run mean.
    weight = 1.0 if gauges.waiting >= 1.0 else config.prefill_share_weight
    stretch = usual + weight * (history[-1][1] - usual)
    return 1.0 - 1.0 / stretch


def _remember_gauges(r: ReplicaRecord, s: ReplicaSnapshot) -> None:
    kv = engine_kv_tokens(s)
    r.gauges.append((s.taken_at, float(s.num_running or 0), float(s.num_waiting or 0), kv))
    while r.gauges and r.gauges[0][0] < s.taken_at - s.window_s:
        r.gauges.popleft()


def observe_overhead(r: ReplicaRecord, snapshot: ReplicaSnapshot, config: PredictionConfig) -> None:
    """Update ``r.overhead_ewma_s`` from one scrape window.

    The forecast prices engine steps; a TTFT the caller measures (the gateway: dispatch to
    first token back) also holds the HTTP hop and the replica server's own work, a few
    milliseconds no step model learns. The replica reports its own TTFT (arrival to first
    token); the mean of the caller's TTFTs of the requests whose first token came in the same
    window (dispatch time + TTFT; the finish time when the forecast is unknown), less that
    mean, measures the overhead without the forecast (so the step fit and the
    overhead cannot feed each other). The replica's mean also counts other clients' requests
    and the windows' edges differ by a request's decode time: an EWMA over windows smooths
    that. Only with ``PredictionConfig.learn_dispatch_overhead``. An engine without a TTFT
    histogram (TGI) gives its queue time plus its prefill step instead (``_engine_ttft_mean_s``).
    """
    cfg = config
    if not cfg.learn_dispatch_overhead:
        return
    engine = _engine_ttft_mean_s(snapshot)
    if engine is None or not math.isfinite(engine) or snapshot.window_s < cfg.overhead_min_window_s:
        return
    since = snapshot.taken_at - snapshot.window_s
    mine = [t for at, t in r.ttfts if since <= at <= snapshot.taken_at]
    if len(mine) < cfg.overhead_min_requests:
        return
    measured = sum(mine) / len(mine) - engine
    r.overhead_windows += 1
    # From 0, not from the first window: a short first window after start-up is the least
    # trustworthy, and an overhead too large would teach the step fit steps too short.
    r.overhead_ewma_s += cfg.overhead_weight * (measured - r.overhead_ewma_s)


def _observe_capacity(
    r: ReplicaRecord,
    snapshot: ReplicaSnapshot,
    before: tuple[float, float, float, float] | None,
    config: PredictionConfig,
) -> None:
    """Keep ``snapshot``'s newest scrape interval in ``r.full_intervals`` if the replica was full
    through it: requests waiting in its queue at the scrape that opened it (``before``, the
    gauges remembered then) and at this one. Its finish rate then is the replica's capacity under
    the traffic of the moment, whatever was offered. Intervals older than
    ``capacity_memory_s`` are dropped."""
    intervals = r.full_intervals
    now = snapshot.taken_at
    while intervals and intervals[0][0] < now - config.capacity_memory_s:
        intervals.popleft()
    interval = snapshot.last_interval
    if interval is None or before is None:
        return
    rate, seconds = interval.requests_finished_per_s, interval.window_s
    if rate is None or not (math.isfinite(rate) and rate >= 0.0 and seconds > 0.0):
        return
    # The gauges remembered last must be those of the scrape that opened the interval (not of one
    # before a gap in the scrapes, whose waiting queue says nothing of this interval).
    if not 0.5 * seconds <= now - before[0] <= 1.5 * seconds:
        return
    if before[2] > 0.0 and (snapshot.num_waiting or 0) > 0:
        intervals.append((now, rate * seconds, seconds))


def full_finish_rate(r: ReplicaRecord, config: PredictionConfig) -> float | None:
    """``r``'s capacity: requests finished per second over its newest full intervals
    (``_observe_capacity``, which drops those older than ``capacity_memory_s``),
    ``capacity_window_s`` of them at most; ``None`` with fewer than ``capacity_min_s`` seconds of
    them."""
    finished = seconds = 0.0
    for _, count, span in reversed(r.full_intervals):
        if seconds >= config.capacity_window_s:
            break
        finished += count
        seconds += span
    if seconds < config.capacity_min_s:
        return None
    return finished / seconds


def _idle(snapshot: ReplicaSnapshot) -> bool:
    """The replica was idle at ``snapshot``: its metrics say nothing is running or waiting (both
    known) and the caller had nothing in flight there."""
    return snapshot.num_running == 0 and snapshot.num_waiting == 0 and not snapshot.in_flight


def _engine_ttft_mean_s(snapshot: ReplicaSnapshot) -> float | None:
    """The replica's own mean TTFT over the snapshot's window, seconds; ``None`` if unknown.

    Its TTFT histogram's mean (vLLM, SGLang: arrival to first token). TGI has none: its own
    dashboard's TTFT, the mean queue time (``tgi_request_queue_duration``: arrival in the queue
    to the batch that takes it) plus the mean prefill step as the router ran it
    (``tgi_batch_inference_duration{method="prefill"}``: the step whose end is the first token).
    Validation (tokenization) happens before the queue and so counts as overhead, like the hop.
    The queue time is a mean over requests, the prefill step one over steps: a step several
    requests share counts once there but once per request in their TTFTs, and takes longer. So
    the prefill step is weighted by the requests each started (``tgi_batch_next_size``,
    ``ReplicaSnapshot.request_prefill_step_time_mean_s``) where known; unweighted, the learned
    overhead comes out long (docs/engines.md).
    """
    if snapshot.ttft_mean_s is not None:
        return snapshot.ttft_mean_s
    queue = snapshot.queue_time_mean_s
    prefill = snapshot.request_prefill_step_time_mean_s
    if prefill is None:
        prefill = snapshot.prefill_step_time_mean_s
    if queue is None or prefill is None:
        return None
    return queue + prefill
