"""Slack per candidate replica: the forecast there times the margins and the measured correction.

``SlackRules.evaluate`` forecasts one request on one replica view and returns its ``_Candidate``:
the numbers with the margins applied (seconds), and its slack vector by the constraint slots of
``gateway.admission.decision`` (fractions of each limit, negative = violated; ``None`` on a replica
with no step model yet). Forecast multiplier: ``1 + forecast_margin`` (times ``1 + stale_margin``
when stale), the attainment controller's margin in its place for a class where it holds one,
the replica's measured correction (``ReplicaView.correction``) for the request's regime, and
the TTFT's spread there at the class's ``attainment_target`` (``Correction.ttft_upper``; not on
an unloaded replica, as the attainment margin). Forecasts are memoised per view (a view lives
for many decisions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

from gateway.admission.config import AdmissionSettings, ClassSettings, ShadowSettings
from gateway.admission.decision import _SLOTS, _enforced_slots
from gateway.admission.request import AdmissionRequest
from gateway.admission.shares import decode_slot_capacity, kv_share_limit, slot_share_limit
from gateway.admission.views import NO_MARGINS, ReplicaView, with_queued
from predictor import (
    CandidateRequest,
    Forecast,
    ForecastConfig,
    ForecastReason,
    ReplicaState,
    StepBatch,
    StepModel,
)
from predictor.forecast import ForecastValues, forecast_of, forecast_values
from predictor.overhead import added_overhead_s

_INF: Final = math.inf
#: Most replicas (and idle replica states, ``gateway.admission.idle``) kept (cleared when exceeded).
_IDLE_STATES_KEPT: Final = 64
#: Most forecasts kept per replica state in ``evaluate``'s memo (cleared when exceeded).
_FORECASTS_KEPT: Final = 256
#: A probe's outcome on one candidate: (the protected class, its probe's TTFT, its TPOT), seconds,
#: margins applied.
_Probe = tuple[ClassSettings, float, float]
#: Shared by every candidate of a class that yields to none (never mutated).
_NO_PROBES: Final[list[_Probe]] = []


@dataclass(slots=True)
class _Candidate:
    """One healthy replica's verdict for one request.

    ``raw``: the predictor's numbers (``predictor.forecast.forecast_values``; ``None`` without a
    step model); ``scale``: the margins' multiplier (``1 + forecast_margin``, times
    ``1 + stale_margin`` when stale). ``ttft_s``, ``tpot_s``, ``inflicted_tpot_s``,
    ``inflicted_stall_s``: its numbers with the margins applied (NaN without a step model).
    ``output_tokens``: the output length the forecast assumed. The ``Forecast`` object (margins
    applied) is built only when a decision carries it (``forecast``): one per decision, not one
    per replica. ``ttft_factor`` / ``tpot_factor``: the replica's measured correction for this
    request's regime (``ReplicaView.correction``), applied to its TTFT and to its TPOTs;
    ``ttft_spread``: the correction's TTFT spread there at the class's attainment target
    (``Correction.ttft_upper``), applied to its TTFT on top.
    """

    view: ReplicaView
    raw: ForecastValues | None
    scale: float
    ttft_s: float
    tpot_s: float
    inflicted_tpot_s: float
    inflicted_stall_s: float
    output_tokens: float
    slacks: tuple[float, ...] | None  # by _SLOTS; None without a step model
    slack: float  # minimum over every rule
    slack_enforced: float  # minimum over the enforced rules
    probes: list[_Probe]
    _forecast: Forecast | None = None
    #: The memo entry ``raw`` came from (``_Known``), which keeps the ``Forecast`` built from it.
    known: _Known | None = None
    ttft_factor: float = 1.0
    tpot_factor: float = 1.0
    #: Prompt tokens the forecast took as hits in the replica's prefix cache.
    cached_tokens: int = 0
    ttft_spread: float = 1.0

    @property
    def forecast(self) -> Forecast | None:
        """The forecast with the margins applied (``None`` without a step model)."""
        if self._forecast is None and self.raw is not None:
            known = self.known
            key = (self.scale, self.ttft_factor, self.tpot_factor, self.ttft_spread)
            if known is not None and known.forecast is not None and known.scale == key:
                self._forecast = known.forecast
            else:
                self._forecast = forecast_of(
                    self.raw,
                    self.scale,
                    self.ttft_factor,
                    self.tpot_factor,
                    self.cached_tokens,
                    self.ttft_spread,
                )
                if known is not None:
                    known.scale, known.forecast = key, self._forecast
        return self._forecast


class _Known:
    """One memoised forecast (``SlackRules._forecast``): the predictor's numbers and the
    ``Forecast`` object last built from them, with the (scale, TTFT factor, TPOT factor, TTFT
    spread) it was built at."""

    __slots__ = ("forecast", "scale", "values")

    def __init__(self, values: ForecastValues) -> None:
        self.values = values
        self.scale: tuple[float, float, float, float] | None = None
        self.forecast: Forecast | None = None


class _Forecasts:
    """``evaluate``'s memo for one replica: forecasts made on ``state`` with ``model``, by request.

    Valid while the replica's view carries these very objects (states and models are immutable;
    a view rebuild or a refit brings new ones, which replace the memo)."""

    __slots__ = ("known", "model", "state")

    def __init__(self, state: ReplicaState, model: StepModel) -> None:
        self.state = state
        self.model = model
        self.known: dict[CandidateRequest, _Known] = {}


def _overhead_s(d: float, f: ForecastValues, model: StepModel) -> float:
    """What a dispatch overhead of ``d`` seconds adds to the TTFT of forecast ``f``
    (``predictor.overhead.added_overhead_s``: all of it on an idle engine, the steps it misses on
    a busy one); 0 when none is learned (``d`` 0), without touching the step model."""
    if d <= 0.0:
        return 0.0
    batch = f[11]
    decodes, kv = (batch[1], batch[2]) if batch is not None else (0.0, 0.0)
    return added_overhead_s(d, f[10], decodes, kv, model)


def _after(f: ForecastValues, elapsed_s: float) -> ForecastValues:
    """``f`` (made on a view as built) ``elapsed_s`` later, within the same engine step: the step
    wait, and with it the TTFT, shorter by that much; nothing else moves (``ReplicaView``)."""
    return (
        f[0] - elapsed_s,
        f[1],
        f[2],
        f[3],
        f[4],
        f[5],
        f[6],
        f[7],
        f[8],
        f[9],
        f[10] - elapsed_s,
        f[11],
        f[12],
    )


def _unloaded(view: ReplicaView) -> bool:
    """None of the gateway's requests is on ``view``'s replica and nothing waits there: the load
    a margin was learned under has gone. Unlike ``idle._is_idle``, a request the engine still runs by
    the last scrape counts as gone once the gateway saw it end (scrapes lag by up to an interval,
    and light traffic would otherwise always find the replica busy)."""
    state = view.state
    return view.gateway_streams == 0 and state.num_waiting == 0 and state.queued_requests == 0


class SlackRules:
    """Computes a request's slack vector on each replica (see the module docstring).

    ``forecast_config`` is passed through to the predictor's forecast; ``shadow`` names the rules
    not enforced (their slots count in ``_Candidate.slack`` but not in ``slack_enforced``).
    """

    def __init__(
        self, settings: AdmissionSettings, forecast_config: ForecastConfig, shadow: ShadowSettings
    ) -> None:
        self._settings = settings
        self._fc = forecast_config
        #: Forecast multipliers: every replica, and a replica whose metrics are stale.
        self._fresh_scale = 1.0 + settings.forecast_margin
        self._stale_scale = self._fresh_scale * (1.0 + settings.stale_margin)
        self._enforced = _enforced_slots(shadow)
        self._all_enforced = self._enforced == tuple(range(len(_SLOTS)))
        self._slo_enforced = not shadow.slo
        self._default = settings.classes[settings.default_class]
        #: (TPOT target, max stall, stall-budget horizon) per class, for the streams already running.
        self._stream_limits = {
            n: (c.tpot_target_s, c.max_stall_s, c.stall_budget_horizon) for n, c in settings.classes.items()
        }
        #: ``evaluate``'s memo, per replica name: the forecast of a request on a view is a pure
        #: function of (request, state, step model, forecast config), and a view lives for many
        #: decisions (an engine step; ``gateway.admission.live``), so alike requests (a flood)
        #: share one forecast and one ``Forecast`` object per view instead of one each.
        self._forecasts: dict[str, _Forecasts] = {}
        self._default_limits = (
            self._default.tpot_target_s,
            self._default.max_stall_s,
            self._default.stall_budget_horizon,
        )
        self._any_budget = any(c.stall_budget_horizon is not None for c in settings.classes.values())
        tightest = min(settings.classes.values(), key=lambda c: c.tpot_target_s)
        self._tightest_tpot_s = tightest.tpot_target_s
        self._typical_context = tightest.probe_prompt_tokens + tightest.probe_output_tokens / 2.0
        self._probes = {
            name: tuple(
                (
                    settings.classes[p],
                    CandidateRequest(
                        settings.classes[p].probe_prompt_tokens,
                        settings.classes[p].probe_output_tokens,
                        float(settings.classes[p].probe_output_tokens),
                    ),
                )
                for p in cls.yields_to
            )
            for name, cls in settings.classes.items()
        }

    def evaluate(
        self,
        request: AdmissionRequest,
        name: str,
        cls: ClassSettings,
        view: ReplicaView,
        now: float,
        deadline: float,
    ) -> _Candidate | None:
        """Forecast on one replica and compute its slack vector; ``None`` if it cannot serve it."""
        state = view.state
        candidate = request.candidate(state.max_model_len, view.cached_tokens(request))
        memo = self._forecast(candidate, view)
        f = memo.values
        if not f[3] and f[4] != ForecastReason.STALE_STATE:
            if f[4] == ForecastReason.NO_STEP_MODEL:
                return self._unmodelled(view)
            return None
        # The view may be a little older than ``now``: the step in progress has gone on since.
        elapsed = view.step_elapsed_s(now)
        known: _Known | None = memo
        if elapsed > 0.0:
            f = _after(f, elapsed)
            known = None  # the memo's ``Forecast`` is the view's as built
        base = self._stale_scale if view.stale else self._fresh_scale
        # The class's own margin there (the attainment controller's) in place of forecast_margin:
        # on its own forecasts, and on what a newcomer inflicts on its running streams. Not on an
        # unloaded replica: a margin learned under load must not outlive it (no lock-out).
        margins = view.margins
        unloaded = _unloaded(view)
        if margins and unloaded:
            margins = NO_MARGINS
        scale = base
        if margins:
            own_margin = margins.get(name)
            if own_margin is not None:
                scale = base / self._fresh_scale * (1.0 + own_margin)
            stale_factor = base / self._fresh_scale
        # The first token reaches the gateway the replica's dispatch overhead after the engine
        # makes it, or the share of it a busy engine's steps leave (learned, not scaled by the
        # margins; ``predictor.overhead``, as the response's forecast gets it).
        d = view.dispatch_overhead_s
        overhead = _overhead_s(d, f, view.model)
        # The replica's measured correction for this request's regime (its prompt, the batch its
        # prefill joins, the engine-fulls that must leave before it has a slot): what the gateway
        # measured there over what was forecast, the overhead with the engine's TTFT
        # (``predictor.correction``).
        # Then its TTFT's spread there at the class's attainment target (the median is beaten half
        # the time, the target's quantile that share of the time); not on an unloaded replica, as
        # the margins: a spread learned in a burst's transitions must not outlive it.
        batch = f[11]
        joins = state.decode_seqs if batch is None else batch[1]
        quantile = None if unloaded else cls.attainment_target
        ct, cp, st = view.correction.judged(quantile, request.prompt_tokens, joins, f[12])
        ttft, tpot, infl = (f[0] * scale + overhead) * ct * st, f[1] * scale * cp, f[2] * scale * cp
        late = view.overdue_s
        if late > 0.0 and ttft > 0.0:
            # The queue it would join runs that far behind its forecasts now: so will its first
            # token. Carried in the TTFT factor, so that its forecast says what was judged.
            ct *= (ttft + late) / ttft
            ttft += late
        stall = f[7] * scale
        output = f[5]
        streams = stalls = _INF
        extra = view.extra_tpot_s
        limits, fallback = self._stream_limits, self._default_limits
        # Streams of a class with a stall budget are judged by it (below) instead of by the
        # mean-TPOT rule: it counts what each stream's decode has already taken.
        pending = step = math.nan
        if self._any_budget:
            pending = self._pending_stall_s(view) * scale
            step = self._step_with_s(view, request.prompt_tokens + output / 2.0)
        for stream_class, load in view.loads.items():
            target, max_stall, horizon = limits.get(stream_class, fallback)
            # Their class's margin (not the newcomer's) on what the newcomer does to them.
            k = 1.0
            if margins:
                stream_margin = margins.get(stream_class)
                if stream_margin is not None:
                    k = stale_factor * (1.0 + stream_margin) / scale
                else:
                    k = base / scale
            if horizon is not None:
                budget = load.min_stall_budget_s(target, horizon, step)
                if budget < _INF:
                    s = 1.0 - (pending + stall) * k / budget if budget > 0.0 else -1.0
                    if s < stalls:
                        stalls = s
            else:
                s = (target - load.max_tpot_s - extra - infl * k) / target
                if s < streams:
                    streams = s
            if max_stall is not None:
                s = (max_stall - stall * k) / max_stall
                if s < stalls:
                    stalls = s
        kv = slot = yttft = ytpot = _INF
        if cls.kv_share < 1.0 or cls.slot_share < 1.0:
            own = view.loads.get(name)
            if cls.kv_share < 1.0:
                limit = kv_share_limit(cls.kv_share, state)
                used = own.kv_tokens if own is not None else 0.0
                kv = (limit - used - request.prompt_tokens - output) / limit
            if cls.slot_share < 1.0:
                slots = self.slot_limit(cls, view)
                slot = (slots - (own.seqs if own is not None else 0) - 1) / slots
        s_ttft = (deadline - now - ttft) / cls.ttft_target_s
        # A class with a stall budget: once admitted, this request is one of the streams whose
        # budgets every later prefill must fit, so its own TPOT is not also charged the prefill
        # share the replica had recently (the forecast's): its decode step with it seated, when
        # that is lower.
        own_tpot = tpot
        own_step = step * cp * (scale / base)
        if cls.stall_budget_horizon is not None and 0.0 < own_step < tpot:
            own_tpot = own_step
        s_tpot = (cls.tpot_target_s - own_tpot) / cls.tpot_target_s
        if request.max_tokens_on(state.max_model_len) <= 1:
            s_tpot = _INF  # one output token: no time per output token to hold to a target
        probes: list[_Probe] = _NO_PROBES
        plan = self._probes[name]
        # The probes cost a forecast each: skip them where another enforced rule already fails.
        if plan and not (self._all_enforced and min(s_ttft, s_tpot, streams, stalls, kv, slot) < 0.0):
            probes = []
            after = with_queued(
                state, request.prompt_tokens, candidate.cached_prompt_tokens, request.exact_output_tokens
            )
            keep = 1.0 - self._settings.yield_margin
            for protected, probe in plan:
                pf = forecast_values(probe, after, view.model, self._fc)
                pb = pf[11]
                pt, pp = view.correction.factors(
                    probe.prompt_tokens, after.decode_seqs if pb is None else pb[1], pf[12]
                )
                p_ttft = ((pf[0] - elapsed) * base + _overhead_s(d, pf, view.model)) * pt + view.overdue_s
                p_tpot = pf[1] * base * pp
                probes.append((protected, p_ttft, p_tpot))
                t, p = protected.ttft_target_s, protected.tpot_target_s
                yttft = min(yttft, (keep * t - p_ttft) / t)
                ytpot = min(ytpot, (keep * p - p_tpot) / p)
        slacks = (
            s_ttft,
            s_tpot,
            streams,
            stalls,
            kv,
            slot,
            yttft,
            ytpot,
        )
        slack = min(slacks)
        enforced = slack if self._all_enforced else min((slacks[i] for i in self._enforced), default=_INF)
        return _Candidate(
            view,
            f,
            scale,
            ttft,
            tpot,
            infl,
            stall,
            output,
            slacks,
            slack,
            enforced,
            probes,
            None,
            known,
            ct,
            cp,
            candidate.cached_prompt_tokens,
            st,
        )

    def _forecast(self, candidate: CandidateRequest, view: ReplicaView) -> _Known:
        """``forecast_values(candidate, view.state, view.model)``, memoised per view (``_Forecasts``)."""
        state, model = view.state, view.model
        memo = self._forecasts.get(view.name)
        if memo is None or memo.state is not state or memo.model is not model:
            if len(self._forecasts) >= _IDLE_STATES_KEPT:
                self._forecasts.clear()  # replicas that left the fleet
            memo = self._forecasts[view.name] = _Forecasts(state, model)
        known = memo.known.get(candidate)
        if known is None:
            if len(memo.known) >= _FORECASTS_KEPT:
                memo.known.clear()
            known = memo.known[candidate] = _Known(forecast_values(candidate, state, model, self._fc))
        return known

    def _step_with_s(self, view: ReplicaView, context_tokens: float) -> float:
        """The decode step on ``view`` once the newcomer decodes too (``context_tokens`` of KV;
        no prefill riding along), margins applied: what the running streams' remaining steps
        cost while every later prefill is held to their stall budgets."""
        state = view.state
        if not view.model.valid:
            return 0.0
        batch = StepBatch(0.0, state.decode_seqs + 1, state.kv_tokens_in_use + context_tokens)
        return view.model.step_time(batch) * self.scale(view)

    @staticmethod
    def _pending_stall_s(view: ReplicaView) -> float:
        """Seconds of pause the prefill already queued on ``view`` will add to its running decodes
        (admitted, not yet computed: budgets must leave room for it): its tokens at the step
        model's compute-bound cost per token, plus their attention pairs. 0 without a model."""
        state, model = view.state, view.model
        queued = state.queued_prefill_tokens
        if queued <= 0 or not model.valid:
            return 0.0
        p = model.params
        pairs = state.queued_prefill_attn_pairs
        if pairs is None:
            pairs = queued * queued / (2.0 * max(state.queued_requests, 1))
        return queued * p.per_compute_token_s + pairs * p.per_attn_pair_s

    def scale(self, view: ReplicaView) -> float:
        """Forecast multiplier on ``view``: ``1 + forecast_margin`` (times ``1 + stale_margin`` when
        its metrics are stale)."""
        return self._stale_scale if view.stale else self._fresh_scale

    def slot_limit(self, cls: ClassSettings, view: ReplicaView) -> int:
        """Decode slots ``cls`` may hold on ``view``: its share of the slots the step model allows at
        the tightest TPOT target (contexts as running now, else a typical request's)."""
        state = view.state
        context = state.kv_tokens_in_use / state.decode_seqs if state.decode_seqs else self._typical_context
        slots = decode_slot_capacity(view.model, state, self._tightest_tpot_s, context)
        return slot_share_limit(cls.slot_share, slots)

    def _unmodelled(self, view: ReplicaView) -> _Candidate:
        """A replica with no step model: usable below its in-flight cap, as a last resort."""
        cap = self._settings.unmodelled_max_in_flight
        open_ = view.gateway_streams < cap
        enforced = 0.0 if open_ or not self._slo_enforced else -1.0
        nan = math.nan
        return _Candidate(
            view, None, 1.0, nan, nan, nan, nan, nan, None, 0.0 if open_ else -1.0, enforced, _NO_PROBES
        )
