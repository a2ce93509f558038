"""Prefix-cache-aware admission: the forecast prices the uncached prompt, routing weighs hits.

Two replicas in the same state; one has the request's prefix indexed. The forecast there takes
the hit off its prefill, the decision carries it, and routing prefers the hit while the request
meets its targets on both (``prefix_cache.hit_weight``), unless the weight is 0.
"""

from __future__ import annotations

import dataclasses

from gateway.admission import AdmissionRequest, ReplicaView
from gateway.admission.config import PrefixCacheSettings
from gateway.admission.decision import Admit
from gateway.admission.prefix import PrefixCaches
from gateway.admission.views import with_queued
from predictor.prefix_index import PrefixIndex, prefix_key
from tests.unit.admission.fleet import controller, request, settings, state, streams, view

PROMPT_TOKENS = 6000
TEXT = ("Tell me about the history of the printing press. " * 600)[:24_576]  # 96 blocks of 256


def prefixed(prompt: int = PROMPT_TOKENS, **kw: object) -> AdmissionRequest:
    k = prefix_key(TEXT, prompt, seed="m")
    return dataclasses.replace(request(prompt, 50.0, **kw), prefix=k)  # type: ignore[arg-type]


def cached_view(name: str, req: AdmissionRequest, *, realized: float = 1.0, running: int = 4) -> ReplicaView:
    index = PrefixIndex(400_000)
    assert req.prefix is not None
    index.insert(req.prefix)
    base = view(name, state(decodes=running), streams(running))
    return dataclasses.replace(base, prefix=index, prefix_realized=realized)


def cold_view(name: str, running: int = 4) -> ReplicaView:
    return dataclasses.replace(
        view(name, state(decodes=running), streams(running)), prefix=PrefixIndex(400_000)
    )


def test_the_forecast_takes_the_hit_off_the_prefill() -> None:
    req = prefixed()
    hot = controller().submit(req, [cached_view("hot", req)], 1000.0)
    cold = controller().submit(req, [cold_view("cold")], 1000.0)
    assert isinstance(hot, Admit)
    assert isinstance(cold, Admit)
    assert hot.forecast is not None
    assert cold.forecast is not None
    assert hot.forecast.cached_prompt_tokens == PROMPT_TOKENS - 1  # the whole text is indexed
    assert cold.forecast.cached_prompt_tokens == 0
    assert hot.forecast.ttft_s < cold.forecast.ttft_s / 5


def test_routing_prefers_the_hit_where_the_request_meets_its_targets() -> None:
    req = prefixed()
    # The cached replica runs more of the gateway's streams: by load alone the other wins.
    decision = controller().submit(
        req, [cold_view("cold", running=2), cached_view("hot", req, running=6)], 1000.0
    )
    assert isinstance(decision, Admit)
    assert decision.replica == "hot"
    no_weight = settings(prefix_cache={"hit_weight": 0.0})
    decision = controller(no_weight).submit(
        req, [cold_view("cold", running=2), cached_view("hot", req, running=6)], 1000.0
    )
    assert isinstance(decision, Admit)
    assert decision.replica == "cold"


def test_a_replica_that_does_not_deliver_its_hits_is_forecast_without_them() -> None:
    req = prefixed()
    decision = controller().submit(req, [cached_view("hot", req, realized=0.0)], 1000.0)
    assert isinstance(decision, Admit)
    assert decision.forecast is not None
    assert decision.forecast.cached_prompt_tokens == 0


def test_a_session_goes_back_to_its_replica_when_it_fits_there() -> None:
    req = dataclasses.replace(request(500, 50.0), session="s1", affinity="b")
    decision = controller().submit(req, [cold_view("a", running=2), cold_view("b", running=6)], 1000.0)
    assert isinstance(decision, Admit)
    assert decision.replica == "b"


def test_an_admitted_request_queues_only_its_uncached_prompt() -> None:
    req = prefixed()
    v = cached_view("hot", req)
    decision = controller().submit(req, [v], 1000.0)
    assert isinstance(decision, Admit)
    after = v.with_admitted(req, decision.forecast)
    assert (
        after.state.queued_prefill_tokens
        == with_queued(v.state, PROMPT_TOKENS, PROMPT_TOKENS - 1).queued_prefill_tokens
    )
    assert after.state.queued_prefill_tokens == 1


def test_prefix_caches_learn_the_share_of_hits_a_replica_delivers() -> None:
    caches = PrefixCaches(PrefixCacheSettings(session_header="x-session-id", max_sessions=2))
    req = dataclasses.replace(prefixed(), session="s1")
    assert caches.matched_tokens("r0", req) == 0
    caches.sent("r0", req, kv_capacity_tokens=400_000)
    assert caches.matched_tokens("r0", req) == PROMPT_TOKENS - 1
    assert caches.affinity("s1") == "r0"
    for _ in range(30):
        caches.reported("r0", PROMPT_TOKENS - 1, 0)  # the replica caches nothing
    assert caches.realized("r0") < 0.01
    for _ in range(30):
        caches.reported("r0", PROMPT_TOKENS - 1, PROMPT_TOKENS - 1)
    assert caches.realized("r0") > 0.99
    caches.reported("r0", 0, 0)  # nothing was expected: nothing learned
    caches.reported("r0", 100, None)  # the replica did not say
    assert caches.realized("r0") > 0.99
    # Sessions are bounded: the least recently used is forgotten.
    for s in ("s2", "s3"):
        caches.sent("r1", dataclasses.replace(req, session=s), kv_capacity_tokens=None)
    assert (caches.affinity("s1"), caches.affinity("s3")) == (None, "r1")
    caches.reconfigure(PrefixCacheSettings(enabled=False))
    assert caches.index("r0") is None
    assert caches.affinity("s3") is None
    assert caches.key(TEXT, PROMPT_TOKENS, "m") is None
