"""The per-request decision: forecast on every healthy replica, route by slack, admit, queue or reject.

``SloAdmitter`` is the entry point (``policy: slo``). Each constraint's slack and the rule it
belongs to are tabled in ``gateway.admission.decision``; ``gateway.admission.slack`` computes them
(forecast x margins x correction), ``gateway.admission.refusal`` the waits and a refusal's
message, ``gateway.admission.idle`` the forecasts on idle replicas (is retrying hopeless?) and
``gateway.admission.probe`` the probe of an idle replica that keeps refusing.

Headroom of a stream = its class's TPOT target - its TPOT now (as predicted, at least the
replica's current decode step, plus what requests admitted since the view was built inflict).
The first-token deadline is arrival + TTFT target, or the client's earlier deadline, so time spent
in Sluice's queue counts. Every TTFT held against a deadline includes the replica's learned
dispatch overhead (``ReplicaView.dispatch_overhead_s``, added after the margins: all of it on an
idle engine, the steps it misses on a busy one, ``predictor.overhead``). The TTFT with its
overhead, and the TPOTs, are multiplied by the replica's measured correction for the request's
regime (``ReplicaView.correction``, ``predictor.correction``). The replica's slack is
the minimum; the request goes to the replica with
the most slack among those where it is >= 0. A long prompt that would push running streams past
their targets is therefore sent where it hurts least, or held. Slacks within ``_SLACK_TIE`` (1 %
of the binding target) of the most are comparable: of those, the replica with the fewest of the
gateway's requests wins (then the most slack, then the order listed). A difference that small is
below the forecast's own error; ranked on it alone, a replica whose step model came out a little
pessimistic got no request while the others took every one, and so never got the traffic that
would correct its fit (an emulated vLLM served 3 of 754 requests beside a TGI and an SGLang).
A replica with no step model yet is used only when no modelled one can take the request, below
``unmodelled_max_in_flight``.

A request of one output token (``max_tokens`` 1) has no TPOT: its ``tpot`` slack is infinite.

When no replica can take it now, each replica's *wait* is estimated (``retry_after``: drain times
of the failing constraints, never longer than the replica's predicted drain to idle, where the
request fits unless retrying is hopeless) and its predicted first token is ``now + wait + TTFT``.
If even the earliest of these is after the first-token deadline and the request could wait in the
queue (or its TTFT fails already) it is rejected at once (before any GPU work):
``deadline_exceeded`` when the client's deadline binds (or it was queued), else
``slo_unattainable``. Otherwise it is queued when its class queues and the wait fits its queue
deadline, else rejected ``overloaded`` (streams or shares block) or ``slo_unattainable`` (its
own TPOT target). A request marked ``size_protected`` (its prompt size is admitted below its share,
``gateway.admission.size_share``) is queued instead while only the load blocks it and its own
forecasts hold now. Retry-After is the earliest replica's drain time, jittered; ``None`` when even an
idle replica could not meet the targets (retrying cannot help). A refusal's message cites the
forecast that failed with its target, in the numbers its ``forecast`` carries (the TTFT as judged:
margins and dispatch overhead in), which the prediction headers print.

Cost: one forecast (``predictor.forecast.forecast_values``) per healthy replica (plus one per
yielded-to class for classes that yield, on replicas where the other rules hold), and O(classes)
arithmetic; the blocked path adds the wait estimates and, for a rejection, one forecast on an idle
copy of the best replica (is retrying hopeless?), memoised per request size and replica limits.
The margins are applied to the numbers the slacks need; the ``Forecast`` object is built once, for
the replica the decision names. ``bench/admission_cost.py`` times each path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Final

from gateway.admission.config import AdmissionSettings, ClassSettings, ShadowSettings
from gateway.admission.decision import (
    _LOAD_BLOCKERS,
    _SLOTS,
    _TPOT,
    _TTFT,
    Admit,
    Blocker,
    ContextExcess,
    Decision,
    Queue,
    Reject,
    RejectReason,
    _enforced_slots,
)
from gateway.admission.idle import IdleForecasts
from gateway.admission.probe import IdleProbe
from gateway.admission.refusal import (
    WaitEstimates,
    _as_judged,
    blocked_message,
    late_message,
    queue_deadline_message,
)
from gateway.admission.request import AdmissionRequest
from gateway.admission.retry_after import RetryAfterPolicy
from gateway.admission.slack import SlackRules, _Candidate
from gateway.admission.views import ReplicaView
from predictor import ForecastConfig

__all__ = ["SloAdmitter"]

_INF: Final = math.inf
#: Slacks this close to the most (a fraction of the binding target, as slacks are) are comparable
#: for routing (``_pick``): of those, the replica with the fewest gateway requests wins. 1 % of the
#: target (20 ms of the default 2 s TTFT, 1 ms of its 100 ms TPOT) is within the forecast's own
#: error (``forecast_margin`` defaults to 15 % of the forecast) while a replica is far from its
#: targets; near them, slacks differ by more and the most slack decides.
_SLACK_TIE: Final = 0.01


class SloAdmitter:
    """The SLO admitter (``policy: slo``): see the module docstring for the rules.

    ``forecast_config`` is passed through to the predictor's forecast.
    """

    def __init__(
        self,
        settings: AdmissionSettings,
        retry: RetryAfterPolicy,
        *,
        forecast_config: ForecastConfig | None = None,
        shadow_all: bool = False,
    ) -> None:
        self._settings = settings
        self._settings = settings
        self._retry = retry
        fc = forecast_config if forecast_config is not None else ForecastConfig()
        shadow = settings.shadow
        if shadow_all:
            shadow = ShadowSettings(slo=True, protect_streams=True, batch_isolation=True, prompt_size=True)
        self._shadow = shadow
        self._all = tuple(range(len(_SLOTS)))
        self._enforced = _enforced_slots(shadow)
        self._all_enforced = self._enforced == self._all
        self._slack = SlackRules(settings, fc, shadow)
        self._idle = IdleForecasts(self._slack, fc)
        self._wait = WaitEstimates(settings, self._slack, self._idle)
        self._prober = IdleProbe()

    @property
    def settings(self) -> AdmissionSettings:
        return self._settings

    # -- the decision ------------------------------------------------------------------------

    def decide(
        self, request: AdmissionRequest, views: Sequence[ReplicaView], now: float, *, queued: bool = False
    ) -> Decision:
        """Admit, queue or reject ``request`` given ``views`` at ``now`` (see ``Admitter``)."""
        s = self._settings
        name = request.request_class if request.request_class in s.classes else s.default_class
        cls = s.classes[name]
        prompt_reject = self._class_prompt_check(request, cls)
        if prompt_reject is not None and prompt_reject.enforced:
            return prompt_reject
        deadline = request.first_token_deadline_s(cls)
        candidates: list[_Candidate] = []
        fits_somewhere = False
        need_len, need_kv = request.min_model_len, request.min_kv_tokens
        evaluate = self._slack.evaluate
        for view in views:
            state = view.state
            if state.max_model_len >= need_len and state.kv_capacity_tokens >= need_kv:
                fits_somewhere = True
                if view.healthy:
                    c = evaluate(request, name, cls, view, now, deadline)
                    if c is not None:
                        candidates.append(c)
        if views and not fits_somewhere:
            return _too_large(request, max(view.state.max_model_len for view in views))
        if not candidates:
            if queued:
                return Queue(Blocker.NO_REPLICA, s.retry_after.no_replica_s, None, None)
            return Reject(
                RejectReason.NO_HEALTHY_REPLICA,
                self._retry.no_replica(),
                None,
                "no healthy replica can serve this request right now",
                Blocker.NO_REPLICA,
            )
        best_all = self._pick(candidates, request, enforced=False)
        if best_all is not None and prompt_reject is None:
            return self._admit(best_all)
        if self._all_enforced and prompt_reject is None:
            return self._prober.probe(
                candidates, now, self._blocked(request, cls, candidates, now, deadline, queued, self._all)
            )
        best_enforced = self._pick(candidates, request, enforced=True)
        if best_enforced is not None:
            full: Queue | Reject
            if prompt_reject is not None:
                full = prompt_reject
            else:
                full = self._blocked(request, cls, candidates, now, deadline, queued, self._all)
            return replace(
                full, enforced=False, replica=best_enforced.view.name, forecast=best_enforced.forecast
            )
        return self._prober.probe(
            candidates, now, self._blocked(request, cls, candidates, now, deadline, queued, self._enforced)
        )

    def _class_prompt_check(self, request: AdmissionRequest, cls: ClassSettings) -> Reject | None:
        """``prompt_too_large`` (never retryable) over the class's ``max_prompt_tokens`` (``enforced``
        False when that rule is shadowed). A prompt over every replica's context length or KV cache
        is refused in ``decide`` (always enforced: the engine would refuse it)."""
        if request.prompt_tokens <= cls.max_prompt_tokens:
            return None
        return Reject(
            RejectReason.PROMPT_TOO_LARGE,
            None,
            None,
            f"{request.prompt_tokens} prompt tokens exceed this class's limit of {cls.max_prompt_tokens}",
            Blocker.PROMPT_SIZE,
            enforced=not self._shadow.prompt_size,
        )

    def _pick(
        self, candidates: list[_Candidate], request: AdmissionRequest, *, enforced: bool
    ) -> _Candidate | None:
        """The candidate to route to among those admissible under every rule (or, with
        ``enforced``, under the enforced rules only), ranked by their score: the slack, plus
        ``prefix_cache.hit_weight`` times the share of the prompt expected to hit the replica's
        prefix cache (and as much again on the replica its session was served by last). Of those
        whose score is within ``_SLACK_TIE`` of the best, the one with the fewest of the gateway's
        requests (then the best score, then the first listed); replicas without a step model only
        when no modelled one is admissible (the one with the fewest of the gateway's requests).

        Comparable scores are balanced by the gateway's count, least-outstanding style, instead of
        ranked on differences below the forecasts' error: ranked on them, the replica whose fit is
        a little slower (its prior, or a fit from a few windows on a busy host) got nothing while
        others took every request, and without requests its fit never learned otherwise. The
        choice does not depend on the order the candidates are listed in unless they tie fully.
        Ranked by the full slack even when some rules are shadowed: routing stays the same."""
        top = -_INF
        fallback: _Candidate | None = None
        modelled: list[tuple[float, _Candidate]] = []
        prefix = self._settings.prefix_cache
        weight = prefix.hit_weight if prefix.enabled else 0.0
        per_token = weight / request.prompt_tokens
        affinity = request.affinity
        for c in candidates:
            if (c.slack_enforced if enforced else c.slack) < 0.0:
                continue
            if c.slacks is None:
                if fallback is None or c.view.gateway_streams < fallback.view.gateway_streams:
                    fallback = c
            else:
                score = c.slack
                if weight:
                    score += c.cached_tokens * per_token
                    if affinity is not None and c.view.name == affinity:
                        score += weight
                modelled.append((score, c))
                if score > top:
                    top = score
        if top == -_INF:
            return fallback
        floor = top - _SLACK_TIE
        best: _Candidate | None = None
        best_score = -_INF
        for score, c in modelled:
            if not score >= floor:
                continue
            if best is None:
                best, best_score = c, score
                continue
            streams, best_streams = c.view.gateway_streams, best.view.gateway_streams
            if streams < best_streams or (streams == best_streams and score > best_score):
                best, best_score = c, score
        return best

    def _admit(self, c: _Candidate) -> Admit:
        self._prober.admitted(c.view.name)
        return Admit(c.view.name, c.forecast, c.slack if c.slacks is not None else math.nan)

    # -- blocked: queue or reject ------------------------------------------------------------

    def _blocked(
        self,
        request: AdmissionRequest,
        cls: ClassSettings,
        candidates: list[_Candidate],
        now: float,
        deadline: float,
        queued: bool,
        slots: tuple[int, ...],
    ) -> Queue | Reject:
        """The decision when no candidate passes the constraints in ``slots``."""
        best: _Candidate | None = None
        best_first = best_wait = best_retry = _INF
        for c in candidates:
            if c.slacks is None or c.raw is None:
                continue
            wait, retry = self._wait.waits(request, cls, c, slots)
            first = now + wait + c.ttft_s
            if best is None or first < best_first:
                best, best_first, best_wait = c, first, wait
            best_retry = min(best_retry, retry)
        if best is None or best.forecast is None:
            return self._blocked_unmodelled(request, cls, candidates, now, queued)
        blocker = self._blocker(best, slots)
        forecast = best.forecast
        checks_slo = _TTFT in slots
        assert best.slacks is not None
        can_queue = queued or (cls.queue_capacity > 0 and cls.max_queue_wait_s > 0.0)
        late_now = best.slacks[_TTFT] < 0.0
        own_hold = not late_now and best.slacks[_TPOT] >= 0.0
        if request.size_protected and checks_slo and can_queue and own_hold and blocker in _LOAD_BLOCKERS:
            # A prompt size its class admits below its share (``size_share``): only the load
            # blocks it, and the wait forecast assumes the load stays; the queue holds the
            # class's others back while it waits, so it waits while its first token can still
            # come in time. Re-evaluated at least every decode step.
            retry = best.tpot_s if 0.0 < best.tpot_s < best_wait else best_wait
            return Queue(blocker, retry, best.view.name, forecast)
        # Late even after the wait: refused at once. A request that cannot wait in the queue is
        # refused anyway; it is refused for its first token only when that forecast fails now,
        # else for the constraint that does (below), so that the message, the reason and the
        # prediction headers name the forecast that failed.
        if checks_slo and best_first > deadline and (can_queue or late_now):
            reason = RejectReason.DEADLINE_EXCEEDED
            if not queued and not request.client_bound(cls):
                reason = RejectReason.SLO_UNATTAINABLE
            missed = self._idle.missed_when_idle(request, cls, best)
            if missed is None and not math.isfinite(best_retry):
                missed = blocker
            after = None if missed is not None else self._retry.after(best_retry)
            wait = best_wait if can_queue else 0.0
            first = now + wait + best.ttft_s
            return Reject(
                reason,
                after,
                _as_judged(best, now),
                late_message(request, cls, best, blocker, wait, first, deadline, missed),
                blocker,
                best.view.name,
            )
        queue_deadline = (
            request.queue_deadline_s(cls) if checks_slo else request.arrival_s + cls.max_queue_wait_s
        )
        fits_queue = now + best_wait <= queue_deadline
        if queued:
            if fits_queue:
                return Queue(blocker, best_wait, best.view.name, forecast)
            return Reject(
                RejectReason.DEADLINE_EXCEEDED,
                self._retry.after(best_retry),
                forecast,
                queue_deadline_message(blocker),
                blocker,
                best.view.name,
            )
        if cls.queue_capacity > 0 and cls.max_queue_wait_s > 0.0 and fits_queue:
            return Queue(blocker, best_wait, best.view.name, forecast)
        reason = RejectReason.OVERLOADED if blocker in _LOAD_BLOCKERS else RejectReason.SLO_UNATTAINABLE
        missed = (
            self._idle.missed_when_idle(request, cls, best)
            if reason == RejectReason.SLO_UNATTAINABLE
            else None
        )
        if missed is None and not math.isfinite(best_retry):
            missed = blocker
        return Reject(
            reason,
            None if missed is not None else self._retry.after(best_retry),
            _as_judged(best, now),
            blocked_message(cls, best, blocker, missed, request.request_class),
            blocker,
            best.view.name,
        )

    def _blocked_unmodelled(
        self,
        request: AdmissionRequest,
        cls: ClassSettings,
        candidates: list[_Candidate],
        now: float,
        queued: bool,
    ) -> Queue | Reject:
        """Only replicas without a step model, all at their in-flight cap. How long until one has
        room is unknown (no model): a class that queues waits, and its queue deadline decides."""
        guess = self._settings.retry_after.no_replica_s
        if queued or (cls.queue_capacity > 0 and cls.max_queue_wait_s > 0.0):
            return Queue(Blocker.UNMODELLED, guess, candidates[0].view.name, None)
        return Reject(
            RejectReason.OVERLOADED,
            self._retry.after(guess),
            None,
            "every replica is still being calibrated and at its in-flight limit",
            Blocker.UNMODELLED,
            candidates[0].view.name,
        )

    @staticmethod
    def _blocker(c: _Candidate, slots: tuple[int, ...]) -> Blocker:
        """The violated constraint with the least slack (among ``slots``)."""
        assert c.slacks is not None
        i = min(slots, key=c.slacks.__getitem__)
        return _SLOTS[i]


def _too_large(request: AdmissionRequest, context: int) -> Reject:
    """The refusal of a request no replica can hold: beyond the largest ``context`` (tokens), with
    the excess for OpenAI's ``context_length_exceeded``, or beyond every replica's KV cache."""
    if request.min_model_len <= context:
        message = (
            f"{_prompt_size(request)} prompt tokens (plus the output cap) exceed every replica's "
            "context length or KV cache"
        )
        return Reject(RejectReason.PROMPT_TOO_LARGE, None, None, message, Blocker.PROMPT_SIZE)
    fewest = request.fewest_prompt_tokens
    excess = ContextExcess(
        context, request.prompt_tokens if fewest is None else fewest, fewest is not None, request.max_tokens
    )
    message = (
        f"{_prompt_size(request)} prompt tokens and an output cap of {request.max_tokens or 1} exceed "
        f"every replica's context ({context} tokens at most)"
    )
    return Reject(RejectReason.PROMPT_TOO_LARGE, None, None, message, Blocker.PROMPT_SIZE, context=excess)


def _prompt_size(request: AdmissionRequest) -> str:
    """The prompt size a too-long refusal names: its count, or "at least" its fewest plausible."""
    fewest = request.fewest_prompt_tokens
    return str(request.prompt_tokens) if fewest is None else f"at least {fewest}"
