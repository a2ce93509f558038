"""Hard caps on a tenant's tokens: the reservation covers the output a request is sure to produce,
a stream that outruns it is charged ahead step by step, and every reservation settles once.

Virtual time throughout: the gateway's in-memory limiter on the test's clock
(``replay.budget.MemoryBudget``), the engine predicting 200 output tokens (``Predictions``),
weights 1 : 2 (prompt : output). The step charged ahead is the live one
(``LiveBudget.charge`` over the same limiter).
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from gateway.admission.budget import Hold, TopUp, context_left, sure_output
from gateway.admission.engine import AdmissionEngine
from gateway.admission.live import live_entry, output_floor
from gateway.admission.live_budget import LiveBudget
from gateway.admission.request import AdmissionRequest
from gateway.admission.results import Ending, Submitted
from gateway.api.openai import MAX_TOKENS_LIMIT, parse_request
from gateway.limits.base import LimiterUnavailable, Reservation, TenantLimits
from gateway.limits.memory import MemoryLimiter
from gateway.replicas.registry import LiveRequest
from gateway.tenants.pricing import DEFAULT_WEIGHTS
from replay.budget import MemoryBudget
from tests.unit.admission.fleet import MAX_LEN
from tests.unit.admission.test_policies import Fleet, Predictions, new_entry, policy_settings

SETTINGS = policy_settings("admit_all")
#: 6,000 weighted tokens a minute, 1,000 at once.
LIMITS = TenantLimits(tokens_per_minute=6000.0, token_burst=1000.0, max_concurrent=4)
PROMPT = 100


def engine_and_budget(limits: TenantLimits = LIMITS) -> tuple[AdmissionEngine, MemoryBudget]:
    budget = MemoryBudget({"acme": limits}, weights=DEFAULT_WEIGHTS)
    engine = AdmissionEngine(
        SETTINGS, Fleet(["r0"]), Predictions(), rng=random.Random(5), new_entry=new_entry, budget=budget
    )
    return engine, budget


def submit(engine: AdmissionEngine, now: float, **fields: object) -> Submitted:
    req = engine.request(
        "a",
        "m",
        prompt_tokens=PROMPT,
        request_class="interactive",
        arrival_s=now,
        tenant="acme",
        **fields,  # type: ignore[arg-type]
    )
    sent = engine.submit(req, "m", now)
    assert isinstance(sent, Submitted)
    assert sent.replica == "r0"
    return sent


def level(budget: MemoryBudget, now: float) -> float:
    """The tenant's token bucket at ``now``, read by a probe that is refunded at once."""
    probe = budget.limiter.reserve_now(
        "acme",
        cost_tokens=0.0,
        limits=TenantLimits(tokens_per_minute=6000.0, token_burst=1000.0),
        request_id="p",
    )
    assert probe.tokens is not None
    budget.limiter.settle_now(probe, actual_cost_tokens=0.0)
    return probe.tokens.remaining


@pytest.mark.parametrize(
    ("max_tokens", "min_tokens", "ignore_eos", "left", "sure"),
    [
        pytest.param(1500, 0, False, None, 0, id="nothing-sure"),
        pytest.param(1500, 300, False, None, 300, id="min_tokens"),
        pytest.param(100, 300, False, None, 100, id="min_tokens-over-the-cap"),
        pytest.param(1500, 0, True, 4000, 1500, id="ignore_eos-the-cap"),
        pytest.param(None, 0, True, 4000, 4000, id="ignore_eos-the-context-left"),
        pytest.param(None, 20, True, None, 20, id="ignore_eos-context-unknown"),
        pytest.param(None, -5, False, None, 0, id="negative-min"),
    ],
)
def test_the_output_a_request_is_sure_to_produce(
    max_tokens: int | None, min_tokens: int, ignore_eos: bool, left: int | None, sure: int
) -> None:
    assert sure_output(max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos, context_left=left) == sure


def test_the_context_left_is_the_longest_replicas() -> None:
    assert context_left([4096, 8192], 192) == 8000
    assert context_left([100], 500) == 1
    assert context_left([], 10) is None


def sized(engine: AdmissionEngine, capacity: float | None = None, **fields: object) -> AdmissionRequest:
    """``engine.request`` of the tenant's request on model ``m`` at 0 s, with ``fields`` and a
    token bucket of ``capacity`` (``None``: none)."""
    return engine.request(
        "a",
        "m",
        prompt_tokens=PROMPT,
        request_class="interactive",
        arrival_s=0.0,
        tenant="acme",
        token_capacity=capacity,
        **fields,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("fields", "output"),
    [
        pytest.param({"max_tokens": 1500}, 200, id="predicted"),
        pytest.param({"max_tokens": 1500, "min_tokens": 100}, 200, id="min_tokens-under-the-prediction"),
        pytest.param({"max_tokens": 1500, "min_tokens": 700}, 700, id="min_tokens"),
        pytest.param({"max_tokens": 1500, "ignore_eos": True}, 1500, id="ignore_eos"),
        pytest.param({"max_tokens": 50, "ignore_eos": True}, 50, id="ignore_eos-small-cap"),
        pytest.param({"max_tokens": 1500, "ignore_eos": True, "choices": 2}, 3000, id="ignore_eos-n2"),
    ],
)
def test_the_reservation_holds_what_the_request_is_sure_to_produce(
    fields: dict[str, object], output: int
) -> None:
    engine, _ = engine_and_budget()
    req = sized(engine, None, **fields)
    choices = int(fields.get("choices", 1))  # type: ignore[call-overload]
    assert engine.budget_cost(req) == pytest.approx(PROMPT + 2 * output)
    assert req.expected_output_tokens * choices >= output


@pytest.mark.parametrize(
    ("fields", "exact"),
    [
        pytest.param({"max_tokens": 50, "ignore_eos": True}, True, id="ignore_eos-with-a-cap"),
        pytest.param({"max_tokens": None, "ignore_eos": True}, False, id="ignore_eos-without-a-cap"),
        pytest.param({"max_tokens": 50, "min_tokens": 50}, False, id="min_tokens-at-the-cap"),
        pytest.param({"max_tokens": 50}, False, id="predicted"),
    ],
)
def test_an_output_pinned_by_its_client_is_known_exactly_while_it_runs(
    fields: dict[str, object], exact: bool
) -> None:
    """With ``ignore_eos`` and ``max_tokens`` the output is the cap, and the in-flight entry says
    so (the forecasts of the requests behind it count on it); anything else is predicted. (Even
    ``min_tokens`` at the cap may stop at a stop string: not pinned.)"""
    engine, _ = engine_and_budget()
    req = sized(engine, None, **fields)
    assert req.exact_output_tokens == (fields["max_tokens"] if exact else None)
    assert live_entry(req, 0.0, True).freeze().exact_output_tokens == req.exact_output_tokens


def uncapped_ignore_eos(engine: AdmissionEngine, route: str) -> float | None:
    req = engine.request(
        "a",
        route,
        prompt_tokens=PROMPT,
        max_tokens=None,
        request_class="interactive",
        arrival_s=0.0,
        tenant="acme",
        ignore_eos=True,
    )
    return engine.budget_cost(req)


def test_ignore_eos_without_max_tokens_reserves_the_context_left() -> None:
    engine, _ = engine_and_budget()
    # The first request of the route already: its replicas' views are built for it.
    assert uncapped_ignore_eos(engine, "m") == pytest.approx(PROMPT + 2 * (MAX_LEN - PROMPT))
    submit(engine, 0.0, max_tokens=10)
    assert uncapped_ignore_eos(engine, "m") == pytest.approx(PROMPT + 2 * (MAX_LEN - PROMPT))
    # No replica: the context is unknown, the prediction is reserved (and a stream charged
    # ahead); admission then refuses it anyway.
    empty = AdmissionEngine(
        SETTINGS,
        Fleet([]),
        Predictions(),
        rng=random.Random(5),
        new_entry=new_entry,
        budget=MemoryBudget({}, weights=DEFAULT_WEIGHTS),
    )
    assert uncapped_ignore_eos(empty, "m") == pytest.approx(PROMPT + 2 * 200)


def test_charge_ahead_steps_are_the_reservations_output_up_to_the_cap() -> None:
    hold = Hold(object(), DEFAULT_WEIGHTS, PROMPT, 10, 1, output_cap=35)  # type: ignore[arg-type]
    assert hold.next_top_up(10) is None  # covered
    steps = []
    for produced in (11, 21, 31):
        step = hold.next_top_up(produced)
        assert step is not None
        hold.took(step)
        steps.append(step)
    assert steps == [TopUp(10, 20.0), TopUp(10, 20.0), TopUp(5, 10.0)]
    assert hold.covered_output == 35
    assert hold.ahead_cost == 50.0
    assert hold.next_top_up(36) is None  # the cap: nothing more can come


def test_a_jump_past_the_cover_is_charged_whole() -> None:
    hold = Hold(object(), DEFAULT_WEIGHTS, PROMPT, 10, 1)  # type: ignore[arg-type]
    step = hold.next_top_up(25)
    assert step == TopUp(15, 30.0)


async def test_a_stream_charged_ahead_then_refused_settles_once_what_it_produced() -> None:
    engine, budget = engine_and_budget()
    live = LiveBudget(budget.limiter, lambda: DEFAULT_WEIGHTS)
    sent = submit(engine, 10.0, max_tokens=1000)
    assert level(budget, 10.0) == pytest.approx(1000.0 - 500.0)  # 100 + 2 x 200
    hold = engine.held(sent.key)
    assert hold is not None
    first = hold.next_top_up(201)
    assert first == TopUp(200, 400.0)
    assert await live.charge(hold.answer, first.cost_tokens) is True
    hold.took(first)
    await live.drain()
    assert level(budget, 10.0) == pytest.approx(100.0)
    assert budget.stats.settles_total == 1  # the step's lease, settled at its cost at once
    second = hold.next_top_up(401)
    assert second is not None
    assert await live.charge(hold.answer, second.cost_tokens) is False  # 100 left, 400 asked
    assert level(budget, 10.0) == pytest.approx(100.0)
    # The relay stops the stream there: 401 tokens seen, no usage.
    assert isinstance(sent.entry, LiveRequest)
    sent.entry.tokens_streamed = 401
    engine.finish(sent.key, Ending(answered=True, learn=False), 10.0)
    # Charged 100 + 2 x 401 = 902 in all: 400 ahead, 502 at the settle.
    assert level(budget, 10.0) == pytest.approx(1000.0 - 902.0)
    engine.finish(sent.key, Ending(answered=True, learn=False), 10.0)  # a second finish: nothing
    assert level(budget, 10.0) == pytest.approx(1000.0 - 902.0)
    assert budget.stats.settles_total == 2  # the step and the request (probes are not counted)
    assert await budget.limiter.in_flight("acme") == 0


async def test_a_finished_stream_settles_to_usage_net_of_the_steps() -> None:
    engine, budget = engine_and_budget()
    live = LiveBudget(budget.limiter, lambda: DEFAULT_WEIGHTS)
    sent = submit(engine, 10.0, max_tokens=1000)
    hold = engine.held(sent.key)
    assert hold is not None
    step = hold.next_top_up(201)
    assert step is not None
    assert await live.charge(hold.answer, step.cost_tokens)
    hold.took(step)
    engine.finish(sent.key, Ending(produced_tokens=250, prompt_tokens=PROMPT, learn=False), 10.0)
    await live.drain()
    # 100 + 2 x 250 = 600 in all, whatever was charged ahead: the unused step comes back.
    assert level(budget, 10.0) == pytest.approx(1000.0 - 600.0)


class _Gated:
    """A limiter whose reserves wait for ``gate`` (the stream is cancelled meanwhile)."""

    def __init__(self, inner: MemoryLimiter, *, fail: bool = False) -> None:
        self.inner = inner
        self.gate = asyncio.Event()
        self.fail = fail

    async def reserve(
        self, tenant: str, *, cost_tokens: float, limits: TenantLimits, request_id: str
    ) -> Reservation:
        await self.gate.wait()
        if self.fail:
            raise LimiterUnavailable("down")
        return await self.inner.reserve(tenant, cost_tokens=cost_tokens, limits=limits, request_id=request_id)

    async def settle(self, reservation: Reservation, *, actual_cost_tokens: float) -> None:
        await self.inner.settle(reservation, actual_cost_tokens=actual_cost_tokens)


async def test_a_step_whose_stream_is_cancelled_meanwhile_is_refunded() -> None:
    engine, budget = engine_and_budget()
    gated = _Gated(budget.limiter)
    live = LiveBudget(gated, lambda: DEFAULT_WEIGHTS)  # type: ignore[arg-type]
    sent = submit(engine, 10.0, max_tokens=1000)
    hold = engine.held(sent.key)
    assert hold is not None
    charging = asyncio.ensure_future(live.charge(hold.answer, 400.0))
    await asyncio.sleep(0)
    charging.cancel()
    await asyncio.sleep(0)
    gated.gate.set()  # the limiter takes the step after the stream was cancelled
    with pytest.raises(asyncio.CancelledError):
        await charging
    for _ in range(5):
        await asyncio.sleep(0)
    await live.drain()
    assert level(budget, 10.0) == pytest.approx(1000.0 - 500.0)  # only the reservation is held
    assert await budget.limiter.in_flight("acme") == 1


async def test_storage_down_takes_nothing() -> None:
    engine, budget = engine_and_budget()
    gated = _Gated(budget.limiter, fail=True)
    gated.gate.set()
    live = LiveBudget(gated, lambda: DEFAULT_WEIGHTS)  # type: ignore[arg-type]
    sent = submit(engine, 10.0, max_tokens=1000)
    hold = engine.held(sent.key)
    assert hold is not None
    assert await live.charge(hold.answer, 400.0) is None
    assert level(budget, 10.0) == pytest.approx(500.0)


@pytest.mark.parametrize(
    ("fields", "floor"),
    [
        pytest.param({}, {}, id="none"),
        pytest.param(
            {"ignore_eos": True, "min_tokens": 5}, {"ignore_eos": True, "min_tokens": 5}, id="plain"
        ),
        pytest.param(
            {"ignore_eos": "true", "min_tokens": "7"}, {"ignore_eos": True, "min_tokens": 7}, id="lax"
        ),
        pytest.param({"ignore_eos": False}, {"ignore_eos": False}, id="false"),
        pytest.param({"min_tokens": -3}, {"min_tokens": 0}, id="negative"),
        pytest.param({"min_tokens": 10**40}, {"min_tokens": MAX_TOKENS_LIMIT}, id="huge"),
        pytest.param({"ignore_eos": "maybe", "min_tokens": 2.5}, {}, id="what-vllm-refuses"),
    ],
)
def test_the_floor_is_read_as_vllm_reads_it(fields: dict[str, object], floor: dict[str, object]) -> None:
    body = {"model": "m", "prompt": "hi", **fields}
    assert output_floor(parse_request("completions", json.dumps(body).encode())) == floor
