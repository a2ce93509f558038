"""TTFT and TPOT for a candidate request on a replica, and what admitting it costs the others.

The engine is modelled as vLLM V1 schedules it: each step spends ``max_num_batched_tokens`` on the
running decodes first, then on FCFS prefill chunks. TTFT counts the wait for a slot and the steps
that drain the prompts ahead and this one; TPOT is the step time of the decode batch it joins;
"inflicted" is the stall its prefill adds to the running streams. All times are seconds; a
forecast is closed-form (no per-step loop). The derivation is in docs/predictor.md.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

from predictor.step_model import StepBatch, StepModel, StepParams

__all__ = [
    "CandidateRequest",
    "Forecast",
    "ForecastConfig",
    "ForecastReason",
    "ForecastValues",
    "ReplicaState",
    "RunningSeq",
    "SteadyState",
    "TrafficMix",
    "forecast_of",
    "forecast_request",
    "forecast_values",
    "prefill_share",
    "steady_state",
    "steady_weight",
]

_EULER: Final = 0.5772156649015329
#: ``ReplicaState._problem`` before the state was checked (a value no check returns).
_UNCHECKED: Final = "unchecked"


class ForecastReason(StrEnum):
    """Why a forecast is not valid. Bounded set: safe as a metric label."""

    STALE_STATE = "stale_state"  # numbers computed from stale metrics: use with care
    NO_STEP_MODEL = "no_step_model"  # nothing known about the replica's speed yet (numbers NaN)
    BAD_REQUEST = "bad_request"
    BAD_STATE = "bad_state"
    EXCEEDS_MAX_MODEL_LEN = "exceeds_max_model_len"  # the engine would answer 400
    EXCEEDS_KV_CAPACITY = "exceeds_kv_capacity"  # could never fit in the KV cache


@dataclass(frozen=True, slots=True)
class CandidateRequest:
    """The request to forecast.

    ``prompt_tokens``: prompt length (>= 1). ``max_tokens``: the output cap (>= 1).
    ``expected_output_tokens``: predicted output length (``predictor.output_length``), capped here at
    ``max_tokens``. ``output_quantile``: which quantile that prediction is, echoed in the forecast.
    ``cached_prompt_tokens``: prompt tokens expected to hit the prefix cache (not recomputed).
    """

    prompt_tokens: int
    max_tokens: int
    expected_output_tokens: float
    output_quantile: float | None = None
    cached_prompt_tokens: int = 0


@dataclass(frozen=True, slots=True)
class RunningSeq:
    """A request the engine holds, for ``ReplicaState.from_sequences``.

    ``computed_tokens``: prompt tokens already prefilled (vLLM's ``num_computed_tokens``, capped at
    the prompt); ``generated_tokens``: output so far; ``expected_output_tokens``: predicted total.
    """

    prompt_tokens: int
    computed_tokens: int
    generated_tokens: int
    expected_output_tokens: float


@dataclass(frozen=True, slots=True)
class ReplicaState:
    """One replica's load and limits, as the forecast needs them (aggregates; all counts >= 0).

    ``num_running``: requests the engine has scheduled (decoding or mid-prefill).
    ``num_waiting``: requests in the engine's waiting queue.
    ``decode_seqs``: running requests past their prefill (decoding), <= ``num_running``.
    ``kv_tokens_in_use``: tokens held in KV by running requests (decodes read about this many).
    ``queued_prefill_tokens``: prompt tokens still to prefill ahead of a newcomer (mid-prefill
    remainders plus waiting prompts). ``queued_requests``: how many requests those tokens belong to.
    ``queued_prefill_attn_pairs``: their attention pairs, sum of ``r (r/2 + done)``; ``None`` means
    estimate as ``Q^2 / (2 x queued_requests)``.
    ``mean_remaining_output_tokens``: expected remaining output per running request (0 = unknown).
    ``release_steps``: ascending expected remaining output (decode steps) of running requests;
    ``release_kv_cumulative[j]``: KV tokens freed once the first ``j + 1`` of them finish. Both empty
    means "not known": an exponential (memoryless) estimate from the mean is used instead.
    ``background_prefill_tokens_per_step``: prompt tokens later arrivals add per step (observed
    prefill tokens per step of the recent window); loads the steps of the newcomer's decode.
    ``stale``: the metrics behind this state are older than the gateway trusts.
    ``step_remaining_s``: seconds until the engine's step in progress ends (>= 0). A newcomer
    joins the next step at the earliest; the counts above describe the engine after that step.
    ``prefill_share``: the share of step time (0-1) the running decodes are expected to spend on
    other requests' prefill chunks during the newcomer's decode (``prefill_share`` from a
    window's measured inter-token latency); ``None``: unknown, then the prefill a step carries is
    modelled from ``background_prefill_tokens_per_step``. Prefill arrives in lumps (a whole
    prompt in one step, then decode-only steps), which a mean per step cannot price: the step
    cost has a knee.
    ``finish_rate_per_s``: requests the replica finished per second recently (``None``: unknown).
    A full engine admits a waiting request per finished one, so a newcomer that cannot be
    admitted at once waits for the requests ahead of it at this rate; without it, the wait is
    estimated from the running requests' expected remaining outputs.
    ``steady_step_s``: the mean step time the replica settles at under its recent arrivals
    (``steady_state``: Little's law); ``None``: unknown, no arrivals, or overloaded (no steady
    state). The TPOT forecast moves from the batch it joins toward it over its decode
    (``steady_weight``).
    ``arriving_prompt_tokens_per_s``: prompt tokens that reach the replica per second (recent
    rate; 0: unknown or none). The requests that arrive while a newcomer waits for its last
    prefill step come after it in the queue, but the engine packs their prompts into that step's
    unused token budget: the step takes longer and the newcomer's first token comes later.
    """

    num_running: int
    num_waiting: int
    decode_seqs: int
    kv_tokens_in_use: int
    kv_capacity_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    queued_prefill_tokens: int = 0
    queued_requests: int = 0
    queued_prefill_attn_pairs: float | None = None
    mean_remaining_output_tokens: float = 0.0
    release_steps: tuple[float, ...] = ()
    release_kv_cumulative: tuple[float, ...] = ()
    background_prefill_tokens_per_step: float = 0.0
    stale: bool = False
    step_remaining_s: float = 0.0
    prefill_share: float | None = None
    finish_rate_per_s: float | None = None
    steady_step_s: float | None = None
    arriving_prompt_tokens_per_s: float = 0.0
    #: What ``_check`` found wrong with this state (``None``: nothing), filled by the first
    #: forecast on it: a state is forecast many times (admission: every request against it).
    _problem: str | None = field(default=_UNCHECKED, init=False, repr=False, compare=False)

    @classmethod
    def from_sequences(
        cls,
        running: Sequence[RunningSeq],
        waiting_prompt_tokens: Sequence[int],
        *,
        kv_capacity_tokens: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        background_prefill_tokens_per_step: float = 0.0,
        stale: bool = False,
        step_remaining_s: float = 0.0,
        prefill_share: float | None = None,
        finish_rate_per_s: float | None = None,
        steady_step_s: float | None = None,
        arriving_prompt_tokens_per_s: float = 0.0,
    ) -> ReplicaState:
        """Aggregate per-request detail (running in schedule order, waiting FCFS) into a state.

        O(n log n) once per state; forecasts against the result are O(log n).
        """
        return cls.from_rows(
            [
                (s.prompt_tokens, s.computed_tokens, s.generated_tokens, s.expected_output_tokens)
                for s in running
            ],
            waiting_prompt_tokens,
            kv_capacity_tokens=kv_capacity_tokens,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            background_prefill_tokens_per_step=background_prefill_tokens_per_step,
            stale=stale,
            step_remaining_s=step_remaining_s,
            prefill_share=prefill_share,
            finish_rate_per_s=finish_rate_per_s,
            steady_step_s=steady_step_s,
            arriving_prompt_tokens_per_s=arriving_prompt_tokens_per_s,
        )

    @classmethod
    def from_rows(
        cls,
        running: Sequence[tuple[int, int, int, float]],
        waiting_prompt_tokens: Sequence[int],
        *,
        kv_capacity_tokens: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        background_prefill_tokens_per_step: float = 0.0,
        stale: bool = False,
        step_remaining_s: float = 0.0,
        prefill_share: float | None = None,
        finish_rate_per_s: float | None = None,
        steady_step_s: float | None = None,
        arriving_prompt_tokens_per_s: float = 0.0,
    ) -> ReplicaState:
        """``from_sequences`` with each running request as a plain tuple ``(prompt_tokens,
        computed_tokens, generated_tokens, expected_output_tokens)`` (``RunningSeq``'s fields):
        the same state, without building an object per request (a replica holds hundreds)."""
        decode = kv = queued = queued_reqs = 0
        pairs = 0.0
        release: list[tuple[float, int]] = []
        append = release.append
        for prompt, computed, generated, expected in running:
            done = prompt if prompt < computed else computed
            if done < prompt:
                rest = prompt - done
                queued += rest
                queued_reqs += 1
                pairs += rest * (rest / 2.0 + done)
                context = done
            else:
                decode += 1
                context = prompt + generated
            kv += context
            left = expected - generated
            append((left if left > 1.0 else 1.0, context))
        for p in waiting_prompt_tokens:
            queued += p
            queued_reqs += 1
            pairs += p * p / 2.0
        release.sort()
        steps: tuple[float, ...] = ()
        cumulative: tuple[float, ...] = ()
        mean_rest = 0.0
        if release:
            steps = tuple(r for r, _ in release)
            freed = 0.0
            freed_list: list[float] = []
            for _, context in release:
                freed += context
                freed_list.append(freed)
            cumulative = tuple(freed_list)
            mean_rest = sum(steps) / len(release)
        return cls(
            len(running),
            len(waiting_prompt_tokens),
            decode,
            kv,
            kv_capacity_tokens,
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
            queued,
            queued_reqs,
            pairs,
            mean_rest,
            steps,
            cumulative,
            background_prefill_tokens_per_step,
            stale,
            step_remaining_s,
            prefill_share,
            finish_rate_per_s,
            steady_step_s,
            arriving_prompt_tokens_per_s,
        )


@dataclass(frozen=True, slots=True)
class ForecastConfig:
    """``default_window_tokens``: the running streams' remaining output assumed when unknown, the
    window over which the inflicted TPOT is averaged."""

    default_window_tokens: float = 256.0


_DEFAULT_CONFIG: Final = ForecastConfig()


@dataclass(frozen=True, slots=True)
class Forecast:
    """Predicted latencies for one request on one replica (seconds).

    ``ttft_s``: time to first token, from now, engine side (gateway overheads excluded).
    ``tpot_s``: mean time per output token over its decode.
    ``inflicted_tpot_s``: mean extra TPOT it causes the streams already running, over their window.
    ``valid`` False: see ``reason`` (a ``ForecastReason``); numbers are NaN unless the reason is
    ``stale_state``. ``output_tokens_used``: the output length the forecast assumed.
    ``inflicted_stall_s``: total extra time its prefill adds to each running stream.
    ``admission_wait_s``: part of TTFT spent waiting for a sequence slot or KV room.
    ``prefill_steps``: engine steps until its first token (after any admission wait).
    ``step_wait_s``: part of TTFT spent waiting for the engine's step in progress to end.
    ``prefill_batch``: the mean composition of its prefill steps (what ``ttft_s - step_wait_s -
    admission_wait_s`` is the time of, ``prefill_steps`` times); ``None`` when not valid. A
    measured TTFT thus gives a step-time observation (``predictor.calibrate``).
    ``overhead_s``: part of ``ttft_s`` the caller added for the way to and from the engine (its
    transport and the replica server's own work, learned by the caller: on a busy engine, the
    step the request misses on its way in, if any); ``forecast_request`` itself always gives 0.
    ``made_at``: the caller's clock (s) when the forecast was made, if it says; ``None`` here.
    ``base_ttft_s`` / ``base_tpot_s``: the engine's TTFT and TPOT as the step model forecast them,
    before any margin or correction (NaN: not said, read ``ttft_s`` / ``tpot_s``);
    ``ttft_factor`` / ``tpot_factor``: the measured correction the caller applied to them
    (``predictor.correction``; 1: none). What the caller's correction learns against.
    """

    ttft_s: float
    tpot_s: float
    inflicted_tpot_s: float
    valid: bool
    reason: str | None
    output_tokens_used: float
    output_quantile: float | None
    inflicted_stall_s: float = 0.0
    admission_wait_s: float = 0.0
    prefill_steps: int = 0
    step_wait_s: float = 0.0
    prefill_batch: StepBatch | None = None
    overhead_s: float = 0.0
    made_at: float | None = None
    base_ttft_s: float = math.nan
    base_tpot_s: float = math.nan
    ttft_factor: float = 1.0
    tpot_factor: float = 1.0

    def with_overhead(self, ttft_s: float, overhead_s: float, made_at: float) -> Forecast:
        """This forecast with ``ttft_s``, ``overhead_s`` and ``made_at`` replaced: what
        ``dataclasses.replace`` gives, by the constructor (``replace`` walks the fields on every
        call; a caller adding its dispatch overhead does this once a request)."""
        return Forecast(
            ttft_s,
            self.tpot_s,
            self.inflicted_tpot_s,
            self.valid,
            self.reason,
            self.output_tokens_used,
            self.output_quantile,
            self.inflicted_stall_s,
            self.admission_wait_s,
            self.prefill_steps,
            self.step_wait_s,
            self.prefill_batch,
            overhead_s,
            made_at,
            self.base_ttft_s,
            self.base_tpot_s,
            self.ttft_factor,
            self.tpot_factor,
        )


#: ``Forecast``'s first twelve fields as a plain tuple, with ``prefill_batch`` as the tuple of
#: ``StepBatch``'s four fields (or ``None``): what ``forecast_values`` returns.
ForecastValues = tuple[
    float,
    float,
    float,
    bool,
    "str | None",
    float,
    "float | None",
    float,
    float,
    int,
    float,
    "tuple[float, float, float, float] | None",
]


def _invalid(request: CandidateRequest, reason: str, output: float = math.nan) -> ForecastValues:
    nan = math.nan
    return (nan, nan, nan, False, reason, output, request.output_quantile, nan, nan, 0, 0.0, None)


def forecast_of(
    values: ForecastValues, scale: float = 1.0, ttft_factor: float = 1.0, tpot_factor: float = 1.0
) -> Forecast:
    """The ``Forecast`` of ``forecast_values``' tuple, its times (TTFT, TPOT, inflicted TPOT and
    stall, admission wait) multiplied by ``scale`` (a caller's margin; 1: as forecast), its TTFT
    also by ``ttft_factor`` and its TPOT and inflicted TPOT by ``tpot_factor`` (a measured
    correction, ``predictor.correction``; 1: none). The tuple's own TTFT and TPOT are kept as
    ``base_ttft_s`` / ``base_tpot_s``."""
    (ttft, tpot, inflicted, valid, reason, output, quantile, stall, wait, steps, step_wait, batch) = values
    base_ttft, base_tpot = ttft, tpot
    if scale != 1.0 or ttft_factor != 1.0 or tpot_factor != 1.0:
        ttft, tpot, inflicted, stall, wait = (
            ttft * scale * ttft_factor,
            tpot * scale * tpot_factor,
            inflicted * scale * tpot_factor,
            stall * scale,
            wait * scale,
        )
    return Forecast(
        ttft,
        tpot,
        inflicted,
        valid,
        reason,
        output,
        quantile,
        stall,
        wait,
        steps,
        step_wait,
        None if batch is None else StepBatch(*batch),
        0.0,
        None,
        base_ttft,
        base_tpot,
        ttft_factor,
        tpot_factor,
    )


def _check(request: CandidateRequest, state: ReplicaState) -> str | None:
    """The first reason the inputs cannot be forecast (a ``ForecastReason``), or ``None``.

    The state's own checks run once per state (kept on it): a state is forecast many times.
    """
    r = request
    if r.prompt_tokens < 1 or r.max_tokens < 1 or r.cached_prompt_tokens < 0:
        return ForecastReason.BAD_REQUEST
    if not (math.isfinite(r.expected_output_tokens) and r.expected_output_tokens >= 0.0):
        return ForecastReason.BAD_REQUEST
    problem = state._problem
    if problem is _UNCHECKED:
        problem = _check_state(state)
        object.__setattr__(state, "_problem", problem)
    if problem is not None:
        return problem
    if r.prompt_tokens + r.max_tokens > state.max_model_len:
        return ForecastReason.EXCEEDS_MAX_MODEL_LEN
    return None


def _check_state(s: ReplicaState) -> ForecastReason | None:
    """The first reason ``s`` cannot be forecast on (``bad_state``), or ``None``."""
    if min(s.max_num_seqs, s.max_num_batched_tokens, s.kv_capacity_tokens, s.max_model_len) < 1:
        return ForecastReason.BAD_STATE
    counts = (s.num_running, s.num_waiting, s.decode_seqs, s.kv_tokens_in_use, s.queued_prefill_tokens)
    if min(counts) < 0 or s.queued_requests < 0 or s.decode_seqs > s.num_running:
        return ForecastReason.BAD_STATE
    if s.mean_remaining_output_tokens < 0 or s.background_prefill_tokens_per_step < 0:
        return ForecastReason.BAD_STATE
    if not s.step_remaining_s >= 0.0:
        return ForecastReason.BAD_STATE
    if s.prefill_share is not None and not 0.0 <= s.prefill_share < 1.0:
        return ForecastReason.BAD_STATE
    if s.finish_rate_per_s is not None and not (
        math.isfinite(s.finish_rate_per_s) and s.finish_rate_per_s >= 0.0
    ):
        return ForecastReason.BAD_STATE
    if len(s.release_steps) != len(s.release_kv_cumulative):
        return ForecastReason.BAD_STATE
    if s.steady_step_s is not None and not (math.isfinite(s.steady_step_s) and s.steady_step_s > 0.0):
        return ForecastReason.BAD_STATE
    if not (math.isfinite(s.arriving_prompt_tokens_per_s) and s.arriving_prompt_tokens_per_s >= 0.0):
        return ForecastReason.BAD_STATE
    return None


#: One way through the prefill: its seconds and the step shape it implies, as a plain tuple
#: (seconds, steps, last chunk, mean decodes, mean KV read, tokens per step, a full chunk's GEMM
#: time, the queue's attention pairs ahead).
_Prefill = tuple[float, int, float, float, float, float, float, float]


def _harmonic(n: float) -> float:
    """H_n, the n-th harmonic number (0 for n <= 0), to ~1e-3."""
    return math.log(n + 0.5) + _EULER if n >= 1.0 else 0.0


def _release(
    state: ReplicaState, need_slots: int, need_kv: float, default_rest: float
) -> tuple[float, float, float]:
    """(requests that must finish, decode steps until they have, KV tokens they free).

    ``default_rest``: remaining output per request assumed when the state does not say.
    """
    steps = state.release_steps
    if steps:
        cumulative = state.release_kv_cumulative
        k_kv = bisect.bisect_left(cumulative, need_kv) + 1 if need_kv > 0 else 0
        k = min(len(steps), max(need_slots, k_kv))
        if k == 0:
            return 0.0, 0.0, 0.0
        return float(k), steps[k - 1] + _later_waves(need_slots, len(steps), steps[-1]), cumulative[k - 1]
    n = state.num_running
    if n == 0:
        return 0.0, 0.0, 0.0
    mean_rest = state.mean_remaining_output_tokens or default_rest
    per_request_kv = state.kv_tokens_in_use / n
    k_kv = math.ceil(need_kv / per_request_kv) if need_kv > 0 and per_request_kv > 0 else 0
    k = min(n, max(need_slots, k_kv))
    # Memoryless remaining outputs: the k-th of n to finish does so after mean x (H_n - H_{n-k}).
    wait = mean_rest * (_harmonic(n) - _harmonic(n - k)) + _later_waves(need_slots, n, 2.0 * mean_rest)
    return float(k), wait, k * per_request_kv


def _later_waves(need_slots: int, running: int, per_wave_steps: float) -> float:
    """Decode steps for the finishes beyond the running set (0 when the running set suffices).

    A waiting queue longer than the running set needs the requests admitted after today's to
    finish too: each further ``running`` finishes take about one full output, ``per_wave_steps``
    (the longest remaining output among the running, or twice a memoryless mean remaining).
    """
    beyond = need_slots - running
    if beyond <= 0 or running <= 0:
        return 0.0
    return beyond / running * per_wave_steps


def prefill_share(model: StepModel, itl_s: float, decode_seqs: float, kv_tokens: float) -> float | None:
    """Share of step time (0-1) spent on prefill chunks, from a window's measured mean ITL.

    A decode waits one step per token; a step costs the decode batch's time (``decode_seqs``
    sequences reading ``kv_tokens`` KV tokens) plus whatever prefill rides along, so
    ``1 - decode step / ITL`` is the share the prefill took. ``None`` when the model is not
    valid or the inputs make no sense; clamped to [0, 0.95].
    """
    if not model.valid or not (math.isfinite(itl_s) and itl_s > 0.0) or min(decode_seqs, kv_tokens) < 0.0:
        return None
    decode = model.step_time(StepBatch(0.0, decode_seqs, kv_tokens, 0.0))
    return min(max(1.0 - decode / itl_s, 0.0), 0.95)


#: Most prompt sizes a ``TrafficMix`` keeps (quantiles of the sample it is built from).
_MIX_POINTS: Final = 16
#: Share of the expected prompt tokens arriving before a newcomer's last prefill step that the
#: TTFT forecast counts in that step. Arrivals are lumpy (a few requests, bursty): the mean
#: overstates the usual case, and a forecast scored by its percentage error wants the weighted
#: median, not the mean (measurements in docs/predictor.md, "Riders").
_RIDER_SHARE: Final = 0.5
#: Bisection steps of ``steady_state`` (the step time to ~1e-5 of its bracket).
_STEADY_ITERATIONS: Final = 40
#: A steady state needs prefill to leave the decodes more than this share of step time.
_MAX_STEADY_SHARE: Final = 0.95


@dataclass(frozen=True, slots=True)
class TrafficMix:
    """The requests arriving at a replica, as the gateway saw them recently.

    ``rate_per_s``: arrivals per second (>= 0). ``prompt_tokens``: prompt sizes, equally likely
    (a sample or its quantiles; ``from_requests`` keeps 16). ``decode_steps``: mean decode steps
    per request, ``E[O - 1]`` (the first token comes from its prefill step).
    ``decode_context``: mean KV context of a decoding request over its decode steps (tokens),
    ``E[(O - 1)(P + O / 2)] / E[O - 1]``.
    """

    rate_per_s: float
    prompt_tokens: tuple[float, ...]
    decode_steps: float
    decode_context: float

    @classmethod
    def from_requests(cls, rate_per_s: float, requests: Sequence[tuple[int, int]]) -> TrafficMix:
        """The mix of ``requests`` (``(prompt tokens, output tokens)`` each) arriving at ``rate_per_s``.

        O(n log n); the prompt sizes are kept as 16 quantiles (midpoints of 16 equal-count bins).
        """
        if not requests:
            return cls(rate_per_s, (), 0.0, 0.0)
        prompts = sorted(float(p) for p, _ in requests)
        n = len(prompts)
        k = min(n, _MIX_POINTS)
        points = tuple(prompts[min(n - 1, int((i + 0.5) * n / k))] for i in range(k))
        steps = weighted = 0.0
        for p, o in requests:
            d = o - 1 if o > 1 else 0
            steps += d
            weighted += d * (p + o / 2.0)
        return cls(rate_per_s, points, steps / n, weighted / steps if steps > 0 else 0.0)


@dataclass(frozen=True, slots=True)
class SteadyState:
    """Where a replica's batch settles under a ``TrafficMix`` (``steady_state``).

    ``step_s``: mean step time a decoding request sees (its mean TPOT). ``decode_seqs``: mean
    decoding requests per step. ``prefill_share``: share of time spent on prefill chunks (0-1).
    """

    step_s: float
    decode_seqs: float
    prefill_share: float


def _prefill_cost(prompt: float, n: float, budget: float, p: StepParams) -> float:
    """Seconds a ``prompt``-token prefill adds to the steps of ``n`` decodes that carry its chunks.

    Chunks of ``budget - n`` tokens ride on decode steps (their GEMM tokens past the decodes' own,
    on the two-slope line) plus the prompt's attention pairs ``P^2 / 2``.
    """
    knee, ct, cc = p.knee_tokens, p.per_token_s, p.per_compute_token_s
    room = budget - n
    if room < 1.0:
        room = 1.0
    full = math.ceil(prompt / room) - 1
    last = prompt - full * room

    def g(t: float) -> float:
        return ct * (knee if knee < t else t) + cc * (t - knee if t > knee else 0.0)

    base = g(n)
    return full * (g(n + room) - base) + g(n + last) - base + p.per_attn_pair_s * prompt * prompt / 2.0


def steady_state(
    mix: TrafficMix,
    model: StepModel,
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    kv_capacity_tokens: float,
) -> SteadyState | None:
    """The replica's steady state under ``mix``: Little's law closed over the step model.

    With arrivals at rate ``lambda`` each decoding ``E[O - 1]`` steps of mean time ``T``, the decode
    batch is ``N = lambda E[O - 1] T`` (Little's law) reading ``K = N x decode_context`` KV tokens,
    and each arrival's prefill adds ``c_N(P)`` seconds to the steps carrying its chunks
    (``budget - N`` tokens per step), so prefill takes the share ``s = lambda E[c_N(P)]`` of the
    time and ``T = d(N, K) / (1 - s)`` with ``d`` the decode-only step time (math.md §1.6: the
    same ``1 / (1 - rho)`` blow-up, here with the knee and the lumpy prefill kept). The least
    fixed point is found by bisection on ``T`` (40 steps, each O(len(mix.prompt_tokens))).

    ``None`` when the model is not valid, nothing arrives, or there is no steady state: the batch
    would outgrow ``max_num_seqs`` or the KV cache, or prefill would take nearly all the time
    (the replica is overloaded and its queue grows).
    """
    lam = mix.rate_per_s
    if not model.valid or not (math.isfinite(lam) and lam > 0.0) or not mix.prompt_tokens:
        return None
    p = model.params
    budget = float(max_num_batched_tokens)
    prompts = mix.prompt_tokens
    per_prompt = lam / len(prompts)
    occupancy = lam * mix.decode_steps  # decoding requests per second of step time
    context = mix.decode_context
    seqs_cap = float(max_num_seqs)
    if context > 0.0 and kv_capacity_tokens / context < seqs_cap:
        seqs_cap = kv_capacity_tokens / context
    knee, ct, cc = p.knee_tokens, p.per_token_s, p.per_compute_token_s

    def step(t: float) -> tuple[float, float, float] | None:
        """(F(t), N, share): the mean step time the batch of a ``t``-second step implies."""
        n = occupancy * t
        if n > seqs_cap:
            return None
        share = per_prompt * sum(_prefill_cost(x, n, budget, p) for x in prompts)
        if share >= _MAX_STEADY_SHARE:
            return None
        decode = (
            p.base_s
            + ct * (knee if knee < n else n)
            + cc * (n - knee if n > knee else 0.0)
            + (p.per_decode_seq_s + p.per_kv_token_s * context) * n
        )
        return decode / (1.0 - share), n, share

    lo = step(0.0)
    if lo is None or not lo[0] > 0.0:
        return None
    if occupancy <= 0.0:
        return SteadyState(lo[0], 0.0, lo[2])
    # F(t) - t is > 0 at t = 0; the least fixed point is where it first turns <= 0. F grows with
    # t, so an upper bracket is found by doubling from F(0) (none before the batch cap: overload).
    low, high = 0.0, lo[0]
    while True:
        at = step(high)
        if at is None:
            return None
        if at[0] <= high:
            break
        low, high = high, 2.0 * high
    found = at
    for _ in range(_STEADY_ITERATIONS):
        mid = 0.5 * (low + high)
        at = step(mid)
        if at is None:
            return None
        if at[0] > mid:
            low = mid
        else:
            high, found = mid, at
    return SteadyState(high, found[1], found[2])


def steady_weight(decode_steps: float, relax_steps: float) -> float:
    """Weight (0-1] of the batch a request joins in its mean step time over ``decode_steps``.

    The requests running when it joins leave at a rate of one per ``relax_steps`` steps each
    (memoryless), and arrivals replace them at the steady state: the batch's distance from its
    steady state decays as ``exp(-k / relax_steps)``, whose mean over ``k`` in ``[0, decode_steps]``
    is ``(1 - exp(-x)) / x`` with ``x = decode_steps / relax_steps`` (1 at ``x = 0``: a request
    with no decode step keeps the batch it joins).
    """
    if not decode_steps > 0.0 or not relax_steps > 0.0:
        return 1.0
    x = decode_steps / relax_steps
    if x < 1e-6:
        return 1.0
    return -math.expm1(-x) / x


def _prefill(
    ahead: float,
    ahead_reqs: float,
    ahead_pairs: float,
    n: float,
    kv: float,
    own: int,
    own_pairs: float,
    seqs_cap: float,
    budget: int,
    p: StepParams,
) -> _Prefill:
    """Prefill of ``ahead`` queued tokens then ``own``, at (budget - decodes) tokens per step.

    The queue's requests join the decodes as they finish, so half of them decode on average.
    (The step model's two-slope GEMM term is written out inline here and in ``forecast_request``:
    a nested function call per term costs more than the arithmetic on this per-request path.)
    """
    knee = p.knee_tokens
    n_mid = n + ahead_reqs / 2.0
    if not n_mid < seqs_cap:
        n_mid = seqs_cap
    per_step = budget - n_mid
    if not per_step > 1.0:
        per_step = 1.0
    total = ahead + own
    steps = math.ceil(total / per_step)
    last = total - (steps - 1) * per_step
    kv_mid = kv + ahead / 2.0 + n_mid * steps / 2.0
    t = per_step + n_mid
    full = p.per_token_s * (knee if knee < t else t) + p.per_compute_token_s * (t - knee if t > knee else 0.0)
    t = last + n_mid
    last_gemm = p.per_token_s * (knee if knee < t else t) + p.per_compute_token_s * (
        t - knee if t > knee else 0.0
    )
    seconds = (
        steps * (p.base_s + p.per_decode_seq_s * n_mid + p.per_kv_token_s * kv_mid)
        + (steps - 1) * full
        + last_gemm
        + p.per_attn_pair_s * (ahead_pairs + own_pairs)
    )
    return (seconds, steps, last, n_mid, kv_mid, per_step, full, ahead_pairs)


def forecast_request(
    request: CandidateRequest,
    state: ReplicaState,
    model: StepModel,
    config: ForecastConfig = _DEFAULT_CONFIG,
) -> Forecast:
    """Forecast TTFT, TPOT and the TPOT inflicted on others for ``request`` on ``state``.

    Pure and O(log n) in the running requests. Never raises on bad inputs: it returns
    ``valid=False`` with a ``ForecastReason``. ``forecast_of(forecast_values(...))``.
    """
    return forecast_of(forecast_values(request, state, model, config))


def forecast_values(
    request: CandidateRequest,
    state: ReplicaState,
    model: StepModel,
    config: ForecastConfig = _DEFAULT_CONFIG,
) -> ForecastValues:
    """``forecast_request``'s numbers as a plain tuple (``ForecastValues``, ``Forecast``'s field
    order), for a caller that forecasts one request on many replicas and keeps one forecast:
    ``forecast_of`` builds the ``Forecast`` of the one it keeps (objects cost more than the
    arithmetic here).

    Cost: a few dozen float operations and two object constructions (``bench/forecast_cost.py``
    measures it). The step model's GEMM term
    ``c_t min(t, knee) + c_c max(0, t - knee)`` is written out inline (``g(t)`` below): the same
    numbers as ``StepModel.step_time``, without a function call per term.
    """
    problem = _check(request, state)
    output = request.expected_output_tokens
    if output < 1.0:
        output = 1.0
    cap = float(request.max_tokens)
    if cap < output:
        output = cap
    if problem is not None:
        return _invalid(request, problem, output)
    if not model.valid:
        return _invalid(request, ForecastReason.NO_STEP_MODEL, output)
    prompt = request.prompt_tokens
    if prompt + output > state.kv_capacity_tokens:
        return _invalid(request, ForecastReason.EXCEEDS_KV_CAPACITY, output)
    p = model.params
    base, ct, cd, cc = p.base_s, p.per_token_s, p.per_decode_seq_s, p.per_compute_token_s
    ckv, ca, knee = p.per_kv_token_s, p.per_attn_pair_s, p.knee_tokens

    seqs_cap, budget = state.max_num_seqs, state.max_num_batched_tokens
    seqs_cap_f = float(seqs_cap)
    n0, kv0 = state.decode_seqs, state.kv_tokens_in_use
    queued, queued_reqs = state.queued_prefill_tokens, state.queued_requests
    queue_pairs = state.queued_prefill_attn_pairs
    if queue_pairs is None:
        queue_pairs = queued * queued / (2.0 * max(1, queued_reqs))
    cached = request.cached_prompt_tokens
    if cached > prompt - 1:
        cached = prompt - 1  # the last prompt token is always computed
    own = prompt - cached

    own_pairs = own * (own / 2.0 + cached)

    # 1. Engine admission: a sequence slot and KV room for everything ahead plus this prompt.
    g: float = n0
    gemm_n0 = ct * (knee if knee < g else g) + cc * (g - knee if g > knee else 0.0)
    decode_step = base + gemm_n0 + cd * n0 + ckv * kv0
    need_slots = state.num_running + state.num_waiting + 1 - seqs_cap
    need_kv = kv0 + queued + own - state.kv_capacity_tokens
    released = freed = wait_s = 0.0
    replaced = False
    rate = state.finish_rate_per_s
    full_engine = need_slots > 0 or need_kv > 0
    if full_engine and rate is not None and rate > 0.0:
        # A full engine admits one waiting request per finished one: the queue ahead is admitted
        # (and prefilled) while it waits, at the measured finish rate, and the batch stays full.
        # Unless prefilling the queue takes longer still: both bounds hold, the larger one binds.
        mean_prompt = (queued + own) / (queued_reqs + 1.0)
        waiting_out = min(queued_reqs + 1.0, max(float(need_slots), need_kv / mean_prompt))
        admitted = _prefill(0, 0, 0.0, n0, kv0, own, own_pairs, seqs_cap_f, budget, p)
        through = _prefill(queued, queued_reqs, queue_pairs, n0, kv0, own, own_pairs, seqs_cap_f, budget, p)
        if waiting_out / rate + admitted[0] >= through[0]:
            # Each request ahead replaced a finished one: the batch it joins is today's.
            wait_s, pre, replaced = waiting_out / rate, admitted, True
            queued, queued_reqs = 0, 0
        else:
            pre = through
    else:
        if full_engine:
            released, wait_steps, freed = _release(state, need_slots, need_kv, config.default_window_tokens)
            wait_s = wait_steps * decode_step
        n_pre = n0 - released
        kv_pre = kv0 - freed
        pre = _prefill(
            queued,
            queued_reqs,
            queue_pairs,
            n_pre if n_pre > 0.0 else 0.0,
            kv_pre if kv_pre > 0.0 else 0.0,
            own,
            own_pairs,
            seqs_cap_f,
            budget,
            p,
        )
    n1 = n0 - released
    if not n1 > 0.0:
        n1 = 0.0
    kv1 = kv0 - freed
    if not kv1 > 0.0:
        kv1 = 0.0
    prefill_s, steps, last, n_mid, kv_mid, per_step, full, ahead_pairs = pre
    arriving = state.arriving_prompt_tokens_per_s
    riders = 0.0
    if arriving > 0.0 and per_step > last:
        # 2. Prompts that arrive before its last prefill step starts ride in that step's unused
        # budget (FCFS after it, packed by the engine's chunked prefill): the step grows by their
        # GEMM tokens. Their number is the arrival rate times the wait, at most the room left.
        before = state.step_remaining_s + wait_s
        if steps > 1:  # the steps before its last one, attention pairs spread evenly over all
            earlier = steps - 1
            before += earlier * (base + cd * n_mid + ckv * kv_mid + full)
            before += ca * (ahead_pairs + own_pairs) * earlier / steps
        riders = _RIDER_SHARE * arriving * before if before > 0.0 else 0.0
        if riders > per_step - last:
            riders = per_step - last
        g = last + n_mid
        gemm_last = ct * (knee if knee < g else g) + cc * (g - knee if g > knee else 0.0)
        g += riders
        prefill_s += ct * (knee if knee < g else g) + cc * (g - knee if g > knee else 0.0) - gemm_last

    # 3. Decode: the batch it joins, its own context half grown, background prefill piggy-backing;
    # never more sequences or KV than the engine holds.
    # Requests finish while it waits for its first token; on a backlogged replica the ones
    # admitted after it merely replace them.
    if replaced:
        gone = 0.0
    else:
        gone = (state.finish_rate_per_s or 0.0) * (wait_s + prefill_s)
        if not gone < n1:
            gone = n1
    n_join = n1 - gone + queued_reqs + 1.0
    kv_join = kv1 * (1.0 - gone / n1 if n1 > 0.0 else 1.0) + queued + prompt + output / 2.0
    if kv_join > state.kv_capacity_tokens:
        n_join *= state.kv_capacity_tokens / kv_join
        kv_join = float(state.kv_capacity_tokens)
    if not n_join < seqs_cap_f:
        n_join = seqs_cap_f
    if not n_join > 1.0:
        n_join = 1.0
    bg = state.background_prefill_tokens_per_step
    share = state.prefill_share
    g = bg + n_join  # g(bg + n_join): the decode step's GEMM with background prefill riding along
    gemm_join = ct * (knee if knee < g else g) + cc * (g - knee if g > knee else 0.0)
    if share is not None:
        # Decode steps at the batch it joins, stretched by the measured share of prefill work.
        g = n_join
        gemm_n = ct * (knee if knee < g else g) + cc * (g - knee if g > knee else 0.0)
        decode = base + gemm_n + cd * n_join + ckv * kv_join
        tpot = decode / (1.0 - share)
    else:
        tpot = base + gemm_join + cd * n_join + ckv * kv_join
    steady = state.steady_step_s
    if steady is not None and output > 1.0:
        # Over its decode the batch it joins relaxes toward the replica's steady state
        # (``steady_weight``): the running requests leave, later arrivals take their places.
        relax = state.mean_remaining_output_tokens or config.default_window_tokens
        x = (output - 1.0) / relax
        w = -math.expm1(-x) / x if x > 1e-6 else 1.0
        tpot = w * tpot + (1.0 - w) * steady

    # 4. What it costs the streams already decoding: its chunks' extra step time, then its decode.
    stall = inflicted = 0.0
    if n_mid > 0.0:
        first = math.floor(queued / per_step)
        head = queued - first * per_step  # queue tokens sharing its first chunk's step
        own_steps = steps - first
        g = n_mid
        base_gemm = ct * (knee if knee < g else g) + cc * (g - knee if g > knee else 0.0)
        g = head + n_mid
        head_gemm = ct * (knee if knee < g else g) + cc * (g - knee if g > knee else 0.0)
        if own_steps <= 1:
            g = head + own + n_mid
            stall = ct * (knee if knee < g else g) + cc * (g - knee if g > knee else 0.0)
            stall -= head_gemm
        else:
            stall = full - head_gemm + (own_steps - 2) * (full - base_gemm)
            g = last + n_mid
            last_gemm = ct * (knee if knee < g else g) + cc * (g - knee if g > knee else 0.0)
            stall += last_gemm - base_gemm
        stall += ca * own_pairs
        g = bg + n_join - 1.0
        gemm_less = ct * (knee if knee < g else g) + cc * (g - knee if g > knee else 0.0)
        marginal = cd + ckv * (prompt + output / 2.0) + gemm_join - gemm_less
        window = state.mean_remaining_output_tokens or config.default_window_tokens
        if window < own_steps:
            window = float(own_steps)
        overlap = window - own_steps
        if not overlap > 0.0:
            overlap = 0.0
        if output < overlap:
            overlap = output
        inflicted = (stall + marginal * overlap) / window

    stale = state.stale
    step_wait = state.step_remaining_s
    return (
        step_wait + wait_s + prefill_s,
        tpot,
        inflicted,
        not stale,
        ForecastReason.STALE_STATE if stale else None,
        output,
        request.output_quantile,
        stall,
        wait_s,
        steps,
        step_wait,
        ((queued + own + riders) / steps, n_mid, kv_mid, (ahead_pairs + own_pairs) / steps),
    )
