"""``PredictionService``: one step model per replica, fitted from its scrapes, and forecasts with it.

The live gateway and the virtual-time replay drive it alike: ``set_replica(name, facts)`` when a
replica is configured (unknown hardware or model: no prior), ``on_snapshot`` for every scrape
(refitting at most every ``PredictionConfig.refit_interval_s``), ``forecast`` per candidate
request and replica (or ``replica_inputs`` once and ``forecast_request`` per request, for a caller
that forecasts many requests on one replica's load), ``expected_output`` for the output length a
forecast assumes, and ``on_finished`` with each response's usage (output lengths, characters per
token, arrivals). Synchronous, no I/O, no clock reads: times are the caller's monotonic seconds.
Not thread-safe (the gateway calls it from its event loop only).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, cast

from gateway.prediction.facts import ReplicaFacts
from gateway.prediction.state import (
    GaugeMeans,
    Limits,
    Load,
    engine_kv_tokens,
    measured_steps,
    replica_state,
    window_stats,
)
from gateway.replicas.snapshot import InFlight, ReplicaSnapshot
from predictor import (
    FEATURE_NAMES,
    CalibrationConfig,
    CandidateRequest,
    Efficiency,
    FitReport,
    Forecast,
    ForecastConfig,
    ForecastReason,
    Observation,
    OutputLengthConfig,
    OutputLengthPredictor,
    PromptTokenConfig,
    PromptTokenEstimator,
    ReplicaState,
    StepCalibrator,
    StepModel,
    StepParams,
    WindowStats,
    forecast_request,
    observation_from_window,
    prefill_share,
    unknown_step_model,
)
from predictor.correction import Correction, CorrectionConfig, CorrectionLearner
from predictor.forecast import SteadyState, TrafficMix, steady_state
from predictor.overhead import added_overhead_s

__all__ = ["PredictionConfig", "PredictionService"]

# Stand-ins for limits nobody has told us yet: large enough never to bind.
_UNKNOWN_KV_CAPACITY: Final = 1 << 40
_UNKNOWN_MAX_MODEL_LEN: Final = 1 << 30
#: Most entries each per-request estimate memo keeps (cleared when full).
_MEMO_SIZE: Final = 4096
#: Up to this many requests, ``replica_inputs`` asks for their remaining output one by one.
_SCALAR_REMAINING_MAX: Final = 4
#: Output cap assumed by ``expected_output`` when the request sets none (tokens).
_NO_CAP: Final = 1 << 20
#: Limits of a replica the service does not know (never binding).
_UNKNOWN_LIMITS: Final = Limits(_UNKNOWN_KV_CAPACITY, 1, 1, _UNKNOWN_MAX_MODEL_LEN)
_NO_MODEL: Final = unknown_step_model("replica unknown to the prediction service")


@dataclass(frozen=True, slots=True)
class PredictionConfig:
    """Knobs of the service (the predictor's own configs are nested as they are).

    ``refit_interval_s``: least seconds between two fits of one replica (0 = on every snapshot).
    ``stale_after_s``: a forecast built on metrics older than this is flagged ``stale_state``.
    ``efficiency``: the roofline prior's efficiency guesses.
    ``prefill_share_memory_s``: seconds of windows the long-run prefill share is averaged over.
    ``prefill_share_weight``: weight (0-1) of the newest window's share against that mean.
    ``learn_dispatch_overhead``: learn each replica's dispatch overhead (the caller's TTFT minus
    the replica's own, see ``PredictionService._observe_overhead``) and add it to forecast TTFTs.
    Off by default: the virtual-time replay has no transport, and window-edge noise there would
    teach it a spurious overhead. The live gateway should turn it on.
    ``overhead_samples``: most caller-measured TTFTs kept per replica for the dispatch overhead.
    ``overhead_weight``: EWMA weight (0-1] of each scrape window's overhead measurement.
    ``overhead_min_window_s`` / ``overhead_min_requests``: a scrape window shorter than this
    (seconds), or holding fewer of the caller's finished requests, does not measure it (window
    edges count a request's decode time against it).
    ``api_residual_weight``: EWMA weight (0-1] of each finished request in its API's TTFT residual
    (``PredictionService.api_residual_s``, a diagnostic: forecasts do not use it);
    ``api_residual_min_requests``: finished requests of an API on a replica before it is reported.
    ``steady_state``: blend each TPOT forecast toward the replica's steady state under its recent
    traffic (``predictor.forecast.steady_state``: Little's law over the requests the caller saw
    finish there in the last ``arrival_memory_s`` seconds); off: the batch it joins alone. Off by
    default: recent traffic predicts the next seconds' worse than the batch does (measured in
    docs/predictor-accuracy.md).
    ``arrival_min_span_s``: seconds of that history needed before a rate is trusted.
    ``correction``: the measured correction of each replica's TTFT and TPOT forecasts
    (``predictor.correction``: learned in ``on_finished``, read with ``correction``).
    """

    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    forecast: ForecastConfig = field(default_factory=ForecastConfig)
    output_length: OutputLengthConfig = field(default_factory=OutputLengthConfig)
    prompt_tokens: PromptTokenConfig = field(default_factory=PromptTokenConfig)
    efficiency: Efficiency = field(default_factory=Efficiency)
    refit_interval_s: float = 0.0
    stale_after_s: float = 5.0
    prefill_share_memory_s: float = 60.0
    prefill_share_weight: float = 0.3
    learn_dispatch_overhead: bool = False
    overhead_samples: int = 512
    overhead_weight: float = 0.2
    overhead_min_window_s: float = 5.0
    overhead_min_requests: int = 10
    api_residual_weight: float = 0.05
    api_residual_min_requests: int = 20
    steady_state: bool = False
    arrival_memory_s: float = 60.0
    arrival_min_span_s: float = 10.0
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)

    def __post_init__(self) -> None:
        if self.refit_interval_s < 0 or self.stale_after_s <= 0 or self.prefill_share_memory_s <= 0:
            raise ValueError("refit_interval_s must be >= 0, stale_after_s and prefill_share_memory_s > 0")
        if not 0.0 <= self.prefill_share_weight <= 1.0:
            raise ValueError(f"prefill_share_weight must be in [0, 1], got {self.prefill_share_weight}")
        if self.overhead_samples < 1 or not 0.0 < self.overhead_weight <= 1.0:
            raise ValueError("overhead_samples must be >= 1 and overhead_weight in (0, 1]")
        if not 0.0 < self.api_residual_weight <= 1.0 or self.api_residual_min_requests < 1:
            raise ValueError("api_residual_weight must be in (0, 1] and api_residual_min_requests >= 1")
        if not 0.0 < self.arrival_min_span_s <= self.arrival_memory_s:
            raise ValueError("need 0 < arrival_min_span_s <= arrival_memory_s")


@dataclass(slots=True)
class _Replica:
    """Everything the service keeps about one replica."""

    facts: ReplicaFacts
    calibrator: StepCalibrator
    model: StepModel
    report: FitReport
    snapshot: ReplicaSnapshot | None = None
    #: (taken_at, running, waiting, kv tokens) of recent good scrapes, for window means.
    gauges: deque[tuple[float, float, float, float]] = field(default_factory=deque)
    load: Load = field(default_factory=Load)
    last_observation: Observation | None = None
    last_fit_at: float | None = None
    #: (window end, step stretch 1 / (1 - prefill share)) of recent windows, for the long-run mean.
    shares: deque[tuple[float, float]] = field(default_factory=deque)
    #: Newest time a token of any request on it was seen to land (a step boundary).
    last_token_at: float | None = None
    snapshots: int = 0
    stale_snapshots: int = 0
    #: (first token at, TTFT the caller measured) of recent requests, seconds, for the overhead.
    ttfts: deque[tuple[float, float]] = field(default_factory=deque)
    #: EWMA of (caller-measured TTFT - the replica's own TTFT) per scrape window, seconds; may
    #: be < 0 (noise), the forecast adds ``max(0, ...)`` of it.
    overhead_ewma_s: float = 0.0
    overhead_windows: int = 0
    #: EWMAs of (caller-measured TTFT - forecast TTFT), seconds: over all its requests, and by the
    #: API they came through, with that API's count (``PredictionService.api_residual_s``).
    residual_s: float = 0.0
    api_residuals: dict[str, float] = field(default_factory=dict)
    api_requests: dict[str, int] = field(default_factory=dict)
    #: (finished at, prompt tokens, output tokens) of the caller's recent requests there.
    finishes: deque[tuple[float, int, int]] = field(default_factory=deque)
    #: When the service first saw a snapshot of it (the start of its finish history), seconds.
    first_seen_at: float | None = None
    #: The steady state under the recent traffic (``None``: unknown or overloaded).
    steady: SteadyState | None = None
    #: It timed its own prefill steps in some window (TGI): a property of the engine, kept when a
    #: later window had no prefill step to time.
    times_prefills: bool = False

    @property
    def overhead_s(self) -> float:
        """Seconds the caller's TTFT adds to the engine's (transport, the server's own work)."""
        return max(0.0, self.overhead_ewma_s)


class PredictionService:
    """Per-replica step models, output-length and prompt-token learning, and forecasts."""

    def __init__(self, *, output_quantile: float = 0.5, config: PredictionConfig | None = None) -> None:
        if not 0.0 <= output_quantile <= 1.0:
            raise ValueError(f"output_quantile must be in [0, 1], got {output_quantile}")
        self._quantile = output_quantile
        self._config = config or PredictionConfig()
        self._replicas: dict[str, _Replica] = {}
        self._outputs = OutputLengthPredictor(self._config.output_length)
        self._prompts = PromptTokenEstimator(self._config.prompt_tokens)
        self._corrections = CorrectionLearner(self._config.correction)
        #: Per-request estimates (``expected_output``, ``estimate_prompt_tokens``) depend only on
        #: what ``on_finished`` taught: kept until it teaches something that changes an answer
        #: (``OutputLengthPredictor.observe`` says when: about one finish in ``resort_every``;
        #: every request asks, most ask alike; a lookup costs a tenth of the estimate).
        self._outputs_memo: dict[tuple[str, str | None, int], tuple[float, float]] = {}
        self._prompts_memo: dict[tuple[str, int], int] = {}
        #: ``replica_inputs``' expected remaining output per (model, tenant), by (tokens generated,
        #: output cap): the same numbers as ``expected_remaining`` until ``on_finished`` teaches
        #: something that changes them (a view rebuild asks for every stream in flight, most of
        #: which have not moved since the last rebuild; cleared on every finish, the memo would
        #: miss for all of them after each one).
        self._remaining_memo: dict[tuple[str, str | None], dict[tuple[int, int | None], float]] = {}

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
        self._replicas[name] = _Replica(facts, calibrator, fitted.model, fitted.report)
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
        """Take one scrape's snapshot: keep it, feed its window to the fit, refit when due.

        The fit learns from the newest scrape interval: for an engine that times its steps by kind
        (TGI) from its measured decode and prefill steps (``state.measured_steps``), otherwise from
        the interval as a window (``observe_window``).

        Stale snapshots are kept (their in-flight and staleness matter) but teach nothing.
        Snapshots of unknown replicas are ignored.

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
        r = self._replicas.get(snapshot.name)
        if r is None:
            return
        r.snapshot = snapshot
        r.snapshots += 1
        if snapshot.prefill_step_time_mean_s is not None:
            r.times_prefills = True
        if r.first_seen_at is None:
            r.first_seen_at = snapshot.taken_at
        if snapshot.stale:
            r.stale_snapshots += 1
            return
        self._learn(r, snapshot)
        if _idle(snapshot):
            at = snapshot.metrics_at if snapshot.metrics_at is not None else snapshot.taken_at
            r.shares.clear()
            r.shares.append((at, 1.0))
            r.load = Load(0.0, 0.0, snapshot.requests_finished_per_s, r.load.steady_step_s, 0.0)

    def _learn(self, r: _Replica, snapshot: ReplicaSnapshot) -> None:
        """``on_snapshot``'s learning from a fresh ``snapshot`` of ``r``: gauges, overhead, load, fit."""
        self._remember_gauges(r, snapshot)
        self._observe_overhead(r, snapshot)
        gauges = self._gauge_means(r, snapshot.taken_at - snapshot.window_s)
        window = window_stats(snapshot, gauges)
        if window is not None:
            seen = observation_from_window(window, r.calibrator.prior.params.knee_tokens)
            if seen.valid:
                share = self._prefill_share(r, window, gauges)
                r.load = Load(
                    seen.batch.prefill_tokens,
                    share,
                    snapshot.requests_finished_per_s,
                    r.load.steady_step_s,
                    window.prompt_tokens_per_s,
                )
        # The fit learns from the newest scrape interval alone: consecutive windows overlap
        # almost entirely, intervals do not, and their differing mixes identify the coefficients.
        interval = snapshot.last_interval
        stats = None
        if interval is not None:
            stats = window_stats(interval, self._gauge_means(r, interval.taken_at - interval.window_s))
        if stats is None or interval is None:
            self._update_steady(r, snapshot.taken_at)
            return
        # An engine that times its steps by kind (TGI) gives (batch -> step time) pairs outright;
        # the window's steps/s and ITL are then only a blurrier view of the same steps.
        direct = measured_steps(interval, self._gauge_means(r, interval.taken_at - interval.window_s))
        if direct:
            for step in direct:
                obs = r.calibrator.observe_step(step.at_s, step.batch, step.step_s)
        else:
            obs = r.calibrator.observe_window(stats)
        r.last_observation = obs
        now = stats.at_s
        due = r.last_fit_at is None or now - r.last_fit_at >= self._config.refit_interval_s
        if obs.valid and due:
            fitted = r.calibrator.fit(now)
            r.model, r.report, r.last_fit_at = fitted.model, fitted.report, now
        self._update_steady(r, snapshot.taken_at)

    def _update_steady(self, r: _Replica, now: float) -> None:
        """Recompute ``r``'s steady state (and the ``Load`` forecasts see) from its recent finishes.

        Once per scrape: the arrival rate is the rate the caller's requests finished there over
        the last ``arrival_memory_s`` seconds (in a steady state as many finish as arrive), their
        usage the sizes. Requests of other clients are not in it.
        """
        cfg = self._config
        steady = None
        finishes = r.finishes
        while finishes and finishes[0][0] < now - cfg.arrival_memory_s:
            finishes.popleft()
        span = min(cfg.arrival_memory_s, now - (r.first_seen_at if r.first_seen_at is not None else now))
        if cfg.steady_state and finishes and span >= cfg.arrival_min_span_s:
            mix = TrafficMix.from_requests(len(finishes) / span, [(p, o) for _, p, o in finishes])
            limits = self._limits(r)
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

    def _prefill_share(self, r: _Replica, window: WindowStats, gauges: GaugeMeans) -> float | None:
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
        while history and history[0][0] < window.at_s - self._config.prefill_share_memory_s:
            history.popleft()
        usual = statistics.median(h[1] for h in history)
        # A queue in the engine is prefill work already there: the near future is like the
        # recent past, not like the long-run mean.
        weight = 1.0 if gauges.waiting >= 1.0 else self._config.prefill_share_weight
        stretch = usual + weight * (history[-1][1] - usual)
        return 1.0 - 1.0 / stretch

    def _remember_gauges(self, r: _Replica, s: ReplicaSnapshot) -> None:
        kv = engine_kv_tokens(s)
        r.gauges.append((s.taken_at, float(s.num_running or 0), float(s.num_waiting or 0), kv))
        while r.gauges and r.gauges[0][0] < s.taken_at - s.window_s:
            r.gauges.popleft()

    def _gauge_means(self, r: _Replica, since: float) -> GaugeMeans:
        """Means of the gauges of the good scrapes taken at ``since`` or later (the newest included)."""
        kept = [g for g in r.gauges if g[0] >= since - 1e-9] or [r.gauges[-1]]
        n = len(kept)
        return GaugeMeans(
            running=sum(g[1] for g in kept) / n,
            waiting=sum(g[2] for g in kept) / n,
            kv_tokens=sum(g[3] for g in kept) / n,
            busy=all(g[1] + g[2] > 0 for g in kept),
        )

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
        if r is not None and forecast is not None and finished_at is not None:
            self._observe_correction(
                replica,
                forecast,
                prompt_tokens,
                ttft_s if relayed_ttft_s is None else relayed_ttft_s,
                relayed_tpot_s,
                finished_at,
            )
        if r is not None and finished_at is not None:
            r.last_token_at = finished_at if r.last_token_at is None else max(r.last_token_at, finished_at)
            if (
                self._config.steady_state
                and prompt_tokens is not None
                and completion_tokens is not None
                and prompt_tokens > 0
            ):
                r.finishes.append((finished_at, prompt_tokens, max(0, completion_tokens)))
        learn = self._config.learn_dispatch_overhead
        if r is not None and learn and ttft_s is not None and math.isfinite(ttft_s) and ttft_s > 0.0:
            # Keyed by when its first token came, as the replica's TTFT histogram counts it.
            at = finished_at if finished_at is not None else (r.snapshot.taken_at if r.snapshot else None)
            if forecast is not None and forecast.made_at is not None:
                at = forecast.made_at + ttft_s
            if at is not None:
                r.ttfts.append((at, ttft_s))
                while len(r.ttfts) > self._config.overhead_samples:
                    r.ttfts.popleft()
            if api is not None and forecast is not None and math.isfinite(forecast.ttft_s):
                self._observe_api(r, api, ttft_s - forecast.ttft_s)
        if r is not None and forecast is not None and ttft_s is not None:
            # The step fit learns engine steps: what ``with_overhead`` added for this request (the
            # way to and from an idle engine; the steps a busy one ran before it got there) is not
            # theirs to absorb. The mean overhead instead averages out over the step phases at
            # dispatch, but the fit is robust: it follows the majority, the requests that caught
            # their step, whose prefill would then look shorter by the whole overhead.
            self._observe_prefill(r, forecast, max(ttft_s - forecast.overhead_s, 1e-6), finished_at)
        if (
            completion_tokens is not None
            and completion_tokens >= 0
            and self._outputs.observe(model, tenant, completion_tokens)  # True: answers may change
        ):
            self._outputs_memo.clear()
            self._remaining_memo.clear()
        if prompt_chars is not None and prompt_tokens is not None:
            self._prompts.observe(model, prompt_chars, prompt_tokens)
            self._prompts_memo.clear()

    def _observe_correction(
        self,
        replica: str,
        forecast: Forecast,
        prompt_tokens: int | None,
        ttft_s: float | None,
        tpot_s: float | None,
        at: float,
    ) -> None:
        """One sample of ``replica``'s correction: the measured TTFT (less the dispatch overhead the
        forecast added, which is learned apart) and TPOT over the forecast's uncorrected ones, in
        the regime the forecast was made in (its prompt, the batch its prefill joined)."""
        if not forecast.valid:
            return
        batch = forecast.prefill_batch
        decodes = batch.decode_seqs if batch is not None else 0.0
        prompt = prompt_tokens if prompt_tokens is not None else 0
        ttft = None
        if ttft_s is not None and math.isfinite(forecast.base_ttft_s):
            ttft = (ttft_s - forecast.overhead_s, forecast.base_ttft_s, forecast.ttft_factor)
        tpot = None
        if tpot_s is not None and math.isfinite(forecast.base_tpot_s):
            tpot = (tpot_s, forecast.base_tpot_s, forecast.tpot_factor)
        self._corrections.observe(
            replica, at=at, prompt_tokens=prompt, decode_seqs=decodes, ttft=ttft, tpot=tpot
        )

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

    def _observe_overhead(self, r: _Replica, snapshot: ReplicaSnapshot) -> None:
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
        cfg = self._config
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

    def _observe_api(self, r: _Replica, api: str, residual_s: float) -> None:
        """One finished request's TTFT residual (measured - forecast, seconds) into its replica's
        and its API's EWMAs (both from 0, so that a replica served through one API keeps them
        equal: residual 0)."""
        w = self._config.api_residual_weight
        r.residual_s += w * (residual_s - r.residual_s)
        mean = r.api_residuals.get(api, 0.0)
        r.api_residuals[api] = mean + w * (residual_s - mean)
        r.api_requests[api] = r.api_requests.get(api, 0) + 1

    def api_residual_s(self, replica: str, api: str | None) -> float:
        """Seconds by which the TTFTs of ``api``'s requests on ``replica`` came later than forecast,
        beyond the replica's requests of every API (negative: earlier); 0 until
        ``api_residual_min_requests`` of its requests finished. A diagnostic (``describe``):
        forecasts do not add it: the difference between APIs is engine-side, not in the hop, and
        adding it made TGI's forecasts noisier (docs/engines.md, "Why TGI's TTFT forecasts were
        the noisiest").
        """
        r = self._replicas.get(replica)
        if r is None or api is None or r.api_requests.get(api, 0) < self._config.api_residual_min_requests:
            return 0.0
        return r.api_residuals.get(api, 0.0) - r.residual_s

    def _observe_prefill(self, r: _Replica, forecast: Forecast, ttft_s: float, at: float | None) -> None:
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

    def estimate_prompt_tokens(self, model: str, prompt_chars: int) -> int:
        """Prompt tokens for ``prompt_chars`` characters at ``model``'s learned ratio (>= 1)."""
        key = (model, prompt_chars)
        tokens = self._prompts_memo.get(key)
        if tokens is None:
            tokens = self._prompts.estimate(model, max(0, prompt_chars)).tokens
            if len(self._prompts_memo) >= _MEMO_SIZE:
                self._prompts_memo.clear()
            self._prompts_memo[key] = tokens
        return tokens

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
            if len(self._outputs_memo) >= _MEMO_SIZE:
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
        r = self._replicas.get(replica)
        outputs = self._outputs

        memo = self._remaining_memo.get((model, tenant))
        if memo is None:
            memo = self._remaining_memo[(model, tenant)] = {}
        elif len(memo) >= _MEMO_SIZE:
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
                limits=_UNKNOWN_LIMITS,
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
            snapshot.metrics_at is None or now - snapshot.metrics_at > self._config.stale_after_s
        )
        self._note_boundaries(r, in_flight)
        state = replica_state(
            in_flight,
            snapshot,
            limits=self._limits(r),
            load=r.load,
            remaining=remaining,
            stale=stale,
            model=r.model,
            now=now,
            last_boundary=r.last_token_at,
        )
        return r.model, state

    @staticmethod
    def _note_boundaries(r: _Replica, in_flight: Sequence[InFlight]) -> None:
        """The newest token any of ``in_flight`` saw land is a step boundary of the replica."""
        newest = r.last_token_at
        for f in in_flight:
            at = f.last_token_at
            if at is not None and (newest is None or at > newest):
                newest = at
        r.last_token_at = newest

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
        limits = self._limits(r)
        cap = max_tokens if max_tokens is not None else limits.max_model_len - prompt_tokens
        cap = max(1, cap)
        estimate = self._outputs.predict(model, tenant, cap, self._quantile)
        request = CandidateRequest(prompt_tokens, cap, float(estimate.tokens), self._quantile)
        if r is None or (r.snapshot is None and not r.model.valid):
            return _no_model(request)
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
        """``engine`` (a forecast of the engine alone, as ``predictor.forecast_request`` makes them),
        made at ``now`` (the caller's clock, seconds), as the caller will measure its TTFT (dispatch
        to first token back) given ``replica``'s learned dispatch overhead ``d`` (the way in, the
        replica server's own work and the way back, the same for every API it serves: see
        ``api_residual_s``); ``Forecast.overhead_s`` says what was added.
        What ``forecast`` returns; a caller that forecasts with ``replica_inputs`` itself
        (admission) passes its forecast here. Unchanged (``overhead_s`` 0) when no overhead is
        learned, the replica is unknown or the TTFT is not a number.

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
        r = self._replicas.get(replica)
        overhead = 0.0 if r is None else r.overhead_s
        if r is None or overhead <= 0.0 or not math.isfinite(engine.ttft_s):
            return engine.with_overhead(engine.ttft_s, engine.overhead_s, now)
        batch = engine.prefill_batch
        decodes = batch.decode_seqs if batch is not None else 0.0
        kv = batch.kv_tokens_read if batch is not None else 0.0
        added = added_overhead_s(overhead, engine.step_wait_s, decodes, kv, r.model)
        return engine.with_overhead(engine.ttft_s + added, added, now)

    def _limits(self, r: _Replica | None) -> Limits:
        if r is None:
            return Limits(_UNKNOWN_KV_CAPACITY, 1, 1, _UNKNOWN_MAX_MODEL_LEN)
        f, s = r.facts, r.snapshot
        capacity = s.kv_capacity_tokens if s is not None and s.kv_capacity_tokens else _UNKNOWN_KV_CAPACITY
        return Limits(
            kv_capacity_tokens=capacity,
            max_num_seqs=f.max_num_seqs,
            max_num_batched_tokens=f.max_num_batched_tokens,
            max_model_len=f.max_model_len or _UNKNOWN_MAX_MODEL_LEN,
        )

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
        return s, self._gauge_means(r, s.taken_at - s.window_s)

    def report(self, replica: str) -> FitReport | None:
        """The latest fit report of ``replica`` (``None`` if unknown)."""
        r = self._replicas.get(replica)
        return None if r is None else r.report

    def describe(self, now: float | None = None) -> dict[str, object]:
        """JSON-ready state for an admin endpoint: per replica its facts, fit, freshness and
        forecast correction as of ``now`` (the caller's seconds; ``None``: its latest snapshot)."""
        replicas: dict[str, object] = {}
        for name, r in self._replicas.items():
            s = r.snapshot
            at = now if now is not None else (s.taken_at if s is not None else 0.0)
            obs = r.last_observation
            replicas[name] = {
                "facts": dataclasses.asdict(r.facts),
                "fit": _describe_report(r.report),
                "snapshots": r.snapshots,
                "stale_snapshots": r.stale_snapshots,
                "last_snapshot_at": None if s is None else s.taken_at,
                "metrics_at": None if s is None else s.metrics_at,
                "stale": None if s is None else s.stale,
                "stale_reason": None if s is None else s.stale_reason,
                "last_observation": None
                if obs is None
                else {
                    "valid": obs.valid,
                    "reason": None if obs.reason is None else str(obs.reason),
                    "source": str(obs.source),
                    "step_s": _finite(obs.step_s),
                },
                "background_prefill_tokens_per_step": r.load.prefill_tokens_per_step,
                "prefill_share": r.load.prefill_share,
                "dispatch_overhead_s": r.overhead_s,
                "api_ttft_residuals_s": {a: self.api_residual_s(name, a) for a in sorted(r.api_requests)},
                "correction": self._corrections.describe(name, at),
                "steady_state": None
                if r.steady is None
                else {
                    "step_s": r.steady.step_s,
                    "decode_seqs": r.steady.decode_seqs,
                    "prefill_share": r.steady.prefill_share,
                },
            }
        return {"output_quantile": self._quantile, "replicas": replicas}


def _idle(snapshot: ReplicaSnapshot) -> bool:
    """The replica was idle at ``snapshot``: its metrics say nothing is running or waiting (both
    known) and the caller had nothing in flight there."""
    return snapshot.num_running == 0 and snapshot.num_waiting == 0 and not snapshot.in_flight


def _no_model(request: CandidateRequest) -> Forecast:
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


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _params(p: StepParams) -> dict[str, float]:
    values = dict(zip(FEATURE_NAMES, p.coefficients(), strict=True))
    return {**values, "knee_tokens": p.knee_tokens, "attn_pair_tokens": p.attn_pair_tokens}


def _describe_report(rep: FitReport) -> dict[str, object]:
    return {
        "source": str(rep.source),
        "valid": rep.valid,
        "reason": rep.reason,
        "params": _params(rep.params),
        "prior": None if rep.prior is None else _params(rep.prior),
        "mdape": rep.mdape,
        "prior_mdape": rep.prior_mdape,
        "observations_total": rep.observations_total,
        "observations_kept": rep.observations_kept,
        "effective_observations": rep.effective_observations,
        "prior_weight": rep.prior_weight,
        "rejected": {str(k): v for k, v in rep.rejected},
    }
