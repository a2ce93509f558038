"""The inputs of a forecast: the request (``CandidateRequest``) and the replica's load and limits.

``ReplicaState`` is one replica's load as the forecast needs it (aggregates, counts >= 0, times in
seconds; ``None`` in an optional field means unknown, as each field says), built from the engine's
sequences (``from_sequences``) or a caller's rows (``from_rows``); ``RunningSeq`` is one sequence
for the first. ``ForecastReason`` says why a forecast is not valid; ``problem_of`` is the first
reason a request and a state cannot be forecast (``None``: they can). Pure, no I/O:
``predictor.forecast`` forecasts on them.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

__all__ = [
    "CandidateRequest",
    "ForecastReason",
    "ReplicaState",
    "RunningSeq",
    "problem_of",
    "slot_schedule",
    "slots_after_one_more",
]

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
    ``sequences`` (>= 1): sequences it decodes at once (a list of prompts, or the body's ``n``),
    each producing ``expected_output_tokens``; ``prompt_tokens`` is then all of their prompts.
    """

    prompt_tokens: int
    max_tokens: int
    expected_output_tokens: float
    output_quantile: float | None = None
    cached_prompt_tokens: int = 0
    sequences: int = 1


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
    ``full_finish_rate_per_s``: requests it finished per second while it was full, recently (its
    capacity; ``None``: unknown). A recent rate counts the time the engine was not full too (after
    a quiet spell, the quiet traffic's rate): a full engine frees its slots at the larger of the two.
    ``steady_step_s``: the mean step time the replica settles at under its recent arrivals
    (``steady_state``: Little's law); ``None``: unknown, no arrivals, or overloaded (no steady
    state). The TPOT forecast moves from the batch it joins toward it over its decode
    (``steady_weight``).
    ``arriving_prompt_tokens_per_s``: prompt tokens that reach the replica per second (recent
    rate; 0: unknown or none). The requests that arrive while a newcomer waits for its last
    prefill step come after it in the queue, but the engine packs their prompts into that step's
    unused token budget: the step takes longer and the newcomer's first token comes later.
    ``slot_steps``: when no slot is left for a newcomer and every output ahead of it is known
    exactly (clients that pin their outputs: ``ignore_eos`` with ``max_tokens``), the engine
    steps until each of the next slots frees behind the waiting queue, ascending
    (``slot_schedule``): the ``k``-th is when a newcomer needing ``k`` slots gets them. Empty:
    a slot is free, or the outputs are not known (a finish rate and expected outputs tell).
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
    full_finish_rate_per_s: float | None = None
    slot_steps: tuple[float, ...] = ()
    #: What ``problem_of`` found wrong with this state (``None``: nothing), filled by the first
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
        full_finish_rate_per_s: float | None = None,
        waiting_outputs: Sequence[float] | None = None,
    ) -> ReplicaState:
        """Aggregate per-request detail (running in schedule order, waiting FCFS) into a state.

        ``waiting_outputs``: the waiting requests' outputs (tokens, in the order of
        ``waiting_prompt_tokens``) when every output is known exactly, the running requests'
        ``expected_output_tokens`` included; ``None``: not known. It gives ``slot_steps``.
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
            full_finish_rate_per_s=full_finish_rate_per_s,
            waiting_outputs=waiting_outputs,
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
        full_finish_rate_per_s: float | None = None,
        waiting_outputs: Sequence[float] | None = None,
    ) -> ReplicaState:
        """``from_sequences`` with each running request as a plain tuple ``(prompt_tokens,
        computed_tokens, generated_tokens, expected_output_tokens)`` (``RunningSeq``'s fields):
        the same state, without building an object per request (a replica holds hundreds)."""
        if waiting_outputs is not None and len(waiting_outputs) != len(waiting_prompt_tokens):
            raise ValueError("waiting_outputs must match waiting_prompt_tokens")
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
        slots: tuple[float, ...] = ()
        if waiting_outputs is not None and len(running) + len(waiting_outputs) >= max_num_seqs:
            slots = slot_schedule(steps, max(0, max_num_seqs - len(running)), waiting_outputs)
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
            full_finish_rate_per_s,
            slots,
        )


def slot_schedule(rests: Sequence[float], free: int, waiting_outputs: Sequence[float]) -> tuple[float, ...]:
    """Engine steps until each slot frees behind a waiting queue, ascending.

    ``rests``: the running requests' remaining outputs (steps; one token per step each);
    ``free``: slots free now (>= 0); ``waiting_outputs``: the waiting requests' outputs, FCFS.
    Each waiting request takes the first slot to free (a free one at step 0) and holds it for
    its output, its prefill step producing the first token. What is left are the slots a
    newcomer behind them waits for: ``free`` zeros (slots still free) then the heap's times.
    O((n + w) log n); empty only with no slot at all.
    """
    heap = [float(r) for r in rests]
    heapq.heapify(heap)
    for output in waiting_outputs:
        steps = output if output > 1.0 else 1.0
        if free > 0:
            free -= 1
            heapq.heappush(heap, steps)
        else:
            heapq.heappush(heap, heapq.heappop(heap) + steps if heap else steps)
    return (0.0,) * free + tuple(sorted(heap))


def slots_after_one_more(slots: tuple[float, ...], output: float | None) -> tuple[float, ...]:
    """``slots`` (``ReplicaState.slot_steps``) once one more request of ``output`` tokens joins the
    waiting queue: it takes the first slot to free and holds it for its output. Empty when
    ``output`` is not known (``None``) or there was no schedule."""
    if not slots or output is None:
        return ()
    rest = list(slots[1:])
    bisect.insort(rest, slots[0] + (output if output > 1.0 else 1.0))
    return tuple(rest)


def problem_of(request: CandidateRequest, state: ReplicaState) -> str | None:
    """The first reason the inputs cannot be forecast (a ``ForecastReason``), or ``None``.

    The state's own checks run once per state (kept on it): a state is forecast many times.
    """
    r = request
    if r.prompt_tokens < 1 or r.max_tokens < 1 or r.cached_prompt_tokens < 0 or r.sequences < 1:
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
    for rate in (s.finish_rate_per_s, s.full_finish_rate_per_s):
        if rate is not None and not (math.isfinite(rate) and rate >= 0.0):
            return ForecastReason.BAD_STATE
    if len(s.release_steps) != len(s.release_kv_cumulative):
        return ForecastReason.BAD_STATE
    if s.slot_steps and not (math.isfinite(s.slot_steps[-1]) and s.slot_steps[0] >= 0.0):
        return ForecastReason.BAD_STATE
    if s.steady_step_s is not None and not (math.isfinite(s.steady_step_s) and s.steady_step_s > 0.0):
        return ForecastReason.BAD_STATE
    if not (math.isfinite(s.arriving_prompt_tokens_per_s) and s.arriving_prompt_tokens_per_s >= 0.0):
        return ForecastReason.BAD_STATE
    return None
