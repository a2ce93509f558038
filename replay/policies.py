"""Gateway policies for the replay (``replay.admission``): four peers' baselines and Sluice itself.

Every class implements ``GatewayPolicy``. Three baselines are the shipped ``AdmissionEngine`` under
another ``admission.policy`` (``gateway.admission.policies``: the very classes a live gateway runs
when configured so), driven by ``SluicePolicy``'s adapter; each has one knob the goodput bench tunes:

* ``NoAdmission`` (``policy: none``): everything is sent at once to the replica with the fewest
  outstanding requests; the engine's own queue absorbs overload.
* ``ConcurrencyCap(cap)`` (``policy: concurrency_cap``): at most ``cap`` outstanding requests per
  replica; the rest wait in a FIFO queue, refused ``queue_timeout_s`` after arrival.
* ``SaturationShedding(queue_threshold, kv_threshold)`` (``policy: saturation``): GAIE's detector,
  judged on the engine's views (the last scrape plus the requests sent since), as live.
* ``TenantRateLimit(rpm, tpm)``: per-tenant token buckets of requests and tokens per minute,
  LiteLLM style (a request passes when its tenant's request bucket holds one and its token bucket
  is not empty; tokens are charged when it ends); routing is least outstanding. Live, tenant
  rpm/tpm are the ``tenants:`` budgets (``gateway.tenants.live`` over ``gateway.limits``), enforced
  before admission under any policy; this replay-only class models LiteLLM's post-call accounting.
* ``PrefixAffinity``: llm-d's default scheduling profile (prefix-cache, queue and KV-cache
  utilization scorers, max-score picker), everything sent at once: a replay-only model of a
  peer's cache-affinity router.
* ``SluicePolicy``: the shipped ``AdmissionEngine`` (``gateway.admission.engine``) and a
  ``PredictionService``, driven as the live gateway's adapter drives them: the same view cache,
  queue, timer, fairness charges, re-placement, tenant budgets (``replay.budget``: the gateway's
  in-memory limiter on the virtual clock) and learning at a request's end
  (``tests/unit/admission/test_engine_parity.py`` feeds both the same events).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from gateway.admission import (
    AdmissionController,
    AdmissionRequest,
    AdmissionSettings,
    Decision,
    Reject,
    VirtualTokenCounter,
)
from gateway.admission.budget import BudgetRefused
from gateway.admission.config import SaturationSettings
from gateway.admission.engine import AdmissionEngine
from gateway.admission.fairness import TokenWeights
from gateway.admission.policies import saturated
from gateway.admission.ports import AdmissionReplica
from gateway.admission.results import Ending, Resolution, Saturated, UnknownModel
from gateway.limits.base import TenantLimits
from gateway.prediction import PredictionConfig, PredictionService
from gateway.replicas.registry import LiveRequest
from predictor.prefix_index import PrefixIndex, PrefixKey, prefix_key
from replay.budget import DEFAULT_WEIGHTS, MemoryBudget
from replay.loop import Fleet, IdleHooks, ReplicaHandle
from replay.requests import GatewayRequest
from simulator.engine import FinishedRequestStats

__all__ = [
    "ConcurrencyCap",
    "NoAdmission",
    "PrefixAffinity",
    "SaturationShedding",
    "SluicePolicy",
    "TenantRateLimit",
    "TokenBucket",
    "baseline_settings",
]


class _Base(IdleHooks):
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


class PrefixAffinity(_Base):
    """A cache-affinity router configured as llm-d's default: every request sent at once to the
    replica with the highest weighted score (ties at random, ``seed``), no admission.

    Followed: llm-d's inference-scheduling guide (``llm-d/llm-d``,
    ``guides/inference-scheduling/scheduler/inference-scheduling.values.yaml``: one profile of
    ``queue-scorer`` weight 2, ``kv-cache-utilization-scorer`` weight 2, ``prefix-cache-scorer``
    weight 3, picked by the max score), and the approximate prefix scorer of the Gateway API
    inference extension that llm-d runs (``pkg/epp/.../plugins/.../prefix``):

    * prefix: the prompt's bytes cut into blocks of ``block_tokens`` x 4 characters (vLLM's block
      size, autotuned, times its assumed 4 characters a token), at most ``max_blocks`` (256),
      chained hashes seeded with the model; per replica an LRU of block hashes holding as many
      entries as the replica has KV blocks (autotuned from its ``num_gpu_blocks``), fed with a
      request's blocks when it is sent there; score = matched leading blocks / the request's blocks;
    * queue: (most waiting - its waiting) / (most - fewest) over the replicas, 1 when all equal;
    * KV-cache utilization: 1 - its KV-cache use.

    The queue and KV figures are read from the engines at the decision (the extension scrapes
    every 50 ms). The prefix index is ``predictor.prefix_index.PrefixIndex`` with every entry
    weighing one block. Requests without ``hash_ids`` score 0 for prefix everywhere.
    """

    def __init__(
        self,
        *,
        prefix_weight: float = 3.0,
        queue_weight: float = 2.0,
        kv_weight: float = 2.0,
        block_tokens: int = 16,
        max_blocks: int = 256,
        seed: int = 0,
        name: str = "llm-d prefix scorer",
    ) -> None:
        if min(prefix_weight, queue_weight, kv_weight) < 0 or block_tokens < 1 or max_blocks < 1:
            raise ValueError("weights must be >= 0, block_tokens and max_blocks >= 1")
        self.name = name
        self.weights = (prefix_weight, queue_weight, kv_weight)
        self.block_bytes = 4 * block_tokens
        self.max_blocks = max_blocks
        self._rng = random.Random(seed)
        self._model = ""
        self.indexes: list[PrefixIndex] = []

    def bind(self, fleet: Fleet) -> None:
        super().bind(fleet)
        self._model = fleet.model
        blocks = fleet.config.profile.engine.num_gpu_blocks
        self.indexes = [PrefixIndex(blocks) for _ in fleet.replicas]

    def key(self, request: GatewayRequest) -> PrefixKey | None:
        """``request``'s blocks, each weighing one index entry (``None``: no text or no full block)."""
        text = request.text()
        if text is None:
            return None
        size, most = self.block_bytes, self.max_blocks
        key = prefix_key(text, request.prompt_tokens, seed=self._model, block_bytes=size, max_blocks=most)
        return None if key is None else PrefixKey(key.hashes, 1.0)

    def scores(self, key: PrefixKey | None) -> list[float]:
        """Each replica's weighted score for a request with ``key`` (see the class)."""
        replicas = self.fleet.replicas
        waiting = [r.num_waiting for r in replicas]
        most, fewest = max(waiting), min(waiting)
        w_prefix, w_queue, w_kv = self.weights
        out: list[float] = []
        for r, index in zip(replicas, self.indexes, strict=True):
            prefix = index.match(key) / len(key.hashes) if key is not None else 0.0
            queue = 1.0 if most == fewest else (most - r.num_waiting) / (most - fewest)
            kv = 1.0 - r.kv_cache_usage
            out.append(w_prefix * prefix + w_queue * queue + w_kv * kv)
        return out

    def on_arrival(self, request: GatewayRequest, now: float) -> None:
        key = self.key(request)
        scores = self.scores(key)
        top = max(scores)
        chosen = self._rng.choice([k for k, s in enumerate(scores) if s == top])
        if key is not None:
            self.indexes[chosen].insert(key)
        self.fleet.dispatch(request, chosen, now)


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
        self._port = _FleetPort()
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


# -- the baselines: the engine under another ``admission.policy`` ------------------------------------
def baseline_settings(policy: str, **knobs: object) -> AdmissionSettings:
    """The ``admission`` section a baseline drives the engine with: ``policy`` and its knobs
    (``concurrency_cap={...}``, ``saturation={...}``), every class's queue unbounded in count (the
    baselines bound waiting by time only)."""
    data = AdmissionSettings().model_dump()
    data["policy"] = policy
    data.update(knobs)
    for cls in data["classes"].values():
        cls["queue_capacity"] = _UNBOUNDED_QUEUE
    return AdmissionSettings.model_validate(data)


#: A class queue no replay fills (requests).
_UNBOUNDED_QUEUE: Final = 1 << 30


class NoAdmission(SluicePolicy):
    """(a) ``admission.policy: none``: everything sent at once to the replica with the fewest
    outstanding requests; the engine's own queue absorbs overload (vLLM behind a plain load
    balancer)."""

    def __init__(self, *, seed: int = 0) -> None:
        super().__init__(baseline_settings("none"), seed=seed, name="no admission")


class ConcurrencyCap(SluicePolicy):
    """(b) ``admission.policy: concurrency_cap``: at most ``cap`` outstanding per replica; the rest
    wait in a FIFO queue, refused (``deadline_exceeded``) ``queue_timeout_s`` after arrival
    (``math.inf``: never)."""

    def __init__(self, cap: int, *, queue_timeout_s: float = math.inf, seed: int = 0) -> None:
        if cap < 1 or queue_timeout_s <= 0:
            raise ValueError("cap must be >= 1 and queue_timeout_s > 0")
        knobs = {"max_in_flight": cap, "queue_ttl_s": queue_timeout_s}
        super().__init__(
            baseline_settings("concurrency_cap", concurrency_cap=knobs), seed=seed, name=f"cap {cap}"
        )
        self.cap = cap
        self.queue_timeout_s = queue_timeout_s


class SaturationShedding(SluicePolicy):
    """(c) ``admission.policy: saturation``: refuse (``overloaded``) when every replica's waiting
    queue > ``queue_threshold`` or KV use > ``kv_threshold`` (GAIE's detector, defaults 5 and
    0.8), as the engine's views see them (the last scrape plus the requests sent since); else the
    unsaturated replica with the fewest waiting, then the least KV."""

    def __init__(self, *, queue_threshold: int = 5, kv_threshold: float = 0.8, seed: int = 0) -> None:
        if queue_threshold < 0 or not 0 < kv_threshold <= 1:
            raise ValueError("queue_threshold must be >= 0 and kv_threshold in (0, 1]")
        self.knobs = SaturationSettings(queue_threshold=queue_threshold, kv_threshold=kv_threshold)
        super().__init__(
            baseline_settings("saturation", saturation=self.knobs.model_dump()),
            seed=seed,
            name=f"saturation q>{queue_threshold} kv>{kv_threshold:g}",
        )
        self.queue_threshold = queue_threshold
        self.kv_threshold = kv_threshold

    def saturated(self, num_waiting: int, kv_cache_usage: float) -> bool:
        """GAIE's per-replica rule (``gateway.admission.policies.saturated``)."""
        return saturated(num_waiting, kv_cache_usage, self.knobs)
