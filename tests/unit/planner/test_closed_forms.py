"""The planner's closed forms against numbers worked by hand (``planner.closed_forms``,
``planner.checks``); each case's arithmetic is written beside it.

Formulas: Little's law ``L = λ·W`` and ``H = λ·G`` (math.md §7), vLLM preempting when KV blocks
run out (math.md §1.6, §2.3), KV bytes per token ``2·L·h_kv·d_h·s`` (math.md §1.2), speculative
tokens per step ``(1 − α^{k+1})/(1 − α)`` (math.md §9); see ``docs/planning.md``.
"""

from __future__ import annotations

import math

import pytest

from planner import closed_forms as cf
from planner.checks import cost_check, kv_check, recompute_s, speculative_check, swap_check
from planner.workload import Workload
from replay.traces import TraceRequest
from simulator.costmodel import StepShape, step_time_s
from simulator.profile import load_profile


def test_held_token_steps() -> None:
    # P = 1000, O = 200: O·P + O(O+1)/2 = 200,000 + 200·201/2 = 200,000 + 20,100 = 220,100.
    assert cf.held_token_steps(1000, 200) == 220_100
    # One output token holds the prompt plus itself for one step: 1·P + 1 = P + 1.
    assert cf.held_token_steps(7, 1) == 8
    assert cf.mean_held_token_steps([(1000, 200), (7, 1)]) == (220_100 + 8) / 2
    assert cf.mean_held_token_steps([]) == 0.0


def test_littles_law_kv_and_limits() -> None:
    # 2 req/s per replica, TPOT 50 ms, E[O] = 200: λ·E[O]·TPOT = 2 · 200 · 0.05 = 20 sequences.
    assert cf.decode_concurrency(2.0, 200, 0.05) == pytest.approx(20.0)
    # KV in flight: λ·TPOT·E[held] = 2 · 0.05 · 220,100 = 22,010 tokens.
    assert cf.kv_tokens_in_flight(2.0, 0.05, 220_100) == pytest.approx(22_010.0)
    # Preemption: 448,304 tokens / (0.05 · 220,100 = 11,005 token-seconds per request) = 40.736 req/s.
    assert cf.rate_at_kv_capacity(448_304, 0.05, 220_100) == pytest.approx(40.7364, abs=1e-4)
    # max_num_seqs 1024 / (E[O] · TPOT = 200 · 0.05 = 10 s of decoding per request) = 102.4 req/s.
    assert cf.rate_at_seq_limit(1024, 200, 0.05) == pytest.approx(102.4)
    assert math.isinf(cf.rate_at_kv_capacity(100, 0.05, 0.0))


def test_swap_time_and_linear_break_even() -> None:
    # 4,096 tokens x 131,072 B (Llama-3-8B bf16) out and back: 2 · 4096 · 131072 = 2^30 B;
    # over 50 GB/s: 1,073,741,824 / 5e10 = 0.021475 s.
    assert cf.swap_s(4096, 131_072, 50e9) == pytest.approx(0.02147483648)
    # Recompute 7 ms + 24 µs/token, swap 32 µs/token: c* = 0.007 / (32e-6 − 24e-6) = 875 tokens.
    assert cf.linear_break_even_tokens(0.007, 24e-6, 32e-6) == pytest.approx(875.0)
    # Swap at 5.2 µs/token never loses to 24 µs/token of recompute.
    assert math.isinf(cf.linear_break_even_tokens(0.007, 24e-6, 5.2e-6))


def test_break_even_scan_matches_the_closed_form() -> None:
    # Same lines: swap (0.032 ms) beats recompute (7.024 ms) at 1 token; recompute wins from
    # c = 875 on, and the scan by 16 tokens first sees it at 16 · 55 = 880.
    found = cf.break_even_tokens(lambda c: 0.007 + 24e-6 * c, lambda c: 32e-6 * c, 8192, step=16)
    assert (found.cheaper_short, found.crossover_tokens, found.max_tokens) == ("swap", 880, 8192)
    assert found.recompute_at_max_s == pytest.approx(0.007 + 24e-6 * 8192)
    never = cf.break_even_tokens(lambda c: 0.007 + 24e-6 * c, lambda c: 5.2e-6 * c, 8192)
    assert (never.cheaper_short, never.crossover_tokens) == ("swap", None)


def test_cost_and_gpu_hours() -> None:
    # $2/GPU-hour, 1 GPU, 10,000 tok/s = 36 M tokens/hour: $2 / 36 = $0.0556 per million.
    assert cf.cost_per_million_tokens(2.0, 1, 10_000) == pytest.approx(2.0 / 36.0)
    # 1e9 tokens at 10,000 tok/s = 1e5 s = 27.78 h, on 4 GPUs = 111.1 GPU-hours.
    assert cf.gpu_hours(1e9, 10_000, 4) == pytest.approx(1e5 / 3600 * 4)
    assert math.isinf(cf.cost_per_million_tokens(2.0, 1, 0.0))


def test_speculative_tokens_per_step() -> None:
    # α = 0.8, k = 4: (1 − 0.8^5) / (1 − 0.8) = (1 − 0.32768) / 0.2 = 3.3616.
    assert cf.expected_tokens_per_step(0.8, 4) == pytest.approx(3.3616)
    assert cf.expected_tokens_per_step(1.0, 4) == 5.0
    assert cf.expected_tokens_per_step(0.5, 0) == 1.0
    with pytest.raises(ValueError, match="acceptance"):
        cf.expected_tokens_per_step(1.5, 2)


def _uniform_workload(rate: float, seconds: float, prompt: int, output: int) -> Workload:
    n = round(rate * seconds)
    return Workload(tuple(TraceRequest(i / rate, prompt, output) for i in range(n)), "test", seconds)


def test_kv_check_on_the_h100_profile() -> None:
    profile = load_profile("llama3-8b-h100")
    # KV per token: 2 · 32 layers · 8 KV heads · 128 · 2 B = 131,072 B; 28,019 blocks x 16 = 448,304.
    assert profile.kv_bytes_per_token == 131_072
    # 4 req/s over 2 replicas = 2 req/s each, P = 1000, O = 200, TPOT 50 ms: 22,010 tokens in
    # flight (above) = 22,010 / 448,304 = 4.91 % of the cache.
    kv = kv_check(profile, _uniform_workload(4.0, 10.0, 1000, 200), 2, 0.05, "target")
    assert kv.rate_per_s == pytest.approx(2.0)
    assert kv.tokens_in_flight == pytest.approx(22_010.0)
    assert kv.kv_share == pytest.approx(22_010 / 448_304)
    assert kv.preemption_rate_per_s == pytest.approx(40.7364, abs=1e-4)


def test_swap_check_names_what_is_missing_and_uses_the_step_model() -> None:
    profile = load_profile("llama3-8b-h100")
    missing = swap_check(profile, None)
    assert missing.break_even is None
    assert "PCIe" in missing.missing[0]
    # Recompute of 8,192 tokens is one full-budget prefill step; of 10,000 tokens, two chunks.
    one = step_time_s(profile, StepShape(prefill_chunks=((8192, 0),)))
    assert recompute_s(profile, 8192) == pytest.approx(one)
    two = one + step_time_s(profile, StepShape(prefill_chunks=((1808, 8192),)))
    assert recompute_s(profile, 10_000) == pytest.approx(two)
    # At 50 GB/s swapping 8,192 tokens takes 2 · 8192 · 131072 / 5e10 = 0.043 s, less than the
    # ~0.22 s prefill, and it stays faster at every length (recompute never crosses it).
    found = swap_check(profile, 50e9).break_even
    assert found is not None
    assert (found.cheaper_short, found.crossover_tokens) == ("swap", None)
    assert found.swap_at_max_s == pytest.approx(2 * 8192 * 131_072 / 50e9)


def test_cost_check_per_replica() -> None:
    profile = load_profile("llama2-70b-h100-tp4")  # 4 GPUs per replica
    # 3 replicas serving 30,000 good tok/s = 10,000 each; at $2/GPU-hour a replica costs $8/h:
    # 8 / 36 = $0.2222 per million; $24/hour for the fleet.
    c = cost_check(profile, 3, 30_000.0, 6_000.0, 2.0)
    assert c.per_hour == pytest.approx(24.0)
    assert c.per_million_tokens == pytest.approx(8.0 / 36.0)
    assert c.per_million_output_tokens == pytest.approx(8.0 / 7.2)  # 2,000 tok/s: 7.2 M an hour
    # A day of 30,000 tok/s = 2.592e9 tokens = 72 replica-hours = 288 GPU-hours.
    assert c.tokens_per_day == pytest.approx(2.592e9)
    assert c.gpu_hours_per_day == pytest.approx(288.0)


def test_speculative_check() -> None:
    profile = load_profile("llama3-8b-h100")
    skipped = speculative_check(profile, 32, 1000, 0.8, 4, None)
    assert skipped.missing
    assert math.isnan(skipped.speedup)
    sp = speculative_check(profile, 32, 1000, 0.8, 4, 0.001)
    decode = step_time_s(profile, StepShape(decode_contexts=(1000,) * 32))
    verify = step_time_s(profile, StepShape(prefill_chunks=((5, 1000),) * 32))
    # TPOT with speculation = (verify + 4 draft steps of 1 ms) / 3.3616 tokens per step.
    assert sp.tpot_spec_s == pytest.approx((verify + 0.004) / 3.3616)
    assert sp.tpot_s == pytest.approx(decode)
