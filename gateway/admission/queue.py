"""Sluice's queue: requests no replica can take now, released as replicas free up.

Order: strict class priority (lower number first); within a priority, the tenant with the smallest
virtual token counter (``fairness.VirtualTokenCounter``: weighted tokens served / tenant weight)
when several tenants wait; within a tenant, shortest predicted job first with aging. A job's key
is ``size_s - aging_rate x (now - enqueued_at)``; since every entry ages at the same rate this
orders exactly like the static ``size_s + aging_rate x enqueued_at``, so one heap per (priority,
tenant) stays valid as time passes (no re-keying). Ties go to the earlier entry; between tenants
with equal counters, to the smaller (aged) job. With one tenant (or none) the order is plain
priority-then-aged-SJF.

Re-evaluation (``reevaluate``, on every request finish and every scrape) walks each priority in
that order, asking the admitter again (``queued=True``): ``Admit`` -> dispatched (its tenant's
counter charged with the prompt at once, so the next pick sees it; the views updated with
``ReplicaView.with_admitted``, so the next entry sees the load), ``Reject`` -> answered
(``deadline_exceeded``), ``Queue`` -> stays (and the walk goes on: to the same tenant's next
entry only after every other waiting tenant's entry that stayed, so a request that fits is not
kept out by another tenant's that does not). A request still blocked after ``reserve_after_s``
stops the walk for its priority and below, and holds back new requests of those priorities
(``holds_back``), so smaller requests cannot keep it out forever. A ``size_protected`` request (its
prompt size is admitted below its share, ``gateway.admission.size_share``) goes first among its
tenant's (the most starved size first) and holds back the same way from the moment it is queued.

Hard deadlines (``AdmissionRequest.queue_deadline_s``) sit in their own heap and are enforced on
every call for every entry, even those the walk does not reach.

Complexity (n entries, T tenants waiting in a priority): ``push`` O(log n) (plus O(T) when a
tenant's first request arrives: the counter lift); ``cancel`` O(1) (lazy deletion; the heaps are
compacted when stale items outnumber live ones, O(n) amortised over as many cancels);
``reevaluate`` O((e + m) log n + T log T + m x R forecasts) for e expired entries and
m <= ``max_examined`` examined ones on R replicas.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.admission.config import AdmissionSettings, ClassSettings
from gateway.admission.decision import Admitter, Blocker, Decision, Queue, Reject, RejectReason
from gateway.admission.fairness import TenantKey, TokenWeights, VirtualTokenCounter
from gateway.admission.refusal import queue_deadline_message
from gateway.admission.request import AdmissionRequest
from gateway.admission.retry_after import RetryAfterPolicy
from gateway.admission.views import ReplicaView

__all__ = ["AdmissionQueue", "QueueEntry", "Reevaluation"]

#: Stale heap items tolerated beyond the live entries before the heaps are rebuilt.
_COMPACT_SLACK = 64

#: Subtracted from a ``size_protected`` entry's sort key, times 2 less its band's standing (0-1):
#: ahead of any job size and wait, the most starved band's first.
_PROTECTED_LEAD = 1.0e12

#: A heap item: (static sort key, entry id).
_Item = tuple[float, int]
#: A tenant's place in one walk: (its entries that stayed queued so far in this walk, its counter,
#: its next entry's sort key, that entry's id, the tenant's index).
_Pick = tuple[int, float, float, int, int]


@dataclass(slots=True, eq=False)
class QueueEntry:
    """One waiting request.

    ``id``: unique, increasing (FIFO tie-break). ``size_s``: predicted job size (seconds of
    weighted tokens). ``enqueued_at`` / ``deadline_s``: admission-clock seconds; past the deadline
    it is rejected. ``blocker`` / ``earliest_retry_s``: from its latest evaluation. ``fifo``:
    queued under ``policy: concurrency_cap`` (arrival order, no tenant fair share).
    """

    id: int
    request: AdmissionRequest
    request_class: str
    priority: int
    size_s: float
    enqueued_at: float
    deadline_s: float
    blocker: Blocker
    earliest_retry_s: float
    fifo: bool = False

    @property
    def heap_tenant(self) -> TenantKey:
        """The tenant whose heap holds it: its own, or ``None`` (one shared heap: no fair share)
        for a FIFO entry (``policy: concurrency_cap``)."""
        return None if self.fifo else self.request.tenant

    def waited_s(self, now: float) -> float:
        """Seconds spent in the queue so far."""
        return now - self.enqueued_at

    def sort_key(self, aging_rate: float) -> float:
        """Static heap key: ``size_s + aging_rate x enqueued_at`` (smaller goes first); a
        ``size_protected`` request goes before every other of its tenant, the lower its band's
        ``size_standing`` the sooner (several bands may be below their share at once, and the
        first protected entry that stays queued stops the walk)."""
        key = self.size_s + aging_rate * self.enqueued_at
        request = self.request
        return key - _PROTECTED_LEAD * (2.0 - request.size_standing) if request.size_protected else key


@dataclass(slots=True)
class Reevaluation:
    """What one re-evaluation decided.

    ``dispatched``: entries to send now, each with its decision (``decision.admits`` is True;
    ``decision.replica`` says where). ``rejected``: entries to answer with their ``Reject``.
    ``views``: the views passed in, updated for the dispatched requests.
    """

    dispatched: list[tuple[QueueEntry, Decision]] = field(default_factory=list)
    rejected: list[tuple[QueueEntry, Reject]] = field(default_factory=list)
    views: list[ReplicaView] = field(default_factory=list)


class AdmissionQueue:
    """Bounded per class; priority, then tenant fair share, then aged shortest-job-first;
    deadline-aware. Pure: the caller passes the time.

    ``fairness``: the tenants' counters, shared with whoever charges output (default: a fresh one
    weighing tokens by the queue's job-size costs).
    """

    def __init__(
        self,
        settings: AdmissionSettings,
        admitter: Admitter,
        retry: RetryAfterPolicy,
        fairness: VirtualTokenCounter | None = None,
    ) -> None:
        self._settings = settings
        self._admitter = admitter
        self._retry = retry
        if fairness is None:
            fairness = VirtualTokenCounter(TokenWeights.from_queue_settings(settings.queue))
        self._fairness = fairness
        self._entries: dict[int, QueueEntry] = {}
        self._heaps: dict[int, dict[TenantKey, list[_Item]]] = {}
        self._deadlines: list[tuple[float, int]] = []
        self._depth: dict[str, int] = {}
        self._next_id = 0
        self._stale = 0
        self._reserved: int | None = None
        self._reserved_retry_s = 0.0
        self._reserver: int | None = None
        self._walking = False  # no compaction while reevaluate holds popped items

    def reconfigure(self, settings: AdmissionSettings, admitter: Admitter, retry: RetryAfterPolicy) -> None:
        """Swap settings (hot reload). Entries keep their place; capacities apply to new pushes."""
        self._settings, self._admitter, self._retry = settings, admitter, retry

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def fairness(self) -> VirtualTokenCounter:
        """The tenants' virtual token counters this queue orders by."""
        return self._fairness

    def depth(self, request_class: str) -> int:
        """Requests of ``request_class`` waiting."""
        return self._depth.get(request_class, 0)

    def depths(self) -> dict[str, int]:
        """Requests waiting per class (classes with none omitted)."""
        return {c: n for c, n in self._depth.items() if n}

    def entry(self, entry_id: int) -> QueueEntry | None:
        """The waiting entry with this id, if it is still queued."""
        return self._entries.get(entry_id)

    def next_deadline_s(self) -> float | None:
        """The earliest hard deadline of a waiting entry: when ``reevaluate`` must run at the latest."""
        while self._deadlines and self._deadlines[0][1] not in self._entries:
            heapq.heappop(self._deadlines)
            self._stale -= 1
        return self._deadlines[0][0] if self._deadlines else None

    def holds_back(self, priority: int) -> bool:
        """Whether a long-waiting entry currently holds back requests of ``priority``."""
        return self._reserved is not None and priority >= self._reserved

    @property
    def held_back_retry_s(self) -> float:
        """Predicted seconds until the entry that holds back its priority can be placed."""
        return self._reserved_retry_s

    def _class_of(self, request: AdmissionRequest) -> tuple[str, ClassSettings]:
        s = self._settings
        name = request.request_class if request.request_class in s.classes else s.default_class
        return name, s.classes[name]

    def push(self, request: AdmissionRequest, decision: Queue, now: float) -> QueueEntry | Reject:
        """Queue ``request`` (which ``decision`` said to queue); ``Reject(overloaded)`` when its
        class's queue is full. O(log n)."""
        name, cls = self._class_of(request)
        if self.depth(name) >= cls.queue_capacity:
            return Reject(
                RejectReason.OVERLOADED,
                self._retry.after(decision.earliest_retry_s),
                decision.forecast,
                f"the {name} queue is full ({cls.queue_capacity} requests waiting)",
                Blocker.QUEUE_FULL,
                decision.replica,
            )
        fifo = self._settings.policy == "concurrency_cap"
        if fifo:
            deadline = request.arrival_s + self._settings.concurrency_cap.queue_ttl_s
        elif self._settings.shadow.slo:
            deadline = request.arrival_s + cls.max_queue_wait_s
        else:
            deadline = request.queue_deadline_s(cls)
        entry = QueueEntry(
            id=self._next_id,
            request=request,
            request_class=name,
            priority=cls.priority,
            # FIFO (concurrency_cap): every job the same size, so aging orders by enqueue time.
            size_s=0.0 if fifo else request.job_size_s(self._settings.queue),
            fifo=fifo,
            enqueued_at=now,
            deadline_s=deadline,
            blocker=decision.blocker,
            earliest_retry_s=decision.earliest_retry_s,
        )
        self._next_id += 1
        self._entries[entry.id] = entry
        self._depth[name] = self._depth.get(name, 0) + 1
        heap = self._heaps.setdefault(entry.priority, {}).setdefault(entry.heap_tenant, [])
        heapq.heappush(heap, (entry.sort_key(self._settings.queue.aging_rate), entry.id))
        heapq.heappush(self._deadlines, (deadline, entry.id))
        self._fairness.enqueued(request.tenant)
        if request.size_protected and (self._reserved is None or entry.priority < self._reserved):
            self._reserve(entry, decision.earliest_retry_s)
        return entry

    def _reserve(self, entry: QueueEntry, retry_s: float) -> None:
        """``entry`` holds back its priority and below (``holds_back``) until the next walk."""
        self._reserved, self._reserved_retry_s, self._reserver = entry.priority, retry_s, entry.id

    def cancel(self, entry_id: int) -> QueueEntry | None:
        """Drop a waiting entry (its client went away); ``None`` if it is no longer queued. O(1)."""
        entry = self._entries.get(entry_id)
        if entry is not None:
            self._remove(entry)
        return entry

    def _remove(self, entry: QueueEntry) -> None:
        del self._entries[entry.id]
        if entry.id == self._reserver:
            self._reserved = self._reserver = None
        self._depth[entry.request_class] -= 1
        self._fairness.dequeued(entry.request.tenant)
        self._stale += 2  # its items in the order heap and the deadline heap
        if not self._walking and self._stale > len(self._entries) + _COMPACT_SLACK:
            self._compact()

    def _compact(self) -> None:
        """Rebuild the heaps from the live entries, dropping stale items. O(n)."""
        aging = self._settings.queue.aging_rate
        heaps: dict[int, dict[TenantKey, list[_Item]]] = {}
        for e in self._entries.values():
            heaps.setdefault(e.priority, {}).setdefault(e.heap_tenant, []).append((e.sort_key(aging), e.id))
        for by_tenant in heaps.values():
            for heap in by_tenant.values():
                heapq.heapify(heap)
        self._heaps = heaps
        self._deadlines = [(e.deadline_s, e.id) for e in self._entries.values()]
        heapq.heapify(self._deadlines)
        self._stale = 0

    def reevaluate(self, now: float, views: Sequence[ReplicaView]) -> Reevaluation:
        """Expire overdue entries, then offer the waiting ones to the replicas in queue order."""
        out = Reevaluation(views=list(views))
        self._walking = True
        try:
            self._expire(now, out)
            self._walk(now, out)
        finally:
            self._walking = False
        if self._stale > len(self._entries) + _COMPACT_SLACK:
            self._compact()
        return out

    def _expire(self, now: float, out: Reevaluation) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            _, entry_id = heapq.heappop(self._deadlines)
            entry = self._entries.get(entry_id)
            if entry is None:
                self._stale -= 1
                continue
            self._remove_popped(entry)
            reject = Reject(
                RejectReason.DEADLINE_EXCEEDED,
                self._retry.after(entry.earliest_retry_s),
                None,
                queue_deadline_message(entry.blocker, entry.waited_s(now)),
                entry.blocker,
            )
            out.rejected.append((entry, reject))

    def _walk(self, now: float, out: Reevaluation) -> None:
        """Offer entries to the admitter in order, at most ``max_examined`` of them."""
        budget = self._settings.queue.max_examined
        self._reserved = self._reserver = None
        index = {v.name: i for i, v in enumerate(out.views)}
        for priority in sorted(self._heaps):
            budget = self._walk_priority(priority, budget, now, index, out)
            if budget == 0 or self._reserved is not None:
                return

    def _walk_priority(
        self, priority: int, budget: int, now: float, index: dict[str, int], out: Reevaluation
    ) -> int:
        """Offer one priority's entries, each time the least-served tenant's shortest aged job
        (counters change as requests are dispatched). A tenant whose entry must stay goes behind
        every tenant with fewer such entries in this walk, so one tenant's blocked backlog cannot
        use up the examination budget while others' requests would fit. Returns the budget left."""
        reserve_after = self._settings.queue.reserve_after_s
        by_tenant = self._heaps[priority]
        tenants = list(by_tenant)
        stayed = [0] * len(tenants)
        picks: list[_Pick] = []
        for i, tenant in enumerate(tenants):
            self._offer(picks, i, tenant, by_tenant[tenant], 0)
        keep: list[tuple[TenantKey, _Item]] = []
        while picks and budget > 0 and self._reserved is None:
            i = heapq.heappop(picks)[-1]
            tenant = tenants[i]
            heap = by_tenant[tenant]
            item = heapq.heappop(heap)  # live: _offer dropped the stale items above it
            entry = self._entries[item[1]]
            budget -= 1
            decision = self._admitter.decide(entry.request, out.views, now, queued=True)
            if decision.admits:
                self._dispatch(entry, decision, index, out)
            elif isinstance(decision, Reject):
                self._remove_popped(entry)
                out.rejected.append((entry, decision))
            else:
                assert isinstance(decision, Queue)
                entry.blocker, entry.earliest_retry_s = decision.blocker, decision.earliest_retry_s
                keep.append((tenant, item))
                stayed[i] += 1
                protected = entry.request.size_protected
                if protected or (reserve_after is not None and entry.waited_s(now) >= reserve_after):
                    self._reserve(entry, decision.earliest_retry_s)
            self._offer(picks, i, tenant, heap, stayed[i])
        for tenant, item in keep:
            heapq.heappush(by_tenant[tenant], item)
        for tenant in tenants:
            if not by_tenant[tenant]:
                del by_tenant[tenant]  # tenants come and go: keep the walk O(tenants waiting)
        return budget

    def _offer(self, picks: list[_Pick], i: int, tenant: TenantKey, heap: list[_Item], stayed: int) -> None:
        """Put tenant ``i`` in the walk's order (entries that stayed, counter, next live entry)."""
        while heap and heap[0][1] not in self._entries:
            heapq.heappop(heap)
            self._stale -= 1
        if heap:
            key, entry_id = heap[0]
            heapq.heappush(picks, (stayed, self._fairness.counter(tenant), key, entry_id, i))

    def _remove_popped(self, entry: QueueEntry) -> None:
        """Remove an entry one of whose two heap items was already popped."""
        self._stale -= 1
        self._remove(entry)

    def _dispatch(
        self, entry: QueueEntry, decision: Decision, index: dict[str, int], out: Reevaluation
    ) -> None:
        self._remove_popped(entry)
        self._fairness.charge_dispatch(entry.request.tenant, entry.request.prompt_tokens)
        out.dispatched.append((entry, decision))
        i = index.get(decision.replica) if decision.replica is not None else None
        if i is not None:
            out.views[i] = out.views[i].with_admitted(entry.request, decision.forecast, entry.request_class)
