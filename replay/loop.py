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

Requests, outcomes and the fleet's config are plain values (``replay.requests``).

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Protocol

from gateway.prediction import PredictionService
from gateway.replicas.registry import LiveRequest
from gateway.replicas.snapshot import InFlight
from replay.emulated import EmulatedReplica, make_replica
from replay.requests import FleetConfig, GatewayRequest, Outcome
from simulator.engine import FinishedRequestStats

__all__ = ["Fleet", "GatewayPolicy", "IdleHooks", "ReplicaHandle", "VirtualTimeLoop"]


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
            exact_output_tokens=None if self.live is None else self.live.exact_output,
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
    cached_tokens: int = 0

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
            self.cached_tokens,
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
            str(request.index),
            request.prompt_tokens,
            request.max_tokens,
            record.output_tokens,
            now,
            prompt_token_ids=request.token_ids(),
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
            record.cached_tokens = stats.cached_tokens
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
