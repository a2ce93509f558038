"""Sluice's own gateway policy for the replay (``replay.admission``), and the policies' base.

``SluicePolicy`` is the shipped ``AdmissionEngine`` (``gateway.admission.engine``) and a
``PredictionService``, driven as the live gateway's adapter drives them: the same view cache,
queue, timer, fairness charges, re-placement, tenant budgets (``replay.budget``: the gateway's
in-memory limiter on the virtual clock) and learning at a request's end
(``tests/unit/admission/test_engine_parity.py`` feeds both the same events). The engine sees the
fleet through ``replay.ports.FleetPort``. The peers' baselines are in ``replay.baselines``.

``PolicyBase`` gives every replay policy (``GatewayPolicy``) the hooks a simple one does not need.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping

from gateway.admission import (
    AdmissionController,
    AdmissionRequest,
    AdmissionSettings,
    Decision,
    Reject,
    VirtualTokenCounter,
)
from gateway.admission.budget import BudgetRefused
from gateway.admission.engine import AdmissionEngine
from gateway.admission.fairness import TokenWeights
from gateway.admission.results import Ending, Resolution, Saturated, UnknownModel
from gateway.limits.base import TenantLimits
from gateway.prediction import PredictionConfig, PredictionService
from gateway.replicas.registry import LiveRequest
from replay.budget import DEFAULT_WEIGHTS, MemoryBudget
from replay.loop import Fleet, IdleHooks
from replay.ports import FleetPort
from replay.requests import GatewayRequest
from simulator.engine import FinishedRequestStats

__all__ = ["PolicyBase", "SluicePolicy"]


class PolicyBase(IdleHooks):
    """Defaults for the hooks a simple policy does not need."""

    name = "base"
    _fleet: Fleet | None = None

    @property
    def prediction_service(self) -> PredictionService | None:
        return None

    @property
    def fleet(self) -> Fleet:
        if self._fleet is None:
            raise RuntimeError("policy not bound to a fleet")
        return self._fleet

    def bind(self, fleet: Fleet) -> None:
        self._fleet = fleet

    def on_finished(
        self, replica: int, request: GatewayRequest, stats: FinishedRequestStats, now: float
    ) -> None:
        return None


def _new_entry(request: AdmissionRequest, now: float, streamed: bool) -> LiveRequest:
    r = request
    exact = r.exact_output_tokens
    return LiveRequest(
        r.request_id, r.prompt_tokens, now, r.max_tokens, streamed=streamed, exact_output=exact
    )


class SluicePolicy(PolicyBase):
    """(e) Sluice: the shipped ``AdmissionEngine`` over the fleet, with a ``PredictionService``,
    driven as the live gateway's adapter (``gateway.admission.live``) drives it.

    ``settings``: the ``admission`` section (class targets). ``request_class``: the class every
    request is judged as. ``prediction``: the service's config; ``seed``: Retry-After jitter.
    ``budgets``: tenants' budgets (``tenants.<name>.limits`` live; absent tenants have none),
    priced with ``token_weights``.
    """

    def __init__(
        self,
        settings: AdmissionSettings,
        *,
        request_class: str = "interactive",
        prediction: PredictionConfig | None = None,
        output_quantile: float = 0.5,
        seed: int = 0,
        name: str = "sluice",
        budgets: Mapping[str, TenantLimits] | None = None,
        token_weights: TokenWeights = DEFAULT_WEIGHTS,
    ) -> None:
        self.name = name
        self.request_class = request_class
        self.service = PredictionService(output_quantile=output_quantile, config=prediction)
        self._port = FleetPort()
        #: The tenants' budgets (``None``: none is budgeted).
        self.budget = None if budgets is None else MemoryBudget(budgets, weights=token_weights)
        self.engine = AdmissionEngine(
            settings,
            self._port,
            self.service,
            rng=random.Random(seed),
            new_entry=_new_entry,
            budget=self.budget,
        )
        #: Requests by the engine's key while queued; the engine's key by index while sent.
        self._queued: dict[int, GatewayRequest] = {}
        self._sent: dict[int, int] = {}
        self._model = ""
        #: Refusals by (reason, blocking constraint), for the bench's diagnosis.
        self.refusals: Counter[tuple[str, str]] = Counter()
        #: The Retry-After (jittered seconds; ``None``: retrying cannot help) each refused request
        #: was told, by index.
        self.retry_after_s: dict[int, float | None] = {}

    @property
    def prediction_service(self) -> PredictionService | None:
        return self.service

    @property
    def fairness(self) -> VirtualTokenCounter:
        """The tenants' fair-share counters (the engine's)."""
        return self.engine.fairness

    @property
    def route(self) -> str:
        """The route key the engine judges the fleet's requests under (its model, after ``bind``)."""
        return self._model

    @property
    def controller(self) -> AdmissionController:
        """The fleet model's controller (after ``bind``)."""
        return self.engine.controller(self._model)

    def bind(self, fleet: Fleet) -> None:
        super().bind(fleet)
        self._model = fleet.model
        self._port.bind(fleet)

    # -- events ---------------------------------------------------------------------------------------
    def on_arrival(self, request: GatewayRequest, now: float) -> None:
        self._submit(request, now)

    def _sized(self, request: GatewayRequest) -> int:
        """``request``'s prompt tokens as the gateway judges them: exact when sent as token ids,
        else estimated from its characters at the service's learned ratio for its tenant (as
        ``gateway.admission.sizing.prompt_size_of`` does live)."""
        if request.prompt_chars is None:
            return request.prompt_tokens
        return max(self.service.estimate_prompt_tokens(self._model, request.prompt_chars, request.tenant), 1)

    def _fewest(self, request: GatewayRequest, tokens: int) -> int | None:
        """The lowest plausible prompt tokens of ``request`` judged at ``tokens`` (``None``: exact,
        sent as token ids, or no fewer), as ``prompt_size_of`` gives them live."""
        if request.prompt_chars is None:
            return None
        fewest = min(max(self.service.fewest_prompt_tokens(request.prompt_chars), 1), tokens)
        return None if fewest == tokens else fewest

    def _submit(self, request: GatewayRequest, now: float) -> None:
        """Decide ``request`` (arrived at ``request.arrival_s``) now, as ``LiveAdmission.admit``."""
        tokens = self._sized(request)
        areq = self.engine.request(
            str(request.index),
            self._model,
            prompt_tokens=tokens,
            fewest_prompt_tokens=self._fewest(request, tokens),
            max_tokens=request.max_tokens,
            ignore_eos=request.ignore_eos,
            request_class=self.request_class,
            arrival_s=request.arrival_s,
            tenant=request.tenant,
            prompt_text=request.text(),
        )
        submitted = self.engine.submit(areq, self._model, now)
        if isinstance(submitted, UnknownModel):
            raise RuntimeError(f"the fleet does not serve {submitted.model!r}")
        if isinstance(submitted, Saturated | BudgetRefused):
            told = submitted.retry_after
            self.refusals[(submitted.reason.value, "-")] += 1
            self.retry_after_s[request.index] = None if told is None else told.delay_s
            self.fleet.reject(request, now, submitted.reason.value)
            return
        if submitted.queued:
            self._queued[submitted.key] = request
            return
        self._conclude(request, submitted.key, submitted.decision, submitted.replica, submitted.entry, now)

    def on_decision(self, request: GatewayRequest, decision: Decision, now: float) -> None:
        """Told of every final decision (admit or refuse) before it is carried out; a hook for
        observers (the goodput bench records forecasts here). Does nothing by default."""
        return None

    def _conclude(
        self,
        request: GatewayRequest,
        key: int,
        decision: Decision,
        replica: str | None,
        entry: object,
        now: float,
    ) -> None:
        self.on_decision(request, decision, now)
        if not decision.admits or replica is None or not isinstance(entry, LiveRequest):
            assert isinstance(decision, Reject)
            self._refuse(request, decision, now)
            return
        self.fleet.dispatch(request, self.fleet.index_of(replica), now, live=entry)
        self._sent[request.index] = key

    def _apply(self, resolutions: list[Resolution], now: float) -> None:
        """Carry out what a re-evaluation decided for queued requests."""
        for r in resolutions:
            self._conclude(self._queued.pop(r.key), r.key, r.decision, r.replica, r.entry, now)

    def on_finished(
        self, replica: int, request: GatewayRequest, stats: FinishedRequestStats, now: float
    ) -> None:
        # As the live adapter: one ``finish`` forgets, charges, settles, learns, re-evaluates.
        key = self._sent.pop(request.index, -1)
        ending = Ending(
            stats.generation_tokens,
            stats.prompt_tokens,
            finished_at=now,
            ttft_s=stats.ttft_s,
            prompt_chars=request.prompt_chars,
            cached_tokens=stats.cached_tokens,
        )
        self._apply(self.engine.finish(key, ending, now), now)

    def replica_refused(self, request: GatewayRequest, back_off_s: float, now: float, *, retry: bool) -> None:
        """``request``'s replica refused it as overloaded before any token (its own 429/503),
        asking for ``back_off_s`` seconds: as the live proxy, the replica is left alone that long
        and the request placed again (``retry``), or refused as ``replicas_saturated``."""
        key = self._sent.pop(request.index)
        self.engine.replica_refused(key, back_off_s, "overloaded", now, placed_again=retry)
        self.fleet.withdraw(request, now)
        if not retry:
            saturated = self.engine.saturated(self._model, back_off_s, placed=True)
            self.refusals[(saturated.reason.value, "-")] += 1
            self.retry_after_s[request.index] = saturated.retry_after.delay_s
            self.fleet.reject(request, now, saturated.reason.value)
            self._apply(self.engine.finished(key, None, now), now)
            return
        self._apply(self.engine.finished(key, None, now), now)
        self._submit(request, now)

    def _refuse(self, request: GatewayRequest, reject: Reject, now: float) -> None:
        blocker = "-" if reject.blocker is None else reject.blocker.value
        self.refusals[(reject.reason.value, blocker)] += 1
        self.retry_after_s[request.index] = reject.retry_after_s
        self.fleet.reject(request, now, reject.reason.value)

    def on_snapshot(self, replica: str, now: float) -> None:
        self._apply(self.engine.on_snapshot(replica, now), now)

    def on_wakeup(self, now: float) -> None:
        self.reevaluate(now)

    def next_wakeup(self, now: float) -> float | None:
        return self.engine.next_wakeup(now)

    def reevaluate(self, now: float) -> None:
        """Offer the queued requests to the replicas again (``LiveAdmission.reevaluate``)."""
        self._apply(self.engine.reevaluate(now), now)
