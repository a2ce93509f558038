"""``AdmissionController``: the admitter, the queue and the stats behind three calls.

The gateway (wall clock, sockets) and the trace replay (virtual clock) drive the same object::

    decision = controller.submit(request, views, now)     # on arrival
    if decision.admits:            -> send to decision.replica (shadow decisions admit too)
    elif isinstance(decision, Queue): wait for entry decision.entry_id to come out of reevaluate()
    else:                          -> answer the Reject (status, Retry-After, reason)

    result = controller.reevaluate(now, views)           # on request finish, scrape, next_deadline_s()
    controller.cancel(entry_id, now)                     # the queued request's client went away
    controller.fairness.charge_output(tenant, tokens)    # output produced (per chunk, or the total at end)

Nothing here reads a clock, sleeps, or does I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from gateway.admission.config import AdmissionSettings
from gateway.admission.decision import (
    Admit,
    Admitter,
    Blocker,
    Decision,
    Queue,
    Reject,
    RejectReason,
)
from gateway.admission.fairness import TokenWeights, VirtualTokenCounter
from gateway.admission.policies import make_admitter
from gateway.admission.queue import AdmissionQueue, QueueEntry, Reevaluation
from gateway.admission.request import AdmissionRequest
from gateway.admission.retry_after import RetryAfterPolicy, UniformSource
from gateway.admission.size_share import SizeShares
from gateway.admission.stats import AdmissionStats, Outcome
from gateway.admission.views import ReplicaView
from predictor import ForecastConfig

__all__ = ["AdmissionController"]


class AdmissionController:
    """Admission for one gateway process.

    ``rng``: the seeded uniform source for Retry-After jitter (``random.Random(seed)`` or a numpy
    ``Generator``). ``admitter``: overrides the one ``settings.policy`` names (tests, experiments).
    ``fairness``: the tenants' virtual token counters (default: token weights from the queue's
    job-size costs, every tenant weighing 1; set them with ``fairness.set_token_weights`` and
    ``fairness.set_tenant_weights``). Every request sent to a replica, at once or from the queue,
    is charged its prompt there; its output is the gateway's to charge (``fairness.charge_output``).
    """

    def __init__(
        self,
        settings: AdmissionSettings,
        *,
        rng: UniformSource,
        stats: AdmissionStats | None = None,
        admitter: Admitter | None = None,
        forecast_config: ForecastConfig | None = None,
        fairness: VirtualTokenCounter | None = None,
    ) -> None:
        self._rng = rng
        self._forecast_config = forecast_config
        self.stats = stats if stats is not None else AdmissionStats()
        self._settings = settings
        self._retry = RetryAfterPolicy(settings.retry_after, rng)
        self._admitter = admitter if admitter is not None else make_admitter(settings, self._retry)
        if fairness is None:
            fairness = VirtualTokenCounter(TokenWeights.from_queue_settings(settings.queue))
        self._fairness = fairness
        self._queue = AdmissionQueue(settings, self._admitter, self._retry, fairness)
        #: Each class's admission rate per prompt-size quartile; protects the starved quartiles.
        self.size_shares = SizeShares(settings)
        self._update_depths()

    @property
    def fairness(self) -> VirtualTokenCounter:
        """The tenants' virtual token counters (shared with the queue)."""
        return self._fairness

    @property
    def settings(self) -> AdmissionSettings:
        return self._settings

    @property
    def queue(self) -> AdmissionQueue:
        return self._queue

    @property
    def admitter(self) -> Admitter:
        return self._admitter

    def reconfigure(self, settings: AdmissionSettings) -> None:
        """Swap in a new validated ``admission`` section (hot reload); queued requests stay, and the
        fairness counters too. Token weights that were the old queue costs follow the new ones."""
        if self._fairness.token_weights == TokenWeights.from_queue_settings(self._settings.queue):
            self._fairness.set_token_weights(TokenWeights.from_queue_settings(settings.queue))
        self._settings = settings
        self._retry = RetryAfterPolicy(settings.retry_after, self._rng)
        self._admitter = make_admitter(settings, self._retry)
        self._queue.reconfigure(settings, self._admitter, self._retry)
        self.size_shares.reconfigure(settings)
        self._update_depths()

    def _class_name(self, request: AdmissionRequest) -> str:
        s = self._settings
        return request.request_class if request.request_class in s.classes else s.default_class

    def submit(self, request: AdmissionRequest, views: Sequence[ReplicaView], now: float) -> Decision:
        """Decide a new request: ``Admit`` (send now), ``Queue`` (queued, ``entry_id`` set; or, not
        enforced, send to ``replica`` now), or ``Reject``. Counted in ``stats``; a request of a
        prompt-size band its class admits below its share is decided ``size_protected``."""
        name = self._class_name(request)
        cls = self._settings.classes[name]
        if not request.size_protected:
            standing = self.size_shares.standing(name, request.prompt_tokens, now)
            if standing is not None:
                request = replace(request, size_protected=True, size_standing=standing)
        decision = self._admitter.decide(request, views, now)
        if isinstance(decision, Admit) and self._queue.holds_back(cls.priority):
            decision = self._held_back(request, decision)
        if isinstance(decision, Queue) and decision.enforced:
            pushed = self._queue.push(request, decision, now)
            decision = pushed if isinstance(pushed, Reject) else replace(decision, entry_id=pushed.id)
            self._update_depths()
        if decision.admits:
            self._fairness.charge_dispatch(request.tenant, request.prompt_tokens)
        if decision.admits or isinstance(decision, Reject):
            self.size_shares.record(name, request.prompt_tokens, decision.admits, now)
        self._record(name, decision, queued=False)
        return decision

    def _held_back(self, request: AdmissionRequest, admit: Admit) -> Queue | Reject:
        """A request that fits now, but a long-waiting one of its priority or higher goes first."""
        cls = self._settings.class_settings(request.request_class)
        wait = self._queue.held_back_retry_s
        if cls.queue_capacity > 0 and cls.max_queue_wait_s > 0.0:
            return Queue(Blocker.HELD_BACK, wait, admit.replica, admit.forecast)
        return Reject(
            RejectReason.OVERLOADED,
            self._retry.after(wait),
            admit.forecast,
            "a request that has waited long goes first; this class does not queue",
            Blocker.HELD_BACK,
            admit.replica,
        )

    def reevaluate(self, now: float, views: Sequence[ReplicaView]) -> Reevaluation:
        """Re-run the queue against fresh views; see ``AdmissionQueue.reevaluate``. Counted."""
        result = self._queue.reevaluate(now, views)
        shares = self.size_shares
        for entry, decision in result.dispatched:
            shares.record(entry.request_class, entry.request.prompt_tokens, True, now)
            self._record(entry.request_class, decision, queued=True)
            self.stats.observe_queue_wait(entry.request_class, entry.waited_s(now))
        for entry, reject in result.rejected:
            shares.record(entry.request_class, entry.request.prompt_tokens, reject.admits, now)
            self._record(entry.request_class, reject, queued=True)
            self.stats.observe_queue_wait(entry.request_class, entry.waited_s(now))
        self._update_depths()
        return result

    def cancel(self, entry_id: int, now: float) -> QueueEntry | None:
        """Drop a queued request whose client went away; ``None`` if it already left the queue."""
        entry = self._queue.cancel(entry_id)
        if entry is not None:
            self.stats.record(entry.request_class, Outcome.CANCELLED, "client_disconnected")
            self.stats.observe_queue_wait(entry.request_class, entry.waited_s(now))
            self._update_depths()
        return entry

    def next_deadline_s(self) -> float | None:
        """When ``reevaluate`` must run at the latest to expire a queued request (admission clock)."""
        return self._queue.next_deadline_s()

    def _record(self, name: str, decision: Decision, *, queued: bool) -> None:
        stats = self.stats
        if isinstance(decision, Admit):
            stats.record(name, Outcome.DISPATCHED if queued else Outcome.ADMITTED, "ok")
        elif isinstance(decision, Queue):
            if decision.enforced:
                stats.record(name, Outcome.QUEUED, decision.blocker.value)
            else:
                outcome = Outcome.DISPATCHED if queued else Outcome.QUEUED
                stats.record(name, outcome, decision.blocker.value, enforced=False)
        else:
            outcome = Outcome.DISPATCHED if queued and not decision.enforced else Outcome.REJECTED
            stats.record(name, outcome, decision.reason.value, enforced=decision.enforced)
            if decision.enforced and decision.retry_after is not None:
                stats.observe_retry_after(decision.reason.value, decision.retry_after.delay_s)

    def _update_depths(self) -> None:
        depths = self._queue.depths()
        self.stats.queue_depth = {name: depths.get(name, 0) for name in self._settings.classes}
