"""A replica's forecast inputs, and the dispatch overhead on top of an engine forecast.

``replica_inputs`` builds the ``StepModel`` and ``ReplicaState`` a forecast of a request on one
replica uses (from its ``ReplicaRecord``; ``None``: a replica the service does not know, whose
state never binds); ``with_overhead`` turns an engine forecast into the TTFT the caller will
measure, adding the replica's learned dispatch overhead; ``no_model`` is the forecast where there
is no step model. Times are the caller's monotonic seconds, sizes tokens. Pure, synchronous.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final, TypeAlias, cast

from gateway.prediction.record import UNKNOWN_LIMITS, ReplicaRecord, limits_of
from gateway.prediction.service_config import PredictionConfig
from gateway.prediction.state import Load, replica_state
from gateway.replicas.snapshot import InFlight
from predictor import (
    CandidateRequest,
    Forecast,
    ForecastReason,
    OutputLengthPredictor,
    ReplicaState,
    StepModel,
    unknown_step_model,
)
from predictor.overhead import added_overhead_s

__all__ = ["MEMO_SIZE", "RemainingMemos", "no_model", "replica_inputs", "with_overhead"]

#: Most entries each per-request estimate memo keeps (cleared when full).
MEMO_SIZE: Final = 4096
#: Up to this many requests, ``replica_inputs`` asks for their remaining output one by one.
_SCALAR_REMAINING_MAX: Final = 4
_NO_MODEL: Final = unknown_step_model("replica unknown to the prediction service")

#: Expected remaining output tokens per (model, tenant), by (tokens generated, output cap).
RemainingMemos: TypeAlias = dict[tuple[str, str | None], dict[tuple[int, int | None], float]]


def replica_inputs(
    r: ReplicaRecord | None,
    outputs: OutputLengthPredictor,
    memos: RemainingMemos,
    config: PredictionConfig,
    *,
    model: str,
    tenant: str | None,
    in_flight: Sequence[InFlight],
    now: float,
) -> tuple[StepModel, ReplicaState]:
    """The step model and ``ReplicaState`` that ``PredictionService.forecast`` uses for ``r`` at ``now``.

    Built from the gateway's in-flight requests there (``in_flight``, fresh), the last
    snapshot's other clients and background prefill, and the engine step in progress; the
    state is flagged ``stale`` when the metrics are older than ``stale_after_s``. A replica
    the service does not know (``r`` ``None``) gets an invalid model (``no_step_model``) and a state with
    never-binding limits. O(len(in_flight)): build once, forecast many requests against it
    with ``predictor.forecast_request`` (``PredictionService.forecast`` does both per call).
    ``outputs`` gives the expected remaining output of each request in flight, cached in ``memos``
    (the caller clears it when ``outputs`` learns something that changes an answer).
    """
    memo = memos.get((model, tenant))
    if memo is None:
        memo = memos[(model, tenant)] = {}
    elif len(memo) >= MEMO_SIZE:
        memo.clear()

    def remaining(generated: Sequence[int], max_out: Sequence[int | None]) -> list[float]:
        if len(generated) != len(max_out):
            return outputs.expected_remaining_many(model, tenant, generated, max_out)  # raises
        rests = [memo.get(key) for key in zip(generated, max_out, strict=True)]
        missing = [i for i, rest in enumerate(rests) if rest is None]
        if len(missing) <= _SCALAR_REMAINING_MAX:
            # A few requests: one lookup each costs less than building the arrays for one
            # vectorised lookup (same numbers: ``expected_remaining_many`` says so).
            for i in missing:
                rests[i] = memo[(generated[i], max_out[i])] = outputs.expected_remaining(
                    model, tenant, generated[i], max_out[i]
                )
        else:
            found = outputs.expected_remaining_many(
                model, tenant, [generated[i] for i in missing], [max_out[i] for i in missing]
            )
            for i, rest in zip(missing, found, strict=True):
                rests[i] = memo[(generated[i], max_out[i])] = rest
        return cast(list[float], rests)

    if r is None:
        state = replica_state(
            in_flight,
            None,
            limits=UNKNOWN_LIMITS,
            load=Load(),
            remaining=remaining,
            stale=False,
            model=_NO_MODEL,
            now=now,
            last_boundary=None,
        )
        return _NO_MODEL, state
    snapshot = r.snapshot
    stale = snapshot is not None and (
        snapshot.metrics_at is None or now - snapshot.metrics_at > config.stale_after_s
    )
    _note_boundaries(r, in_flight)
    state = replica_state(
        in_flight,
        snapshot,
        limits=limits_of(r),
        load=r.load,
        remaining=remaining,
        stale=stale,
        model=r.model,
        now=now,
        last_boundary=r.last_token_at,
    )
    return r.model, state


def _note_boundaries(r: ReplicaRecord, in_flight: Sequence[InFlight]) -> None:
    """The newest token any of ``in_flight`` saw land is a step boundary of the replica."""
    newest = r.last_token_at
    for f in in_flight:
        at = f.last_token_at
        if at is not None and (newest is None or at > newest):
            newest = at
    r.last_token_at = newest


def with_overhead(r: ReplicaRecord | None, engine: Forecast, now: float) -> Forecast:
    """``engine`` (a forecast of the engine alone, as ``predictor.forecast_request`` makes them),
    made at ``now`` (the caller's clock, seconds), as the caller will measure its TTFT (dispatch
    to first token back) given ``r``'s learned dispatch overhead ``d`` (the way in, the
    replica server's own work and the way back, the same for every API it serves: see
    ``finish_learning.api_residual_s``); ``Forecast.overhead_s`` says what was added, and the
    TTFT holds it times the forecast's ``ttft_factor`` (the measured correction covers the
    overhead with the engine's TTFT).
    What ``PredictionService.forecast`` returns; a caller that forecasts with ``replica_inputs``
    itself (admission) passes its forecast to ``PredictionService.with_overhead``. Unchanged
    (``overhead_s`` 0) when no overhead is learned, ``r`` is ``None`` (a replica the service does
    not know) or the TTFT is not a number.

    * **Idle engine** (no step in progress, nothing decoding): the request's prefill starts
      when it gets there, so all of ``d`` comes on top: ``ttft_s + d``.
    * **Busy engine**: the forecast's step wait runs to the end of the step in progress as the
      caller sees it, from the tokens that last landed, which took the way back too: counted
      from them, the way back is already in it, and the request's prefill starts at that
      step's end if it gets there in time. It does when the wait is at least ``d`` (the way in
      plus the lag of the boundaries it was counted from): nothing is added. Otherwise it is
      ``d - wait`` late: the engine has started the next steps without it, and it waits for
      the end of the one in progress when it gets there: ``ceil((d - wait) / step)`` decode
      steps of the batch it joins are added (one where ``d`` is shorter than a step, as on a
      GPU; about ``d`` plus half a step where it is several, as in front of a slow API
      server). How late it is varies from request to request by about the hop itself (the
      way in and the boundaries' lag on a busy host): it is taken as uniform over
      ``(d - wait) +- d / 2`` and the steps averaged over that (``predictor.overhead``), so a
      request near the edge is forecast half a step late rather than a whole step wrong
      half the time. Adding ``d`` on a busy engine instead would over-predict the requests
      that catch the step by ``d`` and under-predict the ones that miss it by a decode step
      less ``d`` (measured in docs/engines.md).
    """
    overhead = 0.0 if r is None else r.overhead_s
    if r is None or overhead <= 0.0 or not math.isfinite(engine.ttft_s):
        return engine.with_overhead(engine.ttft_s, engine.overhead_s, now)
    batch = engine.prefill_batch
    decodes = batch.decode_seqs if batch is not None else 0.0
    kv = batch.kv_tokens_read if batch is not None else 0.0
    added = added_overhead_s(overhead, engine.step_wait_s, decodes, kv, r.model)
    return engine.with_overhead(engine.ttft_s + added * engine.ttft_factor, added, now)


def no_model(request: CandidateRequest) -> Forecast:
    """The invalid forecast (``no_step_model``) of ``request`` on a replica with no step model."""
    nan = math.nan
    return Forecast(
        nan,
        nan,
        nan,
        False,
        ForecastReason.NO_STEP_MODEL,
        min(max(request.expected_output_tokens, 1.0), float(request.max_tokens)),
        request.output_quantile,
        nan,
        nan,
        0,
    )
