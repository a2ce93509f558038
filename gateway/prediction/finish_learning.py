"""A replica's learning from the caller's finished requests: what ``on_finished`` teaches it.

``observe_finish`` takes one finished request on a known replica (``PredictionService.on_finished``
finds the record; the output-length and prompt-token lessons, which are not per replica, stay
there): a sample of the replica's measured correction, a step boundary, its usage for the steady
state, its TTFT for the dispatch overhead and its API's residual, and its prefill as a step-time
observation. Times are the caller's monotonic seconds; ``None`` means not measured (nothing of
that is learned). ``api_residual_s`` reads the per-API residual back. Pure, synchronous.
"""

from __future__ import annotations

import math

from gateway.prediction.record import ReplicaRecord
from gateway.prediction.service_config import PredictionConfig
from predictor import Forecast
from predictor.correction import CorrectionLearner

__all__ = ["api_residual_s", "observe_finish"]


def observe_finish(
    r: ReplicaRecord,
    corrections: CorrectionLearner,
    config: PredictionConfig,
    *,
    replica: str,
    prompt_tokens: int | None,
    completion_tokens: int | None,
    finished_at: float | None,
    forecast: Forecast | None,
    ttft_s: float | None,
    api: str | None,
    relayed_ttft_s: float | None,
    relayed_tpot_s: float | None,
) -> None:
    """``r``'s (the record of ``replica``) lessons from one finished request; the arguments are
    ``PredictionService.on_finished``'s, which says what each means."""
    if forecast is not None and finished_at is not None:
        _observe_correction(
            corrections,
            replica,
            forecast,
            prompt_tokens,
            ttft_s if relayed_ttft_s is None else relayed_ttft_s,
            relayed_tpot_s,
            finished_at,
        )
    if finished_at is not None:
        r.last_token_at = finished_at if r.last_token_at is None else max(r.last_token_at, finished_at)
        if (
            config.steady_state
            and prompt_tokens is not None
            and completion_tokens is not None
            and prompt_tokens > 0
        ):
            r.finishes.append((finished_at, prompt_tokens, max(0, completion_tokens)))
    learn = config.learn_dispatch_overhead
    if learn and ttft_s is not None and math.isfinite(ttft_s) and ttft_s > 0.0:
        # Keyed by when its first token came, as the replica's TTFT histogram counts it.
        at = finished_at if finished_at is not None else (r.snapshot.taken_at if r.snapshot else None)
        if forecast is not None and forecast.made_at is not None:
            at = forecast.made_at + ttft_s
        if at is not None:
            r.ttfts.append((at, ttft_s))
            while len(r.ttfts) > config.overhead_samples:
                r.ttfts.popleft()
        if api is not None and forecast is not None and math.isfinite(forecast.ttft_s):
            _observe_api(r, api, ttft_s - forecast.ttft_s, config)
    if forecast is not None and ttft_s is not None:
        # The step fit learns engine steps: what ``with_overhead`` added for this request (the
        # way to and from an idle engine; the steps a busy one ran before it got there) is not
        # theirs to absorb. The mean overhead instead averages out over the step phases at
        # dispatch, but the fit is robust: it follows the majority, the requests that caught
        # their step, whose prefill would then look shorter by the whole overhead.
        _observe_prefill(r, forecast, max(ttft_s - forecast.overhead_s, 1e-6), finished_at)


def _observe_correction(
    corrections: CorrectionLearner,
    replica: str,
    forecast: Forecast,
    prompt_tokens: int | None,
    ttft_s: float | None,
    tpot_s: float | None,
    at: float,
) -> None:
    """One sample of ``replica``'s correction: the measured TTFT and TPOT over the forecast's
    uncorrected ones (the TTFT's with the dispatch overhead it added: the overhead, learned as a
    mean over scrape windows, grows with the load like the engine's share), in the regime the
    forecast was made in (its prompt, the batch its prefill joined, the engine-fulls ahead of its
    slot)."""
    if not forecast.valid:
        return
    batch = forecast.prefill_batch
    decodes = batch.decode_seqs if batch is not None else 0.0
    prompt = prompt_tokens if prompt_tokens is not None else 0
    ttft = None
    if ttft_s is not None and math.isfinite(forecast.base_ttft_s):
        ttft = (ttft_s, forecast.base_ttft_s + forecast.overhead_s, forecast.ttft_factor)
    tpot = None
    if tpot_s is not None and math.isfinite(forecast.base_tpot_s):
        tpot = (tpot_s, forecast.base_tpot_s, forecast.tpot_factor)
    corrections.observe(
        replica,
        at=at,
        prompt_tokens=prompt,
        decode_seqs=decodes,
        slot_waves=forecast.slot_waves,
        ttft=ttft,
        tpot=tpot,
    )


def _observe_api(r: ReplicaRecord, api: str, residual_s: float, config: PredictionConfig) -> None:
    """One finished request's TTFT residual (measured - forecast, seconds) into its replica's
    and its API's EWMAs (both from 0, so that a replica served through one API keeps them
    equal: residual 0)."""
    w = config.api_residual_weight
    r.residual_s += w * (residual_s - r.residual_s)
    mean = r.api_residuals.get(api, 0.0)
    r.api_residuals[api] = mean + w * (residual_s - mean)
    r.api_requests[api] = r.api_requests.get(api, 0) + 1


def api_residual_s(r: ReplicaRecord | None, api: str | None, config: PredictionConfig) -> float:
    """Seconds by which the TTFTs of ``api``'s requests on ``r``'s replica came later than forecast,
    beyond the replica's requests of every API (negative: earlier); 0 until
    ``api_residual_min_requests`` of its requests finished. A diagnostic (``describe``):
    forecasts do not add it: the difference between APIs is engine-side, not in the hop, and
    adding it made TGI's forecasts noisier (docs/engines.md, "Why TGI's TTFT forecasts were
    the noisiest").
    """
    if r is None or api is None or r.api_requests.get(api, 0) < config.api_residual_min_requests:
        return 0.0
    return r.api_residuals.get(api, 0.0) - r.residual_s


def _observe_prefill(r: ReplicaRecord, forecast: Forecast, ttft_s: float, at: float | None) -> None:
    """One step observation from a measured TTFT: the time left after the step it waited for.

    Only forecasts without an admission wait are used: that wait is a guess about other
    requests' output lengths, not step time.
    """
    batch = forecast.prefill_batch
    if batch is None or forecast.prefill_steps < 1 or forecast.admission_wait_s > 0.0:
        return
    if r.times_prefills:
        # The engine times its prefill steps itself (TGI: ``measured_steps`` has them). A TTFT
        # is a blurrier view of them, priced as a step that carries the running decodes as
        # vLLM's does; TGI prefills apart from them, so those decodes would take the blame
        # for the TTFT's queueing and skew the fit (docs/engines.md, "On a busy host").
        return
    if forecast.step_wait_s > 0.5 * ttft_s:
        return  # mostly a guess about the step it waited for, hardly a measurement
    prefill_s = (ttft_s - forecast.step_wait_s) / forecast.prefill_steps
    expected = r.model.step_time(batch) if r.model.valid else math.nan
    if math.isfinite(expected) and not 0.25 * expected <= prefill_s <= 4.0 * expected:
        # Not the steps the forecast priced (a long prompt joined them, a preemption): a
        # relative-error fit must not see a step "measured" at a fraction of its cost.
        return
    when = at if at is not None else (r.last_fit_at or 0.0)
    r.calibrator.observe_step(when, batch, prefill_s)
