"""An admission decision's value types: admit, queue or reject, why, and the constraint table.

A ``Decision`` is ``Admit`` (send to a replica now), ``Queue`` (hold in Sluice's queue) or
``Reject`` (refuse, with a ``RejectReason`` and a Retry-After; ``None`` means retrying cannot
help). ``Blocker`` names the constraint that kept a request off its best replica; the slots below
index a candidate's slack vector (``gateway.admission.slack``), and ``Rule`` groups them for
shadow mode. Slacks are fractions of their limit (negative = violated).

For a request of class C on replica r (predictions multiplied by ``1 + forecast_margin``, and by
``1 + stale_margin`` as well when r's metrics are stale), each constraint has a **slack**, its
spare capacity as a fraction of its limit (negative = violated). Where the attainment controller
holds a margin of its own for a class on r (``ReplicaView.margins``), that margin replaces
``forecast_margin`` on the class's own TTFT and TPOT, and on what a newcomer inflicts on the
class's running streams there, unless nothing of the gateway's runs on r and nothing waits there
(a margin learned under load does not outlive it); the probes of yielded-to classes and the
hopeless check keep ``forecast_margin``.

=============== ================================================================ ===============
blocker          slack                                                            rule
=============== ================================================================ ===============
ttft             (first-token deadline - now - TTFT) / C.ttft_target              slo
tpot             (C.tpot_target - TPOT) / C.tpot_target; for a class C with      slo
                 stall_budget_horizon, min(TPOT, the decode step with the
                 newcomer seated): later prefill is held to its stall budget
streams_tpot     min over classes k streaming on r of                             protect_streams
                 (min headroom_k - inflicted TPOT) / k.tpot_target
streams_stall    min over classes k with max_stall of (max_stall - stall) / max  protect_streams
                 and, for classes k with stall_budget_horizon (instead of
                 streams_tpot for them), 1 - (queued prefill's pause + stall) /
                 k's smallest stall budget (ClassLoad.min_stall_budget_s)
kv_share         (C.kv_share x KV capacity - class KV - own KV) / limit           batch_isolation
slot_share       (C.slot_share x decode slots - class seqs - 1) / limit           batch_isolation
yield_ttft/tpot  for each class P in C.yields_to, a typical P request queued       batch_isolation
                 behind this one: ((1 - yield_margin) x P.target - probe) / target
=============== ================================================================ ===============
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Final, Protocol

from gateway.admission.config import ShadowSettings
from gateway.admission.request import AdmissionRequest
from gateway.admission.retry_after import RetryAfter
from gateway.admission.views import ReplicaView
from predictor import Forecast

__all__ = [
    "Admit",
    "Admitter",
    "Blocker",
    "ContextExcess",
    "Decision",
    "Queue",
    "Reject",
    "RejectReason",
    "Rule",
]


class RejectReason(StrEnum):
    """Why a request is refused; the OpenAI error ``code``. Bounded: safe as a metric label."""

    OVERLOADED = "overloaded"
    SLO_UNATTAINABLE = "slo_unattainable"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    PROMPT_TOO_LARGE = "prompt_too_large"
    NO_HEALTHY_REPLICA = "no_healthy_replica"


class Blocker(StrEnum):
    """The constraint that kept a request off its best replica. Bounded: safe as a metric label."""

    TTFT = "ttft"
    TPOT = "tpot"
    STREAMS_TPOT = "streams_tpot"
    STREAMS_STALL = "streams_stall"
    KV_SHARE = "kv_share"
    SLOT_SHARE = "slot_share"
    YIELD_TTFT = "yield_ttft"
    YIELD_TPOT = "yield_tpot"
    UNMODELLED = "unmodelled"  # no step model yet, and its in-flight cap is reached
    NO_REPLICA = "no_replica"
    PROMPT_SIZE = "prompt_size"
    QUEUE_FULL = "queue_full"
    HELD_BACK = "held_back"  # a long-waiting queued request of its priority goes first
    CONCURRENCY = "concurrency"  # policy concurrency_cap: every replica holds max_in_flight
    SATURATED = "saturated"  # policy saturation: every replica's queue or KV use is over its threshold


class Rule(StrEnum):
    """Rules that can run in shadow mode (``admission.shadow``)."""

    SLO = "slo"
    PROTECT_STREAMS = "protect_streams"
    BATCH_ISOLATION = "batch_isolation"
    PROMPT_SIZE = "prompt_size"


#: Constraint slots of a candidate's slack vector, in this order.
_SLOTS: Final = (
    Blocker.TTFT,
    Blocker.TPOT,
    Blocker.STREAMS_TPOT,
    Blocker.STREAMS_STALL,
    Blocker.KV_SHARE,
    Blocker.SLOT_SHARE,
    Blocker.YIELD_TTFT,
    Blocker.YIELD_TPOT,
)
_TTFT, _TPOT, _STREAMS, _STALL, _KV, _SLOT, _YTTFT, _YTPOT = range(8)
_RULE_SLOTS: Final = {
    Rule.SLO: (_TTFT, _TPOT),
    Rule.PROTECT_STREAMS: (_STREAMS, _STALL),
    Rule.BATCH_ISOLATION: (_KV, _SLOT, _YTTFT, _YTPOT),
}
#: Blockers that are the load's fault (others' streams, shares), not the request's own targets.
_LOAD_BLOCKERS: Final = frozenset(
    {Blocker.STREAMS_TPOT, Blocker.STREAMS_STALL, Blocker.KV_SHARE, Blocker.SLOT_SHARE}
    | {Blocker.YIELD_TTFT, Blocker.YIELD_TPOT, Blocker.UNMODELLED, Blocker.QUEUE_FULL, Blocker.HELD_BACK}
    | {Blocker.CONCURRENCY, Blocker.SATURATED}
)


@dataclass(frozen=True, slots=True)
class Admit:
    """Send the request to ``replica`` now.

    ``forecast``: the prediction there, stale margin applied (for the prediction headers).
    ``slack``: the replica's slack, >= 0 (NaN on a replica with no step model yet; < 0 for a
    probe of an idle replica, ``gateway.admission.probe``).
    """

    replica: str
    forecast: Forecast | None
    slack: float
    enforced: bool = True

    @property
    def admits(self) -> bool:
        """The caller sends the request to ``replica`` now."""
        return True


@dataclass(frozen=True, slots=True)
class Queue:
    """Hold the request in Sluice's queue: no replica can take it now, but one should in time.

    ``blocker``: what keeps it off its best replica. ``earliest_retry_s``: predicted seconds until
    a replica could take it (worth scheduling a re-evaluation then). ``replica``/``forecast``: its
    best replica now. ``entry_id``: its queue entry, set by the controller once queued.
    ``enforced`` False (shadow mode): admit it to ``replica`` anyway.
    """

    blocker: Blocker
    earliest_retry_s: float
    replica: str | None
    forecast: Forecast | None
    enforced: bool = True
    entry_id: int | None = None

    @property
    def reason(self) -> Blocker:
        """Why it waits (same as ``blocker``)."""
        return self.blocker

    @property
    def admits(self) -> bool:
        """The caller sends the request to ``replica`` now (shadow mode)."""
        return not self.enforced and self.replica is not None


@dataclass(frozen=True, slots=True)
class ContextExcess:
    """A request no replica's context can hold: ``context_tokens``, the largest ``max_model_len``
    of the replicas judged; ``prompt_tokens``, its prompt (counted, or its fewest plausible tokens
    when ``at_least``); ``max_tokens``, its output cap (``None``: it asked for none, so one token
    at least). ``prompt_over``: the prompt alone leaves no room for one output token."""

    context_tokens: int
    prompt_tokens: int
    at_least: bool
    max_tokens: int | None

    @property
    def prompt_over(self) -> bool:
        return self.prompt_tokens >= self.context_tokens


@dataclass(frozen=True, slots=True)
class Reject:
    """Refuse the request.

    ``retry_after``: when to come back; ``None`` means retrying cannot help (prompt too large,
    targets unattainable even on an idle replica). ``message``: one line for the client and the log.
    ``forecast``: the prediction on the best replica, if any. ``enforced`` False (shadow mode):
    admit it to ``replica`` anyway. ``context``: set when the prompt and output cap exceed every
    replica's context (a ``prompt_too_large`` answered as OpenAI's ``context_length_exceeded``).
    """

    reason: RejectReason
    retry_after: RetryAfter | None
    forecast: Forecast | None
    message: str
    blocker: Blocker | None = None
    replica: str | None = None
    enforced: bool = True
    context: ContextExcess | None = None

    @property
    def admits(self) -> bool:
        """The caller sends the request to ``replica`` now (shadow mode)."""
        return not self.enforced and self.replica is not None

    @property
    def retry_after_s(self) -> float | None:
        """The jittered delay in seconds, ``None`` when not retryable."""
        return None if self.retry_after is None else self.retry_after.delay_s


Decision = Admit | Queue | Reject


class Admitter(Protocol):
    """Decides one request against the current replica views. Pure: ``now`` is the only clock."""

    def decide(
        self, request: AdmissionRequest, views: Sequence[ReplicaView], now: float, *, queued: bool = False
    ) -> Decision:
        """``queued``: the request is already in Sluice's queue (being re-evaluated): it then gets
        ``Queue`` to stay, ``Admit`` to go, or ``Reject`` with ``deadline_exceeded``."""
        ...


def _enforced_slots(shadow: ShadowSettings) -> tuple[int, ...]:
    skipped = {Rule.SLO: shadow.slo, Rule.PROTECT_STREAMS: shadow.protect_streams}
    skipped[Rule.BATCH_ISOLATION] = shadow.batch_isolation
    return tuple(i for rule, slots in _RULE_SLOTS.items() if not skipped[rule] for i in slots)
