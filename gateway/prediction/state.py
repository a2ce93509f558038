"""From a replica's snapshots and the gateway's in-flight list to the predictor's inputs.

Pure mappings: ``window_stats`` (a snapshot plus the kept gauge history -> ``WindowStats``, the
calibrator's input), ``measured_steps`` (an engine that times its steps by kind, as TGI does ->
direct batch/step-time observations) and ``replica_state`` (the gateway's unfinished requests on
the replica plus what the last scrape adds -> ``ReplicaState``, the forecast's input).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.replicas.snapshot import InFlight, ReplicaSnapshot
from predictor import ReplicaState, StepBatch, StepModel, WindowStats

__all__ = [
    "GaugeMeans",
    "Limits",
    "Load",
    "MeasuredStep",
    "StepInProgress",
    "engine_kv_tokens",
    "measured_steps",
    "replica_state",
    "step_in_progress",
    "window_stats",
]


#: Expected further output tokens of requests that generated ``[0]`` of at most ``[1]`` tokens.
Remaining = Callable[[Sequence[int], Sequence[int | None]], list[float]]


@dataclass(frozen=True, slots=True)
class GaugeMeans:
    """Means of the gauges over the scrapes of one window (the snapshot has only the newest).

    ``busy``: every scrape in the window saw a request running or waiting.
    """

    running: float
    waiting: float
    kv_tokens: float
    busy: bool


def window_stats(snapshot: ReplicaSnapshot, gauges: GaugeMeans) -> WindowStats | None:
    """The calibrator's view of ``snapshot``'s window; ``None`` when it has no window or no steps.

    Prompt tokens are the computed ones (prefix-cache hits cost no step time) when the replica
    says, else all prompt tokens. Missing token rates are measured zeros only when the engine
    stepped at all, which ``steps_per_s`` tells.
    """
    s = snapshot
    if s.stale or s.window_s <= 0.0 or s.steps_per_s is None:
        return None
    prompt_rate = s.computed_prompt_tokens_per_s
    if prompt_rate is None:
        prompt_rate = s.prompt_tokens_per_s
    return WindowStats(
        at_s=s.metrics_at if s.metrics_at is not None else s.taken_at,
        window_s=s.window_s,
        steps_per_s=s.steps_per_s,
        mean_tokens_per_step=s.mean_tokens_per_step,
        mean_itl_s=s.itl_mean_s,
        running=gauges.running,
        waiting=gauges.waiting,
        kv_tokens_in_use=gauges.kv_tokens,
        prompt_tokens_per_s=prompt_rate or 0.0,
        generation_tokens_per_s=s.generation_tokens_per_s or 0.0,
        mean_ttft_s=s.ttft_mean_s,
        mean_prompt_tokens=s.mean_prompt_tokens_per_request,
        busy=gauges.busy,
        tokens_per_step_buckets=s.tokens_per_step_buckets,
        steps_counted=not s.steps_estimated,
    )


def engine_kv_tokens(snapshot: ReplicaSnapshot) -> float:
    """KV tokens the replica's running requests hold at ``snapshot.taken_at`` (tokens).

    The replica's KV usage x its capacity, except for TGI: its usage gauge is the batch's
    *reservation* (input + ``max_new_tokens`` of every request), up to twice what attention reads.
    There the gateway's own decoding requests (prompt + tokens streamed, known a moment ago) give
    the mean context, times the batch size TGI reports. Without either, 0.
    """
    s = snapshot
    if s.dialect == "tgi" and s.num_running:
        decoding = [r for r in s.in_flight if r.tokens_streamed > 0]
        if decoding:
            context = sum(r.prompt_tokens + r.tokens_streamed for r in decoding) / len(decoding)
            return context * s.num_running
    return (s.kv_cache_usage or 0.0) * (s.kv_capacity_tokens or 0)


@dataclass(frozen=True, slots=True)
class MeasuredStep:
    """A mean step time the engine measured, and the mean batch those steps carried.

    ``kind``: ``"decode"`` or ``"prefill"``. ``step_s``: mean seconds of the window's steps of that
    kind. ``steps``: how many there were (weight of the mean). ``at_s``: window end (monotonic s).
    """

    kind: str
    at_s: float
    batch: StepBatch
    step_s: float
    steps: float


def measured_steps(snapshot: ReplicaSnapshot, gauges: GaugeMeans) -> list[MeasuredStep]:
    """The window's measured decode and prefill steps, for engines that time steps by kind (TGI).

    Decode steps: mean ``decode_step_time_mean_s`` at the mean running batch B (the
    ``tgi_batch_current_size`` gauge over the window's scrapes), one token per sequence, reading
    ``gauges.kv_tokens``. Prefill steps: mean ``prefill_step_time_mean_s``; they compute the window's
    prompt tokens (``tgi_request_input_length`` sum, counted as requests arrive) spread over the
    window's prefill steps (all steps minus the decode ones), with the running batch decoding
    alongside (TGI v3 and the emulator batch them together) and attention over half of the mean
    prompt. Empty for a stale or window-less snapshot, an engine without per-kind step times, or
    a window with no step of a kind; a prefill step with no prompt tokens counted is skipped (its
    requests arrived in another window, so its batch is unknown). A decode window whose batch
    gauge read 0 at every scrape (it started and finished between scrapes) is skipped too.
    """
    s = snapshot
    if s.stale or s.window_s <= 0.0:
        return []
    at = s.metrics_at if s.metrics_at is not None else s.taken_at
    seqs = gauges.running
    found: list[MeasuredStep] = []
    decode_rate = s.decode_steps_per_s
    decode_s = s.decode_step_time_mean_s
    if decode_rate and decode_s is not None and decode_s > 0.0 and seqs >= 1.0:
        batch = StepBatch(0.0, seqs, gauges.kv_tokens, 0.0)
        found.append(MeasuredStep("decode", at, batch, decode_s, decode_rate * s.window_s))
    prefill_s = s.prefill_step_time_mean_s
    prefill_rate = (s.steps_per_s or 0.0) - (decode_rate or 0.0)
    prompt_rate = s.prompt_tokens_per_s
    if prefill_s is not None and prefill_s > 0.0 and prefill_rate > 1e-9 and prompt_rate:
        tokens = prompt_rate / prefill_rate
        mean_prompt = s.mean_prompt_tokens_per_request or tokens
        batch = StepBatch(tokens, seqs, gauges.kv_tokens, tokens * mean_prompt / 2.0)
        found.append(MeasuredStep("prefill", at, batch, prefill_s, prefill_rate * s.window_s))
    return found


@dataclass(frozen=True, slots=True)
class Load:
    """What recent windows say about the traffic a new request will share steps with.

    ``prefill_tokens_per_step``: prompt tokens computed per engine step (arrivals' prefills).
    ``prefill_share``: expected share of step time spent on others' prefill chunks (0-1);
    ``None`` until a window with inter-token latencies and a valid step model.
    ``finish_rate_per_s``: requests finished per second over the window (``None``: unknown).
    ``full_finish_rate_per_s``: requests it finished per second while full, recently (its
    capacity under the recent mix; ``None``: not full long enough lately).
    ``steady_step_s``: mean step time at the steady state of the recent traffic
    (``predictor.steady.steady_state``; ``None``: unknown or overloaded).
    ``arriving_prompt_tokens_per_s``: prompt tokens the replica took per second over the window
    (computed ones when it says: prefix-cache hits cost no step time), all clients' (0: unknown).
    """

    prefill_tokens_per_step: float = 0.0
    prefill_share: float | None = None
    finish_rate_per_s: float | None = None
    steady_step_s: float | None = None
    arriving_prompt_tokens_per_s: float = 0.0
    full_finish_rate_per_s: float | None = None


@dataclass(frozen=True, slots=True)
class Limits:
    """The engine limits the forecast needs (tokens and sequences, all >= 1)."""

    kv_capacity_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


@dataclass(slots=True)
class _Prefill:
    """A request the gateway has seen no token of yet: prompt tokens done and to do. ``start``:
    the tokens its prefix-cache hit spares it (done before its first chunk)."""

    request: InFlight
    done: int = 0
    start: int = 0

    @classmethod
    def of(cls, request: InFlight) -> _Prefill:
        hit = min(request.cached_tokens, request.prompt_tokens - 1) if request.cached_tokens > 0 else 0
        return cls(request, hit, hit)

    @property
    def rest(self) -> int:
        return self.request.prompt_tokens - self.done


@dataclass(frozen=True, slots=True)
class StepInProgress:
    """Where the engine's step cycle is at ``now``.

    ``remaining_s``: until the step in progress ends (0 when idle). ``completed``: requests whose
    prefill that step completes (they decode from the next one); ``partial``: prefills it leaves
    unfinished, with the tokens done; ``later``: requests it does not touch, FCFS.
    """

    remaining_s: float
    completed: tuple[InFlight, ...]
    partial: tuple[tuple[InFlight, int], ...]
    later: tuple[InFlight, ...]


# Steps followed forward from the last boundary at most (long prompts chunked over many steps).
_MAX_STEPS_FOLLOWED = 64


def step_in_progress(
    decoding: Sequence[InFlight],
    pending: Sequence[InFlight],
    *,
    last_boundary: float | None,
    now: float,
    model: StepModel,
    budget: int,
    max_num_seqs: int,
) -> StepInProgress:
    """Follow the engine's steps from the last step boundary the gateway saw to ``now``.

    A step boundary is when tokens land (``last_boundary``: the newest token of any request). At a
    boundary the engine schedules the next step at once if it has work: every decoding request,
    then prefill chunks of the requests that had arrived by then, FCFS, within ``budget`` tokens
    and ``max_num_seqs`` sequences; an idle engine starts when the first request arrives. Each
    step's duration comes from the step model. ``pending`` must be in dispatch order.

    At the boundary itself (``now`` no later than ``last_boundary``, as when a finished request's
    slot is refilled on its last token) the step starting then is not under way yet for a request
    arriving now: it joins it, after the decodes and the prompts before it, and nothing is left
    to wait for (``remaining_s`` 0).

    Without a known boundary the phase is unknown: half a decode step is assumed left (the mean
    residual of a uniformly random arrival) and no prefill is assumed under way.
    """
    if not decoding and not pending:
        return StepInProgress(0.0, (), (), ())
    kv = float(sum(r.prompt_tokens + r.tokens_streamed for r in decoding))
    n = len(decoding)
    if last_boundary is None or not model.valid:
        decode_step = model.step_time(StepBatch(0.0, n, kv, 0.0)) if n and model.valid else 0.0
        return StepInProgress(0.5 * decode_step, (), (), tuple(pending))
    queue = [_Prefill.of(r) for r in pending]
    if queue and queue[0].request.started_at < last_boundary and queue[0].rest > budget - n:
        # A prompt that needs several steps may be part-way through them. (One that fits a
        # step and is still without a token was blocked, by a full engine: no progress.) It
        # started no earlier than the step that finished the prefill of the last request
        # dispatched before it (FCFS): only that step's leftover, not counted, was its before.
        head = queue[0].request
        since = head.started_at
        for r in decoding:
            first = r.first_token_at
            if first is not None and first > since and r.started_at <= head.started_at:
                since = first
        _catch_up(queue[:1], n, kv, since, last_boundary, model, budget, max_num_seqs)
    if n or (queue and queue[0].request.started_at <= last_boundary):
        start = last_boundary
    else:
        start = queue[0].request.started_at  # idle until the first of them arrived
    if start == last_boundary and now <= start:
        # The step starting at the boundary is being scheduled at this instant: a request
        # arriving now is one of those "arrived by then" and joins it, so none is under way yet
        # to wait for. (An idle engine woken now started its step on the arrival that woke it.)
        return _progress(0.0, [], queue)
    completed: list[InFlight] = []
    for _ in range(_MAX_STEPS_FOLLOWED):
        decodes = n + len(completed)
        batch, chunks = _plan(queue, start, decodes, kv, budget, max_num_seqs)
        end = start + model.step_time(batch)
        finished_here = [e for e, chunk in chunks if e.done + chunk == e.request.prompt_tokens]
        for entry, chunk in chunks:
            entry.done += chunk
        completed.extend(e.request for e in finished_here)
        queue = [e for e in queue if e.rest > 0]
        if end >= now or decodes or finished_here:
            # A step that emitted tokens but should be over already: the model was slow to
            # predict it; its tokens are about to land.
            return _progress(max(0.0, end - now), completed, queue)
        start = end  # a step of unfinished chunks only: no token marked its end
    return _progress(0.0, completed, queue)


def _plan(
    queue: list[_Prefill], start: float, decodes: int, kv: float, budget: int, max_num_seqs: int
) -> tuple[StepBatch, list[tuple[_Prefill, int]]]:
    """The step scheduled at ``start``: the decodes, then chunks of the prompts arrived by then."""
    room, seqs = budget - decodes, max_num_seqs - decodes
    chunks: list[tuple[_Prefill, int]] = []
    prefill, pairs = 0, 0.0
    for entry in queue:
        if room <= 0 or seqs <= 0 or entry.request.started_at > start:
            break
        chunk = min(room, entry.rest)
        chunks.append((entry, chunk))
        pairs += chunk * (chunk / 2.0 + entry.done)
        prefill += chunk
        room -= chunk
        seqs -= 1
    return StepBatch(float(prefill), float(decodes), kv, pairs), chunks


def _catch_up(
    queue: list[_Prefill],
    n: int,
    kv: float,
    since: float,
    boundary: float,
    model: StepModel,
    budget: int,
    max_num_seqs: int,
) -> None:
    """Prefill done before ``boundary`` on prompts that arrived before it (steps the gateway saw no
    token of), replayed with the step model from ``since`` (the first arrival, or later when the
    engine was busy with earlier prompts until then); only steps that end before the boundary
    count, and no prompt is taken as finished (its token would have been seen)."""
    t = since
    for _ in range(_MAX_STEPS_FOLLOWED):
        batch, chunks = _plan(queue, t, n, kv, budget, max_num_seqs)
        if not chunks:
            return
        t += model.step_time(batch)
        if t > boundary:
            return
        for entry, chunk in chunks:
            entry.done = min(entry.done + chunk, entry.request.prompt_tokens - 1)


def _progress(remaining_s: float, completed: list[InFlight], queue: list[_Prefill]) -> StepInProgress:
    return StepInProgress(
        remaining_s,
        tuple(completed),
        tuple((e.request, e.done) for e in queue if e.done > e.start),
        tuple(e.request for e in queue if e.done == e.start),
    )


def replica_state(
    in_flight: Sequence[InFlight],
    snapshot: ReplicaSnapshot | None,
    *,
    limits: Limits,
    load: Load,
    remaining: Remaining,
    stale: bool,
    model: StepModel,
    now: float,
    last_boundary: float | None,
) -> ReplicaState:
    """The forecast's view of one replica: the gateway's requests, plus other clients' from the scrape.

    A request that has streamed tokens is decoding (its KV holds prompt + output so far); one that
    has not is still queued for prefill, FCFS by dispatch time. The step in progress is followed
    (``step_in_progress``): the state describes the engine after it, and its remaining time is
    ``step_remaining_s``. ``remaining(generated, max_tokens)`` gives decoding requests' expected
    further output (all of them in one call). Requests the replica reports beyond the gateway's
    own (other clients; the gateway's count at the scrape is in ``snapshot.in_flight``) are added
    as decodes with the replica's mean context.
    """
    decoding: list[InFlight] = []
    pending: list[InFlight] = []
    for r in in_flight:
        (decoding if r.tokens_streamed > 0 else pending).append(r)
    pending.sort(key=lambda r: r.started_at)
    cycle = step_in_progress(
        decoding,
        pending,
        last_boundary=last_boundary,
        now=now,
        model=model,
        budget=limits.max_num_batched_tokens,
        max_num_seqs=limits.max_num_seqs,
    )
    # (prompt, computed, generated, max_tokens) of every request the engine runs after the step.
    bump = 1 if cycle.remaining_s > 0.0 else 0
    rows = [(r.prompt_tokens, r.prompt_tokens, r.tokens_streamed + bump, r.max_tokens) for r in decoding]
    rows += [(r.prompt_tokens, r.prompt_tokens, 1, r.max_tokens) for r in cycle.completed]
    rows += [(r.prompt_tokens, done, 0, r.max_tokens) for r, done in cycle.partial]
    exact = [r.exact_output_tokens for r in decoding]
    exact += [r.exact_output_tokens for r in cycle.completed]
    exact += [r.exact_output_tokens for r, _ in cycle.partial]
    rests = remaining([g for _, _, g, _ in rows], [m for _, _, _, m in rows]) if rows else []
    # RunningSeq's fields as plain tuples (``ReplicaState.from_rows``): no object per request.
    # A pinned output is known: it runs to it (at least one more token while it runs).
    running = [
        (p, c, g, g + rest if e is None else max(float(e), g + 1.0))
        for (p, c, g, _), rest, e in zip(rows, rests, exact, strict=True)
    ]
    foreign = _foreign(snapshot, remaining)
    running.extend(foreign)
    # Every output ahead known (no other client's, every one pinned): the slots' exact schedule.
    waiting_outputs = None
    if not foreign and None not in exact:
        later = [r.exact_output_tokens for r in cycle.later]
        if None not in later:
            waiting_outputs = [float(e) for e in later if e is not None]
    return ReplicaState.from_rows(
        running,
        [r.prompt_tokens - min(r.cached_tokens, r.prompt_tokens - 1) for r in cycle.later],
        kv_capacity_tokens=limits.kv_capacity_tokens,
        max_num_seqs=limits.max_num_seqs,
        max_num_batched_tokens=limits.max_num_batched_tokens,
        max_model_len=limits.max_model_len,
        background_prefill_tokens_per_step=load.prefill_tokens_per_step,
        stale=stale,
        step_remaining_s=cycle.remaining_s,
        prefill_share=load.prefill_share,
        finish_rate_per_s=load.finish_rate_per_s,
        full_finish_rate_per_s=load.full_finish_rate_per_s,
        steady_step_s=load.steady_step_s,
        arriving_prompt_tokens_per_s=load.arriving_prompt_tokens_per_s,
        waiting_outputs=waiting_outputs,
    )


def _foreign(snapshot: ReplicaSnapshot | None, remaining: Remaining) -> list[tuple[int, int, int, float]]:
    """Decodes of other clients: what the replica held at the scrape beyond the gateway's own, as
    ``RunningSeq`` field tuples (prompt, computed, generated, expected output)."""
    if snapshot is None or snapshot.num_running is None:
        return []
    engine_total = snapshot.num_running + (snapshot.num_waiting or 0)
    extra = engine_total - len(snapshot.in_flight)
    if extra <= 0:
        return []
    kv = (snapshot.kv_cache_usage or 0.0) * (snapshot.kv_capacity_tokens or 0)
    context = max(1, math.ceil(kv / max(1, snapshot.num_running)))
    rest = remaining([0], [None])[0]
    return [(context, context, 0, rest)] * extra
