"""The steady state a replica's batch settles into under a stream of arrivals.

``TrafficMix`` is the traffic (arrival rate, prompt sizes, decode lengths) a caller saw arrive at
a replica; ``steady_state`` closes Little's law over it with the step model (``SteadyState``: mean
step time, decoding requests, prefill share; ``None``: no steady state, overloaded or unknown);
``steady_weight`` is the weight of the batch a request joins against it over its decode. Times
are seconds, sizes tokens. Pure, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from predictor.step_model import StepModel, StepParams

__all__ = ["SteadyState", "TrafficMix", "steady_state", "steady_weight"]

#: Most prompt sizes a ``TrafficMix`` keeps (quantiles of the sample it is built from).
_MIX_POINTS: Final = 16
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
