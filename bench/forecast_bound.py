"""How much of the TTFT and TPOT forecast error is the future's: oracles that know the engine's
exact state at dispatch, in virtual time.

A request's TPOT is the mean step time over its decode, and most of those steps run after it
arrived: they carry the prefills of requests that have not arrived yet and the batch that the
requests still running will leave. Its TTFT, too, moves with a long prompt that arrives just after
it and shares its prefill steps. Part of the error ``bench.predictor_accuracy`` measures is
therefore not the predictor's: it is what the future holds. This bench measures that part.

It replays one cell of ``bench.predictor_accuracy`` (same trace slice, same rate, same engine and
seed, one replica, the shipped ``PredictionService`` forecasting every arrival). At ``--samples``
scored arrivals, spread evenly over the scored window, the engine (``simulator.engine.Engine``:
the ground truth) is copied right after the request joined it, with the step in progress, and the
copy is run ``--futures`` times to the request's end, each time under another future:

* **arrivals**: the trace's own, from another point of the scored window: the arrivals that
  followed another request ``j`` (times shifted so that ``j`` stands at this arrival), so every
  future has the trace's rate and burst shape; ``j`` is at least 30 s away from the request
  (``_APART_S``), so that no future is a shifted copy of the request's real one (which is the one
  with ``j`` = the request itself: ``tests/bench/test_forecast_bound.py`` checks that the copy
  replays it to the same TTFT and TPOT). **Independent** futures draw ``j`` at random; **analog**
  futures take the ``j`` whose recent past looked most like the request's (``recent_load``: the
  prompt tokens that arrived over the last 2, 10 and 30 s), so that a burst in progress goes on
  in them as far as the trace's bursts do;
* **step-time jitter**: the engine's noise, reseeded per future;
* **output lengths**: a gateway does not know how long the requests running there, nor this one,
  will go on. Except in the ``lengths`` oracle, each running request's output is redrawn per
  future from the trace's outputs longer than what it has already produced (the request's own from
  all of them, at least 2); the ``lengths`` oracle keeps every true length.

An oracle's forecast is the value that minimises the mean absolute percentage error over its
futures (their median weighted by 1 / value), and its error is scored against what the request
really measured in the replay, exactly as the shipped forecast is. Every oracle knows the
engine's exact state and its exact step times, which no gateway does. What none knows is the
actual future: they know its distribution as far as the trace's other arrivals describe it
(independent), or as far as arrivals after a similar recent past do (analog). That is not a
strict bound: a forecast that read the present's correlation with the next seconds better than
the analog futures do could beat them. It says how much of the error is left once the present is
known exactly (``ORACLES``):

* ``lengths``: the exact engine with every output length known, independent futures;
* ``state``: the exact engine, output lengths redrawn, independent futures;
* ``analog``: the exact engine, output lengths redrawn, analog futures.

Run: ``.venv/bin/python -m bench.forecast_bound --profile llama3-8b-h100 --loads 0.6 1.0``
(``--samples`` 120 and ``--futures`` 16 per cell by default: minutes per cell on a 2-core
machine). Prints a table (median and p90 APE with 90 % bootstrap intervals, mean APE, and the
targets' verdict, for the shipped forecast and both oracles on the same requests); asserts
nothing. ``--quick``: one tiny cell, for CI's smoke test.
"""

from __future__ import annotations

import argparse
import bisect
import copy
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np

from bench.predictor_accuracy import (
    FACTS,
    TPOT_MEDIAN,
    TPOT_P90,
    TTFT_MEDIAN,
    TTFT_P90,
    Schedule,
    error_stats,
    pct,
    verdict,
)
from replay import (
    EmulatedReplica,
    ReplayConfig,
    TraceRequest,
    fit_to_model_len,
    load_azure_trace,
    measure_capacity,
    run_replay,
)
from simulator.engine import Engine, FinishedRequestStats, StepPlan
from simulator.profile import Profile, load_profile

#: Ids of the futures' arrivals, clear of the trace's (``str(index)``).
_FUTURE_ID: Final = 10_000_000
#: A future is drawn from an arrival at least this far (s) from the request's own, so that it does
#: not replay a shifted copy of the request's real future.
_APART_S: Final = 30.0
#: The windows (s) of ``recent_load``.
_RECENT_S: Final = (2.0, 10.0, 30.0)
#: The oracles, as the table names them (see the module).
ORACLES: Final = {
    "lengths": "oracle, lengths known",
    "state": "oracle, engine state",
    "analog": "oracle, engine state, analog futures",
}


#: The latencies scored: a finished request's ``FinishedRequestStats`` field for each.
METRICS: Final = ("ttft", "tpot")


@dataclass(frozen=True, slots=True)
class Bound:
    """One scored request and latency (``metric``: ``ttft`` or ``tpot``): what it measured, the
    shipped forecast and the two oracles' (seconds)."""

    index: int
    metric: str
    actual_s: float
    shipped_s: float
    #: Each oracle's forecast (``ORACLES``), seconds.
    oracles_s: dict[str, float]


@dataclass(frozen=True, slots=True)
class _Snapshot:
    """The engine right after request ``index`` joined it at ``now``, and its step in progress."""

    index: int
    now: float
    engine: Engine
    plan: StepPlan | None
    plan_end_s: float


def recent_load(requests: Sequence[TraceRequest]) -> np.ndarray:
    """Per request, the log of 1 + the prompt tokens that arrived over the last 2, 10 and 30 s up to
    and including it, each column scaled to unit standard deviation: where the ``analog`` oracle
    looks for arrivals whose past resembled this one's. Shape ``(len(requests), 3)``."""
    times = np.array([r.arrival_s for r in requests])
    cumulative = np.concatenate([[0.0], np.cumsum([float(r.prompt_tokens) for r in requests])])
    upto = np.arange(1, len(requests) + 1)
    columns = []
    for window in _RECENT_S:
        since = np.searchsorted(times, times - window, side="right")
        column = np.log1p(cumulative[upto] - cumulative[since])
        spread = float(np.std(column))
        columns.append(column / spread if spread > 0.0 else column)
    return np.column_stack(columns)


def best_ape_forecast(values: Sequence[float]) -> float:
    """The ``f`` minimising ``mean(|f - y| / y)`` over ``values`` (> 0): their median weighted by
    ``1 / y`` (a weighted L1 problem; the lower weighted median)."""
    ys = sorted(values)
    weights = [1.0 / y for y in ys]
    half = 0.5 * sum(weights)
    acc = 0.0
    for y, w in zip(ys, weights, strict=True):
        acc += w
        if acc >= half:
            return y
    return ys[-1]


@dataclass(slots=True)
class DispatchRecorder:
    """Copies the engine (with its step in progress) right after each chosen arrival joined it;
    ``run_replay``'s ``on_dispatch`` observer (one replica per cell)."""

    chosen: set[int]
    snapshots: list[_Snapshot]

    def __call__(self, index: int, replica: EmulatedReplica, now: float) -> None:
        if index not in self.chosen:
            return
        engine, plan = copy.deepcopy((replica.engine, replica.plan))
        self.snapshots.append(_Snapshot(index, now, engine, plan, replica.plan_end_s))


def _run_future(
    snap: _Snapshot,
    arrivals: Sequence[TraceRequest],
    profile: Profile,
    max_tokens: int,
    rng: np.random.Generator | None,
    outputs: Sequence[int] | None,
) -> FinishedRequestStats | None:
    """What request ``snap.index`` measures on a copy of ``snap``'s engine under ``arrivals``
    (times already shifted to follow ``snap.now``); ``rng``: reseeds the step-time jitter and
    draws the lengths (``None``: the engine's own jitter sequence, as in the replay); ``outputs``
    (sorted): redraw the unknown output lengths from them (see the module), ``None``: keep the
    true ones."""
    engine, plan = copy.deepcopy((snap.engine, snap.plan))
    if rng is not None:  # the noise is part of the future
        engine._jitter_rng = np.random.default_rng(rng.integers(1 << 62))
    target = str(snap.index)
    if outputs is not None and rng is not None:
        for req in engine._requests.values():  # what a gateway cannot know, redrawn
            done = max(req.num_output_tokens, 1 if req.request_id == target else 0)
            start = bisect.bisect_right(outputs, done)
            if start < len(outputs):
                drawn = outputs[int(rng.integers(start, len(outputs)))]
                req.output_tokens = min(drawn, req.max_tokens)
    limit = profile.engine.max_model_len
    now, step_end = snap.now, snap.plan_end_s
    k = 0
    while True:
        next_arrival = arrivals[k].arrival_s if k < len(arrivals) else math.inf
        if plan is not None and step_end <= next_arrival:
            now = step_end
            result = engine.complete(plan, now)
            for stats in result.finished:
                if stats.request_id == target:
                    return stats
            plan = engine.schedule(now)
            step_end = now + plan.duration_s if plan is not None else math.inf
        elif math.isfinite(next_arrival):
            now = next_arrival
            r = arrivals[k]
            cap = max(r.output_tokens, min(max_tokens, limit - r.prompt_tokens))
            engine.add_request(str(_FUTURE_ID + k), r.prompt_tokens, cap, r.output_tokens, now)
            k += 1
            if plan is None:
                plan = engine.schedule(now)
                step_end = now + plan.duration_s if plan is not None else math.inf
        else:
            return None  # nothing left to run and the request never finished: cannot happen


def bound_cell(
    profile_name: str,
    load: float,
    trace: Sequence[TraceRequest],
    capacity_per_s: float,
    *,
    schedule: Schedule,
    samples: int,
    futures: int,
    seed: int,
) -> list[Bound]:
    """Replay one cell (one replica) and score the shipped forecast and both oracles (module), on
    TTFT and TPOT: a ``Bound`` per sampled request and latency it measured."""
    profile = load_profile(profile_name)
    rate = load * capacity_per_s
    requests, first, last, finish = schedule.cell(trace, rate)
    scored = [i for i, r in enumerate(requests) if first <= r.arrival_s < last]
    step = max(1, len(scored) // samples)
    chosen = set(scored[::step][:samples])
    config = ReplayConfig(profile=profile, facts=FACTS[profile_name], replicas=1, seed=seed)
    recorder = DispatchRecorder(chosen, [])
    result = run_replay(requests, config, finish=finish, on_dispatch=recorder)
    outcome = {r.index: r for r in result.records}
    outputs = sorted(r.output_tokens for r in trace)
    rng = np.random.default_rng(seed + 1)
    recent = recent_load(requests)
    bounds: list[Bound] = []
    for snap in recorder.snapshots:
        record = outcome.get(snap.index)
        if record is None or not record.forecast.valid:
            continue
        now = requests[snap.index].arrival_s
        # Futures from elsewhere in the window: never one overlapping the request's own.
        apart = [j for j in scored if abs(requests[j].arrival_s - now) >= _APART_S]
        if not apart:
            continue
        independent = rng.choice(apart, size=min(futures, len(apart)), replace=False).tolist()
        distance = np.linalg.norm(recent[apart] - recent[snap.index], axis=1)
        analog = [apart[k] for k in np.argsort(distance, kind="stable")[:futures]]
        found: dict[tuple[str, str], list[float]] = {}
        for oracle, draws, redraw in (
            ("lengths", independent, None),
            ("state", independent, outputs),
            ("analog", analog, outputs),
        ):
            for j in draws:
                shift = snap.now - requests[j].arrival_s
                alternative = [
                    TraceRequest(r.arrival_s + shift, r.prompt_tokens, r.output_tokens)
                    for r in requests[j + 1 :]
                ]
                stats = _run_future(snap, alternative, profile, config.max_tokens, rng, redraw)
                for metric in METRICS:
                    value = None if stats is None else getattr(stats, f"{metric}_s")
                    if value:
                        found.setdefault((metric, oracle), []).append(value)
        for metric in METRICS:
            actual = getattr(record, f"{metric}_s")
            by_oracle = {name: found.get((metric, name)) for name in ORACLES}
            if not actual or not all(by_oracle.values()):
                continue
            bounds.append(
                Bound(
                    snap.index,
                    metric,
                    actual,
                    getattr(record.forecast, f"{metric}_s"),
                    {name: best_ape_forecast(values or []) for name, values in by_oracle.items()},
                )
            )
    return bounds


#: The accuracy targets (median, p90 absolute percentage error, fractions) per latency.
TARGETS: Final = {"ttft": (TTFT_MEDIAN, TTFT_P90), "tpot": (TPOT_MEDIAN, TPOT_P90)}
#: Bootstrap resamples for the intervals of the median and p90.
_BOOTSTRAP: Final = 2000


@dataclass(frozen=True, slots=True)
class Score:
    """APE statistics of one forecast over a cell's scored requests (fractions); ``*_ci``: 90 %
    bootstrap intervals (the requests resampled), since a cell scores ~100 requests, not 1,000."""

    median: float
    p90: float
    mean: float
    median_ci: tuple[float, float]
    p90_ci: tuple[float, float]
    #: ``bench.predictor_accuracy``'s verdict on the targets (the 5 ms rule included).
    met: str


def _ape(predicted: np.ndarray, actual: np.ndarray, targets: tuple[float, float], seed: int = 0) -> Score:
    ape = np.abs(predicted - actual) / actual
    picks = np.random.default_rng(seed).integers(0, len(ape), size=(_BOOTSTRAP, len(ape)))
    resampled = ape[picks]
    medians = np.median(resampled, axis=1)
    p90s = np.percentile(resampled, 90, axis=1)
    return Score(
        float(np.median(ape)),
        float(np.percentile(ape, 90)),
        float(np.mean(ape)),
        (float(np.percentile(medians, 5)), float(np.percentile(medians, 95))),
        (float(np.percentile(p90s, 5)), float(np.percentile(p90s, 95))),
        verdict(error_stats(list(zip(predicted.tolist(), actual.tolist(), strict=True))), *targets),
    )


def summary(bounds: Sequence[Bound], metric: str) -> dict[str, Score]:
    """APE statistics per forecast (``shipped``, then each of ``ORACLES``) over the ``metric``
    bounds (none when there are none)."""
    chosen = [b for b in bounds if b.metric == metric]
    if not chosen:
        return {}
    actual = np.array([b.actual_s for b in chosen])
    targets = TARGETS[metric]
    scores = {"shipped": _ape(np.array([b.shipped_s for b in chosen]), actual, targets)}
    for name in ORACLES:
        scores[name] = _ape(np.array([b.oracles_s[name] for b in chosen]), actual, targets)
    return scores


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--profile", default="llama3-8b-h100", choices=list(FACTS))
    parser.add_argument("--loads", nargs="+", type=float, default=[0.6, 1.0])
    parser.add_argument("--samples", type=int, default=120, help="scored requests per cell")
    parser.add_argument("--futures", type=int, default=16, help="futures per scored request")
    parser.add_argument("--trace-start", type=int, default=0)
    parser.add_argument("--trace-rows", type=int, default=4000)
    parser.add_argument("--warmup", type=float, default=40.0)
    parser.add_argument("--measure", type=float, default=100.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="one tiny cell (seconds; for CI)")
    args = parser.parse_args(argv)
    for name in ("samples", "futures", "trace_rows"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.quick:
        args.loads, args.samples, args.futures = [0.6], 4, 3
        args.trace_rows, args.warmup, args.measure = 1500, 5.0, 60.0
    schedule = Schedule(warmup_s=args.warmup, measure_s=args.measure, max_requests=args.trace_rows)
    profile = load_profile(args.profile)
    trace, _ = fit_to_model_len(
        load_azure_trace(start=args.trace_start, count=args.trace_rows), profile.engine.max_model_len
    )
    capacity = measure_capacity(profile, trace, seed=args.seed)
    print(
        f"{args.profile}, Azure conversation rows {args.trace_start}+, capacity {capacity:.2f} req/s; "
        f"{args.samples} requests x {args.futures} futures per cell",
        file=sys.stderr,
    )
    header = "| load | latency | n | forecast | APE median (90 % CI) | APE p90 (90 % CI) | APE mean | met |"
    lines = [header, "|---:|---|---:|---|---:|---:|---:|:---:|"]
    label = {"shipped": "shipped", **ORACLES}
    for load in args.loads:
        started = time.perf_counter()
        bounds = bound_cell(
            args.profile,
            load,
            trace,
            capacity,
            schedule=schedule,
            samples=args.samples,
            futures=args.futures,
            seed=args.seed,
        )
        for metric in METRICS:
            n = sum(1 for b in bounds if b.metric == metric)
            for name, score in summary(bounds, metric).items():
                median = f"{pct(score.median)} ({pct(score.median_ci[0])}-{pct(score.median_ci[1])})"
                p90 = f"{pct(score.p90)} ({pct(score.p90_ci[0])}-{pct(score.p90_ci[1])})"
                lines.append(
                    f"| {100 * load:.0f} % | {metric.upper()} | {n} | {label[name]} | {median} | {p90} "
                    f"| {pct(score.mean)} | {score.met} |"
                )
        seconds = time.perf_counter() - started
        print(f"  {100 * load:.0f} %: {len(bounds)} scored latencies, {seconds:.0f} s", file=sys.stderr)
    print("\n".join(lines))
    print(
        f"targets: TTFT APE median <= {pct(TTFT_MEDIAN)}, p90 <= {pct(TTFT_P90)}; "
        f"TPOT APE median <= {pct(TPOT_MEDIAN)}, p90 <= {pct(TPOT_P90)}; "
        "met: yes* = only by the 5 ms absolute rule"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
