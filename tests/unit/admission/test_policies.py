"""The baseline admission policies (``gateway.admission.policies``): each one's decisions on
hand-built views (named cases), the FIFO queue with its TTL, and a hot switch of policy inside
the engine while requests are in flight and queued."""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from gateway.admission import (
    AdmissionController,
    AdmissionSettings,
    Admit,
    Blocker,
    Decision,
    Queue,
    Reject,
    RejectReason,
    ReplicaView,
    RetryAfterPolicy,
    make_admitter,
)
from gateway.admission.engine import AdmissionEngine
from gateway.admission.policies import (
    ConcurrencyCapAdmitter,
    PassThroughAdmitter,
    SaturationAdmitter,
    SloAdmitter,
)
from gateway.admission.results import Submitted
from gateway.replicas.registry import LiveRequest
from predictor import ReplicaState, StepModel
from predictor.correction import NO_CORRECTION, Correction
from tests.unit.admission.fleet import MODEL, SETTINGS, request, state, streams, view


def policy_settings(policy: str, **knobs: Any) -> AdmissionSettings:
    data = SETTINGS.model_dump()
    data["policy"] = policy
    data.update(knobs)
    return AdmissionSettings.model_validate(data)


def loaded(
    name: str, gateway: int = 0, waiting: int = 0, kv: float = 0.0, healthy: bool = True
) -> ReplicaView:
    """A replica with ``gateway`` of Sluice's streams, ``waiting`` requests in its engine's queue
    and ``kv`` of its KV cache in use (a fraction of 400,000 tokens)."""
    base = state(queued=[100] * waiting)
    replica = ReplicaState.from_sequences(
        [],
        [100] * waiting,
        kv_capacity_tokens=base.kv_capacity_tokens,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=base.max_model_len,
    )
    replica = ReplicaState(
        replica.num_running,
        waiting,
        replica.decode_seqs,
        round(kv * base.kv_capacity_tokens),
        base.kv_capacity_tokens,
        256,
        8192,
        base.max_model_len,
        queued_prefill_tokens=100 * waiting,
        queued_requests=waiting,
    )
    return view(name, replica, streams(gateway), healthy=healthy)


def outcome(decision: Decision) -> str:
    """``admit rX``, ``queue blocker`` or ``reject reason/blocker``."""
    if isinstance(decision, Admit):
        return f"admit {decision.replica}"
    if isinstance(decision, Queue):
        return f"queue {decision.blocker}"
    return f"reject {decision.reason}/{decision.blocker}"


CAP = {"concurrency_cap": {"max_in_flight": 2, "queue_ttl_s": 1.0}}
SAT = {"saturation": {"queue_threshold": 5, "kv_threshold": 0.8}}

#: id -> (policy, its knobs, the views, queued, expected outcome).
CASES: dict[str, tuple[str, dict[str, Any], list[ReplicaView], bool, str]] = {
    "none_least_busy": ("none", {}, [loaded("r0", 3), loaded("r1", 1), loaded("r2", 2)], False, "admit r1"),
    "none_tie_goes_to_first": ("none", {}, [loaded("r0", 1), loaded("r1", 1)], False, "admit r0"),
    "none_ignores_saturation": ("none", {}, [loaded("r0", 9, waiting=50, kv=1.0)], False, "admit r0"),
    "none_skips_unhealthy": (
        "none",
        {},
        [loaded("r0", 0, healthy=False), loaded("r1", 5)],
        False,
        "admit r1",
    ),
    "none_no_healthy": (
        "none",
        {},
        [loaded("r0", healthy=False)],
        False,
        "reject no_healthy_replica/no_replica",
    ),
    "cap_room": ("concurrency_cap", CAP, [loaded("r0", 2), loaded("r1", 1)], False, "admit r1"),
    "cap_full_queues": (
        "concurrency_cap",
        CAP,
        [loaded("r0", 2), loaded("r1", 2)],
        False,
        "queue concurrency",
    ),
    "cap_queued_stays": ("concurrency_cap", CAP, [loaded("r0", 3)], True, "queue concurrency"),
    "cap_queued_goes": ("concurrency_cap", CAP, [loaded("r0", 1)], True, "admit r0"),
    "cap_no_healthy": ("concurrency_cap", CAP, [], False, "reject no_healthy_replica/no_replica"),
    "sat_fewest_waiting": (
        "saturation",
        SAT,
        [loaded("r0", waiting=3), loaded("r1", 9, waiting=1)],
        False,
        "admit r1",
    ),
    "sat_then_least_kv": ("saturation", SAT, [loaded("r0", kv=0.5), loaded("r1", kv=0.2)], False, "admit r1"),
    "sat_queue_over": (
        "saturation",
        SAT,
        [loaded("r0", waiting=6), loaded("r1", waiting=5)],
        False,
        "admit r1",
    ),
    "sat_kv_over": (
        "saturation",
        SAT,
        [loaded("r0", kv=0.81), loaded("r1", waiting=4, kv=0.8)],
        False,
        "admit r1",
    ),
    "sat_at_thresholds_admits": ("saturation", SAT, [loaded("r0", waiting=5, kv=0.8)], False, "admit r0"),
    "sat_all_saturated": (
        "saturation",
        SAT,
        [loaded("r0", waiting=6), loaded("r1", kv=0.9)],
        False,
        "reject overloaded/saturated",
    ),
    "sat_queued_never_stays": (
        "saturation",
        SAT,
        [loaded("r0", waiting=6)],
        True,
        "reject overloaded/saturated",
    ),
    "sat_threshold_zero": (
        "saturation",
        {"saturation": {"queue_threshold": 0, "kv_threshold": 1.0}},
        [loaded("r0", waiting=1)],
        False,
        "reject overloaded/saturated",
    ),
}


@pytest.mark.parametrize(("policy", "knobs", "views", "queued", "expected"), CASES.values(), ids=list(CASES))
def test_policy_decides(
    policy: str, knobs: dict[str, Any], views: list[ReplicaView], queued: bool, expected: str
) -> None:
    config = policy_settings(policy, **knobs)
    admitter = make_admitter(config, RetryAfterPolicy(config.retry_after, random.Random(1)))
    decision = admitter.decide(request(), views, 1000.0, queued=queued)
    assert outcome(decision) == expected
    if isinstance(decision, Reject):
        assert decision.retry_after is not None
        assert 1.0 <= decision.retry_after.delay_s <= 60.0


@pytest.mark.parametrize(
    ("policy", "kind"),
    [
        ("slo", SloAdmitter),
        ("concurrency_cap", ConcurrencyCapAdmitter),
        ("saturation", SaturationAdmitter),
        ("none", PassThroughAdmitter),
    ],
)
def test_policy_name_picks_its_class(policy: str, kind: type) -> None:
    config = policy_settings(policy)
    assert isinstance(make_admitter(config, RetryAfterPolicy(config.retry_after, random.Random(1))), kind)


def test_defaults_keep_slo_and_gaie_thresholds() -> None:
    config = AdmissionSettings()
    assert config.policy == "slo"
    assert (config.saturation.queue_threshold, config.saturation.kv_threshold) == (5, 0.8)


# -- the queue under concurrency_cap: FIFO whatever the size and tenant, a TTL from arrival ------------
def test_concurrency_cap_queue_is_fifo_and_refuses_after_its_ttl() -> None:
    config = policy_settings("concurrency_cap", concurrency_cap={"max_in_flight": 1, "queue_ttl_s": 0.5})
    controller = AdmissionController(config, rng=random.Random(3))
    full = [loaded("r0", 1)]
    # Longest first, tenants alternating: the SLO queue would pick the shortest / least-served.
    sizes = [(8000, "a"), (100, "b"), (4000, "a"), (50, "c")]
    ids = []
    for i, (prompt, tenant) in enumerate(sizes):
        r = request(prompt, arrival=1000.0 + i * 0.01, request_id=f"q{i}")
        r = dataclasses.replace(r, tenant=tenant)
        decision = controller.submit(r, full, 1000.0 + i * 0.01)
        assert isinstance(decision, Queue)
        assert decision.entry_id is not None
        ids.append(decision.entry_id)
    # One slot frees at a time: they leave in arrival order.
    order = []
    for step in range(2):
        result = controller.reevaluate(1000.1 + step * 0.01, [loaded("r0", 0)])
        order += [e.request.request_id for e, _ in result.dispatched]
    assert order == ["q0", "q1"]
    assert controller.next_deadline_s() == pytest.approx(1000.52)
    refused = []
    for now in (1000.515, 1000.52, 1000.53):
        refused += [
            (now, e.request.request_id, r.reason) for e, r in controller.reevaluate(now, full).rejected
        ]
    assert refused == [
        (1000.52, "q2", RejectReason.DEADLINE_EXCEEDED),
        (1000.53, "q3", RejectReason.DEADLINE_EXCEEDED),
    ]
    assert len(controller.queue) == 0


def test_concurrency_cap_refuses_when_the_class_queue_is_full() -> None:
    data = policy_settings("concurrency_cap", concurrency_cap={"max_in_flight": 1}).model_dump()
    data["classes"]["interactive"]["queue_capacity"] = 1
    controller = AdmissionController(AdmissionSettings.model_validate(data), rng=random.Random(3))
    full = [loaded("r0", 1)]
    assert isinstance(controller.submit(request(request_id="a"), full, 1000.0), Queue)
    second = controller.submit(request(request_id="b"), full, 1000.0)
    assert isinstance(second, Reject)
    assert (second.reason, second.blocker) == (RejectReason.OVERLOADED, Blocker.QUEUE_FULL)


# -- the engine: switching policy while requests are in flight and queued ---------------------------
@dataclass
class Replica:
    name: str
    outstanding: int = 0
    state: str = "healthy"
    saturated_until: float = 0.0

    def serves(self, model: str, engine: str | None = None) -> bool:
        return True

    def saturated(self, now: float) -> bool:
        return False


class Fleet:
    def __init__(self, names: Sequence[str]) -> None:
        self._replicas = [Replica(n) for n in names]

    def replicas(self) -> Sequence[Replica]:
        return self._replicas

    def get(self, name: str) -> Replica | None:
        return next((r for r in self._replicas if r.name == name), None)

    def saturate_named(self, name: str, now: float, back_off_s: float, why: str) -> None:
        return None


class Predictions:
    """Every replica runs what Sluice sent there; ``waiting``: its engine queue on top."""

    def __init__(self) -> None:
        self.waiting = 0

    def replica_inputs(
        self, replica: str, *, model: str, tenant: str | None, in_flight: Sequence[Any], now: float
    ) -> tuple[StepModel, ReplicaState]:
        return MODEL, state(decodes=len(in_flight), queued=[100] * self.waiting)

    def expected_output(self, model: str, tenant: str | None, max_tokens: int | None) -> tuple[float, float]:
        return 200.0, 0.5

    def dispatch_overhead_s(self, replica: str) -> float:
        return 0.0

    def correction(self, replica: str, now: float) -> Correction:
        return NO_CORRECTION

    def on_finished(self, **facts: Any) -> None:
        """Learns nothing: these replicas' load is what the test sets."""


def new_entry(r: Any, now: float, streamed: bool) -> LiveRequest:
    return LiveRequest(r.request_id, r.prompt_tokens, now, r.max_tokens, streamed=streamed)


def engine_with(config: AdmissionSettings, predictions: Predictions) -> AdmissionEngine:
    return AdmissionEngine(config, Fleet(["r0"]), predictions, rng=random.Random(5), new_entry=new_entry)


def submit(engine: AdmissionEngine, n: int, now: float) -> list[Submitted]:
    out = []
    for i in range(n):
        req = engine.request(
            f"q{i}", "m", prompt_tokens=100, max_tokens=50, request_class="interactive", arrival_s=now
        )
        submitted = engine.submit(req, "m", now)
        assert isinstance(submitted, Submitted)
        out.append(submitted)
    return out


CAP_ONE = policy_settings("concurrency_cap", concurrency_cap={"max_in_flight": 1, "queue_ttl_s": 30.0})


@pytest.mark.parametrize(
    ("switch_to", "waiting", "expected"),
    [
        pytest.param("none", 0, ["q1 admit r0", "q2 admit r0"], id="to_none_sends_the_queue"),
        pytest.param("saturation", 0, ["q1 admit r0", "q2 admit r0"], id="to_saturation_room"),
        pytest.param(
            "saturation",
            9,
            ["q1 reject overloaded/saturated", "q2 reject overloaded/saturated"],
            id="to_saturation_refuses_the_queue",
        ),
    ],
)
def test_reconfigure_switches_policy_and_decides_the_queued(
    switch_to: str, waiting: int, expected: list[str]
) -> None:
    predictions = Predictions()
    engine = engine_with(CAP_ONE, predictions)
    first, *rest = submit(engine, 3, 10.0)
    assert first.replica == "r0"
    assert all(s.queued for s in rest)
    assert engine.queue_order() == ["q1", "q2"]
    predictions.waiting = waiting
    engine.reconfigure(policy_settings(switch_to))
    # The timer keeps running while they wait: the switch is acted on without a finish.
    wake = engine.next_wakeup(10.1)
    assert wake is not None
    assert wake <= 10.1 + 0.25
    resolved = engine.reevaluate(wake)
    assert [f"{r.request_id} {outcome(r.decision)}" for r in resolved] == expected
    assert engine.queued() == 0
    # The request in flight under the old policy is still tracked, and its finish is clean.
    assert engine.finished(first.key, 50, 11.0) == []


def test_reconfigure_to_a_higher_cap_releases_the_queue_in_order() -> None:
    engine = engine_with(CAP_ONE, Predictions())
    submitted = submit(engine, 4, 10.0)
    assert [s.queued for s in submitted] == [False, True, True, True]
    engine.reconfigure(policy_settings("concurrency_cap", concurrency_cap={"max_in_flight": 3}))
    resolved = engine.reevaluate(10.2)
    assert [(r.request_id, r.replica) for r in resolved] == [("q1", "r0"), ("q2", "r0")]
    assert engine.queue_order() == ["q3"]
    assert math.isfinite(engine.next_wakeup(10.2) or math.inf)
