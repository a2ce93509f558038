"""Tenant fairness: the virtual token counters' arithmetic, the lift of a returning tenant, the
queue's order by counter, and a virtual-time simulation of two tenants on one saturated replica in
which token fairness gives each its weighted share of GPU time and request fairness does not."""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import pytest
from pydantic import ValidationError

from gateway.admission import (
    AdmissionController,
    AdmissionRequest,
    AdmissionSettings,
    Admit,
    Blocker,
    ClassSettings,
    Decision,
    Queue,
    QueueEntry,
    QueueSettings,
    ReplicaView,
    TokenWeights,
    VirtualTokenCounter,
)
from gateway.admission.fairness import REQUEST_COUNT
from tests.unit.admission.fleet import SETTINGS, controller, request, state, streams, view

T0 = 1000.0


# --- the counters' arithmetic -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "weight", "prompt", "output", "counter", "served"),
    [
        pytest.param(TokenWeights(1.0, 2.0), 1.0, 1000, 100, 1200.0, 1200.0, id="vtc-defaults"),
        pytest.param(TokenWeights(1.0, 2.0), 2.0, 1000, 100, 600.0, 1200.0, id="weight-2-halves-the-counter"),
        pytest.param(TokenWeights(1.0, 2.0), 0.5, 1000, 100, 2400.0, 1200.0, id="weight-half-doubles-it"),
        pytest.param(TokenWeights(3e-5, 1e-4), 1.0, 4000, 200, 0.14, 0.14, id="gpu-seconds-weights"),
        pytest.param(TokenWeights(1.0, 2.0, 50.0), 1.0, 100, 10, 170.0, 170.0, id="per-request-cost"),
        pytest.param(TokenWeights(0.0, 0.0, 1.0), 1.0, 4000, 200, 1.0, 1.0, id="request-count-only"),
    ],
)
def test_a_request_is_charged_weighted_tokens_over_the_tenant_weight(
    tokens: TokenWeights, weight: float, prompt: int, output: int, counter: float, served: float
) -> None:
    vtc = VirtualTokenCounter(tokens, {"a": weight})
    vtc.charge_dispatch("a", prompt)
    vtc.charge_output("a", output / 2)  # streamed in two chunks
    vtc.charge_output("a", output / 2)
    assert vtc.counter("a") == pytest.approx(counter)
    assert vtc.served("a") == pytest.approx(served)
    assert vtc.counter("b") == 0.0


def test_prompt_is_charged_at_dispatch_and_output_as_it_is_produced() -> None:
    vtc = VirtualTokenCounter(TokenWeights(1.0, 2.0))
    assert vtc.charge_dispatch("a", 300) == 300.0
    assert vtc.charge_output("a", 0) == 0.0
    assert vtc.charge_output("a", 7) == 14.0
    assert vtc.counters() == {"a": 314.0}


def test_output_is_charged_for_the_context_it_reads() -> None:
    # w_ctx per output token per token of context before it: the 1st of 4 outputs after a
    # 1000-token prompt reads 1000, the 4th 1003 (VTC's profiled x·y and y² terms).
    weights = TokenWeights(1.0, 2.0, context=0.01)
    assert weights.cost(1000, 4) == pytest.approx(1000.0 + 8.0 + 0.01 * (4 * 1000 + 6))
    vtc = VirtualTokenCounter(weights)
    vtc.charge_dispatch("docs", 1000)
    vtc.charge_output("docs", 2, context_tokens=1000)  # streamed in two chunks
    vtc.charge_output("docs", 2, context_tokens=1002)
    vtc.charge_dispatch("chat", 10)
    vtc.charge_output("chat", 4, context_tokens=10)
    assert vtc.served("docs") == pytest.approx(weights.cost(1000, 4))
    assert vtc.served("chat") == pytest.approx(weights.cost(10, 4))
    # Without a context weight (the default), the context changes nothing.
    assert TokenWeights(1.0, 2.0).output_cost(4, context_tokens=1000) == 8.0


def test_requests_without_a_tenant_share_one_counter_of_weight_one() -> None:
    vtc = VirtualTokenCounter(TokenWeights(1.0, 2.0), {"a": 4.0})
    vtc.charge_dispatch(None, 100)
    vtc.charge_dispatch(None, 100)
    assert (vtc.counter(None), vtc.weight(None), vtc.weight("unconfigured")) == (200.0, 1.0, 1.0)


def test_new_weights_apply_to_later_charges_only() -> None:
    vtc = VirtualTokenCounter(TokenWeights(1.0, 2.0), {"a": 1.0})
    vtc.charge_dispatch("a", 100)
    vtc.set_tenant_weights({"a": 4.0})
    vtc.set_token_weights(TokenWeights(2.0, 2.0))
    vtc.charge_dispatch("a", 100)
    assert vtc.counter("a") == pytest.approx(100.0 + 200.0 / 4.0)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        pytest.param(lambda v: v.charge_dispatch("a", -1), "a token count must be finite and >= 0", id="neg"),
        pytest.param(lambda v: v.charge_output("a", math.nan), "a token count must be finite", id="nan"),
        pytest.param(lambda v: v.set_tenant_weights({"a": 0.0}), "weight of tenant 'a'", id="zero-weight"),
        pytest.param(lambda v: v.dequeued("a"), "tenant 'a' has no request waiting", id="dequeue-empty"),
        pytest.param(lambda v: TokenWeights(-1.0, 1.0), "input weight must be finite", id="neg-weight"),
        pytest.param(lambda v: TokenWeights(0.0, 0.0), "at least one token weight", id="all-zero"),
    ],
)
def test_bad_inputs_are_refused(call: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call(VirtualTokenCounter())  # type: ignore[operator]


def test_default_weights_are_the_queue_job_size_costs() -> None:
    assert TokenWeights.from_queue_settings(QueueSettings()) == TokenWeights(3.0e-5, 1.0e-4)
    assert controller().fairness.token_weights == TokenWeights(3.0e-5, 1.0e-4)


def test_the_queue_can_count_requests_instead_of_tokens() -> None:
    by_requests = QueueSettings(fairness="requests")
    assert TokenWeights.from_queue_settings(by_requests) == REQUEST_COUNT == TokenWeights(0.0, 0.0, 1.0)
    ctl = controller(SETTINGS.model_copy(update={"queue": by_requests}))
    assert isinstance(ctl.submit(tenant_request("docs", 8000), open_(), T0), Admit)
    assert isinstance(ctl.submit(tenant_request("chat", 100), open_(), T0), Admit)
    ctl.fairness.charge_output("docs", 500)
    assert ctl.fairness.counters() == {"docs": 1.0, "chat": 1.0}


def test_unknown_fairness_modes_are_refused() -> None:
    with pytest.raises(ValidationError, match="fairness"):
        QueueSettings.model_validate({"fairness": "bytes"})


def test_a_reload_switches_the_fairness_mode_and_keeps_the_counters() -> None:
    ctl = controller()
    ctl.fairness.charge_dispatch("a", 1000)
    ctl.reconfigure(SETTINGS.model_copy(update={"queue": QueueSettings(fairness="requests")}))
    assert ctl.fairness.token_weights == REQUEST_COUNT
    ctl.fairness.charge_dispatch("a", 1000)
    assert ctl.fairness.counter("a") == pytest.approx(1000 * 3.0e-5 + 1.0)
    ctl.reconfigure(SETTINGS)
    assert ctl.fairness.token_weights == TokenWeights(3.0e-5, 1.0e-4)


# --- the lift: no banked credit -----------------------------------------------------------------


def served(vtc: VirtualTokenCounter, counters: Mapping[str, float]) -> None:
    for tenant, counter in counters.items():
        vtc.charge_dispatch(tenant, counter)


@pytest.mark.parametrize(
    ("counters", "backlogged", "returning", "expected"),
    [
        pytest.param({"a": 500.0}, ["a"], "b", 500.0, id="lifted-to-the-one-backlogged"),
        pytest.param({"a": 500.0, "c": 300.0}, ["a", "c"], "b", 300.0, id="lifted-to-the-minimum"),
        pytest.param({"a": 500.0, "b": 800.0}, ["a"], "b", 800.0, id="never-lowered"),
        pytest.param({"a": 500.0, "c": 100.0}, ["a"], "b", 500.0, id="idle-tenants-do-not-count"),
        pytest.param({"a": 500.0, "b": 20.0}, [], "b", 500.0, id="nobody-backlogged-virtual-time"),
    ],
)
def test_a_tenant_returning_from_idle_starts_at_the_active_minimum(
    counters: dict[str, float], backlogged: Sequence[str], returning: str, expected: float
) -> None:
    vtc = VirtualTokenCounter(TokenWeights(1.0, 0.0))
    for tenant in backlogged:  # waiting from the start, then served while waiting
        vtc.enqueued(tenant)
    served(vtc, counters)
    served(vtc, {"a": 0.0})  # a's latest dispatch: the virtual time is its counter
    assert vtc.virtual_time == 500.0
    vtc.enqueued(returning)
    assert vtc.counter(returning) == expected


def test_only_the_first_waiting_request_lifts() -> None:
    vtc = VirtualTokenCounter(TokenWeights(1.0, 0.0))
    served(vtc, {"a": 500.0})
    vtc.enqueued("a")
    vtc.enqueued("b")
    assert vtc.counter("b") == 500.0
    vtc.charge_dispatch("a", 1000)  # a moves on; b's second request must not lift b again
    vtc.enqueued("b")
    assert (vtc.counter("b"), vtc.backlog("b")) == (500.0, 2)
    vtc.dequeued("b")
    vtc.dequeued("b")
    vtc.enqueued("b")  # empty -> non-empty again: lifted to a, now the only one waiting
    assert vtc.counter("b") == 1500.0


# --- the queue's order --------------------------------------------------------------------------


def blocked() -> list[ReplicaView]:
    """A replica whose streams sit at their TPOT target: every newcomer waits a little."""
    return [view("a", state(32), streams(32, tpot_s=0.1, generated=100, expected=102))]


def open_() -> list[ReplicaView]:
    return [view("a", state())]


def tenant_request(tenant: str | None, prompt: int = 500, **kw: object) -> AdmissionRequest:
    return replace(request(prompt, arrival=T0, **kw), tenant=tenant)  # type: ignore[arg-type]


def queue_up(
    ctl: AdmissionController, tenant: str | None, name: str, prompt: int = 500, **kw: object
) -> None:
    decision = ctl.submit(tenant_request(tenant, prompt, request_id=name, **kw), blocked(), T0)
    assert isinstance(decision, Queue), decision


def ids(items: Sequence[tuple[QueueEntry, object]]) -> list[str]:
    return [entry.request.request_id for entry, _ in items]


def test_the_least_served_tenant_goes_first_whatever_its_job_sizes() -> None:
    ctl = controller()
    queue_up(ctl, "heavy", "heavy-small", prompt=100)
    queue_up(ctl, "light", "light-big", prompt=8000)
    ctl.fairness.charge_dispatch("heavy", 50_000)  # served while both wait (admitted at once)
    result = ctl.reevaluate(T0 + 0.05, open_())
    assert ids(result.dispatched) == ["light-big", "heavy-small"]


def test_tenants_with_equal_counters_interleave_as_their_counters_grow() -> None:
    ctl = controller()
    for i in range(3):
        queue_up(ctl, "a", f"a{i}")
        queue_up(ctl, "b", f"b{i}")
    result = ctl.reevaluate(T0 + 0.05, open_())
    assert ids(result.dispatched) == ["a0", "b0", "a1", "b1", "a2", "b2"]
    assert ctl.fairness.counter("a") == ctl.fairness.counter("b") > 0


def test_within_a_tenant_shortest_job_first() -> None:
    ctl = controller()
    for prompt, name in [(8000, "big"), (500, "small"), (2000, "mid")]:
        queue_up(ctl, "a", name, prompt=prompt)
    assert ids(ctl.reevaluate(T0 + 0.05, open_()).dispatched) == ["small", "mid", "big"]


def test_class_priority_comes_before_the_counters() -> None:
    ctl = controller()
    queue_up(ctl, "light", "light-batch", request_class="batch")
    queue_up(ctl, "heavy", "heavy-interactive")
    ctl.fairness.charge_dispatch("heavy", 50_000)
    result = ctl.reevaluate(T0 + 0.05, open_())
    assert ids(result.dispatched) == ["heavy-interactive", "light-batch"]


def test_requests_admitted_at_once_are_charged_too() -> None:
    ctl = controller()
    decision = ctl.submit(tenant_request("a", 700), open_(), T0)
    assert isinstance(decision, Admit)
    assert ctl.fairness.served("a") == pytest.approx(700 * 3.0e-5)


def test_every_way_out_of_the_queue_ends_the_backlog() -> None:
    ctl = controller()
    queue_up(ctl, "a", "dispatched")
    queue_up(ctl, "b", "cancelled")
    queue_up(ctl, "c", "expires")
    assert [ctl.fairness.backlog(t) for t in "abc"] == [1, 1, 1]
    entry_b = next(e for e in (ctl.queue.entry(i) for i in range(3)) if e and e.request.tenant == "b")
    ctl.cancel(entry_b.id, T0)
    expired = ctl.reevaluate(T0 + 5.0, open_())  # past interactive's 1 s queue deadline
    assert ids(expired.rejected) == ["dispatched", "expires"]
    assert [ctl.fairness.backlog(t) for t in "abc"] == [0, 0, 0]


# --- two tenants on one saturated replica, in virtual time ---------------------------------------

#: Seconds of slot time per weighted token (w_in = 1, w_out = 2): a long document holds a slot
#: for 0.44 s, a short chat for 0.04 s.
SECONDS_PER_TOKEN = 1e-4
SHAPES = {"docs": (4000, 200), "chat": (200, 100)}  # (prompt, output) tokens
GPU_WEIGHTS = TokenWeights(input=1.0, output=2.0)
#: One class whose targets never bind: the replica's slots are the only limit.
PATIENT = AdmissionSettings(
    classes={"chat": ClassSettings(ttft_target_s=1e6, max_queue_wait_s=1e6, queue_capacity=100_000)},
    default_class="chat",
    queue=QueueSettings(reserve_after_s=None, max_examined=4),
)


@dataclass
class SlotReplica:
    """One replica with ``slots`` identical slots; the admitter: admit while a slot is free.

    A request holds its slot for (w_in x prompt + w_out x output) x SECONDS_PER_TOKEN seconds of
    GPU time. Every decision that admits is dispatched by the controller, so counting here is exact.
    """

    slots: int
    free: int = field(init=False)

    def __post_init__(self) -> None:
        self.free = self.slots

    def decide(
        self, request: AdmissionRequest, views: Sequence[ReplicaView], now: float, *, queued: bool = False
    ) -> Decision:
        if self.free == 0:
            return Queue(Blocker.SLOT_SHARE, 0.01, "r0", None)
        self.free -= 1
        return Admit("r0", None, 1.0)


@dataclass
class Run:
    """GPU seconds each tenant received between ``start_s`` and ``end_s``."""

    start_s: float
    end_s: float
    gpu_s: dict[str, float] = field(default_factory=dict)

    def add(self, tenant: str, begin: float, end: float) -> None:
        overlap = min(end, self.end_s) - max(begin, self.start_s)
        if overlap > 0:
            self.gpu_s[tenant] = self.gpu_s.get(tenant, 0.0) + overlap

    def share(self, tenant: str) -> float:
        return self.gpu_s.get(tenant, 0.0) / sum(self.gpu_s.values())


def simulate(
    weights: Mapping[str, float],
    charge: TokenWeights,
    *,
    joins_s: Mapping[str, float] | None = None,
    window_s: tuple[float, float] = (2.0, 32.0),
    slots: int = 8,
    backlog: int = 3,
) -> Run:
    """Both tenants always backlogged (each dispatch of one is replaced by a new request of it)
    on one replica of ``slots`` slots, from each tenant's join time until the window's end."""
    replica = SlotReplica(slots)
    ctl = AdmissionController(
        PATIENT, rng=random.Random(0), admitter=replica, fairness=VirtualTokenCounter(charge, weights)
    )
    run = Run(*window_s)
    finishes: list[tuple[float, int, str]] = []
    joins = sorted((t, tenant) for tenant, t in (joins_s or dict.fromkeys(SHAPES, 0.0)).items())
    sequence = 0

    def start(tenant: str, now: float) -> None:
        nonlocal sequence
        prompt, output = SHAPES[tenant]
        end = now + GPU_WEIGHTS.cost(prompt, output, 0.0) * SECONDS_PER_TOKEN
        run.add(tenant, now, end)
        sequence += 1
        heapq.heappush(finishes, (end, sequence, tenant))

    def submit(tenant: str, now: float) -> None:
        prompt, output = SHAPES[tenant]
        req = AdmissionRequest(
            f"{tenant}-{sequence}", "chat", prompt, output, float(output), now, tenant=tenant
        )
        if ctl.submit(req, [], now).admits:
            start(tenant, now)

    now = 0.0
    while now < run.end_s:
        if joins and (not finishes or joins[0][0] <= finishes[0][0]):
            now, tenant = joins.pop(0)
            for _ in range(slots + backlog):
                submit(tenant, now)
            continue
        now, _, tenant = heapq.heappop(finishes)
        replica.free += 1
        ctl.fairness.charge_output(tenant, SHAPES[tenant][1])
        for entry, _decision in ctl.reevaluate(now, []).dispatched:
            assert entry.request.tenant is not None
            start(entry.request.tenant, now)
            submit(entry.request.tenant, now)
    return run


@pytest.mark.parametrize(
    "weights",
    [
        pytest.param({"docs": 1.0, "chat": 1.0}, id="weights-1-1"),
        pytest.param({"docs": 2.0, "chat": 1.0}, id="docs-weighs-2"),
        pytest.param({"docs": 1.0, "chat": 2.0}, id="chat-weighs-2"),
    ],
)
def test_each_tenant_gets_its_weighted_share_of_gpu_time(weights: dict[str, float]) -> None:
    fair = simulate(weights, GPU_WEIGHTS)
    for tenant, weight in weights.items():
        expected = weight / sum(weights.values())
        assert fair.share(tenant) == pytest.approx(expected, rel=0.10), (tenant, fair.gpu_s)
    # The same replica, queue served by request count (round robin by request, weighted):
    # the long documents take most of the GPU.
    by_requests = simulate(weights, REQUEST_COUNT)
    assert by_requests.share("docs") > 0.8, by_requests.gpu_s
    assert by_requests.share("docs") > fair.share("docs") + 0.2


def test_a_tenant_back_from_idle_does_not_crowd_out_the_busy_one() -> None:
    # docs has the replica to itself for 30 s (its counter runs far ahead); chat then joins.
    run = simulate(
        {"docs": 1.0, "chat": 1.0}, GPU_WEIGHTS, joins_s={"docs": 0.0, "chat": 30.0}, window_s=(31.0, 41.0)
    )
    assert run.share("chat") == pytest.approx(0.5, rel=0.10), run.gpu_s


@dataclass
class SizeGate:
    """An admitter that takes prompts up to ``limit`` tokens (``None``: none) and queues the rest."""

    limit: int | None = None

    def decide(
        self, request: AdmissionRequest, views: Sequence[ReplicaView], now: float, *, queued: bool = False
    ) -> Decision:
        if self.limit is not None and request.prompt_tokens <= self.limit:
            return Admit("r0", None, 1.0)
        return Queue(Blocker.KV_SHARE, 1.0, "r0", None)


def test_one_tenants_blocked_backlog_does_not_use_up_the_walk() -> None:
    # Two examinations per walk; the least-served tenant's three long requests cannot be placed.
    gate = SizeGate()
    config = PATIENT.model_copy(update={"queue": QueueSettings(reserve_after_s=None, max_examined=2)})
    ctl = AdmissionController(config, rng=random.Random(0), admitter=gate)
    for i in range(3):
        assert isinstance(ctl.submit(tenant_request("docs", 5000, request_id=f"doc{i}"), [], T0), Queue)
    assert isinstance(ctl.submit(tenant_request("chat", 100, request_id="chat"), [], T0), Queue)
    ctl.fairness.charge_dispatch("chat", 1_000_000)  # chat is far ahead: docs is examined first
    gate.limit = 1000
    result = ctl.reevaluate(T0 + 1.0, [])
    assert ids(result.dispatched) == ["chat"]
    assert len(ctl.queue) == 3
