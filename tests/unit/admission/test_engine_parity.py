"""Parity: the live gateway's adapter and the replay's drive one ``AdmissionEngine`` alike.

One scripted sequence of events (bursts of arrivals with prompts and tenants, replica snapshots,
tokens landing, finishes, a replica's own 429 with re-placement and without, a tenant over its
budget, timers) is fed to both adapters: ``gateway.admission.live.LiveAdmission`` (real aiohttp
requests, futures, its timer armed through an injected ``call_later`` on a scripted clock) and
``replay.policies.SluicePolicy`` (over a replay fleet whose engines never step: the script is the
world). Both get their own prediction service with the same facts and the same snapshots,
Retry-After jitter seeded alike, and the gateway's in-memory limiter for tenant budgets, each on
its own clock (the live adapter fetches from it asynchronously, the replay asks it directly).
Each adapter's finish teaches its service, as the gateway does. The test asserts the same
decision, replica, Retry-After and queue order after every event; it fails if either adapter
drifts.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

from aiohttp.test_utils import make_mocked_request

from bench.goodput.core import FACTS, PROFILE, admission_settings
from gateway.admission import Outcome
from gateway.admission.live import LiveAdmission, Ticket
from gateway.admission.live_budget import LiveBudget
from gateway.api.openai import ParsedRequest
from gateway.config.store import SettingsStore
from gateway.http.errors import GatewayError, Refused
from gateway.limits.base import TenantLimits
from gateway.limits.memory import MemoryLimiter
from gateway.observability.outcome import RequestOutcome
from gateway.prediction.live import LivePredictions
from gateway.prediction.service import PredictionService
from gateway.replicas.registry import ReplicaRegistry, ReplicaState
from gateway.replicas.scraper import MetricsScraper
from gateway.replicas.snapshot import ReplicaSnapshot
from gateway.tenants.live import TENANT
from gateway.tenants.pricing import DEFAULT_WEIGHTS
from replay.loop import VirtualTimeLoop
from replay.policies import SluicePolicy
from replay.requests import FleetConfig, GatewayRequest
from simulator.engine import FinishedRequestStats
from simulator.profile import load_profile
from tests.unit.gateway.fakes import gateway_settings

SEED = 7
#: A class that queues: the bench's, with a 3-s TTFT target and queue wait.
SETTINGS = admission_settings((("class.ttft_target_s", 3.0), ("class.max_queue_wait_s", 3.0)))
REPLICAS = 2
#: Tenant budgets: ``small`` holds 3,000 weighted tokens, refilled at 1,000 a second (at 1 : 2, a
#: request of 800 prompt and 100 output tokens costs 1,000); the others have none.
BUDGETS = {"small": TenantLimits(tokens_per_minute=60_000.0, token_burst=3000.0)}
#: (time, prompt tokens, max tokens, tenant) per request; index = position.
ARRIVALS: list[tuple[float, int, int, str]] = [
    *[(0.0, 2000, 300, f"t{i % 3}") for i in range(30)],
    *[(0.05, 1500, 300, f"t{i % 3}") for i in range(10)],
    (0.3, 500, 200, "t1"),
    (0.6, 1200, 300, "t2"),
    # The small tenant: three fit its budget, the fourth and fifth do not (Retry-After: the
    # bucket's refill, 1 s and 0.9 s); the last, after a while, fits again.
    *[(0.02, 800, 100, "small") for _ in range(4)],
    (0.12, 800, 100, "small"),
    (0.75, 500, 50, "small"),
]


@dataclass(order=True)
class Event:
    at: float
    order: int
    kind: str = field(compare=False)
    args: tuple[Any, ...] = field(compare=False, default=())


def script() -> list[Event]:
    """The scripted events (besides timers): arrivals, snapshots, tokens, finishes, 429s."""
    events = [Event(at, i, "arrive", (i,)) for i, (at, *_) in enumerate(ARRIVALS)]
    # The last snapshot comes after the queue's 3-s wait: timers expire what still waits.
    events += [Event(0.2, 100, "snapshot"), Event(0.7, 100, "snapshot"), Event(3.5, 100, "snapshot")]
    events += [
        Event(0.1, 200, "tokens", (1,)),
        Event(0.15, 200, "tokens", (3,)),
        Event(0.4, 200, "tokens", (2,)),
    ]
    events += [Event(0.45, 300, "finish", (0, 40)), Event(0.5, 300, "finish", (1, 55))]
    events += [Event(0.25, 400, "refused", (2, 0.5, True)), Event(0.55, 400, "refused", (3, 0.3, False))]
    events += [Event(0.65, 300, "finish", (4, 60)), Event(0.8, 300, "finish", (5, 10))]
    return sorted(events)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Timers:
    """``call_later`` on the scripted clock: handles fired by ``due``."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.armed: list[tuple[float, int, SimpleNamespace]] = []
        self.seq = 0

    def call_later(self, delay: float, callback: Callable[[], None]) -> SimpleNamespace:
        handle = SimpleNamespace(callback=callback, cancelled=False)
        handle.cancel = lambda: setattr(handle, "cancelled", True)
        self.armed.append((self.clock.now + delay, self.seq, handle))
        self.seq += 1
        return handle

    def next_at(self) -> float | None:
        live = [at for at, _, h in self.armed if not h.cancelled]
        return min(live) if live else None

    def fire(self, at: float) -> None:
        for entry in sorted(self.armed, key=lambda e: (e[0], e[1])):
            when, _, handle = entry
            if when <= at and not handle.cancelled:
                self.armed.remove(entry)
                handle.callback()
                return


def services() -> PredictionService:
    service = PredictionService(output_quantile=0.5)
    for k in range(REPLICAS):
        service.set_replica(f"r{k}", FACTS)
    return service


class LiveSide:
    """``LiveAdmission`` as the proxy drives it, on the scripted clock."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.clock = Clock()
        self.limiter = MemoryLimiter(clock=self.clock)
        self.timers = Timers(self.clock)
        settings = gateway_settings({f"r{k}": "http://127.0.0.1:9" for k in range(REPLICAS)})
        settings = settings.model_copy(update={"admission": SETTINGS})
        store = SettingsStore(settings)
        self.registry = ReplicaRegistry(store)
        for replica in self.registry.replicas():
            replica.state = ReplicaState.HEALTHY
            replica.models = cast(Any, {model: None})
        self.service = services()
        scraper = MetricsScraper(cast(Any, None), interval_s=1.0, timeout_s=1.0, window_s=5.0)
        predictions = LivePredictions(self.registry, scraper, self.service)
        for k in range(REPLICAS):
            self.service.set_replica(f"r{k}", FACTS)
        self.admission = LiveAdmission(
            store,
            self.registry,
            predictions,
            clock=self.clock,
            rng=random.Random(SEED),
            call_later=self.timers.call_later,
            budget=LiveBudget(self.limiter, lambda: DEFAULT_WEIGHTS),
        )
        self.decisions: dict[int, tuple[str, str | None, float | None]] = {}
        self.tickets: dict[int, Ticket] = {}
        self.requests: dict[int, Any] = {}
        self.outcomes: dict[int, RequestOutcome] = {}

    async def arrive(self, i: int) -> None:
        at, prompt, max_tokens, tenant = ARRIVALS[i]
        if i not in self.requests:
            request = make_mocked_request("POST", "/v1/chat/completions")
            limits = BUDGETS.get(tenant, TenantLimits())
            request[TENANT] = cast(
                Any, SimpleNamespace(name=tenant, default_class=None, allowed_classes=None, limits=limits)
            )
            self.requests[i] = request
            self.outcomes[i] = RequestOutcome(
                request_id=str(i), method="POST", path="/v1/chat/completions", received_at=at
            )
        parsed = ParsedRequest("chat", self.model, True, False, max_tokens, {}, b"", prompt_token_ids=prompt)
        asyncio.get_running_loop().create_task(self._admit(i, parsed))
        await settle()

    async def _admit(self, i: int, parsed: ParsedRequest) -> None:
        try:
            ticket = await self.admission.admit(self.requests[i], parsed, self.outcomes[i])
        except Refused as err:
            told = None if err.retry_after is None else err.retry_after.delay_s
            self.decisions[i] = (f"rejected: {err.reason.value}", None, told)
        except GatewayError:
            outcome = self.outcomes[i]
            self.decisions[i] = (f"rejected: {outcome.reason}", None, outcome.retry_after_s)
        else:
            self.tickets[i] = ticket
            self.decisions[i] = ("admitted", ticket.replica.name, None)

    async def snapshot(self, snapshots: list[ReplicaSnapshot]) -> None:
        for snapshot in snapshots:
            self.service.on_snapshot(snapshot)
            self.admission.on_snapshot(snapshot)
        await settle()

    def tokens(self, i: int, count: int) -> None:
        live = self.tickets[i].live
        live.tokens_streamed += count
        live.last_token_at = self.clock.now
        if live.first_token_at is None:
            live.first_token_at = self.clock.now

    async def finish(self, i: int, produced: int) -> None:
        """As the proxy: the usage and timings on the outcome, the last token landing now; the
        adapter settles the budget and teaches the service."""
        ticket = self.tickets.pop(i)
        outcome = self.outcomes[i]
        outcome.completion_tokens = produced
        outcome.prompt_tokens = ticket.request.prompt_tokens
        outcome.dispatched_at, outcome.first_token_at = 0.0, 0.2
        ticket.live.last_token_at = self.clock.now
        self.admission.finished(ticket, outcome)
        await settle()

    async def refused(self, i: int, back_off_s: float, retry: bool) -> None:
        ticket = self.tickets.pop(i)
        self.admission.replica_refused(ticket, back_off_s, "overloaded", placed_again=retry)
        if not retry:
            err = self.admission.saturated(self.model, back_off_s, placed=True)
            told = None if err.retry_after is None else err.retry_after.delay_s
            self.decisions[i] = (f"rejected: {err.reason.value}", None, told)
            self.admission.finished(ticket, self.outcomes[i])
            await settle()
            return
        self.admission.finished(ticket, self.outcomes[i])
        del self.decisions[i]  # placed again: undecided until admission decides it anew
        await self.arrive(i)

    async def timer(self, at: float) -> None:
        self.timers.fire(at)
        await settle()

    def queue(self) -> list[str]:
        return self.admission.engine.queue_order()


class ReplaySide:
    """``SluicePolicy`` over a replay fleet whose engines never step (the script is the world)."""

    def __init__(self) -> None:
        self.config = FleetConfig(load_profile(PROFILE), FACTS, replicas=REPLICAS, jitter=0.0, max_tokens=800)
        self.policy = SluicePolicy(SETTINGS, seed=SEED, budgets=BUDGETS, token_weights=DEFAULT_WEIGHTS)
        self.loop = VirtualTimeLoop(self.config, self.policy)
        self.requests = [
            GatewayRequest(i, tenant, at, prompt, max_tokens)
            for i, (at, prompt, max_tokens, tenant) in enumerate(ARRIVALS)
        ]
        self.loop.expect(self.requests, [m for *_, m, _ in ARRIVALS])
        self.policy.bind(self.loop.fleet)
        self.wake: float | None = None

    @property
    def model(self) -> str:
        return self.loop.fleet.model

    def arm(self, now: float) -> None:
        """As ``VirtualTimeLoop.arm``: keep the earlier of the armed wake-up and the policy's."""
        when = self.policy.next_wakeup(now)
        if when is not None and (self.wake is None or when < self.wake):
            self.wake = max(when, now)

    def decisions(self) -> dict[int, tuple[str, str | None, float | None]]:
        out: dict[int, tuple[str, str | None, float | None]] = {}
        for r in self.requests:
            o = self.loop.outcome(r.index)
            if o.rejected:
                out[r.index] = (f"rejected: {o.reason}", None, self.policy.retry_after_s.get(r.index))
            elif o.replica is not None:
                out[r.index] = ("admitted", o.replica, None)
        return out

    def snapshots(self, now: float) -> list[ReplicaSnapshot]:
        out = []
        for handle in self.loop.fleet.replicas:
            text = handle.inner.metrics.exposition().decode("utf-8")
            out.append(handle.inner.builder.observe_text(text, now, handle.in_flight()))
        return out

    def _open(self, i: int) -> Any:
        record = self.loop.outcome(i)
        handle = self.loop.fleet.replicas[self.loop.fleet.index_of(record.replica or "")]
        return handle, handle.open[i]

    def tokens(self, i: int, count: int, now: float) -> None:
        _, o = self._open(i)
        live = o.live
        live.tokens_streamed += count
        live.last_token_at = now
        if live.first_token_at is None:
            live.first_token_at = now

    def finish(self, i: int, produced: int, now: float) -> None:
        handle, _ = self._open(i)
        del handle.open[i]
        request = self.requests[i]
        stats = FinishedRequestStats(
            str(i), cast(Any, "stop"), request.prompt_tokens, produced, request.max_tokens,
            0, 0.2, now - request.arrival_s, 0.0, 0.0, 0.0, 0.0, None,
        )  # fmt: skip
        self.policy.on_finished(handle.index, request, stats, now)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def run(*, drift: Callable[[ReplaySide], None] | None = None) -> list[tuple[Any, ...]]:
    """Play the script on both sides; a list of (event, live state, replay state) that differ."""
    differences, _ = await play(drift=drift)
    return differences


async def play(
    *, drift: Callable[[ReplaySide], None] | None = None
) -> tuple[list[tuple[Any, ...]], LiveSide]:
    """``run``, and the live side as the script left it."""
    replay = ReplaySide()
    if drift is not None:
        drift(replay)
    live = LiveSide(replay.model)
    differences: list[tuple[Any, ...]] = []
    pending = script()
    while pending:
        nxt = pending[0].at
        live_timer, replay_timer = live.timers.next_at(), replay.wake
        timer = min((t for t in (live_timer, replay_timer) if t is not None), default=None)
        if timer is not None and timer < nxt:
            if live_timer != replay_timer:
                differences.append(("timer", live_timer, replay_timer))
                break
            live.clock.now = timer
            replay.wake = None
            await live.timer(timer)
            replay.policy.on_wakeup(timer)
            replay.arm(timer)
            event = Event(timer, -1, "timer")
        else:
            event = pending.pop(0)
            now = live.clock.now = event.at
            if event.kind == "arrive":
                await live.arrive(*event.args)
                replay.policy.on_arrival(replay.requests[event.args[0]], now)
            elif event.kind == "snapshot":
                snaps = replay.snapshots(now)
                await live.snapshot(snaps)
                for snap in snaps:
                    replay.policy.service.on_snapshot(snap)
                    replay.policy.on_snapshot(snap.name, now)
            elif event.kind == "tokens":
                i, count = event.args[0], 5
                if i in live.tickets:
                    live.tokens(i, count)
                    replay.tokens(i, count, now)
            elif event.kind == "finish":
                i, produced = event.args
                if i in live.tickets:
                    await live.finish(i, produced)
                    replay.finish(i, produced, now)
            elif event.kind == "refused":
                i, back_off, retry = event.args
                if i in live.tickets:
                    await live.refused(i, back_off, retry)
                    replay.policy.replica_refused(replay.requests[i], back_off, now, retry=retry)
            replay.arm(now)
        state = (live.decisions, live.queue())
        other = (replay.decisions(), replay.policy.engine.queue_order())
        if state != other:
            differences.append((event, state, other))
            break
    live.admission.close()
    return differences, live


def kinds(decisions: dict[int, tuple[str, str | None, float | None]]) -> set[str]:
    return {d for d, _, _ in decisions.values()}


async def test_live_and_replay_adapters_decide_alike() -> None:
    assert await run() == []


async def test_the_script_covers_queueing_refusals_and_re_placement() -> None:
    differences, live = await play()
    assert differences == []
    decided = live.decisions
    assert {r for _, r, _ in decided.values() if r is not None} == {"r0", "r1"}
    assert any(k.startswith("rejected") for k in kinds(decided))
    assert "rejected: replicas_saturated" in kinds(decided)
    assert "rejected: deadline_exceeded" in kinds(decided)  # expired in the queue, by a timer
    stats = live.admission.stats
    assert stats.count(outcome=Outcome.QUEUED) > 0
    assert stats.count(outcome=Outcome.DISPATCHED) > 0  # dispatched from the queue


async def test_the_tenant_over_budget_is_told_the_buckets_refill_jittered() -> None:
    _, live = await play()
    small = {i: live.decisions[i] for i, (*_, tenant) in enumerate(ARRIVALS) if tenant == "small"}
    assert [d for d, _, _ in small.values()] == [
        "admitted",
        "admitted",
        "admitted",
        "rejected: rate_limit_exceeded",
        "rejected: rate_limit_exceeded",
        "admitted",
    ]
    over = [retry for d, _, retry in small.values() if d.startswith("rejected")]
    # Nothing left after three at 0.02 s, refilled at 1,000 a second: 1,000 more in 1 s, and
    # in 0.9 s from 0.12 s; each jittered up to half as much again (the same draw on both sides:
    # the parity tests compare them).
    assert len(over) == 2
    for retry, wait in zip(over, [1.0, 0.9], strict=True):
        assert retry is not None
        assert wait - 1e-9 <= retry <= wait * 1.5 + 1e-9


async def test_a_drifting_adapter_is_caught() -> None:
    # The replay's jitter seeded differently: the first jittered Retry-After differs.
    def reseed(side: ReplaySide) -> None:
        side.policy.engine._rng = random.Random(SEED + 1)

    assert await run(drift=reseed) != []


async def test_a_replay_without_the_budgets_is_caught() -> None:
    def unbudgeted(side: ReplaySide) -> None:
        side.policy.engine._budget = None

    assert await run(drift=unbudgeted) != []
