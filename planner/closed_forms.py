"""Closed-form capacity arithmetic: Little's law for the KV cache, recompute versus swap, cost.

Plain functions of numbers (no profile, no replay), each returning one quantity in the unit its
name says: ``_s`` seconds, ``_tokens`` tokens, ``_per_s`` per second, ``_Bps`` bytes per second.
The formulas and where they come from (``docs/planning.md`` repeats them):

* Little's law, ``L = λ·W`` [Little 1961], and its time-average form ``H = λ·G``: the mean of a
  quantity summed over the requests in a system is the arrival rate times the mean integral of
  that quantity over one request's stay. A request with prompt ``P`` and output ``O`` holds
  ``P + j`` KV tokens during its ``j``-th decode step, each lasting ``TPOT``, so its KV
  token-seconds are ``TPOT · (O·P + O(O+1)/2)``; decoding sequences in flight are
  ``λ·E[O]·TPOT`` (the decode-side corollary of Little's law).
* vLLM preempts when the KV cache runs out of blocks: preemption starts at the arrival rate whose
  KV tokens in flight reach the cache's capacity.
* Recompute versus swap: getting a preempted request's ``c`` context tokens back takes a prefill
  of ``c`` tokens (recompute) or copying ``c · kv_bytes_per_token`` out to host memory and back
  over PCIe (swap, ``2·c·kv_bytes/BW``). vLLM V1 only recomputes; the break-even says what swap
  would buy.
* Cost: a replica of ``g`` GPUs at ``$p`` per GPU-hour costs ``g·p`` an hour; at ``X`` tokens
  per second that is ``g·p / (3600·X) · 1e6`` per million tokens.
* Speculative decoding with draft length ``k`` and i.i.d. acceptance ``α`` yields
  ``(1 − α^{k+1}) / (1 − α)`` tokens per verification step, the bonus token included
  [Leviathan et al. 2023].
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = [
    "BreakEven",
    "break_even_tokens",
    "cost_per_million_tokens",
    "decode_concurrency",
    "expected_tokens_per_step",
    "gpu_hours",
    "held_token_steps",
    "kv_tokens_in_flight",
    "linear_break_even_tokens",
    "mean_held_token_steps",
    "rate_at_kv_capacity",
    "rate_at_seq_limit",
    "swap_s",
]

SECONDS_PER_HOUR = 3600.0


def held_token_steps(prompt_tokens: int, output_tokens: int) -> float:
    """KV tokens held summed over one request's decode steps: ``O·P + O(O+1)/2`` (token-steps).

    Multiply by the time per output token for KV token-seconds. ``>= 0``.
    """
    if prompt_tokens < 0 or output_tokens < 0:
        raise ValueError("token counts must be >= 0")
    o = output_tokens
    return float(o * prompt_tokens + o * (o + 1) / 2)


def mean_held_token_steps(requests: Iterable[tuple[int, int]]) -> float:
    """Mean of ``held_token_steps`` over ``(prompt, output)`` pairs (0.0 for none)."""
    total, n = 0.0, 0
    for p, o in requests:
        total += held_token_steps(p, o)
        n += 1
    return total / n if n else 0.0


def decode_concurrency(rate_per_s: float, mean_output_tokens: float, tpot_s: float) -> float:
    """Sequences decoding at once by Little's law: ``λ·E[O]·TPOT``."""
    return rate_per_s * mean_output_tokens * tpot_s


def kv_tokens_in_flight(rate_per_s: float, tpot_s: float, mean_held_steps: float) -> float:
    """Mean KV tokens held by decoding requests (``H = λ·G``): ``λ · TPOT · E[O·P + O(O+1)/2]``.

    Queued and prefilling requests are not counted (a lower bound while prefill is short).
    """
    return rate_per_s * tpot_s * mean_held_steps


def rate_at_kv_capacity(capacity_tokens: float, tpot_s: float, mean_held_steps: float) -> float:
    """Arrival rate (per second, per replica) at which ``kv_tokens_in_flight`` reaches
    ``capacity_tokens``: where vLLM starts preempting. ``math.inf`` when requests hold nothing."""
    per_request = tpot_s * mean_held_steps
    return math.inf if per_request <= 0 else capacity_tokens / per_request


def rate_at_seq_limit(max_num_seqs: int, mean_output_tokens: float, tpot_s: float) -> float:
    """Arrival rate (per second, per replica) at which ``decode_concurrency`` reaches
    ``max_num_seqs``: beyond it requests wait in the engine's queue (no preemption)."""
    per_request = mean_output_tokens * tpot_s
    return math.inf if per_request <= 0 else max_num_seqs / per_request


def swap_s(context_tokens: int, kv_bytes_per_token: float, pcie_Bps: float) -> float:
    """Seconds to copy ``context_tokens`` of KV to host memory and back: ``2·c·kv_bytes / BW``."""
    if pcie_Bps <= 0:
        raise ValueError("pcie_Bps must be > 0")
    return 2.0 * context_tokens * kv_bytes_per_token / pcie_Bps


def linear_break_even_tokens(
    recompute_fixed_s: float, recompute_per_token_s: float, swap_per_token_s: float
) -> float:
    """Context length where recomputing (``a + b·c``) and swapping (``s·c``) take equal time:
    ``c* = a / (s − b)``; recompute is cheaper above it. ``math.inf`` when ``s <= b``: swapping is
    faster at every length."""
    slope = swap_per_token_s - recompute_per_token_s
    return math.inf if slope <= 0 else recompute_fixed_s / slope


@dataclass(frozen=True, slots=True)
class BreakEven:
    """Where recompute and swap cross over context lengths ``1..max_tokens``.

    ``cheaper_short``: ``"recompute"`` or ``"swap"``, the faster one at the shortest length.
    ``crossover_tokens``: the first length where the other one is faster (``None``: never, up to
    ``max_tokens``). Times at ``max_tokens`` for the report.
    """

    cheaper_short: str
    crossover_tokens: int | None
    max_tokens: int
    recompute_at_max_s: float
    swap_at_max_s: float


def break_even_tokens(
    recompute: Callable[[int], float], swap: Callable[[int], float], max_tokens: int, step: int = 16
) -> BreakEven:
    """Scan context lengths ``1, step, 2·step, ..., max_tokens`` for the first where the faster of
    ``recompute(c)`` and ``swap(c)`` (seconds) changes. ``step``: the scan's resolution (tokens;
    a KV block). A tie counts as recompute (no copy needed)."""
    if max_tokens < 1 or step < 1:
        raise ValueError("max_tokens and step must be >= 1")

    def cheaper(c: int) -> str:
        return "recompute" if recompute(c) <= swap(c) else "swap"

    lengths = [1, *range(step, max_tokens + 1, step)]
    if lengths[-1] != max_tokens:
        lengths.append(max_tokens)
    first = cheaper(lengths[0])
    crossing = next((c for c in lengths[1:] if cheaper(c) != first), None)
    return BreakEven(first, crossing, max_tokens, recompute(max_tokens), swap(max_tokens))


def gpu_hours(tokens: float, tokens_per_s_per_replica: float, gpus_per_replica: int) -> float:
    """GPU-hours to process ``tokens`` at ``tokens_per_s_per_replica``: ``tokens / X / 3600 · g``."""
    if tokens_per_s_per_replica <= 0:
        return math.inf
    return tokens / tokens_per_s_per_replica / SECONDS_PER_HOUR * gpus_per_replica


def cost_per_million_tokens(
    price_per_gpu_hour: float, gpus_per_replica: int, tokens_per_s_per_replica: float
) -> float:
    """Price of a million tokens: ``g·p / (3600·X) · 1e6`` (same currency as the price)."""
    if tokens_per_s_per_replica <= 0:
        return math.inf
    return price_per_gpu_hour * gpus_per_replica / (SECONDS_PER_HOUR * tokens_per_s_per_replica) * 1e6


def expected_tokens_per_step(acceptance: float, draft_tokens: int) -> float:
    """Tokens one speculative verification step yields: ``(1 − α^{k+1}) / (1 − α)``, ``k + 1`` at
    ``α = 1``, 1 at ``k = 0``. ``acceptance`` in [0, 1], ``draft_tokens`` >= 0."""
    if not 0.0 <= acceptance <= 1.0 or draft_tokens < 0:
        raise ValueError("acceptance must be in [0, 1] and draft_tokens >= 0")
    if acceptance == 1.0:
        return float(draft_tokens + 1)
    return (1.0 - acceptance ** (draft_tokens + 1)) / (1.0 - acceptance)
