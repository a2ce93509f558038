"""TTFT and TPOT for a candidate request on a replica, and what admitting it costs the others.

The engine is modelled as vLLM V1 schedules it: each step spends ``max_num_batched_tokens`` on the
running decodes first, then on FCFS prefill chunks. TTFT counts the wait for a slot and the steps
that drain the prompts ahead and this one; TPOT is the step time of the decode batch it joins;
"inflicted" is the stall its prefill adds to the running streams. All times are seconds; a
forecast is closed-form (no per-step loop). The derivation is in docs/predictor.md. Its inputs
(the request, the replica's state) are in ``predictor.forecast_inputs``, the steady state it may
blend TPOT toward in ``predictor.steady``.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Final

from predictor.forecast_inputs import CandidateRequest, ForecastReason, ReplicaState, problem_of
from predictor.step_model import StepBatch, StepModel, StepParams

__all__ = [
    "Forecast",
    "ForecastConfig",
    "ForecastValues",
    "forecast_of",
    "forecast_request",
    "forecast_values",
    "prefill_share",
]

_EULER: Final = 0.5772156649015329


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
    ``overhead_s``: what the caller added for the way to and from the engine (its transport and
    the replica server's own work, learned by the caller: on a busy engine, the step the request
    misses on its way in, if any), before its correction: ``ttft_s`` holds it times
    ``ttft_factor``. ``forecast_request`` itself always gives 0.
    ``made_at``: the caller's clock (s) when the forecast was made, if it says; ``None`` here.
    ``base_ttft_s`` / ``base_tpot_s``: the engine's TTFT and TPOT as the step model forecast them,
    before any margin or correction (NaN: not said, read ``ttft_s`` / ``tpot_s``);
    ``ttft_factor`` / ``tpot_factor``: the measured correction the caller applied to them
    (``predictor.correction``; 1: none). What the caller's correction learns against.
    ``ttft_spread``: the spread the caller judged the TTFT at on top, an upper quantile of what
    it measured (``Correction.ttft_upper``; 1: none): admission held ``ttft_s`` times it against
    the deadline. ``ttft_s`` itself stays the median forecast (what headers, metrics and the
    correction compare with the measured TTFT).
    ``cached_prompt_tokens``: the prompt tokens it assumed hit the replica's prefix cache.
    ``slot_waves``: the requests that must leave the engine before it has a slot (or KV room),
    in engine-fulls (``max_num_seqs``); 0 when one is free. What the correction's TTFT regime is
    keyed by (``predictor.correction``): a queue deeper than the slots is where the error grows.
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
    cached_prompt_tokens: int = 0
    slot_waves: float = 0.0
    ttft_spread: float = 1.0

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
            self.cached_prompt_tokens,
            self.slot_waves,
            self.ttft_spread,
        )


#: ``Forecast``'s first twelve fields as a plain tuple, with ``prefill_batch`` as the tuple of
#: ``StepBatch``'s four fields (or ``None``), then ``slot_waves``: what ``forecast_values`` returns.
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
    float,
]


def _invalid(request: CandidateRequest, reason: str, output: float = math.nan) -> ForecastValues:
    nan = math.nan
    return (nan, nan, nan, False, reason, output, request.output_quantile, nan, nan, 0, 0.0, None, 0.0)


def forecast_of(
    values: ForecastValues,
    scale: float = 1.0,
    ttft_factor: float = 1.0,
    tpot_factor: float = 1.0,
    cached_prompt_tokens: int = 0,
    ttft_spread: float = 1.0,
) -> Forecast:
    """The ``Forecast`` of ``forecast_values``' tuple, its times (TTFT, TPOT, inflicted TPOT and
    stall, admission wait) multiplied by ``scale`` (a caller's margin; 1: as forecast), its TTFT
    also by ``ttft_factor`` and its TPOT and inflicted TPOT by ``tpot_factor`` (a measured
    correction, ``predictor.correction``; 1: none). ``ttft_spread`` (the correction's spread,
    ``Correction.ttft_upper``; 1: none) is recorded, not applied. The tuple's own
    TTFT and TPOT are kept as ``base_ttft_s`` / ``base_tpot_s``. ``cached_prompt_tokens``: the
    prefix-cache hit the forecast assumed (``CandidateRequest.cached_prompt_tokens``), echoed."""
    (ttft, tpot, inflicted, valid, reason, output, quantile, stall, wait, steps, step_wait, batch, waves) = (
        values
    )
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
        cached_prompt_tokens,
        waves,
        ttft_spread,
    )


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


#: Share of the expected prompt tokens arriving before a newcomer's last prefill step that the
#: TTFT forecast counts in that step. Arrivals are lumpy (a few requests, bursty): the mean
#: overstates the usual case, and a forecast scored by its percentage error wants the weighted
#: median, not the mean (measurements in docs/predictor.md, "Riders").
_RIDER_SHARE: Final = 0.5


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
    cached = max(0, min(request.cached_prompt_tokens, request.prompt_tokens - 1))
    return forecast_of(forecast_values(request, state, model, config), cached_prompt_tokens=cached)


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
    problem = problem_of(request, state)
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
    seqs = request.sequences
    if prompt + output * seqs > state.kv_capacity_tokens:
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
    need_slots = state.num_running + state.num_waiting + seqs - seqs_cap
    need_kv = kv0 + queued + own - state.kv_capacity_tokens
    released = freed = wait_s = waves = 0.0
    replaced = False
    rate = state.finish_rate_per_s
    full_engine = need_slots > 0 or need_kv > 0
    if full_engine:
        # The recent rate counts the time the engine was not full; full, it frees slots at its
        # capacity (``ReplicaState.full_finish_rate_per_s``).
        capacity = state.full_finish_rate_per_s
        if capacity is not None and (rate is None or capacity > rate):
            rate = capacity
    slot_wait = 0.0
    exact = state.slot_steps
    if need_slots > 0 and exact:
        # Every output ahead is known exactly: the schedule says when its slot frees, in steps
        # at today's inter-token latency (the decode step, stretched by the prefill riding along).
        share = state.prefill_share
        itl = decode_step / (1.0 - share) if share is not None else decode_step
        slot_wait = exact[(seqs if seqs < len(exact) else len(exact)) - 1] * itl
    if full_engine and rate is not None and rate > 0.0:
        # A full engine admits one waiting request per finished one: the queue ahead is admitted
        # (and prefilled) while it waits, at the measured finish rate, and the batch stays full.
        # Unless prefilling the queue takes longer still: both bounds hold, the larger one binds.
        mean_prompt = (queued + own) / (queued_reqs + 1.0)
        waiting_out = min(queued_reqs + 1.0, max(float(need_slots), need_kv / mean_prompt))
        waves = waiting_out / seqs_cap_f
        admitted = _prefill(0, 0, 0.0, n0, kv0, own, own_pairs, seqs_cap_f, budget, p)
        through = _prefill(queued, queued_reqs, queue_pairs, n0, kv0, own, own_pairs, seqs_cap_f, budget, p)
        # The rate is the recent past's: when the outputs ahead are known, never sooner than
        # their schedule (a mix of longer outputs frees slots slower than the rate says).
        by_rate = waiting_out / rate
        if slot_wait > by_rate:
            by_rate = slot_wait
        if by_rate + admitted[0] >= through[0]:
            # Each request ahead replaced a finished one: the batch it joins is today's.
            wait_s, pre, replaced = by_rate, admitted, True
            queued, queued_reqs = 0, 0
        else:
            pre = through
    else:
        if full_engine:
            released, wait_steps, freed = _release(state, need_slots, need_kv, config.default_window_tokens)
            # The schedule, when known, beats expected outputs (it knows the queue's too).
            wait_s = slot_wait if slot_wait > 0.0 else wait_steps * decode_step
            waves = max(float(need_slots), released) / seqs_cap_f
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
    n_join = n1 - gone + queued_reqs + seqs
    kv_join = kv1 * (1.0 - gone / n1 if n1 > 0.0 else 1.0) + queued + prompt + seqs * output / 2.0
    if kv_join > state.kv_capacity_tokens:
        n_join *= state.kv_capacity_tokens / kv_join
        kv_join = float(state.kv_capacity_tokens)
    if not n_join < seqs_cap_f:
        n_join = seqs_cap_f
    least = seqs if seqs < seqs_cap_f else seqs_cap_f
    if not n_join > least:
        n_join = least
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
        g = bg + n_join - seqs
        if not g > 0.0:
            g = 0.0
        gemm_less = ct * (knee if knee < g else g) + cc * (g - knee if g > knee else 0.0)
        marginal = cd * seqs + ckv * (prompt + seqs * output / 2.0) + gemm_join - gemm_less
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
        waves,
    )
