"""``AdmissionEngine``: a request's whole admission lifecycle, sans I/O, on an injected clock.

The one place that decides: one ``AdmissionController`` per route, the queue and its
re-evaluation, the timer's next instant, fairness (weights, output charges), re-placement when
a replica refuses a request as overloaded, the tenant's budget (``BudgetLedger``: reserved
before the decision, refunded on a refusal, settled when the request ends), the replicas' views
(``ViewCache``: cached, rebuilt on events) and what is learned when a request ends (``finish``):
the prediction service's lessons, and each class's attainment on its replica, which moves the
margin admission judges that class by there (``AttainmentController``).
Two adapters drive it: the live gateway (``gateway.admission.live``: futures, the loop's timer,
headers) and the virtual-time replay (``replay.policies.SluicePolicy``). Times are seconds of
the adapter's clock, passed in as ``now``; nothing here reads a clock, sleeps, logs on its own or
does I/O. Its ports are in ``gateway.admission.ports``, its answers in
``gateway.admission.results``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from gateway.admission.attainment import AttainmentController
from gateway.admission.budget import (
    BudgetLedger,
    BudgetRefused,
    Hold,
    TenantBudget,
    bucket_output_cap,
    context_left,
    sure_output,
)
from gateway.admission.config import AdmissionSettings
from gateway.admission.core import AdmissionController
from gateway.admission.decision import Blocker, Decision, Queue, Reject, RejectReason
from gateway.admission.fairness import TokenWeights, VirtualTokenCounter
from gateway.admission.judging import AttainmentJudge, class_of
from gateway.admission.ports import (
    AdmissionReplica,
    EngineLog,
    EntryFactory,
    PredictionInputs,
    QuietLog,
    ReplicaSource,
    split_route,
)
from gateway.admission.prefix import PrefixCaches
from gateway.admission.request import AdmissionRequest
from gateway.admission.results import (
    Ending,
    Resolution,
    Saturated,
    Submitted,
    UnknownModel,
)
from gateway.admission.retry_after import (
    RefusalReason,
    RetryAfterPolicy,
    UniformSource,
    retry_after,
)
from gateway.admission.size_share import QuartileRow
from gateway.admission.stats import AdmissionStats
from gateway.admission.view_cache import ViewCache
from gateway.admission.views import LiveEntry, ReplicaView, TrackedStream
from predictor import Forecast

__all__ = ["MAX_TICK_S", "MIN_TICK_S", "AdmissionEngine"]

#: Shortest and longest wait between two timer re-evaluations while requests are queued, seconds.
MIN_TICK_S: Final = 0.005
MAX_TICK_S: Final = 0.25
#: Refusals a looser margin could have avoided: the forecasts held against the request's own
#: targets and the running streams' (the attainment controller loosens only while they happen).
_MARGIN_BLOCKERS: Final = frozenset({Blocker.TTFT, Blocker.TPOT, Blocker.STREAMS_TPOT, Blocker.STREAMS_STALL})


@dataclass(slots=True)
class _Queued:
    route: str
    entry_id: int
    request: AdmissionRequest
    streamed: bool
    hold: Hold | None


@dataclass(slots=True)
class _Sent:
    replica: str
    entry: LiveEntry[Any]
    request: AdmissionRequest
    route: str
    forecast: Forecast | None
    hold: Hold | None
    #: The replica refused it as overloaded; ``placed_again``: its budget waits for the next placement.
    refused: bool = False
    placed_again: bool = False
    #: Prompt tokens the replica's prefix index held when it was sent (before the delivered share).
    matched_tokens: int = 0


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
        self._log: EngineLog = log if log is not None else QuietLog()
        self._budget = (
            None
            if budget is None
            else BudgetLedger(budget, self._log, rng=rng, retry_settings=lambda: self._settings.retry_after)
        )
        self.view_cache = ViewCache(
            predictions, self._log, max_age_s=view_max_age_s, stale_margin=settings.stale_margin
        )
        #: Each class's margin per replica, held by the attainment admitted requests reach.
        self.attainment = AttainmentController(settings)
        self.view_cache.margins = self.attainment.margins
        self.view_cache.overdue = settings.overdue_ttft
        #: When each sent request counts towards its class's attainment there.
        self.judging = AttainmentJudge(self.attainment, lambda: self._settings, self.view_cache.touch)
        #: Each replica's prefix cache as admission believes it.
        self.prefix = PrefixCaches(settings.prefix_cache)
        self.view_cache.prefix = self.prefix
        self.stats = AdmissionStats()
        self.fairness = VirtualTokenCounter(TokenWeights.from_queue_settings(settings.queue))
        #: The token weights tenants' budgets are charged with; with ``queue.fairness: tokens`` the
        #: fair-share counters charge the same. ``None``: the queue's costs.
        self.token_weights: Callable[[], TokenWeights] | None = None
        self._controllers: dict[str, AdmissionController] = {}
        self._sent: dict[int, _Sent] = {}
        #: Queued requests by key, in the order they were queued.
        self._queued: dict[int, _Queued] = {}
        self._keys = itertools.count()

    # -- settings and fairness ----------------------------------------------------------------------
    @property
    def settings(self) -> AdmissionSettings:
        return self._settings

    def reconfigure(self, settings: AdmissionSettings) -> None:
        """Swap in a new validated ``admission`` section; queued requests and counters stay."""
        if settings == self._settings:
            return
        self._settings = settings
        self.view_cache.stale_margin = settings.stale_margin
        if self.view_cache.overdue != settings.overdue_ttft:
            self.view_cache.overdue = settings.overdue_ttft
            self.view_cache.changed()
        self.attainment.reconfigure(settings)
        self.prefix.reconfigure(settings.prefix_cache)
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

    def size_shares(self, now: float) -> dict[str, dict[str, dict[str, object]]]:
        """Per route, each class's admission by prompt-size quartile over its window at ``now``
        (``SizeShares.as_json``: edges, counts, rates, the bands ``size_fairness`` protects)."""
        return {route: c.size_shares.as_json(now) for route, c in sorted(self._controllers.items())}

    def size_share_rows(self, now: float) -> list[QuartileRow]:
        """Every route's classes' prompt-size quartiles at ``now`` (``SizeShares.rows``), for the
        metrics (which sum them per class)."""
        return [row for c in self._controllers.values() for row in c.size_shares.rows(now)]

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
        min_tokens: int = 0,
        ignore_eos: bool = False,
        fewest_prompt_tokens: int | None = None,
        token_capacity: float | None = None,
        prompt_text: str | None = None,
        session: str | None = None,
    ) -> AdmissionRequest:
        """The request sized for admission: its output predicted at the service's quantile,
        capped by ``max_tokens`` (the cap itself, at quantile 1, when the prediction fails), and
        never below what it is sure to produce (``min_tokens``; with ``ignore_eos`` its whole cap,
        the rest of the route's largest context when ``max_tokens`` is absent: ``sure_output``;
        with ``ignore_eos`` and ``max_tokens`` it is exact: ``AdmissionRequest.exact_output_tokens``).
        ``choices``: the sequences it decodes (the body's ``n``; its budget pays for each).
        The output is predicted for ``tenant`` (``PredictionService.expected_output``).
        ``fewest_prompt_tokens``: the lowest plausible prompt size when ``prompt_tokens`` is an
        estimate (``None``: exact). ``token_capacity``: set for a response that cannot be stopped
        part-way (not streamed) whose tenant has a token bucket of that many weighted tokens: its
        budget reserves its whole output cap, and without ``max_tokens`` that cap is the largest
        output the bucket can hold, at most the context left (``bucket_output_cap``; never below
        ``min_tokens``), set as its ``max_tokens`` (the adapter sends it to the replica).
        ``None``: reserved at the prediction. ``prompt_text``: the prompt as text (a chat's
        messages in order, any rendering that keeps a shared prefix shared), indexed for prefix-cache
        hits (``None``: not indexed). ``session``: the client session, for session affinity."""
        model, _ = split_route(route)
        whole = token_capacity is not None and self._budget is not None
        if max_tokens is None and token_capacity is not None and self._budget is not None:
            # The context left at the fewest plausible prompt tokens: an estimate never cuts it.
            left = self._context_left(route, fewest_prompt_tokens or prompt_tokens, arrival_s)
            weights = self._budget.budget.weights(model)
            cap = bucket_output_cap(weights, prompt_tokens, choices, token_capacity, left)
            # Never below min_tokens (vLLM refuses min_tokens > max_tokens): then too large, refused.
            max_tokens = max(cap, min_tokens)
        try:
            output, quantile = self._predictions.expected_output(model, tenant, max_tokens)
        except Exception:
            self._log.exception("output-length prediction failed; assuming the output cap")
            output, quantile = float(max_tokens or 256), 1.0
        if min_tokens > 0 or ignore_eos:
            left = None if max_tokens is not None else self._context_left(route, prompt_tokens, arrival_s)
            sure = sure_output(max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos, context_left=left)
            if sure >= output:
                output, quantile = float(sure), 1.0 if ignore_eos else quantile
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
            fewest_prompt_tokens=fewest_prompt_tokens,
            reserve_whole_output=whole,
            model=model,
            prefix=self.prefix.key(prompt_text, prompt_tokens, model),
            session=session,
            affinity=self.prefix.affinity(session),
            exact_output_tokens=max_tokens if ignore_eos else None,
        )

    def submit(
        self, request: AdmissionRequest, route: str, now: float, *, streamed: bool = True
    ) -> Submitted | UnknownModel | Saturated | BudgetRefused:
        """Decide a new request on ``route``: its tenant's budget first (``BudgetRefused`` when it
        is spent), then admitted (sent and tracked at once), queued (until a ``reevaluate``
        resolves it) or refused; ``UnknownModel``/``Saturated`` when no replica may take it. A
        budget reserved for a request refused here is refunded at once. ``streamed``: the client
        streams the response (its tokens are seen)."""
        self.judging.due(now)
        self.refresh_fair_weights()
        hold = self._reserve(request, now)
        if isinstance(hold, BudgetRefused):
            return hold
        candidates = self._candidates(route, now)
        if not isinstance(candidates, list):
            self._refund(hold, now)
            return candidates
        controller = self.controller(route)
        decision = controller.submit(request, self.view_cache.views_for(route, candidates, now), now)
        self._note_refusal(request, decision, now)
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
        hold: Hold | None,
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
        return None if self._budget is None else self._budget.cost(request)

    def held(self, key: int) -> Hold | None:
        """The budget held for sent request ``key`` (``None``: none, or not in flight), for the
        live relay to charge ahead (``Hold.next_top_up``) when its stream outruns it."""
        sent = self._sent.get(key)
        return None if sent is None else sent.hold

    def _context_left(self, route: str, prompt_tokens: int, now: float) -> int | None:
        """``budget.context_left`` over the route's replica views: the cached ones, else those
        of its healthy replicas built now (``None``: it has none)."""
        replicas = self._replicas.replicas()
        lens = []
        for replica in replicas:
            view = self.view_cache.cached_view(route, replica.name)
            if view is not None:
                lens.append(view.state.max_model_len)
        if not lens:
            model, engine = split_route(route)
            healthy = [r for r in replicas if r.state == "healthy" and r.serves(model, engine)]
            if healthy:
                lens = [v.state.max_model_len for v in self.view_cache.views_for(route, healthy, now)]
        return context_left(lens, prompt_tokens)

    def _reserve(self, request: AdmissionRequest, now: float) -> Hold | BudgetRefused | None:
        return None if self._budget is None else self._budget.reserve(request, now)

    def _refund(self, hold: Hold | None, now: float) -> None:
        if self._budget is not None:
            self._budget.refund(hold, now)

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
        hold, budget = sent.hold, self._budget
        if hold is not None and budget is not None:
            if sent.placed_again:
                budget.park(hold, request)
            else:
                budget.settle(hold, ending, produced, now)
        resolutions = self.reevaluate(now)
        # Learned after the re-evaluation, as the live gateway always has: the queue is judged on
        # what was known while the request ran.
        if ending.learn and not sent.refused:
            self.prefix.reported(sent.replica, sent.matched_tokens, ending.cached_tokens)
            self._learn(sent, ending)
            self.judging.ended(key, ending, now)
        else:
            self.judging.withdraw(key)
        return resolutions

    def finished(self, key: int, produced_tokens: int | None, now: float) -> list[Resolution]:
        """``finish`` without learning: request ``key`` ended having produced ``produced_tokens``
        (``None``: the tokens seen)."""
        return self.finish(key, Ending(produced_tokens, learn=False), now)

    def _learn(self, sent: _Sent, ending: Ending) -> None:
        model, _ = split_route(sent.route)
        forecast = sent.forecast if ending.forecast is None else ending.forecast
        ttft, tpot = ending.relayed(sent.entry)
        try:
            self._predictions.on_finished(
                replica=sent.replica,
                model=model,
                tenant=sent.request.tenant,
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

    def _note_refusal(self, request: AdmissionRequest, decision: Decision, now: float) -> None:
        """An enforced refusal or hold on a replica's forecasts (its own targets, its streams')
        lets the margin of the request's class there loosen (``AttainmentController.refused``)."""
        if not isinstance(decision, Queue | Reject) or not decision.enforced or decision.replica is None:
            return
        if decision.blocker not in _MARGIN_BLOCKERS:
            return
        self.attainment.refused(class_of(self._settings, request)[0], decision.replica, now)

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
            self.judging.withdraw(key)
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
            self.judging.withdraw(key)
            self._refund(sent.hold, now)
        return False

    # -- events -------------------------------------------------------------------------------------
    def changed(self, now: float) -> list[Resolution]:
        """Every replica's load or health may have changed: views are rebuilt, the queue
        re-evaluated."""
        self.view_cache.changed()
        return self.reevaluate(now)

    def on_snapshot(self, replica: str, now: float) -> list[Resolution]:
        """A new snapshot of ``replica``: its views (only its) are rebuilt, the queue re-evaluated."""
        self.view_cache.touch(replica)
        return self.reevaluate(now)

    def reevaluate(self, now: float) -> list[Resolution]:
        """Offer every route's queued requests to its replicas again; the ones decided, in the
        order they were decided (each dispatch tracked on its replica at once). Requests whose
        first-token deadline has passed are judged first (``AttainmentJudge.due``)."""
        self.judging.due(now)
        if not self._queued:
            return []
        by_entry = {(q.route, q.entry_id): key for key, q in self._queued.items()}
        out: list[Resolution] = []
        for route, controller in self._controllers.items():
            if len(controller.queue) == 0:
                continue
            candidates = self._candidates(route, now)
            views = self.view_cache.views_for(route, candidates if isinstance(candidates, list) else [], now)
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
                    self._note_refusal(queued.request, reject, now)
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
        hold: Hold | None,
    ) -> None:
        tpot = forecast.tpot_s if forecast is not None and math.isfinite(forecast.tpot_s) else 0.0
        ttft = forecast.ttft_s if forecast is not None else math.nan
        output = request.expected_output_tokens if forecast is None else forecast.output_tokens_used
        stream = TrackedStream(entry, request.request_class, output, tpot, ttft)
        matched = self.prefix.matched_tokens(replica, request)
        if forecast is not None:
            entry.cached_tokens = forecast.cached_prompt_tokens
        else:  # no step model there: the hit its index expects, for the state and the access log
            share = self.prefix.realized(replica)
            entry.cached_tokens = max(request.cached_prompt_tokens, int(matched * share))
        view = self.view_cache.cached_view(route, replica)
        self.prefix.sent(replica, request, None if view is None else view.state.kv_capacity_tokens)
        self.view_cache.track(replica, entry, stream)
        if self._budget is not None:
            self._budget.running(hold, stream)
        self._sent[key] = _Sent(replica, entry, request, route, forecast, hold, matched_tokens=matched)
        self.judging.sent(key, replica, entry, request)

    def _forget(self, sent: _Sent) -> None:
        self.view_cache.forget(sent.replica, sent.entry)

    # -- views --------------------------------------------------------------------------------------
    def views_for(self, route: str, replicas: Iterable[AdmissionReplica], now: float) -> list[ReplicaView]:
        """Views of ``replicas`` for a request on ``route`` (``ViewCache.views_for``)."""
        return self.view_cache.views_for(route, list(replicas), now)

    def cached_view(self, route: str, replica: str) -> ReplicaView | None:
        """The view of ``replica`` for ``route`` the last decision there used (``None``: none yet)."""
        return self.view_cache.cached_view(route, replica)
