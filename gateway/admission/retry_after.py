"""Retry-After from the forecast: when the backlog will have drained enough, spread with jitter.

The base delay is a drain time the admitter derives per blocking constraint on the replica that
would free up first:

* **TTFT**: the prefill path is a FCFS server that works through its backlog in real time, so a
  request predicted ``e`` seconds over its TTFT budget fits again after about ``e`` seconds
  (math.md §8, Little's law sizing): ``ttft_excess_s``.
* **TPOT**: the decode batch must shrink until one step meets the target; with memoryless remaining
  outputs the k-th of n decodes finishes after ``mean_rest x (H_n - H_{n-k})`` steps:
  ``decode_drain_s``.
* **Streams, shares**: until the blocking streams finish (``shares.ClassLoad`` waits).

``retry_after(reason, wait_s, ...)`` is the ONE function that turns a wait into the delay a client
is told, for every refusal (``RefusalReason``):

* **jittered** reasons (admission's ``overloaded``, ``slo_unattainable``, ``deadline_exceeded``,
  ``no_healthy_replica``, ``replicas_saturated``: every replica refused as overloaded; and a
  tenant's budget, ``rate_limit_exceeded``) are drawn uniformly from ``[d, d x (1 + jitter)]``
  (never earlier than the wait, since an earlier retry would be refused again) with ``d`` clamped
  to ``[min_s, max_s / (1 + jitter)]``, so it never exceeds ``max_s`` (<= 60 s) and clients
  refused together spread. A budget's wait is when it really frees (``budget.budget_retry_after``:
  a bucket's refill to this request's cost, the predicted end of the tenant's earliest running
  request for a concurrency slot); without the spread every client of a tenant refused in the
  same instant would come back in the same instant and be refused together again;
* **exact** reasons (the budget store's next probe; a gateway shutting down) are not: the delay
  is the wait itself, at most 60 s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Final, Protocol

from gateway.admission.config import RETRY_AFTER_CAP_S, RetryAfterSettings
from predictor import ReplicaState, StepModel

__all__ = [
    "UNMEASURED_WAIT_S",
    "RefusalReason",
    "RetryAfter",
    "RetryAfterPolicy",
    "UniformSource",
    "decode_drain_s",
    "retry_after",
    "ttft_excess_s",
]


class RefusalReason(StrEnum):
    """Why Sluice refused a request, every refusal it answers. Bounded: safe as a metric label.

    The values are the OpenAI error ``code`` sent (``replicas_saturated`` is sent as code
    ``overloaded``; it is the ``x-sluice-admission-reason``). ``gateway.http.errors`` maps each to its
    status, type and headers; ``retry_after`` to its delay.
    """

    #: The tenant's token, request or concurrency budget is spent (429).
    RATE_LIMITED = "rate_limit_exceeded"
    #: The shared budget store is down and the limiter fails closed (503).
    LIMITER_UNAVAILABLE = "rate_limit_unavailable"
    #: Admission: the replicas' load blocks it (429).
    OVERLOADED = "overloaded"
    #: Admission: its targets are out of reach on every replica (429).
    SLO_UNATTAINABLE = "slo_unattainable"
    #: Admission: its deadline passed, or will, before a replica could start it (429).
    DEADLINE_EXCEEDED = "deadline_exceeded"
    #: The prompt exceeds its class's limit or every replica's context (400, never retryable).
    PROMPT_TOO_LARGE = "prompt_too_large"
    #: No healthy replica serves the model (503).
    NO_HEALTHY_REPLICA = "no_healthy_replica"
    #: Every replica that could serve it refused as overloaded moments ago (their own 429/503).
    REPLICAS_SATURATED = "replicas_saturated"
    #: The gateway is draining or its shutdown grace ran out (503).
    SHUTTING_DOWN = "server_shutting_down"


#: Reasons whose wait is exact (no jitter): the budget store's next probe, a shutdown. Every other
#: reason is jittered.
EXACT_REASONS: Final = frozenset({RefusalReason.LIMITER_UNAVAILABLE, RefusalReason.SHUTTING_DOWN})
#: The wait used where nothing measured one, seconds: a concurrency slot before any request of
#: the gateway has ended (``budget.SlotClock``), a replica's overload refusal without a
#: Retry-After, a gateway shutting down.
UNMEASURED_WAIT_S: Final = 1.0
_DEFAULT_SETTINGS: Final = RetryAfterSettings()

_EULER: Final = 0.5772156649015329
#: Remaining output per running request assumed when the state does not say (tokens); the
#: predictor's default window.
DEFAULT_REMAINING_TOKENS: Final = 256.0


class UniformSource(Protocol):
    """A seeded source of uniform floats in [0, 1): ``random.Random`` or ``numpy.random.Generator``."""

    def random(self) -> float: ...


@dataclass(frozen=True, slots=True)
class RetryAfter:
    """When a rejected client should come back.

    ``delay_s``: the jittered delay, seconds, in ``[min_s, max_s]``. ``seconds``: the ``Retry-After``
    value (RFC 9110 delay-seconds: ``ceil(delay_s)``, >= 1). ``milliseconds``: the
    ``retry-after-ms`` value (``ceil(delay_s x 1000)``, >= 1), which the ``openai`` SDKs prefer.
    ``base_s``: the wait it was computed from (``retry_after``'s ``wait_s``), before clamping and
    jitter. Its headers are ``gateway.http.errors``'s to write.
    """

    delay_s: float
    seconds: int
    milliseconds: int
    base_s: float


class RetryAfterPolicy:
    """Admission's Retry-After: ``retry_after`` for a load-driven refusal with one seeded source."""

    def __init__(self, settings: RetryAfterSettings, rng: UniformSource) -> None:
        self._settings = settings
        self._rng = rng

    @property
    def settings(self) -> RetryAfterSettings:
        return self._settings

    def after(self, base_s: float) -> RetryAfter:
        """A ``RetryAfter`` for a predicted drain of ``base_s`` seconds (``inf``/NaN: the cap)."""
        return retry_after(RefusalReason.OVERLOADED, base_s, self._settings, self._rng)

    def no_replica(self) -> RetryAfter:
        """The delay suggested when no replica is healthy (``no_replica_s``, jittered)."""
        return retry_after(
            RefusalReason.NO_HEALTHY_REPLICA, self._settings.no_replica_s, self._settings, self._rng
        )


def retry_after(
    reason: RefusalReason,
    wait_s: float,
    settings: RetryAfterSettings = _DEFAULT_SETTINGS,
    rng: UniformSource | None = None,
) -> RetryAfter:
    """When a client refused for ``reason`` should come back, ``wait_s`` seconds being the wait
    that was predicted or measured: the forecast's drain time, a replica's own ``Retry-After``,
    a budget's refill or free slot, ``UNMEASURED_WAIT_S`` when nothing measured it (``inf``/NaN:
    unknown, the cap).

    Every reason but ``EXACT_REASONS``: jittered in ``[d, d x (1 + settings.jitter_fraction)]``,
    ``d`` the wait clamped to ``[settings.min_s, settings.max_s / (1 + jitter)]``; one draw from
    ``rng`` (required: ``ValueError`` without one). ``EXACT_REASONS``: the wait itself (>= 0), at
    most 60 s, no draw (``settings`` and ``rng`` unused). Either way ``seconds`` is in 1..60 and
    ``milliseconds`` in 1..60,000.
    """
    if reason in EXACT_REASONS:
        delay = min(max(wait_s, 0.0), RETRY_AFTER_CAP_S) if not math.isnan(wait_s) else RETRY_AFTER_CAP_S
    else:
        if rng is None:
            raise ValueError(f"a jittered Retry-After ({reason.value}) needs a uniform source")
        spread = 1.0 + settings.jitter_fraction
        low = settings.max_s / spread
        d = low if not math.isfinite(wait_s) else min(max(wait_s, settings.min_s), low)
        drawn = d * (1.0 + settings.jitter_fraction * float(rng.random()))
        delay = min(settings.max_s, max(settings.min_s, drawn))
    return RetryAfter(
        delay_s=delay,
        seconds=max(1, math.ceil(delay)),
        milliseconds=max(1, math.ceil(delay * 1000.0)),
        base_s=wait_s,
    )


def ttft_excess_s(predicted_ttft_s: float, budget_s: float) -> float:
    """Seconds the prefill backlog must drain before a request predicted at ``predicted_ttft_s``
    fits a TTFT budget of ``budget_s`` (0 when it already fits)."""
    return max(0.0, predicted_ttft_s - budget_s)


def _harmonic(n: float) -> float:
    return math.log(n + 0.5) + _EULER if n >= 1.0 else 0.0


def decode_drain_s(state: ReplicaState, model: StepModel, excess_s: float, step_s: float) -> float:
    """Seconds until enough decodes finish that a step is ``excess_s`` seconds shorter.

    ``step_s``: the current decode step time (seconds per step). Each decode that leaves saves
    its marginal step cost (per-sequence cost + its mean KV read + its GEMM token). ``inf`` when
    even an empty batch would not be fast enough.
    """
    if excess_s <= 0.0:
        return 0.0
    p = model.params
    n = state.decode_seqs + state.queued_requests + 1
    context = state.kv_tokens_in_use / state.decode_seqs if state.decode_seqs else 0.0
    slope = p.per_compute_token_s if n > p.knee_tokens else p.per_token_s
    marginal = p.per_decode_seq_s + p.per_kv_token_s * context + slope
    if marginal <= 0.0:
        return math.inf
    leave = math.ceil(excess_s / marginal)
    if leave >= n:
        return math.inf
    return remaining_tokens(state) * (_harmonic(n) - _harmonic(n - leave)) * step_s


def remaining_tokens(state: ReplicaState, typical_tokens: float = 0.0) -> float:
    """Output tokens a running request on ``state``'s replica has left, as a drain estimate takes
    it: the state's mean, or where the state does not say (requests the gateway does not know one
    by one) ``typical_tokens``, or where that is 0 ``DEFAULT_REMAINING_TOKENS``."""
    return state.mean_remaining_output_tokens or typical_tokens or DEFAULT_REMAINING_TOKENS
