"""What ``AdmissionEngine`` answers: typed decisions on a request and how its adapter says it ended.

``submit`` answers ``Submitted`` (admitted, queued or refused by admission), ``UnknownModel``,
``Saturated`` or the budget's ``BudgetRefused`` (``gateway.admission.budget``); a queued request
is decided later by a ``Resolution``. An adapter reports a request's end as an ``Ending``.
``labels`` names a decision for the access line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.admission.decision import Admit, Decision, Queue
from gateway.admission.retry_after import RefusalReason, RetryAfter
from gateway.admission.views import LiveEntry
from predictor import Forecast

__all__ = ["Ending", "Resolution", "Saturated", "Submitted", "UnknownModel", "labels"]


@dataclass(frozen=True, slots=True)
class UnknownModel:
    """No replica serves ``model`` (not even an unhealthy one): the client named a wrong model."""

    model: str


@dataclass(frozen=True, slots=True)
class Saturated:
    """Every replica serving ``model`` refused requests as overloaded moments ago (``placed``:
    this request itself was refused by every replica it was placed on). ``retry_after``: the
    jittered ``replicas_saturated`` delay."""

    model: str
    retry_after: RetryAfter
    placed: bool

    @property
    def reason(self) -> RefusalReason:
        return RefusalReason.REPLICAS_SATURATED

    @property
    def message(self) -> str:
        if self.placed:
            return f"the replicas serving `{self.model}` are overloaded right now"
        return f"every replica serving `{self.model}` is overloaded right now"


@dataclass(frozen=True, slots=True)
class Submitted:
    """A decision on a new request. ``key``: the engine's handle on it (``finished``, ``drop``,
    ``replica_refused``; request ids need not be unique). ``replica``/``entry``: where it was sent
    and its in-flight entry (already tracked there) when the decision admits; ``None``
    otherwise. ``queued``: it waits in the queue (a later ``Resolution`` decides it)."""

    key: int
    decision: Decision
    replica: str | None = None
    entry: LiveEntry[Any] | None = None

    @property
    def queued(self) -> bool:
        return isinstance(self.decision, Queue) and self.decision.enforced


@dataclass(frozen=True, slots=True)
class Resolution:
    """A queued request decided by a re-evaluation: dispatched to ``replica`` (``entry`` tracked
    there) or refused (``replica`` and ``entry`` ``None``). ``key``: as ``Submitted.key``."""

    key: int
    request_id: str
    decision: Decision
    replica: str | None
    entry: LiveEntry[Any] | None


@dataclass(frozen=True, slots=True)
class Ending:
    """How a request sent to a replica ended, as its adapter saw it (``AdmissionEngine.finish``).

    ``produced_tokens``: its output tokens (``None``: the tokens its entry saw streamed).
    ``prompt_tokens``: the replica's usage count (``None``: none; the estimate is charged).
    ``finished_at``: when its last token landed, adapter's seconds (``None``: unknown).
    ``ttft_s``: its measured time to first token, seconds. ``forecast``: the forecast to learn
    against (``None``: the one it was dispatched with). ``prompt_chars``/``api``: for the
    characters-per-token and per-API learning (``None``: not known). ``learn``: teach the
    prediction service (``False``: only forget, charge and settle). ``answered``: output did
    come (a token, or a complete non-streamed answer) though neither a usage count nor the
    tokens seen say how much: its budget is charged the output it reserved. ``cached_tokens``:
    the prompt tokens the replica's usage says hit its prefix cache (``None``: it did not say)."""

    produced_tokens: int | None = None
    prompt_tokens: int | None = None
    finished_at: float | None = None
    ttft_s: float | None = None
    forecast: Forecast | None = None
    prompt_chars: int | None = None
    api: str | None = None
    learn: bool = True
    answered: bool = False
    cached_tokens: int | None = None

    def relayed(self, entry: LiveEntry[Any]) -> tuple[float | None, float | None]:
        """(TTFT, TPOT) of a finished request as its adapter relayed it, seconds: dispatch to first
        token, and the mean gap per output token after the first (the last token's time from
        this ending, else the entry's; its output tokens from it, else those streamed).
        ``None`` where not measured (no token; fewer than two)."""
        first = entry.first_token_at
        if first is None:
            return None, None
        ttft = first - entry.started_at
        last = self.finished_at if self.finished_at is not None else entry.last_token_at
        tokens = self.produced_tokens if self.produced_tokens is not None else entry.tokens_streamed
        tpot = None
        if last is not None and tokens is not None and tokens >= 2 and last > first:
            tpot = (last - first) / (tokens - 1)
        return (ttft if ttft >= 0.0 else None), tpot


def labels(decision: Decision) -> tuple[str, str]:
    """(decision, reason) for an outcome record: admitted/ok, queued, shadow_rejected or
    shadow_queued with the rule's reason, rejected with the ``RejectReason``."""
    if isinstance(decision, Admit):
        return "admitted", "ok"
    if isinstance(decision, Queue):
        if decision.enforced:
            return "queued", decision.blocker.value
        return "shadow_queued", decision.blocker.value
    if decision.enforced:
        return "rejected", decision.reason.value
    return "shadow_rejected", decision.reason.value
