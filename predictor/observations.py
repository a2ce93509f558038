"""What a replica's engine steps are observed as: scrape windows and timed steps, made into rows.

``WindowStats`` is one scrape window of an engine's ``/metrics`` as rates and means;
``observation_from_window`` turns it into an ``Observation`` (mean step composition -> mean step
time, seconds) or says why it is unusable (``Reject``, a bounded set safe as a metric label).
``mean_excess_tokens`` recovers the hinge feature from the iteration histogram's buckets.
Pure arithmetic; the fit that learns from these rows is ``predictor.calibrate``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from predictor.step_model import StepBatch

__all__ = [
    "MAX_STEP_S",
    "Observation",
    "ObservationSource",
    "Reject",
    "SourceKind",
    "WindowStats",
    "mean_excess_tokens",
    "observation_from_window",
]

#: Longest plausible engine step (seconds); anything above is a broken window, not a slow step.
MAX_STEP_S: Final = 60.0


class ObservationSource(StrEnum):
    """How an observation's step time was measured."""

    STEP = "step"  # one measured step (TGI forward duration, emulator, synthetic)
    WINDOW_PERIOD = "window_period"  # window length / engine steps: the engine was busy throughout
    WINDOW_ITL = "window_itl"  # mean inter-token latency: decode steps only, robust to idle gaps


class SourceKind(StrEnum):
    """The two views of a replica's steps the fit learns from, which it weighs equally.

    Each has its own bias (a window's mean batch approximates its mixed steps; a step timed from
    outside the engine, e.g. a prefill from a request's TTFT, carries the model of the wait
    before it) and its own rate (a TTFT per finished request, a window per scrape), so its rows'
    errors are correlated: a thousand rows of one are not a thousand times the evidence of one
    row of the other, and must not drown it.
    """

    STEP = "step"  # ``ObservationSource.STEP``: one step (or one kind of step) timed
    WINDOW = "window"  # ``WINDOW_PERIOD`` and ``WINDOW_ITL``: a scrape window's mean step

    @staticmethod
    def of(source: ObservationSource) -> SourceKind:
        """The kind ``source`` is of."""
        return SourceKind.STEP if source == ObservationSource.STEP else SourceKind.WINDOW


class Reject(StrEnum):
    """Why a window or step was not usable. Bounded set: safe as a metric label."""

    NO_STEPS = "no_steps"
    NO_STEP_TIME = "no_step_time"
    NOT_FINITE = "not_finite"
    OUT_OF_RANGE = "out_of_range"


@dataclass(frozen=True, slots=True)
class WindowStats:
    """What one scrape window of a vLLM ``/metrics`` says, as rates and means over the window.

    ``at_s``: window end on the caller's monotonic clock (s). ``window_s``: its length (s, > 0).
    ``steps_per_s``: rate(``vllm:iteration_tokens_total_count``).
    ``mean_tokens_per_step``: rate(``_sum``) / rate(``_count``) of the same histogram; ``None`` if absent.
    ``mean_itl_s``: mean ``vllm:inter_token_latency_seconds`` over the window; ``None`` if no samples.
    ``running``, ``waiting``: ``num_requests_running`` / ``_waiting`` (mean of the window's scrapes).
    ``kv_tokens_in_use``: ``kv_cache_usage_perc`` x KV capacity in tokens.
    ``prompt_tokens_per_s``, ``generation_tokens_per_s``: rates of the two token counters.
    ``mean_ttft_s``: mean TTFT; carried for accuracy dashboards, not used by the step fit (it mixes
    queueing with step time).
    ``mean_prompt_tokens``: mean of ``vllm:request_prompt_tokens`` (for long-prompt attention);
    ``None`` if unknown.
    ``busy``: the caller saw the engine never idle (e.g. running > 0 at every scrape); ``waiting > 0``
    counts as busy too.
    ``tokens_per_step_buckets``: the window's increase of ``iteration_tokens_total_bucket`` as
    cumulative ``(le, count)`` pairs in ascending ``le`` (last may be ``inf``); empty if not scraped.
    ``steps_counted``: ``steps_per_s`` counts every step the engine ran (vLLM's iteration histogram),
    so that window / steps is the mean step when busy. ``False`` for an estimate that counts some
    steps only over a wall time that holds all of them (old SGLang: ``gen_throughput /
    num_running_reqs``, decode steps alone over a log interval that also ran the prefill batches);
    its period is then no step time and the ITL is used.
    """

    at_s: float
    window_s: float
    steps_per_s: float
    mean_tokens_per_step: float | None
    mean_itl_s: float | None
    running: float
    waiting: float
    kv_tokens_in_use: float
    prompt_tokens_per_s: float
    generation_tokens_per_s: float
    mean_ttft_s: float | None = None
    mean_prompt_tokens: float | None = None
    busy: bool = False
    tokens_per_step_buckets: tuple[tuple[float, float], ...] = ()
    steps_counted: bool = True


@dataclass(frozen=True, slots=True)
class Observation:
    """One (mean batch composition -> mean step time) pair, or why there is none.

    ``excess_tokens``: mean over the window's steps of ``max(0, tokens - knee)`` (the hinge feature;
    a per-step mean, which is not the hinge of the mean tokens when steps are mixed).
    """

    at_s: float
    batch: StepBatch
    excess_tokens: float
    step_s: float
    source: ObservationSource
    valid: bool = True
    reason: Reject | None = None

    @staticmethod
    def rejected(at_s: float, reason: Reject, source: ObservationSource) -> Observation:
        """An invalid observation carrying only its reason."""
        return Observation(at_s, StepBatch(), 0.0, math.nan, source, valid=False, reason=reason)


def mean_excess_tokens(
    buckets: tuple[tuple[float, float], ...], mean_tokens: float, knee_tokens: float
) -> float | None:
    """Mean of ``max(0, N - knee)`` over steps, from cumulative histogram buckets of N and its mean.

    Uses ``E[max(0, N - k)] = E[N] - E[min(N, k)]``: the exact mean carries every step above the
    knee (which all count ``k`` in the second term), so only the buckets below the knee need a
    guess about where their steps lie (uniform inside a bucket). Buckets are coarse (vLLM's go
    512, 1024, 2048...) and prompt lengths are not uniform inside them, so this is much closer than
    placing every step at its bucket's midpoint. The result is clamped to what the buckets allow
    (each step between its bucket's bounds). ``None`` when the buckets hold no count.
    """
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0.0:
        return None
    lo, prev_cum, below, low_bound, high_bound = 0.0, 0.0, 0.0, 0.0, 0.0
    for le, cum in buckets:
        count = max(0.0, cum - prev_cum)
        prev_cum = max(prev_cum, cum)
        if count > 0.0:
            below += count * _uniform_min(lo, le, knee_tokens)
            low_bound += count * max(0.0, lo - knee_tokens)
            high_bound += count * max(0.0, le - knee_tokens)
        if not math.isinf(le):
            lo = le
    estimate = mean_tokens - below / total
    return min(max(estimate, low_bound / total), high_bound / total)


def _uniform_min(lo: float, hi: float, knee: float) -> float:
    """E[min(X, knee)] for X uniform on [lo, hi] (``hi`` may be infinite: then ``knee`` if lo < knee)."""
    if lo >= knee:
        return knee
    if math.isinf(hi):
        return knee  # unbounded above: its steps are taken past the knee
    if hi <= knee or hi <= lo:
        return (lo + hi) / 2.0
    share_below = (knee - lo) / (hi - lo)
    return share_below * (lo + knee) / 2.0 + (1.0 - share_below) * knee


def observation_from_window(window: WindowStats, knee_tokens: float) -> Observation:
    """Turn one scrape window into an observation (``valid=False`` with a reason when unusable).

    Composition: decoding sequences per step = generation tokens / steps (each decode step yields
    one token per sequence); prefill tokens per step = mean tokens per step minus that (or prompt
    tokens / steps when the iteration histogram is absent); KV read = KV tokens in use; prefill
    attention pairs per step ~ prefill tokens per step x mean prompt / 2.

    Step time: the mean step period (window / steps) when the engine was busy throughout, unless
    it exceeds 1.5x the mean ITL (then it idled, and the ITL is used), or the steps were estimated
    rather than counted (``steps_counted``); else the mean ITL.
    """
    w, src = window, ObservationSource.WINDOW_ITL
    numbers = (w.steps_per_s, w.running, w.waiting, w.kv_tokens_in_use, w.generation_tokens_per_s)
    if not all(math.isfinite(x) for x in (*numbers, w.prompt_tokens_per_s, w.window_s, w.at_s)):
        return Observation.rejected(w.at_s, Reject.NOT_FINITE, src)
    if w.steps_per_s <= 0.0 or w.window_s <= 0.0:
        return Observation.rejected(w.at_s, Reject.NO_STEPS, src)
    if min(numbers) < 0.0 or w.prompt_tokens_per_s < 0.0:
        return Observation.rejected(w.at_s, Reject.OUT_OF_RANGE, src)
    decode = w.generation_tokens_per_s / w.steps_per_s
    if w.mean_tokens_per_step is not None and math.isfinite(w.mean_tokens_per_step):
        prefill = max(0.0, w.mean_tokens_per_step - decode)
    else:
        prefill = w.prompt_tokens_per_s / w.steps_per_s
    attn = prefill * w.mean_prompt_tokens / 2.0 if w.mean_prompt_tokens else 0.0
    batch = StepBatch(prefill, decode, w.kv_tokens_in_use, attn)
    excess = mean_excess_tokens(w.tokens_per_step_buckets, batch.tokens, knee_tokens)
    if excess is None:
        excess = max(0.0, batch.tokens - knee_tokens)
    itl = w.mean_itl_s if w.mean_itl_s is not None and w.mean_itl_s > 0.0 else None
    period = 1.0 / w.steps_per_s
    if w.steps_counted and (w.busy or w.waiting > 0.0) and (itl is None or period <= 1.5 * itl):
        step_s, src = period, ObservationSource.WINDOW_PERIOD
    elif itl is not None:
        step_s = itl
    else:
        return Observation.rejected(w.at_s, Reject.NO_STEP_TIME, src)
    if not math.isfinite(step_s) or step_s > MAX_STEP_S:
        return Observation.rejected(w.at_s, Reject.OUT_OF_RANGE, src)
    return Observation(w.at_s, batch, excess, step_s, src)
