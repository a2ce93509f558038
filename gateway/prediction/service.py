"""``PredictionService``: one step model per replica, fitted from its scrapes, and forecasts with it.

The live gateway and the virtual-time replay drive it alike: ``set_replica(name, facts)`` when a
replica is configured (unknown hardware or model: no prior), ``on_snapshot`` for every scrape
(refitting at most every ``PredictionConfig.refit_interval_s``), ``forecast`` per candidate
request and replica (or ``replica_inputs`` once and ``forecast_request`` per request, for a caller
that forecasts many requests on one replica's load), ``expected_output`` for the output length a
forecast assumes, and ``on_finished`` with each response's usage (output lengths, characters per
token, arrivals). Synchronous, no I/O, no clock reads: times are the caller's monotonic seconds.
Not thread-safe (the gateway calls it from its event loop only).

A facade: each replica's state is a ``record.ReplicaRecord``, learned from scrapes in
``scrape_learning`` and from finished requests in ``finish_learning``, turned into forecast inputs
in ``forecasting`` and rendered for the admin view in ``admin_view``; the knobs are
``service_config.PredictionConfig``. What is not per replica (output lengths, characters per
token, the corrections, the memos of per-request estimates) is kept here; output lengths and
characters per token are learned per (model, tenant), each with a fleet prior no one tenant
decides (``predictor.output_length``, ``predictor.prompt_tokens``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Final

from gateway.prediction.admin_view import describe
from gateway.prediction.facts import ReplicaFacts
from gateway.prediction.finish_learning import api_residual_s, observe_finish
from gateway.prediction.forecasting import MEMO_SIZE, RemainingMemos, no_model, replica_inputs, with_overhead
from gateway.prediction.record import ReplicaRecord, gauge_means, limits_of
from gateway.prediction.scrape_learning import observe_snapshot
from gateway.prediction.service_config import PredictionConfig
from gateway.prediction.state import GaugeMeans
from gateway.replicas.snapshot import InFlight, ReplicaSnapshot
from predictor import (
    CandidateRequest,
    FitReport,
    Forecast,
    OutputLengthPredictor,
    PromptTokenEstimate,
    PromptTokenEstimator,
    ReplicaState,
    StepCalibrator,
    StepModel,
    forecast_request,
)
from predictor.correction import Correction, CorrectionConfig, CorrectionLearner

__all__ = ["PredictionService"]

#: Output cap assumed by ``expected_output`` when the request sets none (tokens).
_NO_CAP: Final = 1 << 20


class PredictionService:
    """Per-replica step models, output-length and prompt-token learning, and forecasts."""

    def __init__(self, *, output_quantile: float = 0.5, config: PredictionConfig | None = None) -> None:
        if not 0.0 <= output_quantile <= 1.0:
            raise ValueError(f"output_quantile must be in [0, 1], got {output_quantile}")
        self._quantile = output_quantile
        self._config = config or PredictionConfig()
        self._replicas: dict[str, ReplicaRecord] = {}
        self._outputs = OutputLengthPredictor(self._config.output_length)
        self._prompts = PromptTokenEstimator(self._config.prompt_tokens)
        self._corrections = CorrectionLearner(self._config.correction)
        #: Per-request estimates (``expected_output``, ``estimate_prompt_tokens``) depend only on
        #: what ``on_finished`` taught: kept until it teaches something that changes an answer
        #: (``OutputLengthPredictor.observe`` says when: about one finish in ``resort_every``;
        #: every request asks, most ask alike; a lookup costs a tenth of the estimate).
        self._outputs_memo: dict[tuple[str, str | None, int], tuple[float, float]] = {}
        self._prompts_memo: dict[tuple[str, str | None, int], int] = {}
        #: ``replica_inputs``' expected remaining output per (model, tenant), by (tokens generated,
        #: output cap): the same numbers as ``expected_remaining`` until ``on_finished`` teaches
        #: something that changes them (a view rebuild asks for every stream in flight, most of
        #: which have not moved since the last rebuild; cleared on every finish, the memo would
        #: miss for all of them after each one).
        self._remaining_memo: RemainingMemos = {}

    # ------------------------------------------------------------------ replicas

    def set_replica(self, name: str, facts: ReplicaFacts) -> None:
        """Add ``name`` or update its facts. Unchanged facts keep the fit; changed facts restart it
        (a new prior, and observations of another configuration would mislead)."""
        current = self._replicas.get(name)
        if current is not None and current.facts == facts:
            return
        prior = facts.prior(self._config.efficiency)
        calibrator = StepCalibrator(prior, self._config.calibration)
        fitted = calibrator.fit(0.0)
        self._replicas[name] = ReplicaRecord(facts, calibrator, fitted.model, fitted.report)
        self._corrections.forget(name)

    def remove_replica(self, name: str) -> None:
        """Forget ``name`` and its fit; unknown names are ignored."""
        self._replicas.pop(name, None)
        self._corrections.forget(name)

    def replicas(self) -> tuple[str, ...]:
        """Names of the replicas the service knows, in insertion order."""
        return tuple(self._replicas)

    # ------------------------------------------------------------------ learning

    def on_snapshot(self, snapshot: ReplicaSnapshot) -> None:
        """Take one scrape's snapshot: keep it, feed its window to the fit, refit when due, and
        forget the recent traffic of a replica it shows idle (``scrape_learning.observe_snapshot``
        says how). Stale snapshots are kept but teach nothing; snapshots of unknown replicas are
        ignored."""
        r = self._replicas.get(snapshot.name)
        if r is None:
            return
        observe_snapshot(r, snapshot, self._config)

    def on_finished(
        self,
        *,
        replica: str,
        model: str,
        tenant: str | None,
        prompt_chars: int | None,
        prompt_tokens: int | None,
        completion_tokens: int | None,
        finished_at: float | None = None,
        forecast: Forecast | None = None,
        ttft_s: float | None = None,
        api: str | None = None,
        relayed_ttft_s: float | None = None,
        relayed_tpot_s: float | None = None,
    ) -> None:
        """Learn from a finished request: its output length, chars per prompt token, its prefill,
        and how far its measured latencies were from its forecast (the correction).

        ``None`` means the response carried no such number (no usage block, a non-text prompt).
        ``finished_at``: monotonic seconds its last token landed, when known (a step boundary of
        ``replica``, which tells the forecast where the engine's step cycle is).
        ``forecast`` (the one made for it on ``replica`` at dispatch) and ``ttft_s`` (its measured
        time to first token, seconds): the prefill steps the forecast priced become one step-time
        observation for ``replica``'s fit. Scrape windows are dominated by decode steps; these are
        the prefill-heavy steps the forecast needs most, measured where they happen. ``api``: the
        API it came through (the proxy's endpoint), for that API's residual (``api_residual_s``).
        ``relayed_ttft_s`` / ``relayed_tpot_s``: its TTFT (dispatch to first token relayed) and
        mean time per output token after the first as the caller relayed them, seconds (``None``:
        not measured; the TTFT then defaults to ``ttft_s``): with ``forecast`` (its uncorrected
        numbers, ``Forecast.base_ttft_s``), one sample of the replica's correction.
        """
        r = self._replicas.get(replica)
        if r is not None:
            observe_finish(
                r,
                self._corrections,
                self._config,
                replica=replica,
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                finished_at=finished_at,
                forecast=forecast,
                ttft_s=ttft_s,
                api=api,
                relayed_ttft_s=relayed_ttft_s,
                relayed_tpot_s=relayed_tpot_s,
            )
        if (
            completion_tokens is not None
            and completion_tokens >= 0
            and self._outputs.observe(model, tenant, completion_tokens)  # True: answers may change
        ):
            self._outputs_memo.clear()
            self._remaining_memo.clear()
        if prompt_chars is not None and prompt_tokens is not None:
            self._prompts.observe(model, prompt_chars, prompt_tokens, tenant)
            self._prompts_memo.clear()

    def correction(self, replica: str, now: float) -> Correction:
        """The factors admission multiplies ``replica``'s engine TTFT and TPOT forecasts by at
        ``now``, per load regime (``predictor.correction``; every factor 1 when nothing is learned
        or ``PredictionConfig.correction`` is off)."""
        return self._corrections.correction(replica, now)

    @property
    def corrections(self) -> CorrectionLearner:
        """The correction learner (its state, for reports and metrics)."""
        return self._corrections

    def configure_correction(self, config: CorrectionConfig) -> None:
        """Take new correction knobs (a reload); what was learned is kept."""
        self._config = dataclasses.replace(self._config, correction=config)
        self._corrections.configure(config)

    def api_residual_s(self, replica: str, api: str | None) -> float:
        """Seconds by which the TTFTs of ``api``'s requests on ``replica`` came later than forecast,
        beyond the replica's requests of every API (negative: earlier); 0 until
        ``api_residual_min_requests`` of its requests finished, or for an unknown replica. A
        diagnostic (``describe``): forecasts do not add it (``finish_learning.api_residual_s``)."""
        return api_residual_s(self._replicas.get(replica), api, self._config)

    def estimate_prompt_tokens(self, model: str, prompt_chars: int, tenant: str | None = None) -> int:
        """Prompt tokens for ``tenant``'s prompt of ``prompt_chars`` characters on ``model`` (>= 1):
        at the tenant's learned ratio, blended with the model's fleet prior until trusted
        (``predictor.prompt_tokens``; ``None``: requests of no tenant)."""
        key = (model, tenant, prompt_chars)
        tokens = self._prompts_memo.get(key)
        if tokens is None:
            tokens = self._prompts.estimate(model, max(0, prompt_chars), tenant).tokens
            if len(self._prompts_memo) >= MEMO_SIZE:
                self._prompts_memo.clear()
            self._prompts_memo[key] = tokens
        return tokens

    def prompt_estimate(
        self, model: str, prompt_chars: int, tenant: str | None = None
    ) -> PromptTokenEstimate:
        """What ``estimate_prompt_tokens`` rests on: the tokens, the ratio used, the tenant's own
        usage reports behind it and the fewest plausible tokens (for reports and tests)."""
        return self._prompts.estimate(model, max(0, prompt_chars), tenant)

    def fewest_prompt_tokens(self, prompt_chars: int) -> int:
        """The lowest plausible token count of a prompt of ``prompt_chars`` characters (>= 1): all
        that refusing it as too long may rest on without a tokenizer."""
        return self._prompts.fewest_tokens(prompt_chars)

    @property
    def output_quantile(self) -> float:
        """The quantile of the output-length distribution forecasts assume (0-1)."""
        return self._quantile

    def expected_output(self, model: str, tenant: str | None, max_tokens: int | None) -> tuple[float, float]:
        """(predicted output tokens, the quantile that is) of a request on ``model`` for ``tenant``,
        capped at ``max_tokens`` (``None``: uncapped), from the output lengths learned so far.

        The same prediction ``forecast`` makes for a request with that cap (``forecast`` caps a
        missing ``max_tokens`` at the replica's context left instead).
        """
        cap = max_tokens if max_tokens is not None and max_tokens >= 1 else _NO_CAP
        key = (model, tenant, cap)
        known = self._outputs_memo.get(key)
        if known is None:
            estimate = self._outputs.predict(model, tenant, cap, self._quantile)
            known = (float(estimate.tokens), self._quantile)
            if len(self._outputs_memo) >= MEMO_SIZE:
                self._outputs_memo.clear()
            self._outputs_memo[key] = known
        return known

    def replica_inputs(
        self,
        replica: str,
        *,
        model: str,
        tenant: str | None,
        in_flight: Sequence[InFlight],
        now: float,
    ) -> tuple[StepModel, ReplicaState]:
        """The step model and ``ReplicaState`` that ``forecast`` uses for ``replica`` at ``now``.

        Built from the gateway's in-flight requests there (``in_flight``, fresh), the last
        snapshot's other clients and background prefill, and the engine step in progress; the
        state is flagged ``stale`` when the metrics are older than ``stale_after_s``. A replica
        the service does not know gets an invalid model (``no_step_model``) and a state with
        never-binding limits. O(len(in_flight)): build once, forecast many requests against it
        with ``predictor.forecast_request`` (``forecast`` does both per call).
        """
        return replica_inputs(
            self._replicas.get(replica),
            self._outputs,
            self._remaining_memo,
            self._config,
            model=model,
            tenant=tenant,
            in_flight=in_flight,
            now=now,
        )

    # ------------------------------------------------------------------ forecasting

    def forecast(
        self,
        replica: str,
        *,
        model: str,
        tenant: str | None,
        prompt_tokens: int,
        max_tokens: int | None,
        in_flight: Sequence[InFlight],
        now: float,
    ) -> Forecast:
        """TTFT, TPOT and inflicted TPOT of a request of ``prompt_tokens`` on ``replica`` at ``now``.

        ``max_tokens`` ``None`` means the engine's default, ``max_model_len - prompt_tokens``.
        ``in_flight``: the gateway's unfinished requests on that replica now. Never raises for a
        bad request or an unknown replica: the forecast is ``valid=False`` with a reason.
        """
        r = self._replicas.get(replica)
        limits = limits_of(r)
        cap = max_tokens if max_tokens is not None else limits.max_model_len - prompt_tokens
        cap = max(1, cap)
        estimate = self._outputs.predict(model, tenant, cap, self._quantile)
        request = CandidateRequest(prompt_tokens, cap, float(estimate.tokens), self._quantile)
        if r is None or (r.snapshot is None and not r.model.valid):
            return no_model(request)
        step_model, state = self.replica_inputs(
            replica, model=model, tenant=tenant, in_flight=in_flight, now=now
        )
        engine = forecast_request(request, state, step_model, self._config.forecast)
        return self.with_overhead(replica, engine, now)

    def dispatch_overhead_s(self, replica: str) -> float:
        """``replica``'s learned dispatch overhead ``d``, seconds (the way in, the replica server's
        own work and the way back; 0 when unknown or not learned yet). Admission adds it to the
        TTFTs it holds against deadlines (``ReplicaView.dispatch_overhead_s``): the whole of it,
        as on an idle engine; ``with_overhead`` prices a busy engine's share more finely for the
        forecast the response carries, never above ``d`` plus a decode step."""
        r = self._replicas.get(replica)
        return 0.0 if r is None else r.overhead_s

    def with_overhead(self, replica: str, engine: Forecast, now: float) -> Forecast:
        """``engine`` (a forecast of the engine alone, as ``predictor.forecast_request`` makes them)
        made at ``now`` (the caller's seconds), with ``replica``'s learned dispatch overhead added
        as the caller will measure its TTFT (``forecasting.with_overhead`` says how: all of it on
        an idle engine, the decode steps it misses on a busy one). What ``forecast`` returns; a
        caller that forecasts with ``replica_inputs`` itself (admission) passes its forecast here.
        Unchanged (``overhead_s`` 0) for an unknown replica or none learned."""
        return with_overhead(self._replicas.get(replica), engine, now)

    def refit(self, replica: str, now: float) -> FitReport | None:
        """Fit ``replica``'s step model now (``on_snapshot`` does so by itself); its report."""
        r = self._replicas.get(replica)
        if r is None:
            return None
        fitted = r.calibrator.fit(now)
        r.model, r.report, r.last_fit_at = fitted.model, fitted.report, now
        return r.report

    # ------------------------------------------------------------------ reporting

    def step_model(self, replica: str) -> StepModel | None:
        """The step model in use for ``replica`` (``None`` if unknown)."""
        r = self._replicas.get(replica)
        return None if r is None else r.model

    def latest_window(self, replica: str) -> tuple[ReplicaSnapshot, GaugeMeans] | None:
        """``replica``'s latest fresh snapshot (its counter rates cover ``window_s`` seconds) and
        the means of its gauges over that window; ``None`` before one (or if unknown)."""
        r = self._replicas.get(replica)
        s = None if r is None else r.snapshot
        if r is None or s is None or s.stale or not r.gauges:
            return None
        return s, gauge_means(r, s.taken_at - s.window_s)

    def report(self, replica: str) -> FitReport | None:
        """The latest fit report of ``replica`` (``None`` if unknown)."""
        r = self._replicas.get(replica)
        return None if r is None else r.report

    def describe(self, now: float | None = None) -> dict[str, object]:
        """JSON-ready state for an admin endpoint: per replica its facts, fit, freshness and
        forecast correction as of ``now`` (the caller's seconds; ``None``: its latest snapshot);
        ``admin_view.describe`` lists the fields."""
        return describe(self._replicas, self._corrections, self._config, self._quantile, now)
