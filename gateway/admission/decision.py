"""The per-request decision: forecast on every healthy replica, route by slack, admit, queue or reject.

For a request of class C on replica r (predictions multiplied by ``1 + forecast_margin``, and by
``1 + stale_margin`` as well when r's metrics are stale), each constraint has a **slack**, its
spare capacity as a fraction of its limit (negative = violated). Where the attainment controller
holds a margin of its own for a class on r (``ReplicaView.margins``), that margin replaces
``forecast_margin`` on the class's own TTFT and TPOT, and on what a newcomer inflicts on the
class's running streams there, unless nothing of the gateway's runs on r and nothing waits there
(a margin learned under load does not outlive it); the probes of yielded-to classes and the
hopeless check keep ``forecast_margin``.

=============== ================================================================ ===============
blocker          slack                                                            rule
=============== ================================================================ ===============
ttft             (first-token deadline - now - TTFT) / C.ttft_target              slo
tpot             (C.tpot_target - TPOT) / C.tpot_target; for a class C with      slo
                 stall_budget_horizon, min(TPOT, the decode step with the
                 newcomer seated): later prefill is held to its stall budget
streams_tpot     min over classes k streaming on r of                             protect_streams
                 (min headroom_k - inflicted TPOT) / k.tpot_target
streams_stall    min over classes k with max_stall of (max_stall - stall) / max  protect_streams
                 and, for classes k with stall_budget_horizon (instead of
                 streams_tpot for them), 1 - (queued prefill's pause + stall) /
                 k's smallest stall budget (ClassLoad.min_stall_budget_s)
kv_share         (C.kv_share x KV capacity - class KV - own KV) / limit           batch_isolation
slot_share       (C.slot_share x decode slots - class seqs - 1) / limit           batch_isolation
yield_ttft/tpot  for each class P in C.yields_to, a typical P request queued       batch_isolation
                 behind this one: ((1 - yield_margin) x P.target - probe) / target
=============== ================================================================ ===============

Headroom of a stream = its class's TPOT target - its TPOT now (as predicted, at least the
replica's current decode step, plus what requests admitted since the view was built inflict).
The first-token deadline is arrival + TTFT target, or the client's earlier deadline, so time spent
in Sluice's queue counts. Every TTFT held against a deadline includes the replica's learned
dispatch overhead (``ReplicaView.dispatch_overhead_s``, added after the margins: all of it on an
idle engine, the steps it misses on a busy one, ``predictor.overhead``). Before the margins, the
engine's TTFT and TPOTs are multiplied by the replica's measured correction for the request's
regime (``ReplicaView.correction``, ``predictor.correction``). The replica's slack is
the minimum; the request goes to the replica with
the most slack among those where it is >= 0. A long prompt that would push running streams past
their targets is therefore sent where it hurts least, or held. Slacks within ``_SLACK_TIE`` (1 %
of the binding target) of the most are comparable: of those, the replica with the fewest of the
gateway's requests wins (then the most slack, then the order listed). A difference that small is
below the forecast's own error; ranked on it alone, a replica whose step model came out a little
pessimistic got no request while the others took every one, and so never got the traffic that
would correct its fit (an emulated vLLM served 3 of 754 requests beside a TGI and an SGLang).
A replica with no step model yet is used only when no modelled one can take the request, below
``unmodelled_max_in_flight``.

A request of one output token (``max_tokens`` 1) has no TPOT: its ``tpot`` slack is infinite.

When no replica can take it now, each replica's *wait* is estimated (``retry_after``: drain times
of the failing constraints, never longer than the replica's predicted drain to idle, where the
request fits unless retrying is hopeless) and its predicted first token is ``now + wait + TTFT``.
If even the earliest of these is after the first-token deadline and the request could wait in the
queue (or its TTFT fails already) it is rejected at once (before any GPU work):
``deadline_exceeded`` when the client's deadline binds (or it was queued), else
``slo_unattainable``. Otherwise it is queued when its class queues and the wait fits its queue
deadline, else rejected ``overloaded`` (streams or shares block) or ``slo_unattainable`` (its
own TPOT target). Retry-After is the earliest replica's drain time, jittered; ``None`` when even an
idle replica could not meet the targets (retrying cannot help). A refusal's message cites the
forecast that failed with its target, in the numbers its ``forecast`` carries (the TTFT as judged:
margins and dispatch overhead in), which the prediction headers print.

Cost: one forecast (``predictor.forecast.forecast_values``) per healthy replica (plus one per
yielded-to class for classes that yield, on replicas where the other rules hold), and O(classes)
arithmetic; the blocked path adds the wait estimates and, for a rejection, one forecast on an idle
copy of the best replica (is retrying hopeless?), memoised per request size and replica limits.
The margins are applied to the numbers the slacks need; the ``Forecast`` object is built once, for
the replica the decision names. ``bench/admission_cost.py`` times each path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Final, Protocol

from gateway.admission.config import AdmissionSettings, ClassSettings, ShadowSettings
from gateway.admission.request import AdmissionRequest
from gateway.admission.retry_after import (
    DEFAULT_REMAINING_TOKENS,
    RetryAfter,
    RetryAfterPolicy,
    decode_drain_s,
    ttft_excess_s,
)
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

__all__ = [
    "Admit",
    "Admitter",
    "Blocker",
    "Decision",
    "Queue",
    "Reject",
    "RejectReason",
    "Rule",
    "SloAdmitter",
]


class RejectReason(StrEnum):
    """Why a request is refused; the OpenAI error ``code``. Bounded: safe as a metric label."""

    OVERLOADED = "overloaded"
    SLO_UNATTAINABLE = "slo_unattainable"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    PROMPT_TOO_LARGE = "prompt_too_large"
    NO_HEALTHY_REPLICA = "no_healthy_replica"


class Blocker(StrEnum):
    """The constraint that kept a request off its best replica. Bounded: safe as a metric label."""

    TTFT = "ttft"
    TPOT = "tpot"
    STREAMS_TPOT = "streams_tpot"
    STREAMS_STALL = "streams_stall"
    KV_SHARE = "kv_share"
    SLOT_SHARE = "slot_share"
    YIELD_TTFT = "yield_ttft"
    YIELD_TPOT = "yield_tpot"
    UNMODELLED = "unmodelled"  # no step model yet, and its in-flight cap is reached
    NO_REPLICA = "no_replica"
    PROMPT_SIZE = "prompt_size"
    QUEUE_FULL = "queue_full"
    HELD_BACK = "held_back"  # a long-waiting queued request of its priority goes first
    CONCURRENCY = "concurrency"  # policy concurrency_cap: every replica holds max_in_flight
    SATURATED = "saturated"  # policy saturation: every replica's queue or KV use is over its threshold


class Rule(StrEnum):
    """Rules that can run in shadow mode (``admission.shadow``)."""

    SLO = "slo"
    PROTECT_STREAMS = "protect_streams"
    BATCH_ISOLATION = "batch_isolation"
    PROMPT_SIZE = "prompt_size"


#: Constraint slots of a candidate's slack vector, in this order.
_SLOTS: Final = (
    Blocker.TTFT,
    Blocker.TPOT,
    Blocker.STREAMS_TPOT,
    Blocker.STREAMS_STALL,
    Blocker.KV_SHARE,
    Blocker.SLOT_SHARE,
    Blocker.YIELD_TTFT,
    Blocker.YIELD_TPOT,
)
_TTFT, _TPOT, _STREAMS, _STALL, _KV, _SLOT, _YTTFT, _YTPOT = range(8)
_RULE_SLOTS: Final = {
    Rule.SLO: (_TTFT, _TPOT),
    Rule.PROTECT_STREAMS: (_STREAMS, _STALL),
    Rule.BATCH_ISOLATION: (_KV, _SLOT, _YTTFT, _YTPOT),
}
#: Blockers that are the load's fault (others' streams, shares), not the request's own targets.
_LOAD_BLOCKERS: Final = frozenset(
    {Blocker.STREAMS_TPOT, Blocker.STREAMS_STALL, Blocker.KV_SHARE, Blocker.SLOT_SHARE}
    | {Blocker.YIELD_TTFT, Blocker.YIELD_TPOT, Blocker.UNMODELLED, Blocker.QUEUE_FULL, Blocker.HELD_BACK}
    | {Blocker.CONCURRENCY, Blocker.SATURATED}
)
_INF: Final = math.inf
_EULER: Final = 0.5772156649015329
#: Most idle replica states kept (distinct replica limits; cleared when exceeded).
_IDLE_STATES_KEPT: Final = 64
#: Most forecasts on idle replicas kept for ``_hopeless`` (cleared when exceeded).
_IDLE_FORECASTS_KEPT: Final = 1024
#: Slacks this close to the most (a fraction of the binding target, as slacks are) are comparable
#: for routing (``_pick``): of those, the replica with the fewest gateway requests wins. 1 % of the
#: target (20 ms of the default 2 s TTFT, 1 ms of its 100 ms TPOT) is within the forecast's own
#: error (``forecast_margin`` defaults to 15 % of the forecast) while a replica is far from its
#: targets; near them, slacks differ by more and the most slack decides.
_SLACK_TIE: Final = 0.01
#: Seconds an idle replica refuses requests on their own targets (its forecast of them misses)
#: before it takes the next such one anyway, and between two such probes (``SloAdmitter._probe``).
PROBE_AFTER_S: Final = 2.0
#: Most forecasts kept per replica state in ``_evaluate``'s memo (cleared when exceeded).
_FORECASTS_KEPT: Final = 256
#: A probe's outcome on one candidate: (the protected class, its probe's TTFT, its TPOT), seconds,
#: margins applied.
_Probe = tuple[ClassSettings, float, float]
#: Shared by every candidate of a class that yields to none (never mutated).
_NO_PROBES: Final[list[_Probe]] = []


@dataclass(frozen=True, slots=True)
class Admit:
    """Send the request to ``replica`` now.

    ``forecast``: the prediction there, stale margin applied (for the prediction headers).
    ``slack``: the replica's slack, >= 0 (NaN on a replica with no step model yet; < 0 for a
    probe of an idle replica, ``SloAdmitter._probe``).
    """

    replica: str
    forecast: Forecast | None
    slack: float
    enforced: bool = True

    @property
    def admits(self) -> bool:
        """The caller sends the request to ``replica`` now."""
        return True


@dataclass(frozen=True, slots=True)
class Queue:
    """Hold the request in Sluice's queue: no replica can take it now, but one should in time.

    ``blocker``: what keeps it off its best replica. ``earliest_retry_s``: predicted seconds until
    a replica could take it (worth scheduling a re-evaluation then). ``replica``/``forecast``: its
    best replica now. ``entry_id``: its queue entry, set by the controller once queued.
    ``enforced`` False (shadow mode): admit it to ``replica`` anyway.
    """

    blocker: Blocker
    earliest_retry_s: float
    replica: str | None
    forecast: Forecast | None
    enforced: bool = True
    entry_id: int | None = None

    @property
    def reason(self) -> Blocker:
        """Why it waits (same as ``blocker``)."""
        return self.blocker

    @property
    def admits(self) -> bool:
        """The caller sends the request to ``replica`` now (shadow mode)."""
        return not self.enforced and self.replica is not None


@dataclass(frozen=True, slots=True)
class Reject:
    """Refuse the request.

    ``retry_after``: when to come back; ``None`` means retrying cannot help (prompt too large,
    targets unattainable even on an idle replica). ``message``: one line for the client and the log.
    ``forecast``: the prediction on the best replica, if any. ``enforced`` False (shadow mode):
    admit it to ``replica`` anyway.
    """

    reason: RejectReason
    retry_after: RetryAfter | None
    forecast: Forecast | None
    message: str
    blocker: Blocker | None = None
    replica: str | None = None
    enforced: bool = True

    @property
    def admits(self) -> bool:
        """The caller sends the request to ``replica`` now (shadow mode)."""
        return not self.enforced and self.replica is not None

    @property
    def retry_after_s(self) -> float | None:
        """The jittered delay in seconds, ``None`` when not retryable."""
        return None if self.retry_after is None else self.retry_after.delay_s


Decision = Admit | Queue | Reject


class Admitter(Protocol):
    """Decides one request against the current replica views. Pure: ``now`` is the only clock."""

    def decide(
        self, request: AdmissionRequest, views: Sequence[ReplicaView], now: float, *, queued: bool = False
    ) -> Decision:
        """``queued``: the request is already in Sluice's queue (being re-evaluated): it then gets
        ``Queue`` to stay, ``Admit`` to go, or ``Reject`` with ``deadline_exceeded``."""
        ...


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
    request's regime (``ReplicaView.correction``), applied to its TTFT and to its TPOTs.
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

    @property
    def forecast(self) -> Forecast | None:
        """The forecast with the margins applied (``None`` without a step model)."""
        if self._forecast is None and self.raw is not None:
            known = self.known
            key = (self.scale, self.ttft_factor, self.tpot_factor)
            if known is not None and known.forecast is not None and known.scale == key:
                self._forecast = known.forecast
            else:
                self._forecast = forecast_of(self.raw, self.scale, self.ttft_factor, self.tpot_factor)
                if known is not None:
                    known.scale, known.forecast = key, self._forecast
        return self._forecast


class _Known:
    """One memoised forecast (``SloAdmitter._forecast``): the predictor's numbers and the
    ``Forecast`` object last built from them, with the (scale, TTFT factor, TPOT factor) it was
    built at."""

    __slots__ = ("forecast", "scale", "values")

    def __init__(self, values: ForecastValues) -> None:
        self.values = values
        self.scale: tuple[float, float, float] | None = None
        self.forecast: Forecast | None = None


class _Forecasts:
    """``_evaluate``'s memo for one replica: forecasts made on ``state`` with ``model``, by request.

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
    )


def _idle_after_s(state: ReplicaState, step_s: float) -> float:
    """Predicted seconds until every request on the replica in ``state`` has finished, its decode
    steps taking ``step_s`` each: the step in progress, then the last of its running and queued
    requests to finish, each with memoryless remaining output of the state's mean (``n`` of them
    all finish after ``mean x H_n`` steps). 0 for an idle replica; ``inf`` when ``step_s`` is not
    a number."""
    n = state.decode_seqs + state.queued_requests
    if n <= 0:
        return state.step_remaining_s
    if not step_s >= 0.0:
        return _INF
    rest = state.mean_remaining_output_tokens or DEFAULT_REMAINING_TOKENS
    return state.step_remaining_s + rest * (math.log(n + 0.5) + _EULER) * step_s


def _idle(state: ReplicaState) -> ReplicaState:
    """The same replica with nothing running or waiting."""
    return ReplicaState(
        0,
        0,
        0,
        0,
        state.kv_capacity_tokens,
        state.max_num_seqs,
        state.max_num_batched_tokens,
        state.max_model_len,
    )


def _is_idle(view: ReplicaView) -> bool:
    """Nothing runs or waits on ``view``'s replica, none of the gateway's requests is there, and
    its metrics are fresh."""
    state = view.state
    return (
        not view.stale
        and view.gateway_streams == 0
        and state.num_running == 0
        and state.num_waiting == 0
        and state.queued_requests == 0
    )


def _unloaded(view: ReplicaView) -> bool:
    """None of the gateway's requests is on ``view``'s replica and nothing waits there: the load
    a margin was learned under has gone. Unlike ``_is_idle``, a request the engine still runs by
    the last scrape counts as gone once the gateway saw it end (scrapes lag by up to an interval,
    and light traffic would otherwise always find the replica busy)."""
    state = view.state
    return view.gateway_streams == 0 and state.num_waiting == 0 and state.queued_requests == 0


def _as_judged(c: _Candidate, now: float) -> Forecast | None:
    """``c``'s forecast with the TTFT admission held against the deadline (margins and the
    replica's dispatch overhead in): what a refusal's prediction headers and message both cite."""
    f = c.forecast
    if f is None or not math.isfinite(c.ttft_s) or c.ttft_s == f.ttft_s:
        return f
    return f.with_overhead(c.ttft_s, f.overhead_s + c.ttft_s - f.ttft_s, now)


def _blocker_story(cls: ClassSettings, c: _Candidate, blocker: Blocker) -> str:
    """The failing forecast behind ``blocker`` with its target, in the prediction headers' units
    (its own TPOT), or the constraint's name."""
    f = c.forecast
    if blocker == Blocker.TPOT and f is not None:
        return (
            f"its predicted time per output token {f.tpot_s * 1e3:.2f} ms exceeds the "
            f"{cls.tpot_target_s * 1e3:.3g} ms target"
        )
    return f"the replica's load ({blocker}) blocks it"


def _enforced_slots(shadow: ShadowSettings) -> tuple[int, ...]:
    skipped = {Rule.SLO: shadow.slo, Rule.PROTECT_STREAMS: shadow.protect_streams}
    skipped[Rule.BATCH_ISOLATION] = shadow.batch_isolation
    return tuple(i for rule, slots in _RULE_SLOTS.items() if not skipped[rule] for i in slots)


class SloAdmitter:
    """The SLO admitter (``policy: slo``): see the module docstring for the rules.

    ``forecast_config`` is passed through to the predictor's forecast.
    """

    def __init__(
        self,
        settings: AdmissionSettings,
        retry: RetryAfterPolicy,
        *,
        forecast_config: ForecastConfig | None = None,
        shadow_all: bool = False,
    ) -> None:
        self._settings = settings
        self._retry = retry
        self._fc = forecast_config if forecast_config is not None else ForecastConfig()
        #: Forecast multipliers: every replica, and a replica whose metrics are stale.
        self._fresh_scale = 1.0 + settings.forecast_margin
        self._stale_scale = self._fresh_scale * (1.0 + settings.stale_margin)
        shadow = settings.shadow
        if shadow_all:
            shadow = ShadowSettings(slo=True, protect_streams=True, batch_isolation=True, prompt_size=True)
        self._shadow = shadow
        self._all = tuple(range(len(_SLOTS)))
        self._enforced = _enforced_slots(shadow)
        self._all_enforced = self._enforced == self._all
        self._slo_enforced = not shadow.slo
        self._default = settings.classes[settings.default_class]
        #: (TPOT target, max stall, stall-budget horizon) per class, for the streams already running.
        self._stream_limits = {
            n: (c.tpot_target_s, c.max_stall_s, c.stall_budget_horizon) for n, c in settings.classes.items()
        }
        #: ``_hopeless``'s memo: idle copies of replica states by their limits, and forecasts on
        #: them by (request, limits) -> (the step model it was made with, TTFT, TPOT), unscaled.
        #: A flood of rejections is mostly alike requests: one forecast for all of them, not one
        #: per request (a replica's refit gives it a new model object, which misses the memo).
        self._idle_states: dict[tuple[int, int, int, int], ReplicaState] = {}
        self._idle_forecasts: dict[
            tuple[CandidateRequest, tuple[int, int, int, int]], tuple[StepModel, float, float]
        ] = {}
        #: ``_evaluate``'s memo, per replica name: the forecast of a request on a view is a pure
        #: function of (request, state, step model, forecast config), and a view lives for many
        #: decisions (an engine step; ``gateway.admission.live``), so alike requests (a flood)
        #: share one forecast and one ``Forecast`` object per view instead of one each.
        self._forecasts: dict[str, _Forecasts] = {}
        #: ``_probe``'s history: per idle replica name, since when it has refused requests on
        #: their own targets (or when it was last probed), seconds.
        self._refusing_since: dict[str, float] = {}
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

    @property
    def settings(self) -> AdmissionSettings:
        return self._settings

    # -- the decision ------------------------------------------------------------------------

    def decide(
        self, request: AdmissionRequest, views: Sequence[ReplicaView], now: float, *, queued: bool = False
    ) -> Decision:
        """Admit, queue or reject ``request`` given ``views`` at ``now`` (see ``Admitter``)."""
        s = self._settings
        name = request.request_class if request.request_class in s.classes else s.default_class
        cls = s.classes[name]
        prompt_reject = self._class_prompt_check(request, cls)
        if prompt_reject is not None and prompt_reject.enforced:
            return prompt_reject
        deadline = request.first_token_deadline_s(cls)
        candidates: list[_Candidate] = []
        fits_somewhere = False
        need_len, need_kv = request.min_model_len, request.min_kv_tokens
        evaluate = self._evaluate
        for view in views:
            state = view.state
            if state.max_model_len >= need_len and state.kv_capacity_tokens >= need_kv:
                fits_somewhere = True
                if view.healthy:
                    c = evaluate(request, name, cls, view, now, deadline)
                    if c is not None:
                        candidates.append(c)
        if views and not fits_somewhere:
            return Reject(
                RejectReason.PROMPT_TOO_LARGE,
                None,
                None,
                f"{request.prompt_tokens} prompt tokens (plus the output cap) exceed every replica's "
                "context length or KV cache",
                Blocker.PROMPT_SIZE,
            )
        if not candidates:
            if queued:
                return Queue(Blocker.NO_REPLICA, s.retry_after.no_replica_s, None, None)
            return Reject(
                RejectReason.NO_HEALTHY_REPLICA,
                self._retry.no_replica(),
                None,
                "no healthy replica can serve this request right now",
                Blocker.NO_REPLICA,
            )
        best_all = self._pick(candidates, enforced=False)
        if best_all is not None and prompt_reject is None:
            return self._admit(best_all)
        if self._all_enforced and prompt_reject is None:
            return self._probe(
                candidates, now, self._blocked(request, cls, candidates, now, deadline, queued, self._all)
            )
        best_enforced = self._pick(candidates, enforced=True)
        if best_enforced is not None:
            full: Queue | Reject
            if prompt_reject is not None:
                full = prompt_reject
            else:
                full = self._blocked(request, cls, candidates, now, deadline, queued, self._all)
            return replace(
                full, enforced=False, replica=best_enforced.view.name, forecast=best_enforced.forecast
            )
        return self._probe(
            candidates, now, self._blocked(request, cls, candidates, now, deadline, queued, self._enforced)
        )

    def _probe(self, candidates: list[_Candidate], now: float, blocked: Queue | Reject) -> Decision:
        """``blocked``, or an ``Admit`` to its replica when that replica is idle (``_is_idle``),
        the request fails only its own targets there (TTFT or TPOT), and the replica has refused
        such requests for ``PROBE_AFTER_S`` since it went idle or since its last probe.

        On an idle replica a forecast is the step model's alone, and the fit learns only from
        traffic: one taught by a burst (a host too busy to step at speed) can refuse everything
        for good, without a Retry-After, on a replica that would serve it. A probe every few
        seconds lets the replica's own steps correct it; it costs an idle replica one request at
        a time. The history is per replica name; an admission or a busy view there resets it."""
        name = blocked.replica
        if not blocked.enforced or name is None or blocked.blocker not in (Blocker.TTFT, Blocker.TPOT):
            return blocked
        for c in candidates:
            if c.view.name == name:
                break
        else:
            return blocked
        if c.slacks is None or not _is_idle(c.view):
            self._refusing_since.pop(name, None)
            return blocked
        since = self._refusing_since.setdefault(name, now)
        if now - since < PROBE_AFTER_S:
            return blocked
        self._refusing_since[name] = now
        return Admit(name, c.forecast, c.slack)

    def _class_prompt_check(self, request: AdmissionRequest, cls: ClassSettings) -> Reject | None:
        """``prompt_too_large`` (never retryable) over the class's ``max_prompt_tokens`` (``enforced``
        False when that rule is shadowed). A prompt over every replica's context length or KV cache
        is refused in ``decide`` (always enforced: the engine would refuse it)."""
        if request.prompt_tokens <= cls.max_prompt_tokens:
            return None
        return Reject(
            RejectReason.PROMPT_TOO_LARGE,
            None,
            None,
            f"{request.prompt_tokens} prompt tokens exceed this class's limit of {cls.max_prompt_tokens}",
            Blocker.PROMPT_SIZE,
            enforced=not self._shadow.prompt_size,
        )

    def _evaluate(
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
        memo = self._forecast(request.candidate(state.max_model_len), view)
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
        if margins and _unloaded(view):
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
        # prefill joins): what the gateway measured there over what the step model forecast.
        batch = f[11]
        ct, cp = view.correction.factors(
            request.prompt_tokens, state.decode_seqs if batch is None else batch[1]
        )
        ttft, tpot, infl = f[0] * scale * ct + overhead, f[1] * scale * cp, f[2] * scale * cp
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
                slots = self._slot_limit(cls, view)
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
            after = with_queued(state, request.prompt_tokens, request.cached_prompt_tokens)
            keep = 1.0 - self._settings.yield_margin
            for protected, probe in plan:
                pf = forecast_values(probe, after, view.model, self._fc)
                pb = pf[11]
                pt, pp = view.correction.factors(
                    probe.prompt_tokens, after.decode_seqs if pb is None else pb[1]
                )
                p_ttft = (pf[0] - elapsed) * base * pt + _overhead_s(d, pf, view.model)
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
        return view.model.step_time(batch) * self._scale(view)

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

    def _scale(self, view: ReplicaView) -> float:
        """Forecast multiplier on ``view``: ``1 + forecast_margin`` (times ``1 + stale_margin`` when
        its metrics are stale)."""
        return self._stale_scale if view.stale else self._fresh_scale

    def _slot_limit(self, cls: ClassSettings, view: ReplicaView) -> int:
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

    def _pick(self, candidates: list[_Candidate], *, enforced: bool) -> _Candidate | None:
        """The candidate to route to among those admissible under every rule (or, with
        ``enforced``, under the enforced rules only): of those whose slack is within ``_SLACK_TIE``
        of the most, the one with the fewest of the gateway's requests (then the most slack, then
        the first listed); replicas without a step model only when no modelled one is admissible
        (the one with the fewest of the gateway's requests).

        Comparable slacks are balanced by the gateway's count, least-outstanding style, instead of
        ranked on differences below the forecasts' error: ranked on them, the replica whose fit is
        a little slower (its prior, or a fit from a few windows on a busy host) got nothing while
        others took every request, and without requests its fit never learned otherwise. The
        choice does not depend on the order the candidates are listed in unless they tie fully.
        Ranked by the full slack even when some rules are shadowed: routing stays the same."""
        top = -_INF
        fallback: _Candidate | None = None
        modelled: list[_Candidate] = []
        for c in candidates:
            if (c.slack_enforced if enforced else c.slack) < 0.0:
                continue
            if c.slacks is None:
                if fallback is None or c.view.gateway_streams < fallback.view.gateway_streams:
                    fallback = c
            else:
                modelled.append(c)
                if c.slack > top:
                    top = c.slack
        if top == -_INF:
            return fallback
        floor = top - _SLACK_TIE
        best: _Candidate | None = None
        for c in modelled:
            if not c.slack >= floor:
                continue
            if best is None:
                best = c
                continue
            streams, best_streams = c.view.gateway_streams, best.view.gateway_streams
            if streams < best_streams or (streams == best_streams and c.slack > best.slack):
                best = c
        return best

    def _admit(self, c: _Candidate) -> Admit:
        if self._refusing_since:
            self._refusing_since.pop(c.view.name, None)
        return Admit(c.view.name, c.forecast, c.slack if c.slacks is not None else math.nan)

    # -- blocked: queue or reject ------------------------------------------------------------

    def _blocked(
        self,
        request: AdmissionRequest,
        cls: ClassSettings,
        candidates: list[_Candidate],
        now: float,
        deadline: float,
        queued: bool,
        slots: tuple[int, ...],
    ) -> Queue | Reject:
        """The decision when no candidate passes the constraints in ``slots``."""
        best: _Candidate | None = None
        best_first = best_wait = best_retry = _INF
        for c in candidates:
            if c.slacks is None or c.raw is None:
                continue
            wait, retry = self._waits(request, cls, c, slots)
            first = now + wait + c.ttft_s
            if best is None or first < best_first:
                best, best_first, best_wait = c, first, wait
            best_retry = min(best_retry, retry)
        if best is None or best.forecast is None:
            return self._blocked_unmodelled(request, cls, candidates, now, queued)
        blocker = self._blocker(best, slots)
        forecast = best.forecast
        checks_slo = _TTFT in slots
        assert best.slacks is not None
        can_queue = queued or (cls.queue_capacity > 0 and cls.max_queue_wait_s > 0.0)
        late_now = best.slacks[_TTFT] < 0.0
        # Late even after the wait: refused at once. A request that cannot wait in the queue is
        # refused anyway; it is refused for its first token only when that forecast fails now,
        # else for the constraint that does (below), so that the message, the reason and the
        # prediction headers name the forecast that failed.
        if checks_slo and best_first > deadline and (can_queue or late_now):
            reason = RejectReason.DEADLINE_EXCEEDED
            if not queued and not request.client_bound(cls):
                reason = RejectReason.SLO_UNATTAINABLE
            hopeless = not math.isfinite(best_retry) or self._hopeless(request, cls, best)
            after = None if hopeless else self._retry.after(best_retry)
            wait = best_wait if can_queue else 0.0
            first = now + wait + best.ttft_s
            return Reject(
                reason,
                after,
                _as_judged(best, now),
                self._late_message(request, cls, best, blocker, wait, first, deadline, hopeless),
                blocker,
                best.view.name,
            )
        queue_deadline = (
            request.queue_deadline_s(cls) if checks_slo else request.arrival_s + cls.max_queue_wait_s
        )
        fits_queue = now + best_wait <= queue_deadline
        if queued:
            if fits_queue:
                return Queue(blocker, best_wait, best.view.name, forecast)
            return Reject(
                RejectReason.DEADLINE_EXCEEDED,
                self._retry.after(best_retry),
                forecast,
                f"still waiting for a replica ({blocker}); predicted to wait past its queue deadline",
                blocker,
                best.view.name,
            )
        if cls.queue_capacity > 0 and cls.max_queue_wait_s > 0.0 and fits_queue:
            return Queue(blocker, best_wait, best.view.name, forecast)
        reason = RejectReason.OVERLOADED if blocker in _LOAD_BLOCKERS else RejectReason.SLO_UNATTAINABLE
        hopeless = not math.isfinite(best_retry) or (
            reason == RejectReason.SLO_UNATTAINABLE and self._hopeless(request, cls, best)
        )
        return Reject(
            reason,
            None if hopeless else self._retry.after(best_retry),
            _as_judged(best, now),
            self._blocked_message(cls, best, blocker, hopeless),
            blocker,
            best.view.name,
        )

    def _blocked_unmodelled(
        self,
        request: AdmissionRequest,
        cls: ClassSettings,
        candidates: list[_Candidate],
        now: float,
        queued: bool,
    ) -> Queue | Reject:
        """Only replicas without a step model, all at their in-flight cap. How long until one has
        room is unknown (no model): a class that queues waits, and its queue deadline decides."""
        guess = self._settings.retry_after.no_replica_s
        if queued or (cls.queue_capacity > 0 and cls.max_queue_wait_s > 0.0):
            return Queue(Blocker.UNMODELLED, guess, candidates[0].view.name, None)
        return Reject(
            RejectReason.OVERLOADED,
            self._retry.after(guess),
            None,
            "every replica is still being calibrated and at its in-flight limit",
            Blocker.UNMODELLED,
            candidates[0].view.name,
        )

    @staticmethod
    def _blocker(c: _Candidate, slots: tuple[int, ...]) -> Blocker:
        """The violated constraint with the least slack (among ``slots``)."""
        assert c.slacks is not None
        i = min(slots, key=c.slacks.__getitem__)
        return _SLOTS[i]

    def _waits(
        self, request: AdmissionRequest, cls: ClassSettings, c: _Candidate, slots: tuple[int, ...]
    ) -> tuple[float, float]:
        """(seconds until the failing non-TTFT constraints could hold, seconds until a fresh retry
        could be admitted here): the first delays its first token, the second is its Retry-After."""
        assert c.slacks is not None
        wait = 0.0
        for i in slots:
            if c.slacks[i] < 0.0 and i != _TTFT:
                wait = max(wait, self._wait_for(i, request, cls, c))
        retry = wait
        if _TTFT in slots and c.slacks[_TTFT] < 0.0:
            retry = max(retry, ttft_excess_s(c.ttft_s, request.fresh_ttft_budget_s(cls)))
        # Once everything on the replica now has finished, it is idle, where the request fits
        # unless even an idle copy would miss (``_hopeless``, the reason an estimate is ``inf``):
        # no finite estimate is longer than that. The gateway's own streams there are known one
        # by one (``max_finish_s``), the rest from the state's mean, at the forecast's TPOT.
        idle = _idle_after_s(c.view.state, c.tpot_s)
        for load in c.view.loads.values():
            if load.max_finish_s > idle:
                idle = load.max_finish_s
        if wait > idle and math.isfinite(wait):
            wait = idle
        if retry > idle and math.isfinite(retry):
            retry = idle
        return wait, retry

    def _wait_for(self, slot: int, request: AdmissionRequest, cls: ClassSettings, c: _Candidate) -> float:
        """Predicted seconds until constraint ``slot`` would hold on ``c`` (drain estimates)."""
        view = c.view
        assert c.raw is not None
        state, model = view.state, view.model
        tpot, output = c.tpot_s, c.output_tokens
        name = (
            request.request_class
            if request.request_class in self._settings.classes
            else self._settings.default_class
        )
        own = view.loads.get(name)
        if slot == _TPOT:
            drain = decode_drain_s(state, model, tpot - cls.tpot_target_s, tpot)
            if math.isinf(drain) and self._idle_forecast(request, c)[1] <= cls.tpot_target_s:
                # No number of running decodes leaving brings the TPOT under target, yet an idle
                # copy meets it: the excess is the replica's load as a whole (the steady state
                # its recent arrivals settle at, which a burst inflates), not its batch. That
                # passes as the running requests are replaced: wait a typical one's duration,
                # not forever (which would refuse the request as hopeless, without Retry-After).
                return self._or_typical(0.0, state, tpot)
            return drain
        if slot == _STREAMS:
            infl, extra = c.inflicted_tpot_s, view.extra_tpot_s
            waits = []
            for stream_class, load in view.loads.items():
                limit = self._settings.classes.get(stream_class, self._default).tpot_target_s - infl - extra
                if load.max_tpot_s > limit:
                    waits.append(load.wait_for_tpot_below_s(limit))
            return self._or_typical(max(waits, default=0.0), state, tpot)
        if slot == _STALL:
            stall = c.inflicted_stall_s
            waits = []
            for stream_class, load in view.loads.items():
                k = self._settings.classes.get(stream_class, self._default)
                over = k.max_stall_s is not None and k.max_stall_s < stall
                if over or k.stall_budget_horizon is not None:
                    waits.append(load.max_finish_s)
            return self._or_typical(max(waits, default=0.0), state, tpot)
        if slot == _KV:
            limit = kv_share_limit(cls.kv_share, state)
            used = own.kv_tokens if own is not None else 0.0
            if request.prompt_tokens + output > limit:
                return _INF  # larger than the whole share: never here
            need_kv = used + request.prompt_tokens + output - limit
            return self._or_typical(own.wait_for_kv_s(need_kv) if own is not None else 0.0, state, tpot)
        if slot == _SLOT and own is not None:
            limit_seqs = self._slot_limit(cls, view)
            return self._or_typical(own.wait_for_finishes_s(own.seqs + 1 - limit_seqs), state, tpot)
        if slot == _YTTFT:
            keep = 1.0 - self._settings.yield_margin
            return max((ttft_excess_s(pt, keep * p.ttft_target_s) for p, pt, _ in c.probes), default=0.0)
        if slot == _YTPOT:
            keep = 1.0 - self._settings.yield_margin
            return max(
                (decode_drain_s(state, model, pp - keep * p.tpot_target_s, pp) for p, _, pp in c.probes),
                default=0.0,
            )
        return self._or_typical(0.0, state, tpot)

    @staticmethod
    def _or_typical(wait: float, state: ReplicaState, tpot_s: float) -> float:
        """``wait``, or when the blocking streams are not known individually (admitted since the
        view was built), the time a typical running request takes to finish at ``tpot_s``."""
        if wait > 0.0:
            return wait
        rest = state.mean_remaining_output_tokens or 256.0
        return rest * tpot_s

    def _hopeless(self, request: AdmissionRequest, cls: ClassSettings, c: _Candidate) -> bool:
        """Whether even an idle copy of the replica would miss the TTFT budget or TPOT target (a
        request of one output token has no TPOT)."""
        ttft, tpot = self._idle_forecast(request, c)
        if math.isnan(ttft):
            return False
        if request.max_tokens_on(c.view.state.max_model_len) <= 1:
            tpot = 0.0
        return ttft > request.fresh_ttft_budget_s(cls) or tpot > cls.tpot_target_s

    def _idle_forecast(self, request: AdmissionRequest, c: _Candidate) -> tuple[float, float]:
        """(TTFT, TPOT) of ``request`` on an idle copy of ``c``'s replica, seconds, with the
        view's margins and dispatch overhead applied as on the replica itself (NaN: no model)."""
        view = c.view
        state = view.state
        candidate = request.candidate(state.max_model_len)
        limits = (
            state.kv_capacity_tokens,
            state.max_num_seqs,
            state.max_num_batched_tokens,
            state.max_model_len,
        )
        key = (candidate, limits)
        model = view.model
        known = self._idle_forecasts.get(key)
        if known is not None and known[0] is model:
            ttft, tpot = known[1], known[2]
        else:
            f = forecast_values(candidate, self._idle(state, limits), model, self._fc)
            ttft, tpot = f[0], f[1]
            if len(self._idle_forecasts) >= _IDLE_FORECASTS_KEPT:
                self._idle_forecasts.clear()
            self._idle_forecasts[key] = (model, ttft, tpot)
        scale = self._scale(view)
        ct, cp = view.correction.factors(request.prompt_tokens, 0.0)
        return ttft * scale * ct + view.dispatch_overhead_s, tpot * scale * cp

    def _idle(self, state: ReplicaState, key: tuple[int, int, int, int]) -> ReplicaState:
        """``_idle(state)``, kept per set of limits (``key``; a replica's limits rarely change)."""
        idle = self._idle_states.get(key)
        if idle is None:
            if len(self._idle_states) >= _IDLE_STATES_KEPT:
                self._idle_states.clear()
            idle = self._idle_states[key] = _idle(state)
        return idle

    @staticmethod
    def _late_message(
        request: AdmissionRequest,
        cls: ClassSettings,
        c: _Candidate,
        blocker: Blocker,
        wait: float,
        first: float,
        deadline: float,
        hopeless: bool,
    ) -> str:
        """Why the first token would be late: the predicted TTFT (the ``x-sluice-predicted-ttft-ms``
        header's number, as judged: margins and dispatch overhead in), after ``wait`` seconds
        for ``blocker`` when it must wait for one."""
        target = (
            "the client's deadline"
            if request.client_bound(cls)
            else f"the {cls.ttft_target_s:.3g} s TTFT target"
        )
        tail = "; not attainable even on an idle replica" if hopeless else ""
        if not math.isfinite(first):
            why = _blocker_story(cls, c, blocker)
            return f"{why}: no replica can take this request within its limits before {target}{tail}"
        late = first - deadline
        ttft = f"predicted TTFT {c.ttft_s * 1e3:.1f} ms"
        if wait > 0.0:
            ttft = f"{_blocker_story(cls, c, blocker)} for about {wait:.3g} s more, then a {ttft}"
        return f"first token predicted {late:.3g} s after {target}: {ttft} (best replica {c.view.name}){tail}"

    @staticmethod
    def _blocked_message(cls: ClassSettings, c: _Candidate, blocker: Blocker, hopeless: bool) -> str:
        """Why no replica takes it now: the forecast that failed, with its target (its numbers as
        the prediction headers print them)."""
        if blocker == Blocker.TPOT:
            tail = "; not attainable even on an idle replica" if hopeless else ""
            return f"{_blocker_story(cls, c, blocker)} (best replica {c.view.name}){tail}"
        return f"no replica can take this request now without breaking its limits ({blocker})"
