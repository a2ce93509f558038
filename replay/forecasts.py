"""Virtual-time replay: real trace arrivals against emulated vLLM engines, predictions vs outcomes.

No asyncio, no sleeping: one event loop over a heap of (virtual time, event). Three kinds of event:

* **step done**: an engine's step ends; ``Engine.complete`` emits tokens (the gateway's in-flight
  view advances at once, as the streaming relay sees each chunk) and finished requests (their
  actual TTFT and TPOT are recorded, and ``PredictionService.on_finished`` learns their usage);
  the engine schedules its next step immediately, as vLLM's busy loop does;
* **scrape**: every ``scrape_interval_s`` each engine's ``/metrics`` text is rendered by
  ``simulator.metrics.VllmMetrics`` (the exposition the live emulator serves) and goes through
  ``SnapshotBuilder.observe_text`` and ``PredictionService.on_snapshot``: the same parsing,
  windowing and calibration code the live gateway runs;
* **arrival**: the request is routed to the replica with the fewest outstanding requests (ties
  round robin, as ``gateway.replicas.registry`` does), ``PredictionService.forecast`` is asked
  about it first, then it is added to that engine.

The predictor never sees the emulator's profile: the service only gets ``ReplicaFacts``.

``simulator/`` never imports this module (the emulator stays an independent ground truth).
"""

from __future__ import annotations

import csv
import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import IntEnum
from pathlib import Path
from typing import Final

from gateway.prediction import PredictionConfig, PredictionService, ReplicaFacts
from gateway.replicas.dialects.vllm import VllmDialect
from gateway.replicas.scrape import DEFAULT_WINDOW_S, SnapshotBuilder
from gateway.replicas.snapshot import InFlight
from predictor import FitReport, Forecast
from simulator.engine import Engine, FinishedRequestStats, StepPlan
from simulator.metrics import VllmMetrics, cache_config_labels
from simulator.profile import Profile

__all__ = [
    "AZURE_CONV_TRACE",
    "MOONCAKE_CONV_TRACE",
    "EmulatedReplica",
    "ReplayConfig",
    "ReplayResult",
    "RequestRecord",
    "TraceRequest",
    "at_rate",
    "fit_to_model_len",
    "load_azure_trace",
    "load_mooncake_trace",
    "make_replica",
    "measure_capacity",
    "piecewise_rate",
    "run_replay",
]

#: The Azure LLM inference trace 2023 (conversation), copied with its licence (see its README).
AZURE_CONV_TRACE: Final = (
    Path(__file__).resolve().parents[1]
    / "tests"
    / "data"
    / "traces"
    / "azure_llm_2023"
    / "AzureLLMInferenceTrace_conv.csv"
)

#: The Mooncake FAST'25 conversation trace (Kimi), its three numeric columns as CSV (see its README).
MOONCAKE_CONV_TRACE: Final = AZURE_CONV_TRACE.parents[1] / "mooncake_fast25" / "conversation_trace.csv"


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: arrival (seconds from the trace's start) and its token counts."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int


def load_azure_trace(
    path: Path = AZURE_CONV_TRACE, *, start: int = 0, count: int | None = None
) -> list[TraceRequest]:
    """Rows ``start`` .. ``start + count`` of an Azure LLM trace CSV, arrivals relative to the first.

    Timestamps carry 7 fractional digits, which ``datetime.fromisoformat`` of Python 3.11 reads.
    """
    rows: list[tuple[datetime, int, int]] = []
    with path.open(newline="", encoding="utf-8") as f:
        for i, row in enumerate(csv.DictReader(f)):
            if i < start:
                continue
            if count is not None and len(rows) >= count:
                break
            rows.append(
                (
                    datetime.fromisoformat(row["TIMESTAMP"]),
                    int(row["ContextTokens"]),
                    int(row["GeneratedTokens"]),
                )
            )
    if not rows:
        return []
    t0 = rows[0][0]
    return [TraceRequest((t - t0).total_seconds(), p, o) for t, p, o in rows]


def load_mooncake_trace(
    path: Path = MOONCAKE_CONV_TRACE, *, start: int = 0, count: int | None = None, spread: bool = True
) -> list[TraceRequest]:
    """Rows ``start`` .. ``start + count`` of the Mooncake conversation trace CSV
    (``timestamp_ms,input_length,output_length``), arrivals in seconds relative to the first row.

    The trace's timestamps are quantised to 3-second slots (every request of a slot has the same
    one). ``spread``: requests sharing a timestamp are spread evenly over the gap to the next
    distinct timestamp (request j of n at ``t + gap x j / n``), which is milder than replaying
    each slot as one simultaneous burst; the slot's last gap is taken as the previous one.
    """
    rows: list[tuple[float, int, int]] = []
    with path.open(newline="", encoding="utf-8") as f:
        for i, row in enumerate(csv.DictReader(f)):
            if i < start:
                continue
            if count is not None and len(rows) >= count:
                break
            rows.append(
                (float(row["timestamp_ms"]) / 1e3, int(row["input_length"]), int(row["output_length"]))
            )
    if not rows:
        return []
    times = [t for t, _, _ in rows]
    if spread:
        distinct = sorted(set(times))
        gaps = {a: b - a for a, b in itertools.pairwise(distinct)}
        last_gap = gaps[distinct[-2]] if len(distinct) > 1 else 0.0
        groups: dict[float, int] = {}
        for t in times:
            groups[t] = groups.get(t, 0) + 1
        seen: dict[float, int] = {}
        spread_times: list[float] = []
        for t in times:
            j = seen.get(t, 0)
            seen[t] = j + 1
            spread_times.append(t + gaps.get(t, last_gap) * j / groups[t])
        times = spread_times
    t0 = min(times)
    order = sorted(range(len(rows)), key=lambda k: (times[k], k))
    return [TraceRequest(times[k] - t0, rows[k][1], rows[k][2]) for k in order]


def piecewise_rate(
    requests: Sequence[TraceRequest], phases: Sequence[tuple[float, float]]
) -> list[TraceRequest]:
    """The requests, in order, re-timed to run ``phases`` back to back: each ``(duration_s,
    rate_per_s)`` phase takes the next ``ceil(duration x rate)`` requests and compresses their
    gaps by one factor to that mean rate (as ``at_rate``), so each phase keeps the trace's burst
    shape. Stops early when the requests run out.
    """
    out: list[TraceRequest] = []
    offset, used = 0.0, 0
    for duration, rate in phases:
        if duration <= 0 or rate <= 0:
            raise ValueError(f"phases need duration and rate > 0, got {(duration, rate)}")
        n = math.ceil(duration * rate)
        chunk = list(requests[used : used + n + 1])  # one more: its arrival ends the phase
        if not chunk:
            break
        timed = (
            at_rate(chunk, rate)
            if len(chunk) > 1
            else [TraceRequest(0.0, chunk[0].prompt_tokens, chunk[0].output_tokens)]
        )
        scale = duration / timed[-1].arrival_s if len(timed) == n + 1 and timed[-1].arrival_s > 0 else 1.0
        for r in timed[:n]:
            t = offset + r.arrival_s * scale
            if t < offset + duration:
                out.append(TraceRequest(t, r.prompt_tokens, r.output_tokens))
        used += n
        offset += duration
    return out


def at_rate(requests: Sequence[TraceRequest], rate_per_s: float) -> list[TraceRequest]:
    """The same requests with time compressed (or stretched) to a mean rate of ``rate_per_s``.

    Every gap is scaled by one factor, so the trace's burst shape is kept (see the traces README:
    compressing time keeps the shape, superimposing copies would smooth it).
    """
    if rate_per_s <= 0:
        raise ValueError(f"rate_per_s must be > 0, got {rate_per_s}")
    if len(requests) < 2:
        return list(requests)
    span = requests[-1].arrival_s - requests[0].arrival_s
    native = (len(requests) - 1) / span if span > 0 else rate_per_s
    scale = native / rate_per_s
    t0 = requests[0].arrival_s
    return [TraceRequest((r.arrival_s - t0) * scale, r.prompt_tokens, r.output_tokens) for r in requests]


def fit_to_model_len(requests: Sequence[TraceRequest], max_model_len: int) -> tuple[list[TraceRequest], int]:
    """(requests whose prompt + output fit ``max_model_len``, how many did not).

    A real engine answers 400 to the others; they never reach a step, so the replay counts them
    and leaves them out rather than truncating them silently.
    """
    kept = [r for r in requests if r.prompt_tokens + r.output_tokens <= max_model_len]
    return kept, len(requests) - len(kept)


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """One replay: the fleet, what the service is told, and the clocks.

    ``profile``: every replica's emulator profile (the ground truth; the service never sees it).
    ``facts``: what the service is told about each replica (what an operator would write).
    ``max_tokens``: the clients' output cap, lowered to ``max_model_len - prompt`` where needed.
    ``scrape_interval_s`` / ``window_s``: as the live scraper's ``interval`` and ``window``.
    ``jitter``: the engines' relative step-time noise. ``seed``: engines' seeds are seed, seed+1...
    """

    profile: Profile
    facts: ReplicaFacts
    replicas: int = 1
    max_tokens: int = 1000
    scrape_interval_s: float = 1.0
    window_s: float = DEFAULT_WINDOW_S
    jitter: float = 0.02
    seed: int = 0
    output_quantile: float = 0.5
    prediction: PredictionConfig | None = None

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.max_tokens < 1:
            raise ValueError("replicas and max_tokens must be >= 1")
        if self.scrape_interval_s <= 0 or self.window_s <= 0:
            raise ValueError("scrape_interval_s and window_s must be > 0")


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One replayed request: what was predicted at its arrival and what the engine then measured.

    ``ttft_s``: engine arrival -> first token. ``tpot_s``: mean time per output token after the
    first (``None`` with fewer than two tokens), as vLLM's per-request TPOT.
    """

    index: int
    replica: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    max_tokens: int
    forecast: Forecast
    ttft_s: float | None
    tpot_s: float | None
    finished_s: float
    preemptions: int
    #: Requests on the replica (the gateway's in-flight, this one excluded) when it arrived.
    in_flight_at_arrival: int


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """Every finished request in arrival order, plus the fits at the end."""

    records: tuple[RequestRecord, ...]
    end_s: float
    steps: int
    scrapes: int
    reports: dict[str, FitReport | None] = field(default_factory=dict)
    describe: dict[str, object] = field(default_factory=dict)


class _Event(IntEnum):
    """Kinds of event; at one instant, lower values go first (tokens land before anything reads)."""

    STEP_DONE = 0
    SCRAPE = 1
    ARRIVAL = 2


@dataclass(slots=True)
class _Open:
    """A request the gateway has in flight (mutable twin of ``InFlight``)."""

    index: int
    request: TraceRequest
    max_tokens: int
    forecast: Forecast
    in_flight_at_arrival: int
    streamed: int = 0
    last_token_at: float | None = None
    first_token_at: float | None = None

    def view(self) -> InFlight:
        return InFlight(
            str(self.index),
            self.request.prompt_tokens,
            self.streamed,
            self.request.arrival_s,
            self.max_tokens,
            self.last_token_at,
            self.first_token_at,
        )


@dataclass(slots=True)
class EmulatedReplica:
    """One emulated vLLM replica of a replay: its engine, its ``/metrics`` exposition, the
    gateway's snapshot builder for it, the requests in flight and the step in progress."""

    name: str
    engine: Engine
    metrics: VllmMetrics
    builder: SnapshotBuilder
    open: dict[str, _Open] = field(default_factory=dict)
    plan: StepPlan | None = None


def make_replica(name: str, config: ReplayConfig, seed: int) -> EmulatedReplica:
    """A replica of ``config.profile`` whose engine is seeded ``seed`` (jitter from ``config``)."""
    p = config.profile
    engine = Engine(p, seed=seed, jitter=config.jitter)
    metrics = VllmMetrics(
        engine=engine,
        model_name=p.served_model_name,
        max_model_len=p.engine.max_model_len,
        cache_config=cache_config_labels(
            block_size=p.engine.block_size,
            num_gpu_blocks=p.engine.num_gpu_blocks,
            max_model_len=p.engine.max_model_len,
            overrides=p.cache_config_info(),
        ),
        process_metrics=False,  # process/GC families: irrelevant here and slow to render
    )
    return EmulatedReplica(
        name, engine, metrics, SnapshotBuilder(name, VllmDialect(), window_s=config.window_s)
    )


class _Replay:
    """The event loop of one replay (use ``run_replay``)."""

    def __init__(self, config: ReplayConfig, service: PredictionService) -> None:
        self.config = config
        self.service = service
        self.replicas = [make_replica(f"r{i}", config, config.seed + i) for i in range(config.replicas)]
        for r in self.replicas:
            service.set_replica(r.name, config.facts)
        self.model = config.profile.served_model_name
        self.heap: list[tuple[float, int, int, int]] = []
        self.seq = 0
        self.records: list[RequestRecord] = []
        self.steps = 0
        self.scrapes = 0
        self.round_robin = 0
        self.now = 0.0
        #: Requests among the first ``finish`` that have not finished yet.
        self.unfinished = 0
        self.finish_count = 0

    def push(self, at: float, kind: _Event, payload: int) -> None:
        heapq.heappush(self.heap, (at, int(kind), self.seq, payload))
        self.seq += 1

    def run(self, requests: Sequence[TraceRequest], finish: int) -> ReplayResult:
        for i, req in enumerate(requests):
            self.push(req.arrival_s, _Event.ARRIVAL, i)
        if requests:
            self.push(requests[0].arrival_s + self.config.scrape_interval_s, _Event.SCRAPE, 0)
        self.unfinished = finish
        while self.heap and self.unfinished > 0:
            at, kind, _, payload = heapq.heappop(self.heap)
            self.now = at
            if kind == _Event.ARRIVAL:
                self.arrive(payload, requests[payload])
            elif kind == _Event.STEP_DONE:
                self.step_done(self.replicas[payload])
            else:
                self.scrape()
                self.push(at + self.config.scrape_interval_s, _Event.SCRAPE, 0)
        self.records.sort(key=lambda rec: rec.index)
        reports = {r.name: self.service.report(r.name) for r in self.replicas}
        return ReplayResult(
            tuple(self.records), self.now, self.steps, self.scrapes, reports, self.service.describe()
        )

    def route(self) -> int:
        least = min(len(r.open) for r in self.replicas)
        tied = [i for i, r in enumerate(self.replicas) if len(r.open) == least]
        chosen = tied[self.round_robin % len(tied)]
        self.round_robin += 1
        return chosen

    def arrive(self, index: int, req: TraceRequest) -> None:
        k = self.route()
        replica = self.replicas[k]
        limit = self.config.profile.engine.max_model_len
        max_tokens = max(req.output_tokens, min(self.config.max_tokens, limit - req.prompt_tokens))
        forecast = self.service.forecast(
            replica.name,
            model=self.model,
            tenant=None,
            prompt_tokens=req.prompt_tokens,
            max_tokens=max_tokens,
            in_flight=[o.view() for o in replica.open.values()],
            now=self.now,
        )
        rid = str(index)
        replica.engine.add_request(rid, req.prompt_tokens, max_tokens, req.output_tokens, self.now)
        replica.open[rid] = _Open(index, req, max_tokens, forecast, len(replica.open))
        if replica.plan is None:
            self.start_step(k)

    def start_step(self, k: int) -> None:
        replica = self.replicas[k]
        plan = replica.engine.schedule(self.now)
        replica.plan = plan
        if plan is not None:
            self.push(self.now + plan.duration_s, _Event.STEP_DONE, k)

    def step_done(self, replica: EmulatedReplica) -> None:
        """Complete ``replica``'s step: tokens land, finished requests are recorded."""
        assert replica.plan is not None
        result = replica.engine.complete(replica.plan, self.now)
        replica.plan = None
        self.steps += 1
        replica.metrics.record_step(result)
        for event in result.events:
            o = replica.open[event.request_id]
            o.streamed, o.last_token_at = event.num_output_tokens, self.now
            if o.first_token_at is None:
                o.first_token_at = self.now
        for stats in result.finished:
            self.finish(replica, stats)
        self.start_step(self.replicas.index(replica))

    def finish(self, replica: EmulatedReplica, stats: FinishedRequestStats) -> None:
        o = replica.open.pop(stats.request_id)
        if o.index < self.finish_count:
            self.unfinished -= 1
        self.records.append(
            RequestRecord(
                index=o.index,
                replica=replica.name,
                arrival_s=o.request.arrival_s,
                prompt_tokens=o.request.prompt_tokens,
                output_tokens=stats.generation_tokens,
                max_tokens=o.max_tokens,
                forecast=o.forecast,
                ttft_s=stats.ttft_s,
                tpot_s=stats.tpot_s,
                finished_s=self.now,
                preemptions=stats.num_preemptions,
                in_flight_at_arrival=o.in_flight_at_arrival,
            )
        )
        self.service.on_finished(
            replica=replica.name,
            model=self.model,
            tenant=None,
            prompt_chars=None,
            prompt_tokens=stats.prompt_tokens,
            completion_tokens=stats.generation_tokens,
            finished_at=self.now,
            forecast=o.forecast,
            ttft_s=stats.ttft_s,
        )

    def scrape(self) -> None:
        self.scrapes += 1
        for replica in self.replicas:
            text = replica.metrics.exposition().decode("utf-8")
            in_flight = [o.view() for o in replica.open.values()]
            snapshot = replica.builder.observe_text(text, self.now, in_flight)
            self.service.on_snapshot(snapshot)


def run_replay(
    requests: Sequence[TraceRequest],
    config: ReplayConfig,
    service: PredictionService | None = None,
    *,
    finish: int | None = None,
) -> ReplayResult:
    """Replay ``requests`` (arrival order, fitting ``max_model_len``) on ``config``'s fleet.

    Returns the forecast and outcome of every request that finished. Deterministic for a given
    input and config. ``service``: the prediction service to drive (a fresh one from ``config``
    by default). ``finish``: stop once the first ``finish`` requests have finished (default: all);
    later arrivals keep the load up meanwhile, so the last measured requests do not see an
    emptying replica, and whatever is still running then is dropped.
    """
    svc = service or PredictionService(output_quantile=config.output_quantile, config=config.prediction)
    replay = _Replay(config, svc)
    replay.finish_count = len(requests) if finish is None else min(finish, len(requests))
    return replay.run(requests, replay.finish_count)


def measure_capacity(
    profile: Profile,
    requests: Sequence[TraceRequest],
    *,
    max_tokens: int = 1000,
    seed: int = 0,
    min_requests: int = 3000,
) -> float:
    """Requests per second one replica sustains for this length mix, at saturation (virtual time).

    The requests' lengths (cycled up to ``min_requests``) all arrive at time 0, so the waiting
    queue never empties and the engine runs as full as its ``max_num_seqs`` and KV cache let it.
    The rate is measured between the 30th and the 90th percentile completion: the first ones are
    the short requests of the first batch (too fast), the last ones an emptying batch.
    """
    if not requests:
        raise ValueError("no requests to measure capacity with")
    engine = Engine(profile, seed=seed, jitter=0.0)
    limit = profile.engine.max_model_len
    total = max(min_requests, len(requests))
    for i in range(total):
        r = requests[i % len(requests)]
        cap = max(r.output_tokens, min(max_tokens, limit - r.prompt_tokens))
        engine.add_request(str(i), r.prompt_tokens, cap, r.output_tokens, 0.0)
    now, done = 0.0, list[float]()
    while engine.has_unfinished_requests:
        plan = engine.schedule(now)
        if plan is None:
            break
        now += plan.duration_s
        result = engine.complete(plan, now)
        done.extend(now for _ in result.finished)
    lo, hi = math.floor(0.3 * len(done)), math.floor(0.9 * len(done))
    return float(hi - lo) / (done[hi] - done[lo])
