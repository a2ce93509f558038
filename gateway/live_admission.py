"""SLO-aware admission in the live gateway: the pure core driven by the wall clock and real sockets.

Per request (``LiveAdmission.admit``), after the body is parsed:

1. **class and deadline**: the class from the tenant's policy or the class header it may use
   (``admission.choose_class``), the client's deadline header (it only ever tightens the class's
   TTFT target; a malformed one is a 400);
2. **sizes**: the request's one prompt estimate (``gateway.sizing``: the tenancy middleware's,
   when it sized it first), output predicted at the service's quantile, capped by ``max_tokens``;
3. **views**: one ``ReplicaView`` per healthy replica serving the model, from the prediction
   service's fitted step model and its state (the gateway's own in-flight requests, fresh, plus
   what the last scrape adds; stale metrics are flagged so the admitter adds ``stale_margin``),
   with Sluice's streams there (their classes and predicted TPOT);
4. **the decision** (``AdmissionController.submit``): ``Admit`` -> the request goes to the
   replica the admitter chose (not a least-outstanding pick); ``Queue`` -> the handler awaits a
   future that a re-evaluation resolves; ``Reject`` -> a typed error (``gateway.errors``).
   Shadow decisions admit to the replica named (or, when none is, the least-outstanding one).

Re-evaluation runs on every request finish, on every scrape snapshot, and on a timer set to the
earliest of the queue's next hard deadline and its entries' predicted retry times (clamped to
``[MIN_TICK_S, MAX_TICK_S]``). A client that goes away while queued is cancelled from the queue.

One ``AdmissionController`` per model (requests for a model may only go to replicas serving
it); they share one ``AdmissionStats`` and one tenant fairness counter.

Views are cached per model and replica and rebuilt on events only: anything that changes that
replica's load here (a dispatch to it, a finish on it, its scrape), anything's (a health or
settings change), a token of a later engine step landing there (``_SAME_STEP_S``), or, while no
request of the gateway's decodes there, the end of the engine step in progress when it was built,
as the step model predicts it (``ReplicaView.usable_until``: a step that emits no token, a chunk
of a long prompt, has no other mark). In between, only the step's phase moves, and the admitter
takes the time elapsed off the step wait (``ReplicaView.step_elapsed_s``): a reused view
forecasts what a fresh one would. A view is never older than ``view_max_age_s`` (what ages
without an event: metrics going stale). A flood of requests that are rejected thus costs about
one view build per replica per engine step, not one per request, and a request dispatched to one
replica does not make the next decision rebuild the other replicas' views (a build is
O(requests in flight there)).

Cost per decision (``bench/admission_cost.py``, ``bench/rejection_flood.py``): one forecast per
healthy replica serving the model and the admission arithmetic; the prediction service's
``replica_inputs`` (the O(in-flight) state build) runs only when a view is rebuilt.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

from aiohttp import web

from gateway.admission import (
    AdmissionController,
    AdmissionRequest,
    AdmissionSettings,
    AdmissionStats,
    Admit,
    Decision,
    InvalidHeader,
    Queue,
    Reject,
    RejectReason,
    ReplicaView,
    RetryAfter,
    RetryAfterPolicy,
    UniformSource,
    VirtualTokenCounter,
    choose_class,
    client_deadline_s,
    decision_headers,
)
from gateway.admission.fairness import TokenWeights
from gateway.admission.retry_after import RefusalReason, retry_after
from gateway.admission.views import TrackedStream
from gateway.errors import (
    ClientClosedRequest,
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    Refused,
    admission_error,
    refusal_reason_headers,
)
from gateway.forecasts import (
    PREDICTION_HEADER,
    PREDICTION_HEADERS,
    REPLICA_HEADER,
    LivePredictions,
    forecast_headers,
)
from gateway.observability.logs import RequestOutcome
from gateway.openai_api import ParsedRequest
from gateway.prediction.service import PredictionService
from gateway.prediction.state import Limits
from gateway.replicas.registry import LiveRequest, Replica, ReplicaRegistry
from gateway.replicas.snapshot import InFlight, ReplicaSnapshot
from gateway.settings import Settings
from gateway.sizing import estimated_prompt_tokens
from gateway.store import SettingsStore
from gateway.tenancy import TENANT
from gateway.tenants import Tenant
from predictor import Forecast, ForecastReason, ReplicaState, StepModel, unknown_step_model

__all__ = ["ADMISSION", "LiveAdmission", "Ticket", "expected_output", "replica_inputs"]

log = logging.getLogger("sluice.admission")

#: Shortest and longest wait between two timer re-evaluations while requests are queued, seconds.
MIN_TICK_S: Final = 0.005
MAX_TICK_S: Final = 0.25
#: Limits of a replica the prediction service does not know (never binding).
_UNKNOWN_LIMITS: Final = Limits(1 << 40, 1, 1, 1 << 30)
_NO_MODEL: Final = unknown_step_model("replica unknown to the prediction service")
#: A request whose newest token landed this soon (seconds) before the newest of all on its replica
#: when a view was built had its token of that engine step already (``_Cached.seen``): its next
#: token is of a later step, and makes a new view.
_SAME_STEP_S: Final = 0.001
#: Longest a view of a replica running non-streamed requests lives (seconds): their progress is
#: estimated from the clock (``TrackedStream.tokens_at``), with no token to mark it.
_UNSEEN_MAX_AGE_S: Final = 0.002


@dataclass(slots=True)
class Ticket:
    """A request admission let through: where it goes and what was decided.

    ``live``: its in-flight entry (already counted in admission's accounting; the proxy leases
    it on ``replica``). ``forecast``: the forecast on ``replica`` when it was dispatched (stale
    margin applied; ``None`` without a step model). ``headers``: the ``x-sluice-*`` headers.
    """

    request: AdmissionRequest
    model: str
    replica: Replica
    live: LiveRequest
    decision: Decision
    forecast: Forecast | None
    headers: dict[str, str]
    tenant: str | None
    finished: bool = False


@dataclass(slots=True)
class _Waiter:
    """A queued request's handler, waiting for a re-evaluation to decide it."""

    future: asyncio.Future[Decision]
    controller: AdmissionController
    model: str
    request: AdmissionRequest
    #: Whether the client streams the response (its tokens are seen as they come).
    streamed: bool = True
    #: Filled when it is dispatched: the in-flight entry registered at that moment.
    live: LiveRequest | None = None


@dataclass(slots=True)
class _Cached:
    """One replica's view for one model, the versions it was built at (everything's, the
    replica's own), and each of the gateway's requests there as the view saw it: its tokens
    streamed, and whether its newest token was of the engine step in progress then (landed within
    ``_SAME_STEP_S`` of the newest of all; ``_seen_now``)."""

    view: ReplicaView
    version: int
    replica_version: int
    seen: dict[LiveRequest, tuple[int, bool]]


@dataclass(slots=True)
class _Counters:
    stale: dict[str, bool] = field(default_factory=dict)


def expected_output(
    service: PredictionService, model: str, tenant: str | None, max_tokens: int | None
) -> tuple[float, float]:
    """(predicted output tokens, the quantile it is) for a request on ``model`` capped at
    ``max_tokens`` (``None``: no cap), from the service's output-length learning
    (``PredictionService.expected_output``)."""
    return service.expected_output(model, tenant, max_tokens)


def replica_inputs(
    service: PredictionService,
    replica: str,
    *,
    model: str,
    tenant: str | None,
    in_flight: Sequence[InFlight],
    now: float,
) -> tuple[StepModel, ReplicaState]:
    """The step model and ``ReplicaState`` the service's ``forecast`` would use for ``replica`` now
    (``PredictionService.replica_inputs``): the gateway's in-flight requests, the last snapshot's
    other clients and background prefill, the step in progress; flagged ``stale`` when the metrics
    are older than the service trusts. A replica the service does not know gets an invalid model
    (admission then treats it as unmodelled)."""
    return service.replica_inputs(replica, model=model, tenant=tenant, in_flight=in_flight, now=now)


class LiveAdmission:
    """Admission for one gateway process (one per application; event loop only).

    ``clock``: monotonic seconds, the clock of ``RequestOutcome.received_at``, ``LiveRequest``
    and the scraper. ``rng``: the Retry-After jitter source (seeded in tests).
    """

    def __init__(
        self,
        store: SettingsStore,
        registry: ReplicaRegistry,
        predictions: LivePredictions,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: UniformSource | None = None,
        view_max_age_s: float = 0.1,
    ) -> None:
        settings = store.current
        self._store = store
        self._registry = registry
        self._predictions = predictions
        self._service = predictions.service
        self._clock = clock
        self._rng: UniformSource = rng if rng is not None else random.Random()
        self._view_max_age_s = view_max_age_s
        self._settings = settings.admission
        self.stats = AdmissionStats()
        self.fairness = VirtualTokenCounter(TokenWeights.from_queue_settings(settings.admission.queue))
        #: The token weights tenants' budgets are charged with (``Tenancy.weights``: the step
        #: model's relative GPU time of a prefill and a decode token, or ``limits.token_weights``);
        #: with ``queue.fairness: tokens`` the fair-share counters charge the same, so a tenant's
        #: share is a share of the GPU time its budget pays for. ``None``: the queue's costs.
        self.token_weights: Callable[[], TokenWeights] | None = None
        self._controllers: dict[str, AdmissionController] = {}
        #: What admission remembers of the requests it sent, per replica (``TrackedStream``).
        self._streams: dict[str, dict[LiveRequest, TrackedStream[InFlight]]] = {}
        self._waiting: dict[tuple[str, int], _Waiter] = {}
        #: Views per model, per replica name.
        self._views: dict[str, dict[str, _Cached]] = {}
        #: Bumped by anything that changes every view (settings, health); per replica, by what
        #: changes that replica's load (a dispatch to it, a finish there, its scrape).
        self._version = 0
        self._replica_versions: dict[str, int] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._seen = _Counters()
        self._closed = False
        self._apply_tenants(settings)
        store.subscribe(self._on_swap)

    # -- lifecycle ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the timer and answer every queued request's handler (the app is stopping)."""
        self._closed = True
        self._cancel_timer()
        for waiter in list(self._waiting.values()):
            if not waiter.future.done():
                waiter.future.cancel()
        self._waiting.clear()

    def _on_swap(self, old: Settings, new: Settings) -> None:
        if self._closed:
            return
        if old.admission != new.admission:
            self._settings = new.admission
            for controller in self._controllers.values():
                controller.reconfigure(new.admission)
        self._apply_tenants(new)
        self.changed()

    def _refresh_fair_weights(self) -> None:
        """Charge fair-share counters with the budgets' current token weights (cheap: ``Tenancy``
        recomputes them at most every few seconds). Request-count fairness keeps its own."""
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
            log.exception("token weights unavailable; fair share keeps its current weights")
            return
        current = self.fairness.token_weights
        if weights is not current and weights != current:
            self.fairness.set_token_weights(weights)

    def _apply_tenants(self, settings: Settings) -> None:
        """Fair-share weights of the configured tenants (absent tenants weigh 1)."""
        tenants = getattr(settings.tenants, "tenants", {})
        weights = {name: float(t.weight) for name, t in tenants.items()}
        self.fairness.set_tenant_weights(weights)

    # -- what the metrics module reads ----------------------------------------------------------------
    def queue_lengths(self) -> dict[str, int]:
        """Requests waiting in Sluice's queue per configured class (0 included)."""
        lengths = dict.fromkeys(self._settings.classes, 0)
        for controller in self._controllers.values():
            for name, depth in controller.queue.depths().items():
                lengths[name] = lengths.get(name, 0) + depth
        return lengths

    def queued(self) -> int:
        """Requests waiting in Sluice's queue, all classes."""
        return sum(len(c.queue) for c in self._controllers.values())

    # -- events -------------------------------------------------------------------------------------
    def changed(self) -> None:
        """A replica's load or health changed: views are rebuilt, the queue re-evaluated."""
        self._version += 1
        self.reevaluate()

    def on_snapshot(self, snapshot: ReplicaSnapshot) -> None:
        """Scraper subscriber: a new snapshot changes that replica's view (only that one's)."""
        self._touch(snapshot.name)
        self.reevaluate()

    def _touch(self, replica: str) -> None:
        """``replica``'s load changed: its views are rebuilt at their next use."""
        self._replica_versions[replica] = self._replica_versions.get(replica, 0) + 1

    # -- one request --------------------------------------------------------------------------------
    async def admit(
        self,
        request: web.Request,
        parsed: ParsedRequest,
        outcome: RequestOutcome,
        *,
        watch: Callable[[web.BaseRequest, Callable[[], object]], Callable[[], None]] | None = None,
    ) -> Ticket:
        """Decide ``parsed`` and return where it goes; raises ``GatewayError`` when it is refused
        (after filling the outcome's admission fields and the response's prediction headers).

        ``watch(request, on_lost)``: the disconnect monitor's ``watch``, so that a client that goes
        away while its request is queued is dropped from the queue (then ``ClientClosedRequest``).
        """
        settings = self._settings
        self._refresh_fair_weights()
        tenant = self._tenant_of(request)
        tenant_name = None if tenant is None else str(tenant.name)
        if outcome.tenant is None:
            outcome.tenant = tenant_name
        choice = choose_class(
            settings,
            request.headers.get(settings.headers.request_class),
            tenant_default=None if tenant is None else tenant.default_class,
            allowed=None if tenant is None else tenant.allowed_classes,
        )
        arrival = outcome.received_at
        header = settings.headers.deadline_ms
        try:
            deadline = client_deadline_s(arrival, request.headers.get(header), header=header)
        except InvalidHeader as err:
            raise InvalidRequest(err.message, param=header) from None
        cls = settings.classes[choice.name]
        outcome.request_class = choice.name
        outcome.ttft_target_s = (
            cls.ttft_target_s if deadline is None else min(cls.ttft_target_s, deadline - arrival)
        )
        outcome.tpot_target_s = cls.tpot_target_s
        prompt = estimated_prompt_tokens(request, self._service, parsed)
        areq = self._request(outcome.request_id, parsed, prompt, choice.name, arrival, deadline, tenant_name)
        route = route_of(parsed.model, parsed.engine)
        controller = self._controller(route)
        try:
            replicas = self._candidates(route)
        except Refused as refused:
            if refused.reason == RefusalReason.REPLICAS_SATURATED:
                mark_saturated(request, choice.name, settings)
            raise
        now = self._clock()
        decision = controller.submit(areq, self._views_for(route, replicas, now), now)
        live: LiveRequest | None = None
        queued = isinstance(decision, Queue) and decision.enforced
        if isinstance(decision, Queue) and decision.enforced:
            decision, live = await self._wait(
                request, outcome, controller, route, areq, decision, watch, streamed=parsed.stream
            )
        return self._conclude(request, parsed, outcome, areq, decision, tenant_name, queued, live)

    def _request(
        self,
        request_id: str,
        parsed: ParsedRequest,
        prompt: int,
        request_class: str,
        arrival: float,
        deadline: float | None,
        tenant: str | None,
    ) -> AdmissionRequest:
        try:
            output, quantile = self._service.expected_output(parsed.model, None, parsed.max_tokens)
        except Exception:
            log.exception("output-length prediction failed; assuming the output cap")
            output, quantile = float(parsed.max_tokens or 256), 1.0
        return AdmissionRequest(
            request_id=request_id,
            request_class=request_class,
            prompt_tokens=prompt,
            max_tokens=parsed.max_tokens,
            expected_output_tokens=output,
            arrival_s=arrival,
            output_quantile=quantile,
            deadline_s=deadline,
            tenant=tenant,
        )

    def _conclude(
        self,
        request: web.Request,
        parsed: ParsedRequest,
        outcome: RequestOutcome,
        areq: AdmissionRequest,
        decision: Decision,
        tenant: str | None,
        queued: bool,
        live: LiveRequest | None,
    ) -> Ticket:
        """Record the decision on the outcome and the response; a ticket, or raise the rejection.

        ``queued``: it waited in Sluice's queue; ``live``: its in-flight entry when a
        re-evaluation dispatched it (already counted on its replica).
        """
        now = self._clock()
        outcome.queue_wait_s = max(0.0, now - areq.arrival_s) if queued else 0.0
        outcome.decision, outcome.reason = _labels(decision)
        expose = self._settings.expose_prediction_headers
        headers = decision_headers(decision, areq.request_class, self._settings)
        forecast = decision.forecast
        if forecast is not None and math.isfinite(forecast.ttft_s):
            outcome.predicted_ttft_s = forecast.ttft_s
        if forecast is not None and math.isfinite(forecast.tpot_s):
            outcome.predicted_tpot_s = forecast.tpot_s
        if not decision.admits:
            assert isinstance(decision, Reject)
            outcome.retry_after_s = decision.retry_after_s
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "rejected %s: %s; views %s", areq.request_id, decision, self._views.get(parsed.model)
                )
            _set_headers(request, headers)
            raise admission_error(decision)
        replica = self._replica_for(decision, route_of(parsed.model, parsed.engine))
        if live is None:
            live = LiveRequest(
                areq.request_id, areq.prompt_tokens, now, parsed.max_tokens, streamed=parsed.stream
            )
            self._add_stream(replica.name, live, areq, forecast)
        if expose:
            headers = {**_forecast_headers(replica.name, forecast), **headers}
        _set_headers(request, headers)
        return Ticket(areq, parsed.model, replica, live, decision, forecast, headers, tenant)

    def finished(self, ticket: Ticket, outcome: RequestOutcome) -> None:
        """The request's response (or stream) is over: forget it, charge its tenant's output,
        re-evaluate the queue. Idempotent."""
        if ticket.finished:
            return
        ticket.finished = True
        self._forget(ticket.live)
        produced = outcome.completion_tokens
        if produced is None:
            produced = ticket.live.tokens_streamed
        try:
            self.fairness.charge_output(ticket.tenant, max(0, produced), ticket.request.prompt_tokens)
        except ValueError:
            log.exception("could not charge %r output tokens to tenant %r", produced, ticket.tenant)
        self.reevaluate()  # its replica's views were invalidated by _forget

    # -- the queue ----------------------------------------------------------------------------------
    async def _wait(
        self,
        request: web.Request,
        outcome: RequestOutcome,
        controller: AdmissionController,
        model: str,
        areq: AdmissionRequest,
        queued: Queue,
        watch: Callable[[web.BaseRequest, Callable[[], object]], Callable[[], None]] | None,
        *,
        streamed: bool,
    ) -> tuple[Decision, LiveRequest | None]:
        """Wait in the queue until a re-evaluation decides; the client going away cancels it.

        Returns the decision and, when it was dispatched, the in-flight entry registered then.
        ``streamed``: the client streams the response (``LiveRequest.streamed``).
        """
        assert queued.entry_id is not None
        key = (model, queued.entry_id)
        future: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(future, controller, model, areq, streamed)
        self._waiting[key] = waiter
        unwatch = watch(request, lambda: self._client_gone(key)) if watch is not None else None
        self._schedule()
        try:
            decision = await future
            return decision, waiter.live
        except asyncio.CancelledError:
            self._drop(key)
            if waiter.live is not None:
                # Dispatched by a re-evaluation, but its handler was cancelled before it ran.
                self._forget(waiter.live)
            if future.cancelled() and _gone(request):
                outcome.decision, outcome.reason = "cancelled", "client_disconnected"
                outcome.queue_wait_s = max(0.0, self._clock() - areq.arrival_s)
                raise ClientClosedRequest("the client went away while its request was queued") from None
            raise
        finally:
            if unwatch is not None:
                unwatch()

    def _client_gone(self, key: tuple[str, int]) -> None:
        waiter = self._waiting.get(key)
        if waiter is not None and not waiter.future.done():
            self._drop(key)
            waiter.future.cancel()

    def _drop(self, key: tuple[str, int]) -> None:
        """Take a queued request out (its client or handler went away); counted as cancelled."""
        waiter = self._waiting.pop(key, None)
        if waiter is not None:
            waiter.controller.cancel(key[1], self._clock())
            self._schedule()

    def reevaluate(self) -> None:
        """Offer every model's queued requests to its replicas again; resolve decided handlers."""
        if self._closed:
            return
        for model, controller in self._controllers.items():
            if len(controller.queue) == 0:
                continue
            now = self._clock()
            views = self._views_for(model, self._candidates_or_none(model), now)
            result = controller.reevaluate(now, views)
            for entry, decision in result.dispatched:
                # Each dispatch is counted on its replica at once (``_add_stream``), which
                # invalidates that replica's views.
                self._resolve((model, entry.id), decision, dispatched=True)
            for entry, reject in result.rejected:
                self._resolve((model, entry.id), reject, dispatched=False)
        self._schedule()

    def _resolve(self, key: tuple[str, int], decision: Decision, *, dispatched: bool) -> None:
        waiter = self._waiting.pop(key, None)
        if waiter is None or waiter.future.done():
            return
        if dispatched and decision.admits and decision.replica is not None:
            # Counted on its replica now, before its handler runs, so the next decision sees it.
            request = waiter.request
            live = LiveRequest(
                request.request_id,
                request.prompt_tokens,
                self._clock(),
                request.max_tokens,
                streamed=waiter.streamed,
            )
            waiter.live = live
            self._add_stream(decision.replica, live, request, decision.forecast)
        waiter.future.set_result(decision)

    def _schedule(self) -> None:
        """Arm the timer for the earliest queue deadline or predicted retry (none when empty)."""
        if self._closed:
            return
        now = self._clock()
        if self.queued() == 0:
            self._cancel_timer()
            return
        when = math.inf
        for controller in self._controllers.values():
            deadline = controller.next_deadline_s()
            if deadline is not None:
                when = min(when, deadline)
        hint = MAX_TICK_S
        for (_, entry_id), waiter in self._waiting.items():
            entry = waiter.controller.queue.entry(entry_id)
            if entry is not None and math.isfinite(entry.earliest_retry_s):
                hint = min(hint, entry.earliest_retry_s)
        when = min(when, now + min(max(hint, MIN_TICK_S), MAX_TICK_S))
        if self._timer is not None and self._timer_at <= when:
            return
        self._cancel_timer()
        loop = asyncio.get_running_loop()
        self._timer_at = when
        self._timer = loop.call_later(max(0.0, when - now), self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._timer_at = math.inf
        try:
            self.reevaluate()
        except Exception:
            log.exception("queue re-evaluation failed")
            self._schedule()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self._timer_at = math.inf

    # -- replicas and views ---------------------------------------------------------------------------
    def _controller(self, model: str) -> AdmissionController:
        controller = self._controllers.get(model)
        if controller is None:
            controller = AdmissionController(
                self._settings, rng=self._rng, stats=self.stats, fairness=self.fairness
            )
            self._controllers[model] = controller
        return controller

    def _candidates(self, route: str) -> list[Replica]:
        """Healthy replicas serving the route's model (and running its engine, when it names one);
        ``ModelNotFound`` when no replica could serve it."""
        model, engine = split_route(route)
        replicas = self._registry.replicas()
        healthy = [r for r in replicas if r.state == "healthy" and r.serves(model, engine)]
        if healthy:
            now = self._clock()
            rested = [r for r in healthy if not r.saturated(now)]
            if rested:
                return rested
            # All of them refused a request as overloaded moments ago (their own 429/503): come
            # back when the first is expected to take requests again.
            raise self.saturated(model, min(r.saturated_until for r in healthy) - now)
        if any(r.serves(model, engine) or r.models is None for r in replicas):
            return []  # admission answers 503 (no healthy replica)
        raise ModelNotFound(f"the model `{model}` does not exist", param="model")

    def saturated(self, model: str, wait_s: float, *, placed: bool = False) -> Refused:
        """The refusal for a request on ``model`` whose replicas refused as overloaded, the first
        expected to take requests again in ``wait_s`` seconds (jittered: load-driven).

        ``placed``: this request itself was refused by every replica it was placed on (the proxy
        ran out of placements); otherwise every replica serving the model refused others moments
        ago and it was not sent."""
        reason = RefusalReason.REPLICAS_SATURATED
        retry = retry_after(reason, wait_s, self._settings.retry_after, self._rng)
        if placed:
            message = f"the replicas serving `{model}` are overloaded right now"
        else:
            message = f"every replica serving `{model}` is overloaded right now"
        return Refused(reason, message, retry_after=retry)

    def _candidates_or_none(self, model: str) -> list[Replica]:
        try:
            return self._candidates(model)
        except GatewayError:
            return []

    def _views_for(self, model: str, replicas: list[Replica], now: float) -> list[ReplicaView]:
        """Views of ``replicas`` for a request on ``model``: each from the cache while it is
        current (see the module: no event since it was built, still inside the engine step it was
        built in or with none in progress, younger than ``view_max_age_s``), else rebuilt."""
        cache = self._views.get(model)
        if cache is None:
            cache = self._views[model] = {}
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
                view = self._view(replica, model, now)
                cached = cache[name] = _Cached(view, version, replica_version, self._seen_now(name))
            views.append(cached.view)
        if len(cache) > len(replicas):
            # Replicas that left the fleet (or lost health): their views go.
            for name in [n for n in cache if all(r.name != n for r in replicas)]:
                del cache[name]
        return views

    def _current(self, cached: _Cached, now: float, max_age: float) -> bool:
        """Whether ``cached``'s view (versions unchanged) still describes its replica at ``now``.

        Younger than ``max_age``, and no token of a later engine step landed there: a request
        whose token of the view's step had landed when it was built got another, or any got two.
        A request whose token of that step was still on its way (relayed later than the others:
        a gateway busy with a flood relays one engine step's tokens over several milliseconds)
        adds that one without a rebuild, so a step costs one rebuild, not one per stream. While
        some of the gateway's requests there decode, every step ends with their tokens: a step
        predicted over whose tokens have not landed yet is overdue, which the view as built says
        at ``now`` (its step wait aged to 0). Otherwise (prefill only) a step may end unmarked, a
        chunk of a long prompt: the view lasts until the step it was built in is predicted to end.
        A replica running requests whose tokens are not seen (non-streamed responses, whose
        progress is estimated from the clock: ``TrackedStream.tokens_at``) has its view rebuilt
        every ``_UNSEEN_MAX_AGE_S``.
        """
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
        if unseen and age > _UNSEEN_MAX_AGE_S:
            return False
        return any_token or not (now > view.usable_until and view.state.step_remaining_s > 0.0)

    def _seen_now(self, replica: str) -> dict[LiveRequest, tuple[int, bool]]:
        """Each of the gateway's requests on ``replica``: (tokens streamed, whether its newest
        token landed within ``_SAME_STEP_S`` of the newest of all there, i.e. is of the engine
        step whose tokens landed last)."""
        streams = self._streams.get(replica)
        if not streams:
            return {}
        newest = max((live.last_token_at or -math.inf for live in streams), default=-math.inf)
        edge = newest - _SAME_STEP_S
        return {
            live: (live.tokens_streamed, live.last_token_at is not None and live.last_token_at >= edge)
            for live in streams
        }

    def _view(self, replica: Replica, route: str, now: float) -> ReplicaView:
        model, _ = split_route(route)
        streams = self._streams.get(replica.name, {})
        in_flight = [s.in_flight(now) for s in streams.values()]
        try:
            step_model, state = self._service.replica_inputs(
                replica.name, model=model, tenant=None, in_flight=in_flight, now=now
            )
        except Exception:
            log.exception("replica state for %s failed; judging it as unmodelled", replica.name)
            step_model, state = _NO_MODEL, _fallback_state(in_flight)
        self._note_staleness(replica.name, state.stale)
        running = [s.streaming(now) for s in streams.values()]
        return ReplicaView.build(
            replica.name,
            healthy=True,
            model=step_model,
            state=state,
            streams=running,
            stale=state.stale,
            built_at=now,
            dispatch_overhead_s=self._service.dispatch_overhead_s(replica.name),
        )

    def _note_staleness(self, name: str, stale: bool) -> None:
        """Log once per transition that a replica is judged on Sluice's own accounting."""
        before = self._seen.stale.get(name, False)
        if stale == before:
            return
        self._seen.stale[name] = stale
        if stale:
            log.warning(
                "replica %s: metrics stale; admission judges it by Sluice's in-flight requests and its "
                "last fitted model, predictions +%.0f %%",
                name,
                self._settings.stale_margin * 100,
            )
        else:
            log.info("replica %s: metrics fresh again; admission uses them", name)

    def _add_stream(
        self, replica: str, live: LiveRequest, areq: AdmissionRequest, forecast: Forecast | None
    ) -> None:
        tpot = forecast.tpot_s if forecast is not None and math.isfinite(forecast.tpot_s) else 0.0
        ttft = forecast.ttft_s if forecast is not None else math.nan
        output = areq.expected_output_tokens
        if forecast is not None:
            output = forecast.output_tokens_used
        tracked = TrackedStream(live, areq.request_class, output, tpot, ttft)
        self._streams.setdefault(replica, {})[live] = tracked
        self._touch(replica)

    def _forget(self, live: LiveRequest) -> None:
        for replica, streams in self._streams.items():
            if streams.pop(live, None) is not None:
                self._touch(replica)
                return

    def _replica_for(self, decision: Decision, model: str) -> Replica:
        name = decision.replica
        replica = self._registry.get(name) if name is not None else None
        if replica is not None:
            return replica
        # A shadow decision that names no replica: the least-outstanding healthy one.
        candidates = self._candidates(model)
        if not candidates:
            retry = RetryAfterPolicy(self._settings.retry_after, self._rng).no_replica()
            raise admission_error(_no_replica(decision, retry))
        return min(candidates, key=lambda r: r.outstanding)

    def _tenant_of(self, request: web.Request) -> Tenant | None:
        """The tenant ``gateway.tenancy`` authenticated (``None``: anonymous, no tenants)."""
        return request.get(TENANT)


ADMISSION = web.AppKey("admission", LiveAdmission)


#: Joins a model and an engine into one route key (a model id never contains a NUL).
_ROUTE_SEP = "\x00"


def mark_saturated(request: web.Request, request_class: str, settings: AdmissionSettings) -> None:
    """The response to ``request`` says admission refused it because every replica refused it
    as overloaded (``replicas_saturated``), on top of the forecast of an earlier placement the
    replica refused, if any."""
    refused = refusal_reason_headers(request_class, RefusalReason.REPLICAS_SATURATED, settings)
    request[PREDICTION_HEADERS] = {**request.get(PREDICTION_HEADERS, {}), **refused}


def route_of(model: str, engine: str | None) -> str:
    """The key admission keeps its controller, queue and views under: the model, plus the engine
    when the request needs one (TGI's native routes). Plain OpenAI requests key by model alone."""
    return model if engine is None else f"{model}{_ROUTE_SEP}{engine}"


def split_route(route: str) -> tuple[str, str | None]:
    """``route_of``'s inverse: (model, engine or ``None``)."""
    model, sep, engine = route.partition(_ROUTE_SEP)
    return model, (engine if sep else None)


def _labels(decision: Decision) -> tuple[str, str]:
    """(decision, reason) for the outcome: admitted/ok, shadow_rejected or shadow_queued with the
    rule's reason, rejected with the ``RejectReason``."""
    if isinstance(decision, Admit):
        return "admitted", "ok"
    if isinstance(decision, Queue):
        if decision.enforced:
            return "queued", decision.blocker.value
        return "shadow_queued", decision.blocker.value
    if decision.enforced:
        return "rejected", decision.reason.value
    return "shadow_rejected", decision.reason.value


def _forecast_headers(replica: str, forecast: Forecast | None) -> dict[str, str]:
    """``gateway.forecasts.forecast_headers``; without a forecast the admitter had no step model
    for the replica (``no_step_model``)."""
    if forecast is None:
        return {REPLICA_HEADER: replica, PREDICTION_HEADER: ForecastReason.NO_STEP_MODEL.value}
    return forecast_headers(replica, forecast)


def _set_headers(request: web.Request, headers: dict[str, str]) -> None:
    request[PREDICTION_HEADERS] = headers


def _gone(request: web.BaseRequest) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def _no_replica(decision: Decision, retry: RetryAfter) -> Reject:
    return Reject(RejectReason.NO_HEALTHY_REPLICA, retry, decision.forecast, "no healthy replica")


def _fallback_state(in_flight: Sequence[InFlight]) -> ReplicaState:
    return ReplicaState.from_sequences(
        [],
        [f.prompt_tokens for f in in_flight],
        kv_capacity_tokens=_UNKNOWN_LIMITS.kv_capacity_tokens,
        max_num_seqs=_UNKNOWN_LIMITS.max_num_seqs,
        max_num_batched_tokens=_UNKNOWN_LIMITS.max_num_batched_tokens,
        max_model_len=_UNKNOWN_LIMITS.max_model_len,
    )
