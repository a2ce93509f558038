"""``AdmissionEngine``: a request's whole admission lifecycle, sans I/O, on an injected clock.

The one place that decides: the replicas' views (cached, rebuilt on events), one
``AdmissionController`` per route, the queue and its re-evaluation, the timer's next instant,
fairness (weights, output charges), the streams admission tracks per replica, re-placement
when a replica refuses a request as overloaded, the tenant's budget (reserved before the decision,
refunded on a refusal, settled when the request ends) and what is learned when a request ends
(``finish``). Two adapters drive it: the live gateway
(``gateway.admission.live``: futures, the loop's timer, headers) and the virtual-time replay
(``replay.policies.SluicePolicy``). Times are seconds of the adapter's clock, passed in as
``now``; nothing here reads a clock, sleeps, logs on its own or does I/O.

Its inputs are ports: the replicas (``ReplicaSource``: the live registry, or the replay's fleet),
the prediction inputs (``PredictionInputs``: the ``PredictionService``, which also learns from
finished requests) and the tenants' budgets (``gateway.admission.budget.TenantBudget``).

Views are cached per route and replica and rebuilt on events only: anything that changes that
replica's load (a dispatch to it, a finish on it, its scrape), anything's (a health or settings
change: ``changed``), a token of a later engine step landing there (``SAME_STEP_S``), or, while
no request of the gateway's decodes there, the end of the engine step in progress when it was
built (``ReplicaView.usable_until``). In between only the step's phase moves, which the admitter
takes off the step wait (``ReplicaView.step_elapsed_s``). A view is never older than
``view_max_age_s``. A flood of refused requests thus costs about one view build per replica per
engine step, not one per request.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

from gateway.admission.budget import (
    BudgetAnswer,
    BudgetRefused,
    TenantBudget,
    budget_cost,
    budget_retry_after,
    request_cost,
    reserved_output,
)
from gateway.admission.config import AdmissionSettings
from gateway.admission.core import AdmissionController
from gateway.admission.decision import Admit, Decision, Queue, Reject, RejectReason
from gateway.admission.fairness import TokenWeights, VirtualTokenCounter
from gateway.admission.request import AdmissionRequest
from gateway.admission.retry_after import (
    RefusalReason,
    RetryAfter,
    RetryAfterPolicy,
    UniformSource,
    retry_after,
)
from gateway.admission.stats import AdmissionStats
from gateway.admission.views import LiveEntry, ReplicaView, TrackedStream
from predictor import Forecast, ReplicaState, StepModel, unknown_step_model
from predictor.correction import Correction

__all__ = [
    "MAX_TICK_S",
    "MIN_TICK_S",
    "AdmissionEngine",
    "AdmissionReplica",
    "BudgetRefused",
    "Ending",
    "EngineLog",
    "PredictionInputs",
    "ReplicaSource",
    "Resolution",
    "Saturated",
    "Submitted",
    "UnknownModel",
    "expected_output",
    "replica_inputs",
    "route_of",
    "split_route",
]

#: Shortest and longest wait between two timer re-evaluations while requests are queued, seconds.
MIN_TICK_S: Final = 0.005
MAX_TICK_S: Final = 0.25
#: A request whose newest token landed this soon (seconds) before the newest of all on its replica
#: when a view was built had its token of that engine step already (``_Cached.seen``): its next
#: token is of a later step, and makes a new view.
SAME_STEP_S: Final = 0.001
#: Longest a view of a replica running non-streamed requests lives (seconds): their progress is
#: estimated from the clock (``TrackedStream.tokens_at``), with no token to mark it.
UNSEEN_MAX_AGE_S: Final = 0.002
#: Replica capacities for a replica the prediction service cannot describe (never binding).
_UNKNOWN_KV: Final = 1 << 40
_UNKNOWN_LEN: Final = 1 << 30
_NO_MODEL: Final = unknown_step_model("replica unknown to the prediction service")
#: Joins a model and an engine into one route key (a model id never contains a NUL).
_ROUTE_SEP: Final = "\x00"


# -- ports ------------------------------------------------------------------------------------------
class AdmissionReplica(Protocol):
    """A replica as admission sees it (``gateway.replicas.registry.Replica``).

    ``state``: ``"healthy"`` for a replica that may take requests. ``outstanding``: the gateway's
    requests there now. ``saturated_until``: the instant (seconds) until which it asked to be left
    alone after refusing a request as overloaded (its own 429/503)."""

    @property
    def name(self) -> str: ...

    @property
    def state(self) -> str: ...

    @property
    def outstanding(self) -> int: ...

    @property
    def saturated_until(self) -> float: ...

    def serves(self, model: str, engine: str | None = None) -> bool: ...

    def saturated(self, now: float) -> bool: ...


class ReplicaSource(Protocol):
    """The fleet: every replica (``models is None`` when it may serve any model), one by name, and
    the note that one refused a request as overloaded (leave it alone ``back_off_s`` seconds)."""

    def replicas(self) -> Sequence[AdmissionReplica]: ...

    def get(self, name: str) -> AdmissionReplica | None: ...

    def saturate_named(self, name: str, now: float, back_off_s: float, why: str) -> None: ...


class PredictionInputs(Protocol):
    """What admission needs of the prediction service (``PredictionService``)."""

    def replica_inputs(
        self, replica: str, *, model: str, tenant: str | None, in_flight: Sequence[Any], now: float
    ) -> tuple[StepModel, ReplicaState]: ...

    def expected_output(
        self, model: str, tenant: str | None, max_tokens: int | None
    ) -> tuple[float, float]: ...

    def dispatch_overhead_s(self, replica: str) -> float: ...

    def correction(self, replica: str, now: float) -> Correction: ...

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
    ) -> None: ...


class EngineLog(Protocol):
    """Where the engine reports what an operator should see (a ``logging.Logger`` fits)."""

    def exception(self, msg: str, *args: object) -> None: ...

    def warning(self, msg: str, *args: object) -> None: ...

    def info(self, msg: str, *args: object) -> None: ...


class _Quiet:
    def exception(self, msg: str, *args: object) -> None:
        return None

    def warning(self, msg: str, *args: object) -> None:
        return None

    def info(self, msg: str, *args: object) -> None:
        return None


#: Makes the in-flight entry of a request sent to a replica: (request, now, streamed) -> entry.
EntryFactory = Callable[[AdmissionRequest, float, bool], LiveEntry[Any]]


# -- typed results ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class UnknownModel:
    """No replica serves ``model`` (not even an unhealthy one): the client named a wrong model."""

    model: str


@dataclass(frozen=True, slots=True)
class Saturated:
    """Every replica serving ``model`` refused requests as overloaded moments ago (``placed``:
    this request itself was refused by every replica it was placed on). ``retry_after``: the
    jittered ``replicas_saturated`` delay."""

    model: str
    retry_after: RetryAfter
    placed: bool

    @property
    def reason(self) -> RefusalReason:
        return RefusalReason.REPLICAS_SATURATED

    @property
    def message(self) -> str:
        if self.placed:
            return f"the replicas serving `{self.model}` are overloaded right now"
        return f"every replica serving `{self.model}` is overloaded right now"


@dataclass(frozen=True, slots=True)
class Submitted:
    """A decision on a new request. ``key``: the engine's handle on it (``finished``, ``drop``,
    ``replica_refused``; request ids need not be unique). ``replica``/``entry``: where it was sent
    and its in-flight entry (already tracked there) when the decision admits; ``None``
    otherwise. ``queued``: it waits in the queue (a later ``Resolution`` decides it)."""

    key: int
    decision: Decision
    replica: str | None = None
    entry: LiveEntry[Any] | None = None

    @property
    def queued(self) -> bool:
        return isinstance(self.decision, Queue) and self.decision.enforced


@dataclass(frozen=True, slots=True)
class Resolution:
    """A queued request decided by a re-evaluation: dispatched to ``replica`` (``entry`` tracked
    there) or refused (``replica`` and ``entry`` ``None``). ``key``: as ``Submitted.key``."""

    key: int
    request_id: str
    decision: Decision
    replica: str | None
    entry: LiveEntry[Any] | None


@dataclass(frozen=True, slots=True)
class Ending:
    """How a request sent to a replica ended, as its adapter saw it (``AdmissionEngine.finish``).

    ``produced_tokens``: its output tokens (``None``: the tokens its entry saw streamed).
    ``prompt_tokens``: the replica's usage count (``None``: none; the estimate is charged).
    ``finished_at``: when its last token landed, adapter's seconds (``None``: unknown).
    ``ttft_s``: its measured time to first token, seconds. ``forecast``: the forecast to learn
    against (``None``: the one it was dispatched with). ``prompt_chars``/``api``: for the
    characters-per-token and per-API learning (``None``: not known). ``learn``: teach the
    prediction service (``False``: only forget, charge and settle). ``answered``: output did
    come (a token, or a complete non-streamed answer) though neither a usage count nor the
    tokens seen say how much: its budget is charged the output it reserved."""

    produced_tokens: int | None = None
    prompt_tokens: int | None = None
    finished_at: float | None = None
    ttft_s: float | None = None
    forecast: Forecast | None = None
    prompt_chars: int | None = None
    api: str | None = None
    learn: bool = True
    answered: bool = False


@dataclass(frozen=True, slots=True)
class _Hold:
    """An allowed budget reservation: the limiter's answer, the weights it was priced with, the
    prompt estimate and output (all choices) it reserved, and the request's choices (settled
    with the same weights)."""

    answer: BudgetAnswer
    weights: TokenWeights
    prompt_tokens: int
    output_tokens: int
    choices: int


@dataclass(slots=True)
class _Cached:
    """One replica's view for one route, the versions it was built at (everything's, the
    replica's own), and each tracked request there as the view saw it: its tokens streamed, and
    whether its newest token was of the engine step in progress then."""

    view: ReplicaView
    version: int
    replica_version: int
    seen: dict[LiveEntry[Any], tuple[int, bool]]


@dataclass(slots=True)
class _Queued:
    route: str
    entry_id: int
    request: AdmissionRequest
    streamed: bool
    hold: _Hold | None


@dataclass(slots=True)
class _Sent:
    replica: str
    entry: LiveEntry[Any]
    request: AdmissionRequest
    route: str
    forecast: Forecast | None
    hold: _Hold | None
    #: The replica refused it as overloaded; ``placed_again``: its budget waits for the next placement.
    refused: bool = False
    placed_again: bool = False


def route_of(model: str, engine: str | None) -> str:
    """The key admission keeps its controller, queue and views under: the model, plus the engine
    when the request needs one (TGI's native routes). Plain OpenAI requests key by model alone."""
    return model if engine is None else f"{model}{_ROUTE_SEP}{engine}"


def split_route(route: str) -> tuple[str, str | None]:
    """``route_of``'s inverse: (model, engine or ``None``)."""
    model, sep, engine = route.partition(_ROUTE_SEP)
    return model, (engine if sep else None)


def expected_output(
    service: PredictionInputs, model: str, tenant: str | None, max_tokens: int | None
) -> tuple[float, float]:
    """(predicted output tokens, the quantile it is) for a request on ``model`` capped at
    ``max_tokens`` (``None``: no cap), from the service's output-length learning."""
    return service.expected_output(model, tenant, max_tokens)


def replica_inputs(
    service: PredictionInputs,
    replica: str,
    *,
    model: str,
    tenant: str | None,
    in_flight: Sequence[Any],
    now: float,
) -> tuple[StepModel, ReplicaState]:
    """The step model and ``ReplicaState`` the service would forecast ``replica`` with now: the
    gateway's in-flight requests, the last snapshot's other clients and background prefill, the
    step in progress; flagged ``stale`` when the metrics are older than the service trusts."""
    return service.replica_inputs(replica, model=model, tenant=tenant, in_flight=in_flight, now=now)


class AdmissionEngine:
    """Admission for one gateway (or one replay): see the module.

    ``settings``: the ``admission`` section (``reconfigure`` swaps it). ``rng``: the Retry-After
    jitter source (seeded for reproducible runs). ``new_entry``: makes the in-flight entry of a
    request sent to a replica (the live registry's ``LiveRequest``). ``view_max_age_s``: the
    oldest a cached view may be used, seconds. ``log``: where failures and staleness transitions
    are reported (default: nowhere). ``budget``: the tenants' budgets (``None``: no request is
    charged to one).
    """

    def __init__(
        self,
        settings: AdmissionSettings,
        replicas: ReplicaSource,
        predictions: PredictionInputs,
        *,
        rng: UniformSource,
        new_entry: EntryFactory,
        view_max_age_s: float = 0.1,
        log: EngineLog | None = None,
        budget: TenantBudget | None = None,
    ) -> None:
        self._settings = settings
        self._replicas = replicas
        self._predictions = predictions
        self._rng = rng
        self._new_entry = new_entry
        self._view_max_age_s = view_max_age_s
        self._log: EngineLog = log if log is not None else _Quiet()
        self._budget = budget
        #: Budget holds of placements a replica refused, waiting for the request's next placement,
        #: by (tenant, request id), oldest first.
        self._parked: dict[tuple[str, str], list[_Hold]] = {}
        self.stats = AdmissionStats()
        self.fairness = VirtualTokenCounter(TokenWeights.from_queue_settings(settings.queue))
        #: The token weights tenants' budgets are charged with; with ``queue.fairness: tokens`` the
        #: fair-share counters charge the same. ``None``: the queue's costs.
        self.token_weights: Callable[[], TokenWeights] | None = None
        self._controllers: dict[str, AdmissionController] = {}
        #: What admission remembers of the requests it sent, per replica.
        self._streams: dict[str, dict[LiveEntry[Any], TrackedStream[Any]]] = {}
        self._sent: dict[int, _Sent] = {}
        #: Queued requests by key, in the order they were queued.
        self._queued: dict[int, _Queued] = {}
        self._keys = itertools.count()
        self._views: dict[str, dict[str, _Cached]] = {}
        #: Bumped by anything that changes every view (settings, health); per replica, by what
        #: changes that replica's load (a dispatch to it, a finish there, its scrape).
        self._version = 0
        self._replica_versions: dict[str, int] = {}
        self._stale: dict[str, bool] = {}

    # -- settings and fairness ----------------------------------------------------------------------
    @property
    def settings(self) -> AdmissionSettings:
        return self._settings

    def reconfigure(self, settings: AdmissionSettings) -> None:
        """Swap in a new validated ``admission`` section; queued requests and counters stay."""
        if settings == self._settings:
            return
        self._settings = settings
        for controller in self._controllers.values():
            controller.reconfigure(settings)

    def set_tenant_weights(self, weights: Mapping[str, float]) -> None:
        """Fair-share weights of the configured tenants (absent tenants weigh 1)."""
        self.fairness.set_tenant_weights(dict(weights))

    def refresh_fair_weights(self) -> None:
        """Charge fair-share counters with the budgets' current token weights (``token_weights``);
        request-count fairness keeps the queue's own."""
        provider = self.token_weights
        if provider is None:
            return
        if self._settings.queue.fairness != "tokens":
            weights = TokenWeights.from_queue_settings(self._settings.queue)
            if weights != self.fairness.token_weights:
                self.fairness.set_token_weights(weights)
            return
        try:
            weights = provider()
        except Exception:
            self._log.exception("token weights unavailable; fair share keeps its current weights")
            return
        current = self.fairness.token_weights
        if weights is not current and weights != current:
            self.fairness.set_token_weights(weights)

    # -- what the metrics read ----------------------------------------------------------------------
    def queue_lengths(self) -> dict[str, int]:
        """Requests waiting in the queue per configured class (0 included)."""
        lengths = dict.fromkeys(self._settings.classes, 0)
        for controller in self._controllers.values():
            for name, depth in controller.queue.depths().items():
                lengths[name] = lengths.get(name, 0) + depth
        return lengths

    def queued(self) -> int:
        """Requests waiting in the queue, all classes."""
        return sum(len(c.queue) for c in self._controllers.values())

    def queue_order(self) -> list[str]:
        """The queued requests' ids, in the order they were queued."""
        return [q.request.request_id for q in self._queued.values()]

    def controller(self, route: str) -> AdmissionController:
        """The route's controller (made on first use; they share stats and fairness)."""
        controller = self._controllers.get(route)
        if controller is None:
            controller = AdmissionController(
                self._settings, rng=self._rng, stats=self.stats, fairness=self.fairness
            )
            self._controllers[route] = controller
        return controller

    # -- one request --------------------------------------------------------------------------------
    def request(
        self,
        request_id: str,
        route: str,
        *,
        prompt_tokens: int,
        max_tokens: int | None,
        request_class: str,
        arrival_s: float,
        deadline_s: float | None = None,
        tenant: str | None = None,
        choices: int = 1,
    ) -> AdmissionRequest:
        """The request sized for admission: its output predicted at the service's quantile,
        capped by ``max_tokens`` (the cap itself, at quantile 1, when the prediction fails).
        ``choices``: the sequences it decodes (the body's ``n``; its budget pays for each)."""
        model, _ = split_route(route)
        try:
            output, quantile = self._predictions.expected_output(model, None, max_tokens)
        except Exception:
            self._log.exception("output-length prediction failed; assuming the output cap")
            output, quantile = float(max_tokens or 256), 1.0
        return AdmissionRequest(
            request_id=request_id,
            request_class=request_class,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            expected_output_tokens=output,
            arrival_s=arrival_s,
            output_quantile=quantile,
            deadline_s=deadline_s,
            tenant=tenant,
            choices=choices,
        )

    def submit(
        self, request: AdmissionRequest, route: str, now: float, *, streamed: bool = True
    ) -> Submitted | UnknownModel | Saturated | BudgetRefused:
        """Decide a new request on ``route``: its tenant's budget first (``BudgetRefused`` when it
        is spent), then admitted (sent and tracked at once), queued (until a ``reevaluate``
        resolves it) or refused; ``UnknownModel``/``Saturated`` when no replica may take it. A
        budget reserved for a request refused here is refunded at once. ``streamed``: the client
        streams the response (its tokens are seen)."""
        self.refresh_fair_weights()
        hold = self._reserve(request, now)
        if isinstance(hold, BudgetRefused):
            return hold
        candidates = self._candidates(route, now)
        if not isinstance(candidates, list):
            self._refund(hold, now)
            return candidates
        controller = self.controller(route)
        decision = controller.submit(request, self._views_for(route, candidates, now), now)
        key = next(self._keys)
        if isinstance(decision, Queue) and decision.enforced:
            assert decision.entry_id is not None
            self._queued[key] = _Queued(route, decision.entry_id, request, streamed, hold)
            return Submitted(key, decision)
        if not decision.admits:
            self._refund(hold, now)
            return Submitted(key, decision)
        return self._send(key, request, route, decision, now, streamed, hold)

    def _send(
        self,
        key: int,
        request: AdmissionRequest,
        route: str,
        decision: Decision,
        now: float,
        streamed: bool,
        hold: _Hold | None,
    ) -> Submitted:
        replica = self._replica_for(decision, route, now)
        if replica is None:
            self._refund(hold, now)
            return Submitted(key, self.no_replica(decision.forecast))
        entry = self._new_entry(request, now, streamed)
        self._track(key, replica, entry, request, decision.forecast, route, hold)
        return Submitted(key, decision, replica, entry)

    # -- the tenant's budget ------------------------------------------------------------------------
    def budget_cost(self, request: AdmissionRequest) -> float | None:
        """The weighted tokens ``submit`` will reserve of ``request``'s tenant's budget; ``None``
        when it reserves nothing (no budget port, no tenant, or a budget already held for it by a
        placement a replica refused). A live adapter whose limiter is remote fetches the answer
        for this cost before it submits."""
        budget = self._budget
        if budget is None or request.tenant is None:
            return None
        if self._parked.get((request.tenant, request.request_id)):
            return None
        return budget_cost(budget.weights(), request)

    def _reserve(self, request: AdmissionRequest, now: float) -> _Hold | BudgetRefused | None:
        """Reserve ``request``'s cost of its tenant's budget (or take the hold its previous,
        refused placement left); ``None`` when nothing is held for it."""
        budget = self._budget
        tenant = request.tenant
        if budget is None or tenant is None:
            return None
        parked = self._parked.get((tenant, request.request_id))
        if parked:
            hold = parked.pop(0)
            if not parked:
                del self._parked[(tenant, request.request_id)]
            return hold
        weights = budget.weights()
        answer = budget.reserve(request, budget_cost(weights, request), now)
        if answer is None:
            return None
        if not answer.allowed:
            return BudgetRefused(tenant, answer, budget_retry_after(answer))
        return _Hold(answer, weights, request.prompt_tokens, reserved_output(request), request.choices)

    def _refund(self, hold: _Hold | None, now: float) -> None:
        """Give a refused (or never sent) request's reservation back whole."""
        self._settle(hold, 0.0, now)

    def _settle(self, hold: _Hold | None, actual_cost_tokens: float, now: float) -> None:
        if hold is None or self._budget is None:
            return
        try:
            self._budget.settle(hold.answer, actual_cost_tokens, now)
        except Exception:
            self._log.exception("settling tenant %r's budget failed", hold.answer.tenant)

    # -- the end of a request -----------------------------------------------------------------------
    def finish(self, key: int, ending: Ending, now: float) -> list[Resolution]:
        """Request ``key``'s response is over: forget its stream, charge its tenant's output
        after its prompt to the fair-share counters, settle its budget with what it really cost
        (a placement its replica refused and that is placed again keeps its budget for the next
        placement), re-evaluate the queue, then teach the prediction service (``ending.learn``;
        never from a refused placement). Unknown keys only re-evaluate."""
        sent = self._sent.pop(key, None)
        if sent is None:
            return self.reevaluate(now)
        self._forget(sent)
        produced = sent.entry.tokens_streamed if ending.produced_tokens is None else ending.produced_tokens
        produced = max(0, produced)
        request = sent.request
        try:
            self.fairness.charge_output(request.tenant, produced, request.prompt_tokens)
        except ValueError:
            self._log.exception("could not charge %r output tokens to tenant %r", produced, request.tenant)
        hold = sent.hold
        if hold is not None and sent.placed_again:
            self._parked.setdefault((hold.answer.tenant, request.request_id), []).append(hold)
        elif hold is not None:
            self._settle(hold, _spent(hold, ending, produced), now)
        resolutions = self.reevaluate(now)
        # Learned after the re-evaluation, as the live gateway always has: the queue is judged on
        # what was known while the request ran.
        if ending.learn and not sent.refused:
            self._learn(sent, ending)
        return resolutions

    def finished(self, key: int, produced_tokens: int | None, now: float) -> list[Resolution]:
        """``finish`` without learning: request ``key`` ended having produced ``produced_tokens``
        (``None``: the tokens seen)."""
        return self.finish(key, Ending(produced_tokens, learn=False), now)

    def _learn(self, sent: _Sent, ending: Ending) -> None:
        model, _ = split_route(sent.route)
        forecast = sent.forecast if ending.forecast is None else ending.forecast
        ttft, tpot = _relayed(sent.entry, ending)
        try:
            self._predictions.on_finished(
                replica=sent.replica,
                model=model,
                tenant=None,
                prompt_chars=ending.prompt_chars,
                prompt_tokens=ending.prompt_tokens,
                completion_tokens=ending.produced_tokens,
                finished_at=ending.finished_at,
                forecast=forecast,
                ttft_s=ending.ttft_s,
                api=ending.api,
                relayed_ttft_s=ttft,
                relayed_tpot_s=tpot,
            )
        except Exception:
            self._log.exception("prediction service failed on a finished request of replica %s", sent.replica)

    def replica_refused(
        self, key: int, back_off_s: float, why: str, now: float, *, placed_again: bool = False
    ) -> None:
        """The replica request ``key`` was sent to refused it as overloaded (its own
        429/503, asking for ``back_off_s`` seconds): leave it alone that long, so the next
        placement goes elsewhere (``submit`` skips it; ``Saturated`` when every one is).
        ``placed_again``: the adapter submits the request anew after ``finish``; its budget
        stays reserved for that placement instead of being settled."""
        sent = self._sent.get(key)
        if sent is not None:
            sent.refused = True
            sent.placed_again = placed_again
            self._replicas.saturate_named(sent.replica, now, back_off_s, why)

    def saturated(self, model: str, wait_s: float, *, placed: bool = False) -> Saturated:
        """The refusal for a request on ``model`` whose replicas refused as overloaded, the first
        expected to take requests again in ``wait_s`` seconds (jittered)."""
        retry = retry_after(RefusalReason.REPLICAS_SATURATED, wait_s, self._settings.retry_after, self._rng)
        return Saturated(model, retry, placed)

    def no_replica(self, forecast: Forecast | None) -> Reject:
        """The refusal of an admitted request that no replica can take (jittered Retry-After)."""
        retry = RetryAfterPolicy(self._settings.retry_after, self._rng).no_replica()
        return Reject(RejectReason.NO_HEALTHY_REPLICA, retry, forecast, "no healthy replica")

    def drop(self, key: int, now: float) -> bool:
        """Take a queued request out (its client went away; counted as cancelled); a request
        already sent is forgotten without a charge. Either way its budget is refunded. Whether
        it was still queued."""
        queued = self._queued.pop(key, None)
        if queued is not None:
            self.controller(queued.route).cancel(queued.entry_id, now)
            self._refund(queued.hold, now)
            return True
        sent = self._sent.pop(key, None)
        if sent is not None:
            self._forget(sent)
            self._refund(sent.hold, now)
        return False

    # -- events -------------------------------------------------------------------------------------
    def changed(self, now: float) -> list[Resolution]:
        """Every replica's load or health may have changed: views are rebuilt, the queue
        re-evaluated."""
        self._version += 1
        return self.reevaluate(now)

    def on_snapshot(self, replica: str, now: float) -> list[Resolution]:
        """A new snapshot of ``replica``: its views (only its) are rebuilt, the queue re-evaluated."""
        self._touch(replica)
        return self.reevaluate(now)

    def reevaluate(self, now: float) -> list[Resolution]:
        """Offer every route's queued requests to its replicas again; the ones decided, in the
        order they were decided (each dispatch tracked on its replica at once)."""
        if not self._queued:
            return []
        by_entry = {(q.route, q.entry_id): key for key, q in self._queued.items()}
        out: list[Resolution] = []
        for route, controller in self._controllers.items():
            if len(controller.queue) == 0:
                continue
            candidates = self._candidates(route, now)
            views = self._views_for(route, candidates if isinstance(candidates, list) else [], now)
            result = controller.reevaluate(now, views)
            for entry, decision in result.dispatched:
                key = by_entry.get((route, entry.id))
                queued = self._queued.pop(key, None) if key is not None else None
                if key is None or queued is None:
                    continue
                sent = self._send(key, queued.request, route, decision, now, queued.streamed, queued.hold)
                out.append(
                    Resolution(key, queued.request.request_id, sent.decision, sent.replica, sent.entry)
                )
            for entry, reject in result.rejected:
                key = by_entry.get((route, entry.id))
                queued = self._queued.pop(key, None) if key is not None else None
                if key is not None and queued is not None:
                    self._refund(queued.hold, now)
                    out.append(Resolution(key, queued.request.request_id, reject, None, None))
        return out

    def next_wakeup(self, now: float) -> float | None:
        """When the queue must be re-evaluated next (the earliest queue deadline and predicted
        retry, clamped to ``[now + MIN_TICK_S, now + MAX_TICK_S]``); ``None`` when none waits."""
        if self.queued() == 0:
            return None
        when = math.inf
        for controller in self._controllers.values():
            deadline = controller.next_deadline_s()
            if deadline is not None:
                when = min(when, deadline)
        hint = MAX_TICK_S
        for queued in self._queued.values():
            entry = self.controller(queued.route).queue.entry(queued.entry_id)
            if entry is not None and math.isfinite(entry.earliest_retry_s):
                hint = min(hint, entry.earliest_retry_s)
        return min(when, now + min(max(hint, MIN_TICK_S), MAX_TICK_S))

    def clear(self, now: float | None = None) -> list[int]:
        """Forget every queued request (the gateway is stopping), refunding their budgets (at
        ``now``; ``None``: not refunded, their leases expire); their keys."""
        ids = list(self._queued)
        if now is not None:
            for queued in self._queued.values():
                self._refund(queued.hold, now)
        self._queued.clear()
        return ids

    # -- replicas -----------------------------------------------------------------------------------
    def _candidates(self, route: str, now: float) -> list[AdmissionReplica] | UnknownModel | Saturated:
        """Healthy replicas serving the route's model (and engine), except those that refused a
        request as overloaded moments ago; ``Saturated`` when every one did; ``[]`` when some
        replica could serve it but none is healthy; ``UnknownModel`` when none could."""
        model, engine = split_route(route)
        replicas = self._replicas.replicas()
        healthy = [r for r in replicas if r.state == "healthy" and r.serves(model, engine)]
        if healthy:
            rested = [r for r in healthy if not r.saturated(now)]
            if rested:
                return rested
            return self.saturated(model, min(r.saturated_until for r in healthy) - now)
        if any(r.serves(model, engine) or getattr(r, "models", ()) is None for r in replicas):
            return []
        return UnknownModel(model)

    def _replica_for(self, decision: Decision, route: str, now: float) -> str | None:
        """Where an admitting decision goes: its replica, or for a shadow decision naming none,
        the least-outstanding candidate (``None``: there is none)."""
        name = decision.replica
        if name is not None and self._replicas.get(name) is not None:
            return name
        candidates = self._candidates(route, now)
        if not isinstance(candidates, list) or not candidates:
            return None
        return min(candidates, key=lambda r: r.outstanding).name

    def _track(
        self,
        key: int,
        replica: str,
        entry: LiveEntry[Any],
        request: AdmissionRequest,
        forecast: Forecast | None,
        route: str,
        hold: _Hold | None,
    ) -> None:
        tpot = forecast.tpot_s if forecast is not None and math.isfinite(forecast.tpot_s) else 0.0
        ttft = forecast.ttft_s if forecast is not None else math.nan
        output = request.expected_output_tokens if forecast is None else forecast.output_tokens_used
        self._streams.setdefault(replica, {})[entry] = TrackedStream(
            entry, request.request_class, output, tpot, ttft
        )
        self._sent[key] = _Sent(replica, entry, request, route, forecast, hold)
        self._touch(replica)

    def _forget(self, sent: _Sent) -> None:
        streams = self._streams.get(sent.replica)
        if streams is not None and streams.pop(sent.entry, None) is not None:
            self._touch(sent.replica)

    def _touch(self, replica: str) -> None:
        self._replica_versions[replica] = self._replica_versions.get(replica, 0) + 1

    # -- views --------------------------------------------------------------------------------------
    def views_for(self, route: str, replicas: Iterable[AdmissionReplica], now: float) -> list[ReplicaView]:
        """Views of ``replicas`` for a request on ``route``: each from the cache while it is
        current (see the module), else rebuilt."""
        return self._views_for(route, list(replicas), now)

    def cached_view(self, route: str, replica: str) -> ReplicaView | None:
        """The view of ``replica`` for ``route`` the last decision there used (``None``: none yet)."""
        cached = self._views.get(route, {}).get(replica)
        return None if cached is None else cached.view

    def _views_for(self, route: str, replicas: list[AdmissionReplica], now: float) -> list[ReplicaView]:
        cache = self._views.get(route)
        if cache is None:
            cache = self._views[route] = {}
        version, versions, max_age = self._version, self._replica_versions, self._view_max_age_s
        views: list[ReplicaView] = []
        for replica in replicas:
            name = replica.name
            replica_version = versions.get(name, 0)
            cached = cache.get(name)
            if (
                cached is None
                or cached.version != version
                or cached.replica_version != replica_version
                or not self._current(cached, now, max_age)
            ):
                view = self._view(name, route, now)
                cached = cache[name] = _Cached(view, version, replica_version, self._seen_now(name))
            views.append(cached.view)
        if len(cache) > len(replicas):
            # Replicas that left the fleet (or lost health): their views go.
            for name in [n for n in cache if all(r.name != n for r in replicas)]:
                del cache[name]
        return views

    def _current(self, cached: _Cached, now: float, max_age: float) -> bool:
        """Whether ``cached``'s view (versions unchanged) still describes its replica at ``now``:
        younger than ``max_age``, and no token of a later engine step landed there (a request
        whose token of the view's step had landed got another, or any got two). While some
        tracked request decodes there every step ends with its tokens; otherwise (prefill only)
        the view lasts until the step it was built in is predicted to end. A replica running
        requests whose tokens are not seen has its view rebuilt every ``UNSEEN_MAX_AGE_S``."""
        view = cached.view
        age = now - view.built_at
        if age > max_age:
            return False
        seen = cached.seen
        any_token = unseen = False
        for live in self._streams.get(view.name, {}):
            if not live.streamed:
                unseen = True
            tokens = live.tokens_streamed
            if tokens:
                any_token = True
            before = seen.get(live)
            if before is not None:
                moved = tokens - before[0]
                if moved > 1 or (moved == 1 and before[1]):
                    return False  # the next step's tokens: its phase is not in the view
        if unseen and age > UNSEEN_MAX_AGE_S:
            return False
        return any_token or not (now > view.usable_until and view.state.step_remaining_s > 0.0)

    def _seen_now(self, replica: str) -> dict[LiveEntry[Any], tuple[int, bool]]:
        """Each tracked request on ``replica``: (tokens streamed, whether its newest token landed
        within ``SAME_STEP_S`` of the newest of all there)."""
        streams = self._streams.get(replica)
        if not streams:
            return {}
        newest = max((live.last_token_at or -math.inf for live in streams), default=-math.inf)
        edge = newest - SAME_STEP_S
        return {
            live: (live.tokens_streamed, live.last_token_at is not None and live.last_token_at >= edge)
            for live in streams
        }

    def _view(self, replica: str, route: str, now: float) -> ReplicaView:
        model, _ = split_route(route)
        streams = self._streams.get(replica, {})
        in_flight = [s.in_flight(now) for s in streams.values()]
        try:
            step_model, state = self._predictions.replica_inputs(
                replica, model=model, tenant=None, in_flight=in_flight, now=now
            )
        except Exception:
            self._log.exception("replica state for %s failed; judging it as unmodelled", replica)
            step_model, state = _NO_MODEL, _fallback_state(in_flight)
        self._note_staleness(replica, state.stale)
        running = [s.streaming(now) for s in streams.values()]
        return ReplicaView.build(
            replica,
            healthy=True,
            model=step_model,
            state=state,
            streams=running,
            stale=state.stale,
            built_at=now,
            dispatch_overhead_s=self._predictions.dispatch_overhead_s(replica),
            correction=self._predictions.correction(replica, now),
        )

    def _note_staleness(self, name: str, stale: bool) -> None:
        """Report once per transition that a replica is judged on the gateway's own accounting."""
        if stale == self._stale.get(name, False):
            return
        self._stale[name] = stale
        if stale:
            self._log.warning(
                "replica %s: metrics stale; admission judges it by Sluice's in-flight requests and its "
                "last fitted model, predictions +%.0f %%",
                name,
                self._settings.stale_margin * 100,
            )
        else:
            self._log.info("replica %s: metrics fresh again; admission uses them", name)


def _spent(hold: _Hold, ending: Ending, produced: int) -> float:
    """Weighted tokens a request that reached its replica really cost: the replica's prompt
    count, else the estimate reserved; its output tokens (usage, else the tokens seen); when
    neither says and output did come (``ending.answered``), the output reserved."""
    prompt = hold.prompt_tokens if ending.prompt_tokens is None else ending.prompt_tokens
    if ending.produced_tokens is None and produced == 0 and ending.answered:
        produced = hold.output_tokens
    return request_cost(hold.weights, prompt, produced, hold.choices)


def labels(decision: Decision) -> tuple[str, str]:
    """(decision, reason) for an outcome record: admitted/ok, queued, shadow_rejected or
    shadow_queued with the rule's reason, rejected with the ``RejectReason``."""
    if isinstance(decision, Admit):
        return "admitted", "ok"
    if isinstance(decision, Queue):
        if decision.enforced:
            return "queued", decision.blocker.value
        return "shadow_queued", decision.blocker.value
    if decision.enforced:
        return "rejected", decision.reason.value
    return "shadow_rejected", decision.reason.value


def _relayed(entry: LiveEntry[Any], ending: Ending) -> tuple[float | None, float | None]:
    """(TTFT, TPOT) of a finished request as its adapter relayed it, seconds: dispatch to first
    token, and the mean gap per output token after the first (the last token's time from
    ``ending``, else the entry's; its output tokens from ``ending``, else those streamed).
    ``None`` where not measured (no token; fewer than two)."""
    first = entry.first_token_at
    if first is None:
        return None, None
    ttft = first - entry.started_at
    last = ending.finished_at if ending.finished_at is not None else entry.last_token_at
    tokens = ending.produced_tokens if ending.produced_tokens is not None else entry.tokens_streamed
    tpot = None
    if last is not None and tokens is not None and tokens >= 2 and last > first:
        tpot = (last - first) / (tokens - 1)
    return (ttft if ttft >= 0.0 else None), tpot


def _fallback_state(in_flight: Sequence[Any]) -> ReplicaState:
    return ReplicaState.from_sequences(
        [],
        [f.prompt_tokens for f in in_flight],
        kv_capacity_tokens=_UNKNOWN_KV,
        max_num_seqs=1,
        max_num_batched_tokens=1,
        max_model_len=_UNKNOWN_LEN,
    )
