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

The delay sent is drawn uniformly from ``[d, d x (1 + jitter)]`` (never earlier than the forecast,
since an earlier retry would be rejected again) with ``d`` clamped to ``[min_s, max_s / (1 +
jitter)]``, so it never exceeds ``max_s`` (<= 60 s) and clients rejected together still spread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final, Protocol

from gateway.admission.config import RetryAfterSettings
from predictor import ReplicaState, StepModel

__all__ = ["RetryAfter", "RetryAfterPolicy", "UniformSource", "decode_drain_s", "ttft_excess_s"]

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
    ``base_s``: the drain time predicted from the forecast, before clamping and jitter.
    """

    delay_s: float
    seconds: int
    milliseconds: int
    base_s: float

    def headers(self) -> dict[str, str]:
        """``{"Retry-After": ..., "retry-after-ms": ...}``."""
        return {"Retry-After": str(self.seconds), "retry-after-ms": str(self.milliseconds)}


class RetryAfterPolicy:
    """Turns predicted drain times into jittered ``RetryAfter`` values (one seeded source)."""

    def __init__(self, settings: RetryAfterSettings, rng: UniformSource) -> None:
        self._settings = settings
        self._rng = rng

    @property
    def settings(self) -> RetryAfterSettings:
        return self._settings

    def after(self, base_s: float) -> RetryAfter:
        """A ``RetryAfter`` for a predicted drain of ``base_s`` seconds (``inf``/NaN: the cap)."""
        s = self._settings
        spread = 1.0 + s.jitter_fraction
        low = s.max_s / spread
        d = low if not math.isfinite(base_s) else min(max(base_s, s.min_s), low)
        delay = min(s.max_s, max(s.min_s, d * (1.0 + s.jitter_fraction * float(self._rng.random()))))
        return RetryAfter(
            delay_s=delay,
            seconds=max(1, math.ceil(delay)),
            milliseconds=max(1, math.ceil(delay * 1000.0)),
            base_s=base_s,
        )

    def no_replica(self) -> RetryAfter:
        """The delay suggested when no replica is healthy (``no_replica_s``, jittered)."""
        return self.after(self._settings.no_replica_s)


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
    rest = state.mean_remaining_output_tokens or DEFAULT_REMAINING_TOKENS
    return rest * (_harmonic(n) - _harmonic(n - leave)) * step_s
