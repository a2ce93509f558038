"""The closed-form checks of a plan, from a replica profile and a workload (``planner.closed_forms``
applied): the KV check (Little's law against KV capacity, where preemption starts), recompute
versus swap, cost, and the speculative-decoding what-if. Each returns a frozen record with its
inputs, so that the report shows the arithmetic; an input the profile lacks is named in
``missing`` rather than guessed.

Step times come from the emulator's cost model of the profile (``simulator.costmodel``), the same
one the replay runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner import closed_forms as cf
from planner.replicas import ClassResult
from planner.workload import Workload
from simulator.costmodel import StepShape, step_time_s
from simulator.profile import Profile

__all__ = [
    "ClassCost",
    "CostCheck",
    "KvCheck",
    "SpeculativeCheck",
    "SwapCheck",
    "class_cost",
    "cost_check",
    "kv_check",
    "recompute_s",
    "speculative_check",
    "swap_check",
]


@dataclass(frozen=True, slots=True)
class KvCheck:
    """Little's law on one replica: ``rate_per_s`` arrivals (the workload's over the replicas),
    ``tpot_s`` per output token (``tpot_source`` says which: the class target, the worst case
    that still meets it, or the replay's median). Tokens in units of tokens, rates per second."""

    replicas: int
    rate_per_s: float
    tpot_s: float
    tpot_source: str
    mean_held_steps: float
    decode_concurrency: float
    tokens_in_flight: float
    capacity_tokens: int
    max_num_seqs: int
    preemption_rate_per_s: float
    seq_limit_rate_per_s: float

    @property
    def kv_share(self) -> float:
        """Tokens in flight over the KV capacity (above 1: the cache cannot hold them)."""
        return self.tokens_in_flight / self.capacity_tokens


def kv_check(profile: Profile, workload: Workload, replicas: int, tpot_s: float, tpot_source: str) -> KvCheck:
    """The KV check for ``workload`` spread evenly over ``replicas`` replicas of ``profile``."""
    rate = workload.rate_per_s / max(1, replicas)
    held = cf.mean_held_token_steps(workload.pairs())
    mean_out = workload.mean_output_tokens
    return KvCheck(
        replicas,
        rate,
        tpot_s,
        tpot_source,
        held,
        cf.decode_concurrency(rate, mean_out, tpot_s),
        cf.kv_tokens_in_flight(rate, tpot_s, held),
        profile.kv_cache_size_tokens,
        profile.engine.max_num_seqs,
        cf.rate_at_kv_capacity(profile.kv_cache_size_tokens, tpot_s, held),
        cf.rate_at_seq_limit(profile.engine.max_num_seqs, mean_out, tpot_s),
    )


def recompute_s(profile: Profile, context_tokens: int) -> float:
    """Seconds to prefill ``context_tokens`` again, alone on the replica, in chunks of
    ``max_num_batched_tokens`` (the profile's step model, no jitter)."""
    budget = profile.engine.max_num_batched_tokens
    total, done = 0.0, 0
    while done < context_tokens:
        chunk = min(budget, context_tokens - done)
        total += step_time_s(profile, StepShape(prefill_chunks=((chunk, done),)))
        done += chunk
    return total


@dataclass(frozen=True, slots=True)
class SwapCheck:
    """Recompute versus swap for a preempted request. ``missing``: inputs not known (then
    ``break_even`` is ``None``). ``pcie_Bps``: host link bandwidth per GPU, bytes per second."""

    kv_bytes_per_token: int
    pcie_Bps: float | None
    missing: tuple[str, ...]
    break_even: cf.BreakEven | None


def swap_check(profile: Profile, pcie_Bps: float | None) -> SwapCheck:
    """Scan context lengths up to ``max_model_len`` (by KV block) for where recomputing stops (or
    starts) being faster than swapping out and back over PCIe. Profiles carry no PCIe bandwidth,
    so it must be given; every GPU of a tensor-parallel replica moves its own share of the KV
    over its own link, which ``kv_bytes_per_token`` (per GPU) already accounts for."""
    kvb = profile.kv_bytes_per_token
    if pcie_Bps is None:
        return SwapCheck(kvb, None, ("PCIe bandwidth per GPU (the profile has none: --pcie-gbps)",), None)
    found = cf.break_even_tokens(
        lambda c: recompute_s(profile, c),
        lambda c: cf.swap_s(c, kvb, pcie_Bps),
        profile.engine.max_model_len,
        step=profile.engine.block_size,
    )
    return SwapCheck(kvb, pcie_Bps, (), found)


@dataclass(frozen=True, slots=True)
class CostCheck:
    """Cost at ``replicas`` replicas of ``gpus_per_replica`` GPUs at ``price_per_gpu_hour``, for
    the tokens that met their targets (``good_tps``: prompt + output per second, fleet-wide;
    ``good_output_tps``: output only). ``tokens_per_day``: the volume to size for (``None``: the
    replayed rate), with the GPU-hours it takes."""

    price_per_gpu_hour: float
    gpus_per_replica: int
    replicas: int
    good_tps: float
    good_output_tps: float
    per_hour: float
    per_million_tokens: float
    per_million_output_tokens: float
    tokens_per_day: float
    gpu_hours_per_day: float
    classes: tuple[ClassCost, ...] = ()


@dataclass(frozen=True, slots=True)
class ClassCost:
    """One class's share of the cost in a replay that ran ``run_s`` seconds: the engine time its
    requests took (``busy_s``, every replica, each step split by the tokens each request had in
    it), as ``gpu_hours`` (``busy_s x gpus_per_replica / 3600``) and as GPU-hours a day at the
    replayed rate (``gpu_hours x 86400 / run_s``), and the price of a million of its tokens
    (finished requests, prompt + output; and output only) at ``price_per_gpu_hour``. Idle
    engine time belongs to no class."""

    name: str
    busy_s: float
    gpu_hours: float
    gpu_hours_per_day: float
    tokens: int
    output_tokens: int
    per_million_tokens: float
    per_million_output_tokens: float


def class_cost(
    result: ClassResult, gpus_per_replica: int, price_per_gpu_hour: float, run_s: float
) -> ClassCost:
    """``result``'s class's GPU-hours and price per million tokens (``inf`` with no token)."""
    gpu_hours = result.busy_s * gpus_per_replica / cf.SECONDS_PER_HOUR
    dollars = gpu_hours * price_per_gpu_hour
    per_day = gpu_hours * 86400.0 / run_s if run_s > 0 else math.nan
    return ClassCost(
        result.name,
        result.busy_s,
        gpu_hours,
        per_day,
        result.tokens,
        result.output_tokens,
        dollars / result.tokens * 1e6 if result.tokens else math.inf,
        dollars / result.output_tokens * 1e6 if result.output_tokens else math.inf,
    )


def cost_check(
    profile: Profile,
    replicas: int,
    good_tps: float,
    good_output_tps: float,
    price_per_gpu_hour: float,
    tokens_per_day: float | None = None,
    classes: tuple[ClassResult, ...] = (),
    run_s: float = 0.0,
) -> CostCheck:
    """Cost per hour and per million (good) tokens; GPU-hours a day for ``tokens_per_day``; and
    each of ``classes`` (a replay's, that ran ``run_s`` seconds) on its own (``class_cost``)."""
    g = profile.tensor_parallel
    per_replica = good_tps / max(1, replicas)
    per_replica_out = good_output_tps / max(1, replicas)
    volume = good_tps * 86400.0 if tokens_per_day is None else tokens_per_day
    return CostCheck(
        price_per_gpu_hour,
        g,
        replicas,
        good_tps,
        good_output_tps,
        price_per_gpu_hour * g * replicas,
        cf.cost_per_million_tokens(price_per_gpu_hour, g, per_replica),
        cf.cost_per_million_tokens(price_per_gpu_hour, g, per_replica_out),
        volume,
        cf.gpu_hours(volume, per_replica, g),
        tuple(class_cost(c, g, price_per_gpu_hour, run_s) for c in classes),
    )


@dataclass(frozen=True, slots=True)
class SpeculativeCheck:
    """Speculative decoding at ``draft_tokens`` (k) and ``acceptance`` (α) for a batch of
    ``batch`` decoding sequences at mean context ``context_tokens``: the plain decode step, the
    verification step (each sequence computes k + 1 tokens) plus k draft steps, tokens per step,
    and the resulting TPOTs (seconds). ``missing``: inputs not given (then the times are ``nan``)."""

    acceptance: float
    draft_tokens: int
    draft_step_s: float | None
    batch: int
    context_tokens: int
    missing: tuple[str, ...]
    tokens_per_step: float = math.nan
    decode_step_s: float = math.nan
    verify_step_s: float = math.nan
    tpot_s: float = math.nan
    tpot_spec_s: float = math.nan

    @property
    def speedup(self) -> float:
        """Plain TPOT over speculative TPOT (above 1: speculation helps at this batch)."""
        return self.tpot_s / self.tpot_spec_s if self.tpot_spec_s > 0 else math.nan


def speculative_check(
    profile: Profile,
    batch: int,
    context_tokens: int,
    acceptance: float,
    draft_tokens: int,
    draft_step_s: float | None,
) -> SpeculativeCheck:
    """TPOT with and without speculation: ``T_decode(batch)`` versus
    ``(T_verify(batch, k + 1 tokens each) + k · draft_step_s) / E[tokens per step]``; the
    verification step is costed as a (k + 1)-token chunk per sequence on its context."""
    batch, context = max(1, batch), max(1, context_tokens)
    if draft_step_s is None:
        missing = ("the draft model's step time (--draft-step-ms)",)
        return SpeculativeCheck(acceptance, draft_tokens, None, batch, context, missing)
    expected = cf.expected_tokens_per_step(acceptance, draft_tokens)
    decode = step_time_s(profile, StepShape(decode_contexts=(context,) * batch))
    verify = step_time_s(profile, StepShape(prefill_chunks=((draft_tokens + 1, context),) * batch))
    spec = (verify + draft_tokens * draft_step_s) / expected
    return SpeculativeCheck(
        acceptance, draft_tokens, draft_step_s, batch, context, (), expected, decode, verify, decode, spec
    )
