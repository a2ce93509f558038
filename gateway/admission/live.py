"""The live gateway's adapter over ``gateway.admission.engine.AdmissionEngine``.

Everything that decides lives in the engine; this module does what needs aiohttp and the wall
clock. Per request (``LiveAdmission.admit``), after the body is parsed:

1. **class and deadline** from the tenant's policy and the request's headers
   (``admission.choose_class``, ``client_deadline_s``: it only ever tightens the class's TTFT
   target; a malformed one is a 400);
2. **sizes**: the request's one prompt estimate (``gateway.admission.sizing``), then
   ``AdmissionEngine.request`` (the output predicted, capped by ``max_tokens``, never below
   what ``min_tokens``/``ignore_eos`` make sure: ``output_floor``);
3. **the tenant's budget**, with a ``LiveBudget``: the limiter (Redis or memory, async) is asked
   for the cost the engine names (``AdmissionEngine.budget_cost``) and its answer handed to the
   engine, which decides on it (the engine's budget port is synchronous). A request that is not
   streamed reserves its whole output cap of a token bucket; one sent without ``max_tokens`` gets
   the largest the bucket holds (``MAX_TOKENS_SET``: forwarded, and named in a response header);
4. **the decision** (``AdmissionEngine.submit``): admitted -> a ``Ticket`` for the replica it
   was sent to; queued -> the handler awaits a future that a ``Resolution`` of a later
   re-evaluation completes; refused -> a typed error (``gateway.http.errors``).

The engine is told of every event (a finish, a scrape snapshot, a health or settings change);
the queued handlers and the loop's timer are ``gateway.admission.live_queue``'s, the budget's
limiter calls ``gateway.admission.live_budget``'s. When a request ends, ``finished`` hands the
engine its usage (``AdmissionEngine.finish``: fairness charge, budget settle, re-evaluation,
learning).
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Final

from aiohttp import web
from pydantic import TypeAdapter, ValidationError

from gateway.admission import (
    AdmissionRequest,
    AdmissionSettings,
    AdmissionStats,
    Decision,
    InvalidHeader,
    Reject,
    UniformSource,
    VirtualTokenCounter,
    choose_class,
    client_deadline_s,
    decision_headers,
)
from gateway.admission.attainment import AttainmentState
from gateway.admission.budget import BudgetRefused, TopUp
from gateway.admission.engine import AdmissionEngine
from gateway.admission.fairness import TokenWeights
from gateway.admission.live_budget import (
    RESERVATION,
    LiveBudget,
    is_unlimited,
    over_budget,
    refunded,
    token_unit,
)
from gateway.admission.live_queue import CallLater, LiveQueue, Watch
from gateway.admission.ports import AdmissionReplica, route_of
from gateway.admission.results import Ending, Resolution, Saturated, UnknownModel, labels
from gateway.admission.retry_after import RefusalReason
from gateway.admission.size_share import QuartileRow
from gateway.admission.sizing import prompt_size
from gateway.api.openai import MAX_TOKENS_LIMIT, MAX_TOKENS_SET_HEADER, ParsedRequest, off_loop
from gateway.api.prefix_text import prefix_text, session_of
from gateway.config.settings import Settings
from gateway.config.store import SettingsStore
from gateway.http.echo import clip
from gateway.http.errors import (
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    Refused,
    admission_error,
    refusal_reason_headers,
)
from gateway.observability.outcome import RequestOutcome
from gateway.prediction.live import (
    PREDICTION_HEADER,
    PREDICTION_HEADERS,
    REPLICA_HEADER,
    LivePredictions,
    forecast_headers,
)
from gateway.replicas.registry import LiveRequest, Replica, ReplicaRegistry
from gateway.replicas.snapshot import ReplicaSnapshot
from gateway.tenants import Tenant
from gateway.tenants.live import TENANT
from predictor import Forecast, ForecastReason

__all__ = ["ADMISSION", "MAX_TOKENS_SET", "LiveAdmission", "Ticket", "mark_saturated"]

log = logging.getLogger("sluice.admission")

#: The ``max_tokens`` the gateway set on a request that came without one (``AdmissionEngine.request``'s
#: ``token_capacity``): set by its first placement, kept by the next ones.
MAX_TOKENS_SET = web.RequestKey("sluice_max_tokens_set", int)


@dataclass(slots=True)
class Ticket:
    """A request admission let through: where it goes and what was decided.

    ``live``: its in-flight entry (already counted in admission's accounting; the proxy leases
    it on ``replica``). ``forecast``: the forecast on ``replica`` when it was dispatched (stale
    margin applied; ``None`` without a step model). ``headers``: the ``x-sluice-*`` headers.
    ``key``: the engine's handle on it. ``prompt_chars``/``api``: what the prediction service
    learns from at its end (``None``: a token-id prompt, no characters to count).
    ``max_tokens_set``: the ``max_tokens`` the gateway sets on the forwarded body (``None``: the
    body goes as sent).
    """

    request: AdmissionRequest
    model: str
    replica: Replica
    live: LiveRequest
    decision: Decision
    forecast: Forecast | None
    headers: dict[str, str]
    tenant: str | None
    key: int = -1
    finished: bool = False
    prompt_chars: int | None = None
    api: str | None = None
    refused: bool = False
    max_tokens_set: int | None = None


class _Registry:
    """``ReplicaSource`` over the live registry."""

    def __init__(self, registry: ReplicaRegistry) -> None:
        self._registry = registry
        #: Told of each overload refusal, (replica, back-off seconds) (``gateway.ledger``).
        self.on_saturate: Callable[[str, float], None] | None = None

    def replicas(self) -> Sequence[AdmissionReplica]:
        return self._registry.replicas()

    def get(self, name: str) -> AdmissionReplica | None:
        return self._registry.get(name)

    def saturate_named(self, name: str, now: float, back_off_s: float, why: str) -> None:
        replica = self._registry.get(name)
        if replica is not None:
            self._registry.saturate(replica, now, back_off_s, why)
            if self.on_saturate is not None:
                self.on_saturate(name, back_off_s)


_LAX_BOOL: Final = TypeAdapter(bool)
_LAX_COUNT: Final = TypeAdapter(int)


def output_floor(parsed: ParsedRequest) -> dict[str, Any]:
    """vLLM's ``min_tokens`` and ``ignore_eos`` of an OpenAI body, as the engine sizes them
    (``AdmissionEngine.request``), read as leniently as vLLM's own (pydantic, lax) models read
    them: a value they would coerce counts. Anything they would refuse counts as absent (the
    replica answers it with a 400); native TGI bodies have neither."""
    if parsed.native:
        return {}
    body = parsed.body
    floor: dict[str, Any] = {}
    for name, adapter in (("min_tokens", _LAX_COUNT), ("ignore_eos", _LAX_BOOL)):
        value = body.get(name)
        if value is None:
            continue
        try:
            floor[name] = adapter.validate_python(value)
        except ValidationError:
            continue
    if "min_tokens" in floor:
        floor["min_tokens"] = min(max(floor["min_tokens"], 0), MAX_TOKENS_LIMIT)
    return floor


def live_entry(request: AdmissionRequest, now: float, streamed: bool) -> LiveRequest:
    """The registry's entry of ``request``, sent at ``now`` (monotonic seconds); its pinned
    output (``exact_output_tokens``) carried along."""
    r = request
    exact = r.exact_output_tokens
    return LiveRequest(
        r.request_id, r.prompt_tokens, now, r.max_tokens, streamed=streamed, exact_output=exact
    )


class LiveAdmission:
    """Admission for one gateway process (one per application; event loop only).

    ``clock``: monotonic seconds, the clock of ``RequestOutcome.received_at``, ``LiveRequest``
    and the scraper. ``rng``: the Retry-After jitter source (seeded in tests). ``call_later``:
    arms the re-evaluation timer (default: the running loop's). ``budget``: the tenants' budgets
    the engine reserves and settles (``None``: admission charges no budget).
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
        call_later: CallLater | None = None,
        budget: LiveBudget | None = None,
    ) -> None:
        settings = store.current
        self._store = store
        self._registry = registry
        self._budget = budget
        self._clock = clock
        self._rng: UniformSource = rng if rng is not None else random.Random()
        #: The engine's view of the registry (``on_saturate``: told of overload refusals).
        self.replica_source = _Registry(registry)
        self.engine = AdmissionEngine(
            settings.admission,
            self.replica_source,
            predictions.service,
            rng=self._rng,
            new_entry=live_entry,
            view_max_age_s=view_max_age_s,
            log=log,
            budget=budget,
        )
        self._service = predictions.service
        self._queue = LiveQueue(self.engine, clock, call_later, self.reevaluate)
        self._apply_tenants(settings)
        store.subscribe(self._on_swap)

    @property
    def stats(self) -> AdmissionStats:
        return self.engine.stats

    @property
    def fairness(self) -> VirtualTokenCounter:
        return self.engine.fairness

    @property
    def token_weights(self) -> Callable[[], TokenWeights] | None:
        """The tenants' budget token weights (``Tenancy.weights``; see ``AdmissionEngine``)."""
        return self.engine.token_weights

    @token_weights.setter
    def token_weights(self, provider: Callable[[], TokenWeights] | None) -> None:
        self.engine.token_weights = provider

    @property
    def _settings(self) -> AdmissionSettings:
        return self.engine.settings

    # -- lifecycle ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the timer and answer every queued request's handler (the app is stopping); their
        budgets are refunded."""
        self._queue.close()
        self.engine.clear(self._clock())

    def _on_swap(self, old: Settings, new: Settings) -> None:
        if self._queue.closed:
            return
        self.engine.reconfigure(new.admission)
        self._apply_tenants(new)
        self.changed()

    def _apply_tenants(self, settings: Settings) -> None:
        tenants = getattr(settings.tenants, "tenants", {})
        self.engine.set_tenant_weights({name: float(t.weight) for name, t in tenants.items()})

    # -- what the metrics module reads ----------------------------------------------------------------
    def queue_lengths(self) -> dict[str, int]:
        """Requests waiting in Sluice's queue per configured class (0 included)."""
        return self.engine.queue_lengths()

    def queued(self) -> int:
        """Requests waiting in Sluice's queue, all classes."""
        return self.engine.queued()

    def attainment(self) -> list[AttainmentState]:
        """The attainment controller's state now: each class's margin and attainment per replica."""
        return list(self.engine.attainment.states(self._clock()))

    def prefix_caches(self) -> dict[str, object]:
        """What admission believes each replica's prefix cache holds (``PrefixCaches.describe``)."""
        return self.engine.prefix.describe()

    def size_shares(self) -> dict[str, dict[str, dict[str, object]]]:
        """Each route's classes' admission by prompt-size quartile now (``AdmissionEngine.size_shares``)."""
        return self.engine.size_shares(self._clock())

    def size_share_rows(self) -> list[QuartileRow]:
        """Each class's prompt-size quartiles now, for the metrics (``AdmissionEngine.size_share_rows``)."""
        return self.engine.size_share_rows(self._clock())

    # -- events -------------------------------------------------------------------------------------
    def changed(self) -> None:
        """A replica's load or health changed: views are rebuilt, the queue re-evaluated."""
        if not self._queue.closed:
            self._queue.apply(self.engine.changed(self._clock()))

    def on_snapshot(self, snapshot: ReplicaSnapshot) -> None:
        """Scraper subscriber: a new snapshot changes that replica's view (only that one's)."""
        if not self._queue.closed:
            self._queue.apply(self.engine.on_snapshot(snapshot.name, self._clock()))

    def on_load(self, replica: str) -> None:
        """``replica``'s load changed outside this gateway (``gateway.ledger``): its views are
        rebuilt, the queue re-evaluated."""
        if not self._queue.closed:
            self._queue.apply(self.engine.on_snapshot(replica, self._clock()))

    def reevaluate(self) -> None:
        """Offer every route's queued requests to its replicas again; resolve decided handlers."""
        if not self._queue.closed:
            self._queue.apply(self.engine.reevaluate(self._clock()))

    # -- one request --------------------------------------------------------------------------------
    async def admit(
        self,
        request: web.Request,
        parsed: ParsedRequest,
        outcome: RequestOutcome,
        *,
        watch: Watch | None = None,
    ) -> Ticket:
        """Decide ``parsed`` and return where it goes; raises ``GatewayError`` when it is refused
        (after filling the outcome's admission fields and the response's prediction headers).

        ``watch(request, on_lost)``: the disconnect monitor's ``watch``, so that a client that goes
        away while its request is queued is dropped from the queue (then ``ClientClosedRequest``).
        A request refused here never reached a replica: the engine refunded its reservation, and
        its ``x-ratelimit-*`` headers say so (``refunded``).
        """
        try:
            return await self._admit(request, parsed, outcome, watch=watch)
        except GatewayError:
            reservation = request.get(RESERVATION)
            if reservation is not None:
                request[RESERVATION] = refunded(reservation)
            raise

    async def _admit(
        self,
        request: web.Request,
        parsed: ParsedRequest,
        outcome: RequestOutcome,
        *,
        watch: Watch | None,
    ) -> Ticket:
        settings = self._settings
        tenant: Tenant | None = request.get(TENANT)
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
        route = route_of(parsed.model, parsed.engine)
        size = await prompt_size(request, self._service, parsed, tenant_name)
        # A response that cannot be stopped part-way reserves its whole output cap of a token
        # bucket (docs/tenants.md, "Hard caps"); a placement again keeps the cap the first set.
        limits = None if tenant is None or parsed.stream else tenant.limits
        prefix = settings.prefix_cache
        text = await off_loop(parsed, partial(prefix_text, parsed)) if prefix.enabled else None
        areq = self.engine.request(
            outcome.request_id,
            route,
            prompt_tokens=size.tokens,
            fewest_prompt_tokens=None if size.fewest == size.tokens else size.fewest,
            max_tokens=request.get(MAX_TOKENS_SET, parsed.max_tokens),
            token_capacity=None if limits is None else limits.token_capacity,
            request_class=choice.name,
            arrival_s=arrival,
            deadline_s=deadline,
            tenant=tenant_name,
            choices=parsed.choices,
            prompt_text=text,
            session=None
            if not prefix.enabled
            else session_of(
                request.headers,
                parsed,
                header=prefix.session_header,
                from_user=prefix.session_from_user,
                tenant=tenant_name,
            ),
            **output_floor(parsed),
        )
        if parsed.max_tokens is None and areq.max_tokens is not None:
            request[MAX_TOKENS_SET] = areq.max_tokens
        await self._fetch_budget(request, areq, tenant, outcome)
        try:
            submitted = self.engine.submit(areq, route, self._clock(), streamed=parsed.stream)
        finally:
            if self._budget is not None:
                self._budget.forget(areq)
        if isinstance(submitted, BudgetRefused):
            # Refused by the tenant's budget before any class was judged (the outcome says none).
            weights = None if self._budget is None else self._budget.weights(areq.model)
            ietf = self._store.current.limits.ietf_headers
            raise over_budget(submitted, outcome, weights, ietf_headers=ietf)
        cls = settings.classes[choice.name]
        outcome.request_class = choice.name
        outcome.ttft_target_s = (
            cls.ttft_target_s if deadline is None else min(cls.ttft_target_s, deadline - arrival)
        )
        outcome.tpot_target_s = cls.tpot_target_s
        if isinstance(submitted, UnknownModel):
            raise ModelNotFound(f"the model `{clip(submitted.model)}` does not exist", param="model")
        if isinstance(submitted, Saturated):
            mark_saturated(request, choice.name, settings)
            raise _refusal(submitted)
        if submitted.queued:
            resolution = await self._queue.wait(request, outcome, submitted.key, areq.arrival_s, watch)
            return self._conclude(request, parsed, outcome, areq, resolution, tenant_name, queued=True)
        resolution = Resolution(
            submitted.key, areq.request_id, submitted.decision, submitted.replica, submitted.entry
        )
        return self._conclude(request, parsed, outcome, areq, resolution, tenant_name, queued=False)

    def _conclude(
        self,
        request: web.Request,
        parsed: ParsedRequest,
        outcome: RequestOutcome,
        areq: AdmissionRequest,
        resolution: Resolution,
        tenant: str | None,
        *,
        queued: bool,
    ) -> Ticket:
        """Record the decision on the outcome and the response; a ticket, or raise the rejection.
        ``queued``: it waited in Sluice's queue."""
        decision = resolution.decision
        now = self._clock()
        outcome.queue_wait_s = max(0.0, now - areq.arrival_s) if queued else 0.0
        outcome.decision, outcome.reason = labels(decision)
        headers = decision_headers(decision, areq.request_class, self._settings)
        forecast = decision.forecast
        if forecast is not None and math.isfinite(forecast.ttft_s):
            outcome.predicted_ttft_s = forecast.ttft_s
        if forecast is not None and math.isfinite(forecast.tpot_s):
            outcome.predicted_tpot_s = forecast.tpot_s
        if not decision.admits:
            assert isinstance(decision, Reject)
            outcome.retry_after_s = decision.retry_after_s
            log.debug("rejected %s: %s", areq.request_id, decision)
            request[PREDICTION_HEADERS] = headers
            raise admission_error(decision, endpoint=parsed.endpoint)
        replica = self._registry.get(resolution.replica) if resolution.replica is not None else None
        if replica is None or not isinstance(resolution.entry, LiveRequest):
            # Its replica left the fleet while its handler was waking up.
            self.engine.drop(resolution.key, now)
            raise admission_error(self.engine.no_replica(forecast))
        if self._settings.expose_prediction_headers:
            headers = {**_forecast_headers(replica.name, forecast), **headers}
        max_tokens_set = request.get(MAX_TOKENS_SET)
        if max_tokens_set is not None:
            headers = {**headers, MAX_TOKENS_SET_HEADER: str(max_tokens_set)}
        request[PREDICTION_HEADERS] = headers
        live = resolution.entry
        outcome.expected_cached_tokens = live.cached_tokens
        hold = self.engine.held(resolution.key)
        if hold is not None:  # the weights its budget is charged with, for the access line
            outcome.prompt_weight, outcome.output_weight = hold.weights.input, hold.weights.output
        chars = parsed.prompt_chars if parsed.prompt_token_ids is None else None
        return Ticket(
            areq,
            parsed.model,
            replica,
            live,
            decision,
            forecast,
            headers,
            tenant,
            resolution.key,
            prompt_chars=chars,
            api=parsed.endpoint,
            max_tokens_set=max_tokens_set,
        )

    def finished(self, ticket: Ticket, outcome: RequestOutcome, *, forecast: Forecast | None = None) -> None:
        """The request's response (or stream) is over: ``AdmissionEngine.finish`` forgets it,
        charges its tenant's output, settles its budget, re-evaluates the queue and teaches the
        prediction service (against ``forecast``, the one its TTFT is measured against: with the
        dispatch overhead; ``None``: the decision's). Idempotent."""
        if ticket.finished:
            return
        ticket.finished = True
        ending = Ending(
            outcome.completion_tokens,
            outcome.prompt_tokens,
            finished_at=ticket.live.last_token_at,
            ttft_s=outcome.ttft_s,
            forecast=forecast,
            prompt_chars=ticket.prompt_chars,
            api=ticket.api,
            cached_tokens=outcome.cached_tokens,
            learn=not ticket.refused,
            answered=outcome.first_token_at is not None
            or (not outcome.stream and outcome.status == 200 and outcome.error is None),
        )
        self._queue.apply(self.engine.finish(ticket.key, ending, self._clock()))

    def replica_refused(
        self, ticket: Ticket, back_off_s: float, why: str, *, placed_again: bool = False
    ) -> None:
        """``ticket``'s replica refused it as overloaded: the next placement avoids it.
        ``placed_again``: the request is admitted anew after ``finished`` (its budget stays held
        for that placement); else it is refused (``saturated``)."""
        ticket.refused = True
        self.engine.replica_refused(ticket.key, back_off_s, why, self._clock(), placed_again=placed_again)

    def saturated(self, model: str, wait_s: float, *, placed: bool = False) -> Refused:
        """The refusal for a request on ``model`` whose replicas refused as overloaded, the first
        expected to take requests again in ``wait_s`` seconds (jittered: load-driven).
        ``placed``: this request itself was refused by every replica it was placed on."""
        return _refusal(self.engine.saturated(model, wait_s, placed=placed))

    # -- the tenant's budget ------------------------------------------------------------------------
    def covered_output(self, ticket: Ticket) -> float:
        """Output tokens (all choices) the tenant's budget covers for ``ticket`` now; ``math.inf``
        when there is nothing to charge ahead (no budget, no token bucket, or the cover already
        reaches the request's output cap). A stream relayed past it calls ``charge_ahead``."""
        hold = self.engine.held(ticket.key)
        if hold is None or self._budget is None or not self._budget.charges_tokens(hold.answer):
            return math.inf
        if hold.output_cap is not None and hold.covered_output >= hold.output_cap:
            return math.inf
        return float(hold.covered_output)

    def token_unit(self, ticket: Ticket) -> str:
        """What ``ticket``'s tenant's token budget counts, as its messages say it: ``tokens``
        (plain weights) or ``weighted tokens`` (``live_budget.token_unit`` of the weights its
        reservation was priced with; ``tokens`` when it holds none)."""
        hold = self.engine.held(ticket.key)
        return "tokens" if hold is None else token_unit(hold.weights)

    async def charge_ahead(self, ticket: Ticket, produced: int) -> float | None:
        """``ticket``'s stream has produced ``produced`` output tokens, past what its budget
        covers: charge its tenant the next step (``Hold.next_top_up``). Returns the output now
        covered (``covered_output``), or ``None`` when the budget refused the step: the stream
        must stop. Storage down: the step is covered uncharged, the settle charges it."""
        hold = self.engine.held(ticket.key)
        budget = self._budget
        if hold is None or budget is None:
            return math.inf
        top_up = hold.next_top_up(produced)
        if top_up is None:
            return self.covered_output(ticket)
        taken = await budget.charge(hold.answer, top_up.cost_tokens)
        if taken is False:
            return None
        hold.took(top_up if taken else TopUp(top_up.output_tokens, 0.0))
        return self.covered_output(ticket)

    async def _fetch_budget(
        self, request: web.Request, areq: AdmissionRequest, tenant: Tenant | None, outcome: RequestOutcome
    ) -> None:
        """Ask the limiter for ``areq``'s budget before the engine decides (the engine's port is
        synchronous; see ``gateway.admission.live_budget``): only when the engine will reserve
        (``budget_cost``) and the tenant has a budget. Storage down under ``fail_closed``: a 503."""
        budget = self._budget
        if budget is None or tenant is None or is_unlimited(tenant.limits):
            return
        cost = self.engine.budget_cost(areq)
        if cost is not None:
            await budget.fetch(request, areq, cost, tenant.limits, outcome)


ADMISSION = web.AppKey("admission", LiveAdmission)


def mark_saturated(request: web.Request, request_class: str, settings: AdmissionSettings) -> None:
    """The response to ``request`` says admission refused it because every replica refused it
    as overloaded (``replicas_saturated``), on top of the forecast of an earlier placement the
    replica refused, if any."""
    refused = refusal_reason_headers(request_class, RefusalReason.REPLICAS_SATURATED, settings)
    request[PREDICTION_HEADERS] = {**request.get(PREDICTION_HEADERS, {}), **refused}


def _refusal(saturated: Saturated) -> Refused:
    return Refused(saturated.reason, saturated.message, retry_after=saturated.retry_after)


def _forecast_headers(replica: str, forecast: Forecast | None) -> dict[str, str]:
    """``gateway.prediction.live.forecast_headers``; without a forecast the admitter had no step model
    for the replica (``no_step_model``)."""
    if forecast is None:
        return {REPLICA_HEADER: replica, PREDICTION_HEADER: ForecastReason.NO_STEP_MODEL.value}
    return forecast_headers(replica, forecast)
