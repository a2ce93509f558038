"""Per-request arithmetic over a finished request's ``RequestOutcome``: small functions that
return numbers (seconds, ratios) or label values, and never raise on odd values.

The admission and prediction work add optional fields to outcomes (``request_class``,
``queue_wait_s``, ``predicted_ttft_s``, ...); ``number_field`` / ``text_field`` read them,
``None`` when absent, non-finite or of the wrong type. ``None`` from any function here means
"not measured": the caller records no sample, never a made-up zero.
"""

from __future__ import annotations

import math
from typing import Any, Final

from gateway.observability.metrics.labels import code_label
from gateway.observability.outcome import RequestOutcome

#: Outcome errors that mean the client left, not that Sluice or the replica failed.
_ABANDONED: Final = frozenset({"client_disconnected", "cancelled"})
_NUMBERS: Final = (int, float)


def number_field(outcome: RequestOutcome, name: str) -> float | None:
    """The outcome's field ``name`` as a finite float; ``None`` when absent or not one."""
    value: Any = getattr(outcome, name, None)
    if type(value) is float:  # the usual case first
        return value if math.isfinite(value) else None
    if isinstance(value, bool) or not isinstance(value, _NUMBERS) or not math.isfinite(value):
        return None
    return float(value)


def text_field(outcome: RequestOutcome, name: str) -> str | None:
    """The outcome's field ``name`` when it is a string; else ``None``."""
    value: Any = getattr(outcome, name, None)
    return value if isinstance(value, str) else None


def client_ttft_s(outcome: RequestOutcome) -> float | None:
    """Seconds from arrival at Sluice to the first token relayed; ``None`` without a first token."""
    if outcome.first_token_at is None:
        return None
    return outcome.first_token_at - outcome.received_at


def observed_tpot_s(outcome: RequestOutcome) -> float | None:
    """Mean seconds per output token after the first, for a stream that ended without error
    (``RequestOutcome.tpot_s``: ``None`` for non-streamed answers, errors, or fewer than two
    completion tokens)."""
    return outcome.tpot_s


def proxy_overhead_s(outcome: RequestOutcome) -> float | None:
    """Seconds spent in Sluice before the request left for its replica, queue wait excluded.

    ``None`` when it was never dispatched.
    """
    if outcome.dispatched_at is None:
        return None
    wait = number_field(outcome, "queue_wait_s") or 0.0
    return max(0.0, outcome.dispatched_at - outcome.received_at - wait)


def relative_error(predicted: float, observed: float) -> float | None:
    """(predicted - observed) / observed; ``None`` when ``observed`` is not > 0."""
    if not observed > 0:
        return None
    return (predicted - observed) / observed


def decision_of(outcome: RequestOutcome) -> tuple[str, str]:
    """(decision, reason) label values: the outcome's own, else derived from where it went."""
    decision = text_field(outcome, "decision")
    reason = text_field(outcome, "reason")
    if decision is None:
        decision = "admitted" if outcome.replica is not None else "rejected"
    if reason is None:
        reason = "ok" if decision != "rejected" else (outcome.error or "unknown")
    return code_label(decision), code_label(reason)


def slo_result(outcome: RequestOutcome) -> str | None:
    """The SLO result label of an admitted request: ``met``, ``missed_ttft``, ``missed_tpot``,
    ``missed_both`` (streamed), ``missed_e2e`` (not streamed: the whole answer against TTFT +
    TPOT per further token), ``failed`` or ``abandoned``; ``None`` = not judged (never
    dispatched, or no targets)."""
    if outcome.replica is None:  # never dispatched (refused): not judged
        return None
    ttft_target = number_field(outcome, "ttft_target_s")
    tpot_target = number_field(outcome, "tpot_target_s")
    if ttft_target is None or tpot_target is None:
        return None
    if outcome.error in _ABANDONED:
        return "abandoned"
    if outcome.error is not None or (outcome.status is not None and outcome.status >= 400):
        return "failed"
    if not outcome.stream:
        return _e2e_result(outcome, ttft_target, tpot_target)
    ttft = client_ttft_s(outcome)
    tpot = observed_tpot_s(outcome)
    ttft_ok = ttft is not None and ttft <= ttft_target
    tpot_ok = tpot is None or tpot <= tpot_target
    if ttft_ok and tpot_ok:
        return "met"
    if not ttft_ok and not tpot_ok:
        return "missed_both"
    return "missed_tpot" if ttft_ok else "missed_ttft"


def _e2e_result(outcome: RequestOutcome, ttft_target: float, tpot_target: float) -> str:
    duration = outcome.duration_s
    budget = ttft_target + tpot_target * max(0, (outcome.completion_tokens or 1) - 1)
    return "met" if duration is not None and duration <= budget else "missed_e2e"
