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
* ``SluicePolicy``: the shipped ``AdmissionEngine`` (``gateway.admission.engine``) and a
  ``PredictionService``, driven as the live gateway's adapter drives them: the same view cache,
  queue, timer, fairness charges and re-placement (``tests/unit/admission/test_engine_parity.py``
  feeds both the same events).
"""

from __future__ import annotations

import math
import random
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.admission import (
    AdmissionController,
    AdmissionRequest,
    AdmissionSettings,
    Decision,
    Reject,
    VirtualTokenCounter,
)
from gateway.admission.engine import (
    AdmissionEngine,
    AdmissionReplica,
    Resolution,
    Saturated,
    UnknownModel,
)
from gateway.prediction import PredictionConfig, PredictionService
from gateway.replicas.registry import LiveRequest
from predictor import Forecast
from replay.loop import Fleet, GatewayRequest, ReplicaHandle
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

    def on_snapshot(self, replica: str, now: float) -> None:
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


class _FleetReplica:
    """A replica of the fleet as the admission engine sees it (``AdmissionReplica``)."""

    __slots__ = ("_handle", "_port")

    def __init__(self, handle: ReplicaHandle, port: _FleetPort) -> None:
        self._handle = handle
        self._port = port

    @property
    def name(self) -> str:
        return self._handle.name

    @property
    def state(self) -> str:
        return "healthy"

    @property
    def outstanding(self) -> int:
        return self._handle.outstanding

    @property
    def saturated_until(self) -> float:
        return self._port.saturated_until.get(self._handle.name, 0.0)

    def serves(self, model: str, engine: str | None = None) -> bool:
        return model == self._port.model

    def saturated(self, now: float) -> bool:
        return now < self.saturated_until


class _FleetPort:
    """``ReplicaSource`` over the replay's fleet (bound to it by ``SluicePolicy.bind``): every
    replica healthy and serving the fleet's model; a replica that refused a request as
    overloaded is left alone until its back-off ends (as the live registry's ``saturate``)."""

    def __init__(self) -> None:
        self.model = ""
        self.saturated_until: dict[str, float] = {}
        self._replicas: list[_FleetReplica] = []

    def bind(self, fleet: Fleet) -> None:
        self.model = fleet.model
        self._replicas = [_FleetReplica(h, self) for h in fleet.replicas]

    def replicas(self) -> Sequence[AdmissionReplica]:
        return self._replicas

    def get(self, name: str) -> AdmissionReplica | None:
        return next((r for r in self._replicas if r.name == name), None)

    def saturate_named(self, name: str, now: float, back_off_s: float, why: str) -> None:
        self.saturated_until[name] = max(self.saturated_until.get(name, 0.0), now + back_off_s)


def _new_entry(request: AdmissionRequest, now: float, streamed: bool) -> LiveRequest:
    return LiveRequest(request.request_id, request.prompt_tokens, now, request.max_tokens, streamed=streamed)


class SluicePolicy(_Base):
    """(e) Sluice: the shipped ``AdmissionEngine`` over the fleet, with a ``PredictionService``,
    driven as the live gateway's adapter (``gateway.live_admission``) drives it.

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
        self._port = _FleetPort()
        self.engine = AdmissionEngine(
            settings, self._port, self.service, rng=random.Random(seed), new_entry=_new_entry
        )
        #: Requests by the engine's key while queued; by index while sent (key, forecast).
        self._queued: dict[int, GatewayRequest] = {}
        self._sent: dict[int, tuple[int, Forecast | None]] = {}
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

    def _submit(self, request: GatewayRequest, now: float) -> None:
        """Decide ``request`` (arrived at ``request.arrival_s``) now, as ``LiveAdmission.admit``."""
        areq = self.engine.request(
            str(request.index),
            self._model,
            prompt_tokens=request.prompt_tokens,
            max_tokens=request.max_tokens,
            request_class=self.request_class,
            arrival_s=request.arrival_s,
            tenant=request.tenant,
        )
        submitted = self.engine.submit(areq, self._model, now)
        if isinstance(submitted, UnknownModel):
            raise RuntimeError(f"the fleet does not serve {submitted.model!r}")
        if isinstance(submitted, Saturated):
            self.refusals[(submitted.reason.value, "-")] += 1
            self.retry_after_s[request.index] = submitted.retry_after.delay_s
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
        self._sent[request.index] = (key, decision.forecast)

    def _apply(self, resolutions: list[Resolution], now: float) -> None:
        """Carry out what a re-evaluation decided for queued requests."""
        for r in resolutions:
            self._conclude(self._queued.pop(r.key), r.key, r.decision, r.replica, r.entry, now)

    def on_finished(
        self, replica: int, request: GatewayRequest, stats: FinishedRequestStats, now: float
    ) -> None:
        # As the live proxy: admission first (charge, forget, re-evaluate), then the learning.
        key, forecast = self._sent.pop(request.index, (-1, None))
        self._apply(self.engine.finished(key, stats.generation_tokens, now), now)
        self.service.on_finished(
            replica=self.fleet.replicas[replica].name,
            model=self._model,
            tenant=None,
            prompt_chars=None,
            prompt_tokens=stats.prompt_tokens,
            completion_tokens=stats.generation_tokens,
            finished_at=now,
            forecast=forecast,
            ttft_s=stats.ttft_s,
        )

    def replica_refused(self, request: GatewayRequest, back_off_s: float, now: float, *, retry: bool) -> None:
        """``request``'s replica refused it as overloaded before any token (its own 429/503),
        asking for ``back_off_s`` seconds: as the live proxy, the replica is left alone that long
        and the request placed again (``retry``), or refused as ``replicas_saturated``."""
        key, _ = self._sent.pop(request.index)
        self.engine.replica_refused(key, back_off_s, "overloaded", now)
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
