"""Several gateways in front of one fleet, in virtual time, with or without the replica ledger.

``ManyGateways`` is one ``GatewayPolicy`` made of N Sluice gateways (``SluicePolicy``: each its
own ``AdmissionEngine``, ``ViewCache`` and ``PredictionService``). Arrivals are split among them
(``Split``: round robin, or one gateway taking a fixed share). Each gateway sees the replicas as
a live one does: its own in-flight requests, plus its own scrapes of the replicas' ``/metrics``
(each gateway scrapes every ``scrape_interval_s`` at its own phase, through its own
``SnapshotBuilder``), in which the other gateways' requests show as other clients' load.

With a ledger (``ledger_delay_s`` not ``None``) the gateways also share their in-flight requests
through the ledger's own pure parts (``gateway.ledger.state``: each gateway's ``Outbox`` and
``RemoteLedger``), hooked into each engine's ``ViewCache`` exactly as ``gateway.ledger.live``
hooks them (``remote``, ``listener``; the scrapes count the others' entries as their own, as
``gateway.prediction.live`` does): what a gateway publishes reaches every other one
``ledger_delay_s`` later (Redis's round trip and pub/sub), its progress every
``progress_interval_s``. Every time is virtual seconds (the ledger's wall-clock offset is 0).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.admission.shares import StreamingRequest
from gateway.ledger.config import LedgerSettings
from gateway.ledger.live import TICK_S
from gateway.ledger.state import Op, Outbox, RemoteLedger, TrackedSource
from gateway.ledger.unseen import UnseenDispatches
from gateway.prediction import PredictionService
from gateway.replicas.dialects.vllm import VllmDialect
from gateway.replicas.registry import LiveRequest
from gateway.replicas.scrape import SnapshotBuilder
from gateway.replicas.snapshot import InFlight, ReplicaSnapshot
from replay.loop import Fleet, IdleHooks, ReplicaHandle
from replay.policies import SluicePolicy
from replay.requests import GatewayRequest
from simulator.engine import FinishedRequestStats

__all__ = ["Coverage", "DelayedLedger", "ManyGateways", "Split"]


@dataclass(frozen=True, slots=True)
class Split:
    """How arrivals are split among ``gateways`` gateways: round robin (``first_share`` ``None``),
    or gateway 0 taking ``first_share`` (0-1) of them, evenly spread, and the others the rest
    round robin."""

    gateways: int
    first_share: float | None = None

    def __post_init__(self) -> None:
        if self.gateways < 1:
            raise ValueError(f"gateways must be >= 1, got {self.gateways}")
        share = self.first_share
        if share is not None and not (0.0 < share < 1.0 and self.gateways > 1):
            raise ValueError(f"first_share must be in (0, 1) with two gateways or more, got {share}")

    def gateway(self, k: int) -> int:
        """The gateway (0 to ``gateways - 1``) of the ``k``-th arrival (from 0)."""
        n, share = self.gateways, self.first_share
        if share is None:
            return k % n
        before = _floor(k * share)  # arrivals 0 .. k-1 that went to gateway 0
        if _floor((k + 1) * share) > before:
            return 0
        return 1 + (k - before) % (n - 1)

    @property
    def label(self) -> str:
        """``"round robin"`` or ``"50 % to one"``."""
        if self.first_share is None:
            return "round robin"
        return f"{100 * self.first_share:.0f} % to one"


def _floor(x: float) -> int:
    """``floor(x)``, a product that should be whole (``0.1 * 30``) counted as whole."""
    return math.floor(x + 1e-9)


class DelayedLedger:
    """The replica ledger among ``gateways`` gateways named ``g0``.., each change delivered to the
    others ``delay_s`` after it was published (virtual seconds, ``>= 0``).

    ``outboxes[g]`` and ``remotes[g]`` are gateway ``g``'s ``Outbox`` and ``RemoteLedger`` (the
    live ledger's). ``listener(g)`` is what ``ViewCache.listener`` is told, ``in_flight(g, replica)``
    what ``ViewCache.remote`` reads. ``clock()``: the virtual time now. ``on_change(g, replica,
    freed)``: gateway ``g`` applied others' changes on ``replica`` (``freed``: some ended), as
    ``LiveLedger.on_change``.
    """

    def __init__(
        self,
        gateways: int,
        delay_s: float,
        clock: Callable[[], float],
        on_change: Callable[[int, str, bool], None],
        *,
        settings: LedgerSettings | None = None,
    ) -> None:
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s}")
        settings = settings or LedgerSettings(enabled=True)
        cap = settings.max_entries_per_replica
        self.delay_s = delay_s
        self.clock = clock
        self.on_change = on_change
        self.tick_s = min(TICK_S, settings.progress_interval_s)
        self.outboxes = [
            Outbox(f"g{g}", progress_interval_s=settings.progress_interval_s, max_entries_per_replica=cap)
            for g in range(gateways)
        ]
        self.remotes = [RemoteLedger(f"g{g}", max_entries_per_replica=cap) for g in range(gateways)]
        #: Each gateway's estimate of the dispatches on their way to it (``count_unseen``).
        self.unseen = [UnseenDispatches() for _ in range(gateways)]
        self.count_unseen = settings.count_unseen
        #: Messages on their way: (delivery time, sequence, sender, changes).
        self._mail: list[tuple[float, int, int, list[Op]]] = []
        self._seq = 0
        self._next_tick = math.inf
        #: Messages sent and changes applied (by every receiver), for the reports.
        self.messages = 0
        self.applied = 0

    # -- what the gateways' view caches call --------------------------------------------------------
    def listener(self, gateway: int) -> _Listener:
        """Gateway ``gateway``'s ``ViewCache.listener``."""
        return _Listener(self, gateway)

    def in_flight(self, gateway: int, replica: str) -> tuple[InFlight, ...]:
        """The other gateways' entries on ``replica`` as ``gateway`` holds them now, with the
        stand-ins for those on their way (as ``LiveLedger.in_flight``)."""
        held = self.remotes[gateway].in_flight(replica, 0.0)
        return self.unseen[gateway].in_flight(replica, held, self.clock(), 0.0)

    def streams(self, gateway: int, replica: str) -> tuple[StreamingRequest, ...]:
        """The other gateways' streams on ``replica`` that ``gateway`` protects, stand-ins included."""
        held = self.remotes[gateway].streams(replica)
        return self.unseen[gateway].streams(replica, held, self.clock(), 0.0)

    def tracked(self, gateway: int, replica: str, entry: object, stream: TrackedSource) -> None:
        """``gateway`` sent ``entry`` to ``replica``: published now."""
        now = self.clock()
        self.outboxes[gateway].dispatched(replica, entry, stream, now=now, offset=0.0)
        self._flush(gateway, now)
        self._next_tick = min(self._next_tick, now + self.tick_s)

    def forgotten(self, gateway: int, entry: object) -> None:
        """``entry`` of ``gateway`` ended: its deletion published now."""
        self.outboxes[gateway].finished(entry)
        self._flush(gateway, self.clock())

    def _flush(self, gateway: int, now: float) -> None:
        ops = self.outboxes[gateway].drain(now)
        if ops:
            heapq.heappush(self._mail, (now + self.delay_s, self._seq, gateway, ops))
            self._seq += 1
            self.messages += 1

    # -- its timer ----------------------------------------------------------------------------------
    def next_event(self) -> float | None:
        """When the ledger must run next (``run``): a message due, or the progress tick while some
        gateway has requests in flight; ``None``: nothing to do."""
        at = self._mail[0][0] if self._mail else math.inf
        if self._next_tick < at and any(len(o) for o in self.outboxes):
            at = self._next_tick
        return None if math.isinf(at) else at

    def run(self, now: float) -> None:
        """Deliver the messages due by ``now``; queue and publish the progress due (every
        ``tick_s``, as the live ticker)."""
        if now >= self._next_tick:
            self._next_tick = now + self.tick_s
            for g, outbox in enumerate(self.outboxes):
                if len(outbox):
                    outbox.tick(now, 0.0)
                    self._flush(g, now)
        while self._mail and self._mail[0][0] <= now:
            _, _, sender, ops = heapq.heappop(self._mail)
            for g, remote in enumerate(self.remotes):
                if g != sender:
                    self._apply(g, remote, ops, now)

    def _apply(self, gateway: int, remote: RemoteLedger, ops: list[Op], now: float) -> None:
        """As ``LiveLedger.apply_message``."""
        changed: dict[str, bool] = {}
        for kind, entry in ops:
            if kind == "put" and self.count_unseen and not remote.knows(entry):
                self.unseen[gateway].arrived(entry, now, 0.0)
            hit = remote.put(entry, now) if kind == "put" else remote.remove(entry.replica, entry.key, now)
            if hit:
                self.applied += 1
                changed[entry.replica] = changed.get(entry.replica, False) or kind == "del"
        for replica, freed in changed.items():
            self.on_change(gateway, replica, freed)


@dataclass(frozen=True, slots=True)
class _Listener:
    """``TrackListener`` of one gateway's ``ViewCache``."""

    ledger: DelayedLedger
    gateway: int

    def tracked(self, replica: str, entry: Any, stream: Any) -> None:
        self.ledger.tracked(self.gateway, replica, entry, stream)

    def forgotten(self, replica: str, entry: Any) -> None:
        self.ledger.forgotten(self.gateway, entry)

    def in_flight(self, replica: str) -> tuple[InFlight, ...]:
        return self.ledger.in_flight(self.gateway, replica)

    def streams(self, replica: str) -> tuple[StreamingRequest, ...]:
        return self.ledger.streams(self.gateway, replica)


class _GatewayFleet(Fleet):
    """The fleet as one gateway acts on it: the shared replicas, but its ``ReplicaHandle``s hold
    only the requests it sent (their ``outstanding`` and ``in_flight`` are its own, as a live
    gateway's registry)."""

    def __init__(self, shared: Fleet) -> None:  # no Fleet.__init__: the replicas are shared's
        self.config = shared.config
        self.model = shared.model
        self.replicas = [ReplicaHandle(h.index, h.name, h.inner) for h in shared.replicas]
        self._round_robin = 0
        self.shared = shared

    def dispatch(
        self, request: GatewayRequest, replica: int, now: float, *, live: LiveRequest | None = None
    ) -> None:
        self.shared.dispatch(request, replica, now, live=live)
        # The same record of it the loop advances as its tokens land.
        self.replicas[replica].open[request.index] = self.shared.replicas[replica].open[request.index]

    def withdraw(self, request: GatewayRequest, now: float) -> None:
        for handle in self.replicas:
            handle.open.pop(request.index, None)
        self.shared.withdraw(request, now)

    def reject(self, request: GatewayRequest, now: float, reason: str) -> None:
        self.shared.reject(request, now, reason)

    def finished(self, replica: int, index: int) -> None:
        """Request ``index`` finished on replica ``replica``."""
        self.replicas[replica].open.pop(index, None)


class _StepMetricsOnly(PredictionService):
    """The service the loop sees (``ManyGateways.prediction_service``): with one, the loop keeps
    the engines' ``/metrics`` current; its own fleet-wide scrapes are not any gateway's, and are
    dropped here."""

    def on_snapshot(self, snapshot: ReplicaSnapshot) -> None:
        return None


@dataclass(slots=True)
class Coverage:
    """At one gateway's scrapes of one replica: the in-flight requests its views count (its own,
    and the others' from the ledger) against those of every gateway there, summed."""

    scrapes: int = 0
    own: int = 0
    others_counted: int = 0
    everyone: int = 0
    #: The other gateways it has held an entry of, at some scrape.
    gateways_seen: set[str] = field(default_factory=set)

    @property
    def share(self) -> float:
        """Counted / everyone's (NaN before any request was in flight at a scrape)."""
        return (self.own + self.others_counted) / self.everyone if self.everyone else math.nan


class ManyGateways(IdleHooks):
    """``gateways`` (Sluice gateways, each bound here to the fleet) sharing one fleet: arrivals
    split by ``split``; the replica ledger among them when ``ledger_delay_s`` is set (seconds;
    ``None``: none, each sees its own requests and its scrapes only). ``ledger``: its settings
    (``progress_interval_s``, ``max_entries_per_replica``; the rest is for Redis). See the module.
    """

    def __init__(
        self,
        gateways: Sequence[SluicePolicy],
        split: Split,
        *,
        ledger_delay_s: float | None = None,
        ledger: LedgerSettings | None = None,
        name: str | None = None,
    ) -> None:
        if len(gateways) != split.gateways:
            raise ValueError(f"{len(gateways)} gateways for a split among {split.gateways}")
        self.gateways = list(gateways)
        self.split = split
        self.ledger_delay_s = ledger_delay_s
        ledger_text = "no ledger" if ledger_delay_s is None else f"ledger {1e3 * ledger_delay_s:g} ms"
        self.name = name or f"{len(gateways)} gateways, {split.label}, {ledger_text}"
        self.now = 0.0
        self.ledger: DelayedLedger | None = None
        if ledger_delay_s is not None:
            self.ledger = DelayedLedger(
                len(gateways), ledger_delay_s, self._clock, self._changed, settings=ledger
            )
        self._service = _StepMetricsOnly()
        self._fleets: list[_GatewayFleet] = []
        self._builders: list[dict[str, SnapshotBuilder]] = []
        self._next_scrape: list[float] = []
        self._engine_wake: list[float | None] = [None] * len(gateways)
        self._interval = 1.0
        self._arrivals = 0
        #: The gateway each request was sent to, by index.
        self.owner: dict[int, int] = {}
        #: Per gateway, per replica: what its scrapes counted (``Coverage``).
        self.coverage: list[dict[str, Coverage]] = [{} for _ in gateways]

    @property
    def prediction_service(self) -> PredictionService:
        return self._service

    def bind(self, fleet: Fleet) -> None:
        config = fleet.config
        self._interval = config.scrape_interval_s
        for g, gateway in enumerate(self.gateways):
            own = _GatewayFleet(fleet)
            gateway.bind(own)
            self._fleets.append(own)
            window = config.window_s
            self._builders.append(
                {h.name: SnapshotBuilder(h.name, VllmDialect(), window_s=window) for h in fleet.replicas}
            )
            for h in fleet.replicas:
                gateway.service.set_replica(h.name, config.facts)
            if self.ledger is not None:
                cache = gateway.engine.view_cache
                listener = self.ledger.listener(g)
                cache.listener = listener
                cache.remote = listener.in_flight
                cache.remote_streams = listener.streams

    # -- events -------------------------------------------------------------------------------------
    def on_arrival(self, request: GatewayRequest, now: float) -> None:
        self.now = now
        if not self._next_scrape:
            # Gateway g's scrapes run g/N of an interval after gateway 0's (phases spread evenly).
            n = len(self.gateways)
            self._next_scrape = [now + self._interval * (1.0 + g / n) for g in range(n)]
        g = self.split.gateway(self._arrivals)
        self._arrivals += 1
        self.owner[request.index] = g
        self.gateways[g].on_arrival(request, now)

    def on_finished(
        self, replica: int, request: GatewayRequest, stats: FinishedRequestStats, now: float
    ) -> None:
        self.now = now
        g = self.owner[request.index]
        self._fleets[g].finished(replica, request.index)
        self.gateways[g].on_finished(replica, request, stats, now)

    def next_wakeup(self, now: float) -> float | None:
        at = min(self._next_scrape, default=math.inf)
        for g, gateway in enumerate(self.gateways):
            wake = self._engine_wake[g] = gateway.next_wakeup(now)
            if wake is not None and wake < at:
                at = wake
        if self.ledger is not None:
            due = self.ledger.next_event()
            if due is not None and due < at:
                at = due
        return None if math.isinf(at) else at

    def on_wakeup(self, now: float) -> None:
        self.now = now
        if self.ledger is not None:
            self.ledger.run(now)
        for g, at in enumerate(self._next_scrape):
            if at <= now:
                self._scrape(g, now)
                self._next_scrape[g] = at + self._interval
        for g, gateway in enumerate(self.gateways):
            wake = self._engine_wake[g]
            if wake is not None and wake <= now:
                self._engine_wake[g] = None
                gateway.on_wakeup(now)

    def _clock(self) -> float:
        return self.now

    def _changed(self, gateway: int, replica: str, freed: bool) -> None:
        """The ledger's ``on_change``, as ``gateway.ledger.live.install_ledger`` wires it: a
        replica's views rebuilt, and the queue re-evaluated when some request there ended."""
        policy = self.gateways[gateway]
        if freed:
            policy.on_snapshot(replica, self.now)
        else:
            policy.engine.view_cache.touch(replica)

    def _scrape(self, g: int, now: float) -> None:
        """Gateway ``g`` scrapes every replica (as ``VirtualTimeLoop.scrape`` for one gateway)."""
        policy, fleet, builders = self.gateways[g], self._fleets[g], self._builders[g]
        remote = policy.engine.view_cache.remote
        for handle, shared in zip(fleet.replicas, fleet.shared.replicas, strict=True):
            name = handle.name
            own = handle.in_flight()
            others = () if remote is None else tuple(remote(name))
            text = handle.inner.metrics.exposition().decode("utf-8")
            snapshot = builders[name].observe_text(text, now, [*own, *others])
            policy.service.on_snapshot(snapshot)
            policy.on_snapshot(name, now)
            seen = self.coverage[g].setdefault(name, Coverage())
            seen.scrapes += 1
            seen.own += len(own)
            seen.others_counted += len(others)
            seen.everyone += shared.outstanding
            if self.ledger is not None:
                seen.gateways_seen.update(self.ledger.remotes[g].by_gateway(name))
        policy.on_scrape(now)
