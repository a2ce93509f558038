"""Peers' gateway policies for the replay (``replay.admission``): the baselines Sluice is scored against.

Every class implements ``GatewayPolicy``. Three are the shipped ``AdmissionEngine`` under another
``admission.policy`` (``gateway.admission.policies``: the very classes a live gateway runs when
configured so), driven by ``replay.policies.SluicePolicy``'s adapter; each has one knob the
goodput bench tunes:

* ``NoAdmission`` (``policy: none``): everything is sent at once to the replica with the fewest
  outstanding requests; the engine's own queue absorbs overload.
* ``ConcurrencyCap(cap)`` (``policy: concurrency_cap``): at most ``cap`` outstanding requests per
  replica; the rest wait in a FIFO queue, refused ``queue_timeout_s`` after arrival.
* ``SaturationShedding(queue_threshold, kv_threshold)`` (``policy: saturation``): GAIE's detector,
  judged on the engine's views (the last scrape plus the requests sent since), as live.

Two are replay-only models of a peer:

* ``TenantRateLimit(rpm, tpm)``: per-tenant token buckets (``TokenBucket``) of requests and
  tokens per minute, LiteLLM style (a request passes when its tenant's request bucket holds one
  and its token bucket is not empty; tokens are charged when it ends); routing is least
  outstanding. Live, tenant rpm/tpm are the ``tenants:`` budgets (``gateway.tenants.live`` over
  ``gateway.limits``), enforced before admission under any policy; this class models LiteLLM's
  post-call accounting.
* ``PrefixAffinity``: llm-d's default scheduling profile (prefix-cache, queue and KV-cache
  utilization scorers, max-score picker), everything sent at once: a model of a peer's
  cache-affinity router.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Final

from gateway.admission import AdmissionSettings
from gateway.admission.config import SaturationSettings
from gateway.admission.policies import saturated
from predictor.prefix_index import PrefixIndex, PrefixKey, prefix_key
from replay.loop import Fleet
from replay.policies import PolicyBase, SluicePolicy
from replay.requests import GatewayRequest
from simulator.engine import FinishedRequestStats

__all__ = [
    "ConcurrencyCap",
    "NoAdmission",
    "PrefixAffinity",
    "SaturationShedding",
    "TenantRateLimit",
    "TokenBucket",
    "baseline_settings",
]


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


class TenantRateLimit(PolicyBase):
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


class PrefixAffinity(PolicyBase):
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
