"""Gateway policies for the replay (``replay.admission``): four peers' baselines and Sluice itself.

Every class implements ``GatewayPolicy``; each baseline has one knob (the goodput bench tunes it):

* ``NoAdmission``: everything is sent at once to the replica with the fewest outstanding
  requests; the engine's own queue absorbs overload (vLLM behind a plain load balancer).
* ``ConcurrencyCap(cap)``: at most ``cap`` outstanding requests per replica; the rest wait in a
  FIFO gateway queue, dropped when they have waited ``queue_timeout_s`` (TGI's
  ``--max-concurrent-requests`` / vllm-router style, plus the queue TTL llm-d and LiteLLM have).
* ``SaturationShedding(queue_threshold, kv_threshold)``: a replica is saturated when its waiting
  queue is above ``queue_threshold`` or its KV-cache use above ``kv_threshold`` (the Kubernetes
  Gateway API Inference Extension's detector, defaults 5 and 0.8); a request is refused when every
  replica is saturated, else sent to the least loaded non-saturated one (fewest waiting, then
  least KV). It reads each engine's state at the instant of the decision: fresher than any
  scrape (GAIE refreshes every 50 ms).
* ``TenantRateLimit(rpm, tpm)``: per-tenant token buckets of requests and tokens per minute,
  LiteLLM style: a request passes when its tenant's request bucket holds one and its token bucket
  is not empty; the request is charged at once, its tokens (prompt + completion) when it ends.
  No load awareness; routing is least outstanding.
* ``SluicePolicy``: the real ``AdmissionController`` and ``PredictionService``, driven as
  ``gateway.live_admission.LiveAdmission`` drives them (views built the same way, re-evaluation
  on every finish, every scrape and on the queue's timer with the same clamps).
"""

from __future__ import annotations

import math
import random
from collections import Counter, deque
from dataclasses import dataclass

from gateway.admission import (
    AdmissionController,
    AdmissionRequest,
    AdmissionSettings,
    Decision,
    Queue,
    Reject,
    ReplicaView,
    StreamingRequest,
)
from gateway.admission.shares import decode_elapsed_s
from gateway.live_admission import MAX_TICK_S, MIN_TICK_S, expected_output, replica_inputs
from gateway.prediction import PredictionConfig, PredictionService
from predictor import Forecast
from replay.loop import Fleet, GatewayRequest
from simulator.engine import FinishedRequestStats

__all__ = [
    "ConcurrencyCap",
    "NoAdmission",
    "SaturationShedding",
    "SluicePolicy",
    "TenantRateLimit",
    "TokenBucket",
]


class _Base:
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

    def on_scrape(self, now: float) -> None:
        return None

    def next_wakeup(self, now: float) -> float | None:
        return None

    def on_wakeup(self, now: float) -> None:
        return None


class NoAdmission(_Base):
    """(a) Everything dispatched at once, least outstanding; vLLM's own queue holds the overload."""

    def __init__(self) -> None:
        self.name = "no admission"

    def on_arrival(self, request: GatewayRequest, now: float) -> None:
        fleet = self.fleet
        fleet.dispatch(request, fleet.least_outstanding(), now)


class ConcurrencyCap(_Base):
    """(b) At most ``cap`` outstanding per replica; a FIFO gateway queue with a TTL.

    ``queue_timeout_s``: a request still queued this long after its arrival is refused
    (``queue_timeout``); ``math.inf`` never drops.
    """

    def __init__(self, cap: int, *, queue_timeout_s: float = math.inf) -> None:
        if cap < 1 or queue_timeout_s <= 0:
            raise ValueError("cap must be >= 1 and queue_timeout_s > 0")
        self.cap = cap
        self.queue_timeout_s = queue_timeout_s
        self.name = f"cap {cap}"
        self.queue: deque[GatewayRequest] = deque()

    def _room(self) -> list[int]:
        return [r.index for r in self.fleet.replicas if r.outstanding < self.cap]

    def on_arrival(self, request: GatewayRequest, now: float) -> None:
        room = self._room()
        if room and not self.queue:
            self.fleet.dispatch(request, self.fleet.least_outstanding(room), now)
        else:
            self.queue.append(request)

    def _drain(self, now: float) -> None:
        self._expire(now)
        while self.queue:
            room = self._room()
            if not room:
                return
            self.fleet.dispatch(self.queue.popleft(), self.fleet.least_outstanding(room), now)

    def _expire(self, now: float) -> None:
        while self.queue and self.queue[0].arrival_s + self.queue_timeout_s <= now:
            self.fleet.reject(self.queue.popleft(), now, "queue_timeout")

    def on_finished(
        self, replica: int, request: GatewayRequest, stats: FinishedRequestStats, now: float
    ) -> None:
        self._drain(now)

    def next_wakeup(self, now: float) -> float | None:
        if not self.queue or math.isinf(self.queue_timeout_s):
            return None
        return self.queue[0].arrival_s + self.queue_timeout_s

    def on_wakeup(self, now: float) -> None:
        self._drain(now)


class SaturationShedding(_Base):
    """(c) Refuse when every replica's waiting queue > ``queue_threshold`` or KV use >
    ``kv_threshold``; else the least loaded unsaturated replica (fewest waiting, then least KV)."""

    def __init__(self, *, queue_threshold: int = 5, kv_threshold: float = 0.8) -> None:
        if queue_threshold < 0 or not 0 < kv_threshold <= 1:
            raise ValueError("queue_threshold must be >= 0 and kv_threshold in (0, 1]")
        self.queue_threshold = queue_threshold
        self.kv_threshold = kv_threshold
        self.name = f"saturation q>{queue_threshold} kv>{kv_threshold:g}"

    def saturated(self, num_waiting: int, kv_cache_usage: float) -> bool:
        """GAIE's per-pod rule: waiting queue or KV use over its threshold."""
        return num_waiting > self.queue_threshold or kv_cache_usage > self.kv_threshold

    def on_arrival(self, request: GatewayRequest, now: float) -> None:
        fleet = self.fleet
        free = [r for r in fleet.replicas if not self.saturated(r.num_waiting, r.kv_cache_usage)]
        if not free:
            fleet.reject(request, now, "saturated")
            return
        best = min(free, key=lambda r: (r.num_waiting, r.kv_cache_usage, r.index))
        fleet.dispatch(request, best.index, now)


@dataclass(slots=True)
class TokenBucket:
    """A bucket refilled continuously at ``rate_per_s`` up to ``capacity``; starts full.

    ``level`` may go below zero when a charge after the fact exceeds it (LiteLLM's post-call
    token accounting); it then refills from there.
    """

    rate_per_s: float
    capacity: float
    level: float
    updated_s: float = 0.0

    @classmethod
    def full(cls, rate_per_s: float, capacity: float, now: float = 0.0) -> TokenBucket:
        if rate_per_s <= 0 or capacity <= 0:
            raise ValueError("rate_per_s and capacity must be > 0")
        return cls(rate_per_s, capacity, capacity, now)

    def refill(self, now: float) -> float:
        """Bring the level up to ``now``; returns it."""
        if now > self.updated_s:
            self.level = min(self.capacity, self.level + (now - self.updated_s) * self.rate_per_s)
            self.updated_s = now
        return self.level

    def charge(self, amount: float, now: float) -> None:
        self.refill(now)
        self.level -= amount


class TenantRateLimit(_Base):
    """(d) Per-tenant requests-per-minute and tokens-per-minute buckets, no load awareness.

    ``rpm`` / ``tpm``: each tenant's limits; ``burst_s``: the buckets hold this many seconds of
    refill (LiteLLM counts per 60-s window; a smaller burst is kinder to the replicas).
    """

    def __init__(self, rpm: float, tpm: float, *, burst_s: float = 10.0, label: str | None = None) -> None:
        if rpm <= 0 or tpm <= 0 or burst_s <= 0:
            raise ValueError("rpm, tpm and burst_s must be > 0")
        self.rpm, self.tpm, self.burst_s = rpm, tpm, burst_s
        self.name = label or f"rate limit {rpm:.0f} rpm"
        self.requests: dict[str, TokenBucket] = {}
        self.tokens: dict[str, TokenBucket] = {}

    def _buckets(self, tenant: str, now: float) -> tuple[TokenBucket, TokenBucket]:
        if tenant not in self.requests:
            r, t = self.rpm / 60.0, self.tpm / 60.0
            self.requests[tenant] = TokenBucket.full(r, r * self.burst_s, now)
            self.tokens[tenant] = TokenBucket.full(t, t * self.burst_s, now)
        return self.requests[tenant], self.tokens[tenant]

    def allows(self, tenant: str, now: float) -> bool:
        """Whether ``tenant`` may send a request now (does not charge)."""
        req, tok = self._buckets(tenant, now)
        return req.refill(now) >= 1.0 and tok.refill(now) > 0.0

    def on_arrival(self, request: GatewayRequest, now: float) -> None:
        fleet = self.fleet
        if not self.allows(request.tenant, now):
            fleet.reject(request, now, "rate_limited")
            return
        self.requests[request.tenant].charge(1.0, now)
        fleet.dispatch(request, fleet.least_outstanding(), now)

    def on_finished(
        self, replica: int, request: GatewayRequest, stats: FinishedRequestStats, now: float
    ) -> None:
        _, tok = self._buckets(request.tenant, now)
        tok.charge(float(stats.prompt_tokens + stats.generation_tokens), now)


@dataclass(slots=True)
class _Stream:
    """What admission remembers of a request it sent (as ``live_admission._Stream``)."""

    request_class: str
    expected_output_tokens: float
    predicted_tpot_s: float
    forecast: Forecast | None


class SluicePolicy(_Base):
    """(e) Sluice: ``AdmissionController`` + ``PredictionService``, as the live gateway runs them.

    ``settings``: the ``admission`` section (class targets). ``request_class``: the class every
    request is judged as. ``prediction``: the service's config; ``seed``: Retry-After jitter.
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
    ) -> None:
        self.name = name
        self.request_class = request_class
        self.service = PredictionService(output_quantile=output_quantile, config=prediction)
        self.controller = AdmissionController(settings, rng=random.Random(seed))
        self._streams: list[dict[int, _Stream]] = []
        self._queued: dict[int, tuple[GatewayRequest, AdmissionRequest]] = {}
        self._wake: float | None = None
        self._model = ""
        #: Refusals by (reason, blocking constraint), for the bench's diagnosis.
        self.refusals: Counter[tuple[str, str]] = Counter()

    @property
    def prediction_service(self) -> PredictionService | None:
        return self.service

    def bind(self, fleet: Fleet) -> None:
        super().bind(fleet)
        self._streams = [{} for _ in fleet.replicas]
        self._model = fleet.model

    # -- views (as LiveAdmission._view) ---------------------------------------------------------------
    def views(self, now: float) -> list[ReplicaView]:
        """One view per replica, built exactly as the live gateway builds them."""
        out: list[ReplicaView] = []
        for handle in self.fleet.replicas:
            in_flight = handle.in_flight()
            step_model, state = replica_inputs(
                self.service, handle.name, model=self._model, tenant=None, in_flight=in_flight, now=now
            )
            streams = self._streams[handle.index]
            running = [
                StreamingRequest(
                    s.request_class,
                    o.request.prompt_tokens,
                    o.streamed,
                    s.expected_output_tokens,
                    s.predicted_tpot_s,
                    decode_elapsed_s(o.first_token_s, o.last_token_s),
                )
                for i, s in streams.items()
                for o in (handle.open[i],)
            ]
            out.append(
                ReplicaView.build(
                    handle.name,
                    healthy=True,
                    model=step_model,
                    state=state,
                    streams=running,
                    stale=state.stale,
                )
            )
        return out

    # -- events ---------------------------------------------------------------------------------------
    def on_arrival(self, request: GatewayRequest, now: float) -> None:
        output, quantile = expected_output(self.service, self._model, None, request.max_tokens)
        areq = AdmissionRequest(
            request_id=str(request.index),
            request_class=self.request_class,
            prompt_tokens=request.prompt_tokens,
            max_tokens=request.max_tokens,
            expected_output_tokens=output,
            arrival_s=now,
            output_quantile=quantile,
            tenant=request.tenant,
        )
        decision = self.controller.submit(areq, self.views(now), now)
        if isinstance(decision, Queue) and decision.enforced:
            assert decision.entry_id is not None
            self._queued[decision.entry_id] = (request, areq)
            self._schedule(now)
        else:
            self._conclude(request, areq, decision, now)

    def on_decision(self, request: GatewayRequest, decision: Decision, now: float) -> None:
        """Told of every final decision (admit or refuse) before it is carried out; a hook for
        observers (the goodput bench records forecasts here). Does nothing by default."""
        return None

    def _conclude(
        self, request: GatewayRequest, areq: AdmissionRequest, decision: Decision, now: float
    ) -> None:
        self.on_decision(request, decision, now)
        fleet = self.fleet
        if not decision.admits:
            assert isinstance(decision, Reject)
            self._refuse(request, decision, now)
            return
        k = fleet.index_of(decision.replica) if decision.replica is not None else fleet.least_outstanding()
        forecast = decision.forecast
        tpot = forecast.tpot_s if forecast is not None and math.isfinite(forecast.tpot_s) else 0.0
        output = forecast.output_tokens_used if forecast is not None else areq.expected_output_tokens
        fleet.dispatch(request, k, now)
        self._streams[k][request.index] = _Stream(areq.request_class, output, tpot, forecast)

    def on_finished(
        self, replica: int, request: GatewayRequest, stats: FinishedRequestStats, now: float
    ) -> None:
        stream = self._streams[replica].pop(request.index, None)
        self.controller.fairness.charge_output(request.tenant, max(0, stats.generation_tokens))
        self.service.on_finished(
            replica=self.fleet.replicas[replica].name,
            model=self._model,
            tenant=None,
            prompt_chars=None,
            prompt_tokens=stats.prompt_tokens,
            completion_tokens=stats.generation_tokens,
            finished_at=now,
            forecast=None if stream is None else stream.forecast,
            ttft_s=stats.ttft_s,
        )
        self.reevaluate(now)

    def _refuse(self, request: GatewayRequest, reject: Reject, now: float) -> None:
        blocker = "-" if reject.blocker is None else reject.blocker.value
        self.refusals[(reject.reason.value, blocker)] += 1
        self.fleet.reject(request, now, reject.reason.value)

    def on_scrape(self, now: float) -> None:
        self.reevaluate(now)

    def on_wakeup(self, now: float) -> None:
        self._wake = None
        self.reevaluate(now)

    def next_wakeup(self, now: float) -> float | None:
        return self._wake

    def reevaluate(self, now: float) -> None:
        """Offer the queued requests to the replicas again (``LiveAdmission.reevaluate``)."""
        if len(self.controller.queue) == 0:
            self._wake = None
            return
        result = self.controller.reevaluate(now, self.views(now))
        for entry, decision in result.dispatched:
            request, areq = self._queued.pop(entry.id)
            self._conclude(request, areq, decision, now)
        for entry, reject in result.rejected:
            request, _ = self._queued.pop(entry.id)
            self._refuse(request, reject, now)
        self._schedule(now)

    def _schedule(self, now: float) -> None:
        """The queue's next timer, as ``LiveAdmission._schedule`` arms it."""
        queue = self.controller.queue
        if len(queue) == 0:
            self._wake = None
            return
        deadline = self.controller.next_deadline_s()
        when = math.inf if deadline is None else deadline
        hint = MAX_TICK_S
        for entry_id in self._queued:
            entry = queue.entry(entry_id)
            if entry is not None and math.isfinite(entry.earliest_retry_s):
                hint = min(hint, entry.earliest_retry_s)
        self._wake = min(when, now + min(max(hint, MIN_TICK_S), MAX_TICK_S))
