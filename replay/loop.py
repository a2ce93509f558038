"""The replay's one virtual-time loop: a gateway policy in front of a fleet of emulated engines.

No asyncio, no sleeping: one event loop over a heap of (virtual time, event). Every request
reaches a ``GatewayPolicy`` first, which sends it to a replica at once, holds it, or refuses it
(``Fleet.dispatch`` / ``Fleet.reject``). Four kinds of event; at one instant, lower go first:

* **step done**: an engine step ends (``Engine.complete``); its tokens land (the gateway's
  in-flight view advances, as the streaming relay sees each chunk), finished requests are
  recorded and the policy is told (``on_finished``); the engine starts its next step at once,
  as vLLM's busy loop does;
* **scrape** (only for policies that own a ``PredictionService``): every ``scrape_interval_s``
  each engine's ``/metrics`` text, rendered by ``simulator.metrics.VllmMetrics``, goes through
  ``SnapshotBuilder.observe_text`` and ``PredictionService.on_snapshot`` as in the live gateway,
  and the policy is told of each replica's snapshot (``on_snapshot``), then of the scrape
  (``on_scrape``);
* **wake-up**: the policy's own timer (``next_wakeup``), e.g. a queue deadline;
* **arrival**: the policy decides (``on_arrival``).

Per request the loop records the gateway's view of its outcome (``Outcome``): TTFT from its
arrival at the gateway (gateway queueing counts), the engine's TPOT, and the engine busy time
attributed to it: each step's duration is split over the requests scheduled in it in proportion
to the tokens each computed in that step (prefill chunk tokens, or 1 for a decode), so the whole
busy time of every engine is attributed, recomputation after a preemption included.

``replay.forecasts`` and ``replay.admission`` run this loop; ``simulator`` never imports it.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Protocol

from gateway.prediction import PredictionService, ReplicaFacts
from gateway.replicas.registry import LiveRequest
from gateway.replicas.scrape import DEFAULT_WINDOW_S
from gateway.replicas.snapshot import InFlight
from replay.emulated import EmulatedReplica, make_replica
from replay.traces import TraceRequest
from simulator.engine import FinishedRequestStats
from simulator.profile import Profile

__all__ = [
    "Fleet",
    "FleetConfig",
    "GatewayPolicy",
    "GatewayRequest",
    "IdleHooks",
    "Outcome",
    "PromptText",
    "ReplicaHandle",
    "Targets",
    "VirtualTimeLoop",
    "gateway_requests",
]


@dataclass(frozen=True, slots=True)
class Targets:
    """The latency targets a request is scored against, in seconds.

    ``ttft_s`` counts from the request's arrival at the gateway (queue wait included); ``tpot_s``
    is the mean time per output token after the first, as vLLM measures it.
    """

    ttft_s: float
    tpot_s: float


@dataclass(frozen=True, slots=True)
class GatewayRequest:
    """A request as a gateway sees it on arrival (never its true output length).

    ``arrival_s``: virtual seconds. ``max_tokens``: the client's output cap (tokens).
    ``tenant``: who sent it (the trace's, or assigned round robin).
    """

    index: int
    tenant: str
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    prompt_chars: int | None = None

    @property
    def sized_from_text(self) -> bool:
        """The gateway estimates the prompt's tokens from ``prompt_chars`` (its characters), as it
        does for a text prompt live; ``False``: sent as token ids, ``prompt_tokens`` is exact."""
        return self.prompt_chars is not None


@dataclass(frozen=True, slots=True)
class PromptText:
    """Prompts sent as text: request ``i``'s characters are its true tokens times a
    characters-per-token ratio drawn for it, log-normal with median ``chars_per_token`` and
    log-space standard deviation ``spread`` (a real tokeniser's ratio varies with the text:
    prose, code, other languages), seeded by ``seed`` and ``i``. The gateway sees only the
    characters and sizes the prompt from them at its learned ratio, as live."""

    chars_per_token: float = 4.0
    spread: float = 0.2
    seed: int = 0

    def __post_init__(self) -> None:
        if self.chars_per_token <= 0 or self.spread < 0:
            raise ValueError("chars_per_token must be > 0 and spread >= 0")

    def chars(self, index: int, tokens: int) -> int:
        """Characters of request ``index``'s ``tokens``-token prompt (>= 1)."""
        ratio = self.chars_per_token * math.exp(
            self.spread * random.Random(f"{self.seed}:{index}").gauss(0.0, 1.0)
        )
        return max(1, round(tokens * ratio))


@dataclass(frozen=True, slots=True)
class Outcome:
    """What happened to one request, from the gateway's side. Times in virtual seconds.

    ``rejected``: refused by the gateway (at once or after waiting in its queue), with ``reason``.
    ``finished_s`` is ``None`` for a request still running (or waiting in the engine) when the
    replay stopped. ``busy_s``: engine busy time attributed to it (see the module docstring).
    ``tpot_s``: the engine's mean time per output token after the first (``None`` below two
    tokens).
    """

    index: int
    tenant: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    rejected: bool
    reason: str
    replica: str | None
    dispatched_s: float | None
    first_token_s: float | None
    finished_s: float | None
    tpot_s: float | None
    busy_s: float
    preemptions: int

    @property
    def ttft_s(self) -> float | None:
        """Arrival at the gateway -> first token, seconds (``None`` without a first token)."""
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def served(self) -> bool:
        """Sent to a replica (finished or not)."""
        return not self.rejected and self.dispatched_s is not None

    def met(self, targets: Targets) -> bool:
        """Finished with TTFT <= target and TPOT <= target (a one-token answer has no TPOT)."""
        ttft = self.ttft_s
        if self.rejected or self.finished_s is None or ttft is None or ttft > targets.ttft_s:
            return False
        return self.tpot_s is None or self.tpot_s <= targets.tpot_s


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """The fleet: ``replicas`` engines of ``profile`` (ground truth), ``facts`` for predictors.

    ``max_tokens``: the clients' output cap (lowered to ``max_model_len - prompt``).
    ``tenants``: tenants the requests are assigned to, round robin by arrival order.
    ``jitter``: engines' step-time noise; engine ``i`` is seeded ``seed + i``.
    ``scrape_interval_s`` / ``window_s``: as the live scraper's ``interval`` and ``window``.
    ``text``: prompts sent as text, sized by the gateway from their characters (``None``: sent
    as token ids, sized exactly).
    """

    profile: Profile
    facts: ReplicaFacts
    replicas: int = 2
    max_tokens: int = 1000
    scrape_interval_s: float = 1.0
    jitter: float = 0.02
    seed: int = 0
    tenants: int = 4
    window_s: float = DEFAULT_WINDOW_S
    text: PromptText | None = None

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.max_tokens < 1 or self.tenants < 1:
            raise ValueError("replicas, max_tokens and tenants must be >= 1")
        if self.scrape_interval_s <= 0 or self.window_s <= 0:
            raise ValueError("scrape_interval_s and window_s must be > 0")


class IdleHooks:
    """No-op defaults for a ``GatewayPolicy``'s timing hooks, for policies that need none of
    snapshots, scrapes or timers."""

    def on_snapshot(self, replica: str, now: float) -> None:
        return None

    def on_scrape(self, now: float) -> None:
        return None

    def next_wakeup(self, now: float) -> float | None:
        return None

    def on_wakeup(self, now: float) -> None:
        return None


class GatewayPolicy(Protocol):
    """A gateway's admission and routing, driven by the replay's virtual clock.

    ``prediction_service``: a service the replay must feed with scrapes (``None``: no scrapes).
    The policy decides through the ``Fleet`` it was bound to: ``dispatch`` and ``reject``.
    """

    @property
    def name(self) -> str: ...

    @property
    def prediction_service(self) -> PredictionService | None: ...

    def bind(self, fleet: Fleet) -> None:
        """Called once before the first event."""
        ...

    def on_arrival(self, request: GatewayRequest, now: float) -> None:
        """A request arrives: dispatch, queue or reject it."""
        ...

    def on_finished(
        self, replica: int, request: GatewayRequest, stats: FinishedRequestStats, now: float
    ) -> None:
        """A dispatched request's last token landed (its replica's bookkeeping is already updated)."""
        ...

    def on_snapshot(self, replica: str, now: float) -> None:
        """The prediction service just took a snapshot of ``replica``."""
        ...

    def on_scrape(self, now: float) -> None:
        """The prediction service just took a snapshot of every replica."""
        ...

    def next_wakeup(self, now: float) -> float | None:
        """When the policy wants ``on_wakeup`` next (virtual seconds), or ``None``."""
        ...

    def on_wakeup(self, now: float) -> None:
        """Its timer fired."""
        ...


def gateway_requests(
    trace: Sequence[TraceRequest], config: FleetConfig, *, check_fit: bool = True
) -> list[GatewayRequest]:
    """``trace`` as the gateway sees it: request ``i`` goes to tenant ``t{i % tenants}`` with
    ``max_tokens`` = the client's cap, lowered to ``max_model_len - prompt`` (never below the
    request's true output). ``check_fit``: raise ``ValueError`` for a request whose prompt and
    output exceed ``max_model_len`` (``fit_to_model_len`` leaves those out)."""
    limit = config.profile.engine.max_model_len
    requests: list[GatewayRequest] = []
    for i, t in enumerate(trace):
        if check_fit and t.prompt_tokens + t.output_tokens > limit:
            raise ValueError(f"request {i} does not fit max_model_len {limit}: use fit_to_model_len")
        max_tokens = max(t.output_tokens, min(config.max_tokens, limit - t.prompt_tokens))
        chars = None if config.text is None else config.text.chars(i, t.prompt_tokens)
        requests.append(
            GatewayRequest(i, f"t{i % config.tenants}", t.arrival_s, t.prompt_tokens, max_tokens, chars)
        )
    return requests


@dataclass(slots=True)
class _Open:
    """A request dispatched and not finished: the gateway's streaming view of it. ``live``: the
    in-flight entry a policy handed ``Fleet.dispatch``, advanced as its tokens land (as the live
    relay advances the registry's)."""

    request: GatewayRequest
    dispatched_s: float
    streamed: int = 0
    first_token_s: float | None = None
    last_token_s: float | None = None
    live: LiveRequest | None = None

    def view(self) -> InFlight:
        r = self.request
        return InFlight(
            str(r.index),
            r.prompt_tokens,
            self.streamed,
            self.dispatched_s,
            r.max_tokens,
            self.last_token_s,
            self.first_token_s,
        )


@dataclass(slots=True)
class ReplicaHandle:
    """One replica as a policy may inspect it: its engine (read only!) and the gateway's requests."""

    index: int
    name: str
    inner: EmulatedReplica
    open: dict[int, _Open] = field(default_factory=dict)

    @property
    def outstanding(self) -> int:
        """The gateway's requests sent here and not finished."""
        return len(self.open)

    @property
    def num_waiting(self) -> int:
        """The engine's waiting queue now (what ``vllm:num_requests_waiting`` reports)."""
        return self.inner.engine.num_waiting

    @property
    def kv_cache_usage(self) -> float:
        """The engine's KV-cache use now, 0-1 (``vllm:kv_cache_usage_perc``)."""
        return self.inner.engine.kv_cache_usage

    def in_flight(self) -> list[InFlight]:
        """The gateway's in-flight requests here, as the live registry's ``freeze`` gives them."""
        return [o.view() for o in self.open.values()]

    def first_token_s(self, index: int) -> float | None:
        """When request ``index`` (in flight here) got its first token, or ``None``."""
        o = self.open.get(index)
        return None if o is None else o.first_token_s


@dataclass(slots=True)
class _Record:
    request: GatewayRequest
    output_tokens: int
    replica: str | None = None
    dispatched_s: float | None = None
    first_token_s: float | None = None
    finished_s: float | None = None
    tpot_s: float | None = None
    rejected: bool = False
    reason: str = ""
    busy_s: float = 0.0
    preemptions: int = 0

    def outcome(self) -> Outcome:
        r = self.request
        return Outcome(
            r.index,
            r.tenant,
            r.arrival_s,
            r.prompt_tokens,
            self.output_tokens,
            self.rejected,
            self.reason,
            self.replica,
            self.dispatched_s,
            self.first_token_s,
            self.finished_s,
            self.tpot_s,
            self.busy_s,
            self.preemptions,
        )


class _Event(IntEnum):
    """At one instant lower values go first: tokens land before anything reads the state."""

    STEP_DONE = 0
    SCRAPE = 1
    WAKE = 2
    ARRIVAL = 3


class Fleet:
    """The replicas and the two actions a policy takes: ``dispatch`` and ``reject``."""

    def __init__(self, config: FleetConfig, loop: VirtualTimeLoop) -> None:
        self.config = config
        self.model = config.profile.served_model_name
        self.replicas = [
            ReplicaHandle(
                i,
                f"r{i}",
                make_replica(
                    f"r{i}",
                    config.profile,
                    seed=config.seed + i,
                    jitter=config.jitter,
                    window_s=config.window_s,
                ),
            )
            for i in range(config.replicas)
        ]
        self._loop = loop
        self._round_robin = 0

    def index_of(self, name: str) -> int:
        """The index of the replica called ``name``."""
        for r in self.replicas:
            if r.name == name:
                return r.index
        raise KeyError(name)

    def least_outstanding(self, candidates: Sequence[int] | None = None) -> int:
        """The candidate (default: every replica) with the fewest outstanding requests; ties round
        robin, as ``gateway.replicas.registry`` picks."""
        pool = list(range(len(self.replicas))) if candidates is None else list(candidates)
        if not pool:
            raise ValueError("no candidate replica")
        least = min(self.replicas[k].outstanding for k in pool)
        tied = [k for k in pool if self.replicas[k].outstanding == least]
        chosen = tied[self._round_robin % len(tied)]
        self._round_robin += 1
        return chosen

    def dispatch(
        self, request: GatewayRequest, replica: int, now: float, *, live: LiveRequest | None = None
    ) -> None:
        """Send ``request`` to replica ``replica`` now (the engine queues it at once). ``live``:
        the policy's in-flight entry for it, whose tokens the loop advances as they land."""
        record = self._loop.records[request.index]
        if record.dispatched_s is not None or record.rejected:
            raise RuntimeError(f"request {request.index} was already decided")
        handle = self.replicas[replica]
        record.dispatched_s, record.replica = now, handle.name
        engine = handle.inner.engine
        engine.add_request(
            str(request.index), request.prompt_tokens, request.max_tokens, record.output_tokens, now
        )
        handle.open[request.index] = _Open(request, now, live=live)
        if handle.inner.plan is None and replica != self._loop.completing:
            self._loop.start_step(replica)

    def withdraw(self, request: GatewayRequest, now: float) -> None:
        """Take back ``request`` from the replica it was sent to (the replica refused it as
        overloaded before any token): the engine drops it, and it may be dispatched again."""
        record = self._loop.records[request.index]
        if record.replica is None or record.rejected:
            raise RuntimeError(f"request {request.index} is not dispatched")
        handle = self.replicas[self.index_of(record.replica)]
        handle.open.pop(request.index, None)
        handle.inner.engine.abort_request(str(request.index), now)
        record.dispatched_s = record.replica = None

    def reject(self, request: GatewayRequest, now: float, reason: str) -> None:
        """Refuse ``request`` (a 429 or a queue timeout); ``reason`` is recorded."""
        record = self._loop.records[request.index]
        if record.dispatched_s is not None or record.rejected:
            raise RuntimeError(f"request {request.index} was already decided")
        record.rejected, record.reason, record.finished_s = True, reason, now


class VirtualTimeLoop:
    """One replay: ``config``'s fleet driven by ``policy`` on the virtual clock (see the module).

    Build it, then ``run`` it once; ``now``, ``steps``, ``busy_s`` (engine seconds, all replicas)
    and ``scrapes`` then describe the run, and ``outcome(index)`` each request's fate.
    """

    def __init__(self, config: FleetConfig, policy: GatewayPolicy) -> None:
        self.config = config
        self.policy = policy
        self.records: dict[int, _Record] = {}
        self.fleet = Fleet(config, self)
        self.heap: list[tuple[float, int, int, int]] = []
        self.seq = 0
        self.now = 0.0
        self.steps = 0
        self.scrapes = 0
        self.busy_s = 0.0
        self.wake_at = math.inf
        self.wake_gen = 0
        #: The replica whose step is being completed (its next step starts once that is done).
        self.completing = -1
        service = policy.prediction_service
        if service is not None:
            for r in self.fleet.replicas:
                service.set_replica(r.name, config.facts)

    def push(self, at: float, kind: _Event, payload: int) -> None:
        heapq.heappush(self.heap, (at, int(kind), self.seq, payload))
        self.seq += 1

    def start_step(self, k: int) -> None:
        """Let replica ``k``'s engine schedule its next step now, if it has work."""
        inner = self.fleet.replicas[k].inner
        plan = inner.engine.schedule(self.now)
        inner.plan = plan
        inner.plan_end_s = math.inf
        if plan is not None:
            inner.plan_end_s = self.now + plan.duration_s
            self.push(inner.plan_end_s, _Event.STEP_DONE, k)

    def step_done(self, k: int) -> None:
        handle = self.fleet.replicas[k]
        inner = handle.inner
        plan = inner.plan
        assert plan is not None
        result = inner.engine.complete(plan, self.now)
        inner.plan, inner.plan_end_s = None, math.inf
        self.completing = k
        self.steps += 1
        self.busy_s += plan.duration_s
        total = sum(plan.num_scheduled_tokens.values())
        if total > 0:
            for rid, tokens in plan.num_scheduled_tokens.items():
                self.records[int(rid)].busy_s += plan.duration_s * tokens / total
        if self.policy.prediction_service is not None:
            inner.metrics.record_step(result)
        for event in result.events:
            o = handle.open.get(int(event.request_id))
            if o is None:
                continue  # withdrawn while its step ran
            o.streamed, o.last_token_s = event.num_output_tokens, self.now
            if o.first_token_s is None:
                o.first_token_s = self.now
            live = o.live
            if live is not None:
                live.tokens_streamed, live.last_token_at = o.streamed, self.now
                if live.first_token_at is None:
                    live.first_token_at = self.now
        for stats in result.finished:
            index = int(stats.request_id)
            o = handle.open.pop(index, None)
            if o is None:
                continue
            record = self.records[index]
            record.first_token_s = o.first_token_s
            record.finished_s = self.now
            record.tpot_s = stats.tpot_s
            record.output_tokens = stats.generation_tokens
            record.preemptions = stats.num_preemptions
            self.policy.on_finished(k, o.request, stats, self.now)
        self.completing = -1
        self.start_step(k)

    def scrape(self) -> None:
        service = self.policy.prediction_service
        assert service is not None
        self.scrapes += 1
        for handle in self.fleet.replicas:
            inner = handle.inner
            text = inner.metrics.exposition().decode("utf-8")
            snapshot = inner.builder.observe_text(text, self.now, handle.in_flight())
            service.on_snapshot(snapshot)
            self.policy.on_snapshot(handle.name, self.now)
        self.policy.on_scrape(self.now)

    def arm(self) -> None:
        """Ask the policy for its next wake-up; push it if it is earlier than the armed one."""
        when = self.policy.next_wakeup(self.now)
        if when is None:
            self.wake_at = math.inf
            return
        when = max(when, self.now)
        if when < self.wake_at:
            self.wake_at = when
            self.wake_gen += 1
            self.push(when, _Event.WAKE, self.wake_gen)

    def unresolved(self, index: int, ttft_s: float) -> bool:
        """Whether request ``index``'s outcome may still change (not finished, not rejected, and
        not already past its TTFT target without a first token)."""
        record = self.records[index]
        if record.rejected or record.finished_s is not None:
            return False
        if record.dispatched_s is not None:
            handle = self.fleet.replicas[self.fleet.index_of(record.replica or "")]
            first = handle.first_token_s(index)
            if first is not None:
                return True
        return self.now <= record.request.arrival_s + ttft_s

    def expect(self, requests: Sequence[GatewayRequest], outputs: Sequence[int]) -> None:
        """Register ``requests`` (``outputs``: each one's true output length) and push their
        arrivals; ``run`` does this. A caller that drives the policy itself (a parity test)
        registers its requests here before it dispatches them."""
        for req, out in zip(requests, outputs, strict=True):
            self.records[req.index] = _Record(req, out)
            self.push(req.arrival_s, _Event.ARRIVAL, req.index)

    def outcome(self, index: int) -> Outcome:
        """What happened to request ``index`` so far."""
        return self.records[index].outcome()

    def run(
        self,
        requests: Sequence[GatewayRequest],
        outputs: Sequence[int],
        done: Callable[[], bool],
    ) -> None:
        """Replay ``requests`` (arrival order; ``outputs``: each one's true output length, which
        only the engine sees) until the heap is empty or ``done()`` is true; ``done`` is asked
        before the first event and after every event that reached the policy."""
        self.expect(requests, outputs)
        by_index = {r.index: r for r in requests}
        if requests and self.policy.prediction_service is not None:
            self.push(requests[0].arrival_s + self.config.scrape_interval_s, _Event.SCRAPE, 0)
        self.policy.bind(self.fleet)
        if done():
            return
        while self.heap:
            at, kind, _, payload = heapq.heappop(self.heap)
            self.now = at
            if kind == _Event.ARRIVAL:
                self.policy.on_arrival(by_index[payload], at)
            elif kind == _Event.STEP_DONE:
                self.step_done(payload)
            elif kind == _Event.SCRAPE:
                self.scrape()
                self.push(at + self.config.scrape_interval_s, _Event.SCRAPE, 0)
            else:
                if payload != self.wake_gen:
                    continue  # superseded by an earlier wake-up
                self.wake_at = math.inf
                self.policy.on_wakeup(at)
            self.arm()
            if done():
                return
