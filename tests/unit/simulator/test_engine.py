"""Engine: vLLM V1 scheduling rules under a fake clock (each step lasts a chosen ``dt``, no sleeps)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from simulator.costmodel import StepShape
from simulator.engine import Engine, FinishedRequestStats, StepPlan, StepResult
from simulator.profile import load_profile

BASE = load_profile("llama3-8b-h100")


def make_engine(
    *,
    budget: int = 64,
    max_num_seqs: int = 16,
    block_size: int = 4,
    num_gpu_blocks: int = 1000,
    max_model_len: int = 512,
    seed: int = 0,
    jitter: float = 0.0,
) -> Engine:
    profile = BASE.with_engine(
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        max_model_len=max_model_len,
    )
    return Engine(profile, seed=seed, jitter=jitter)


@dataclass
class Run:
    """Everything a drained engine did, with a fake clock advanced by ``dt`` per step."""

    plans: list[StepPlan] = field(default_factory=list)
    results: list[StepResult] = field(default_factory=list)
    now: float = 0.0

    @property
    def finished(self) -> dict[str, FinishedRequestStats]:
        return {f.request_id: f for r in self.results for f in r.finished}


def step(engine: Engine, run: Run, dt: float = 0.1) -> tuple[StepPlan, StepResult]:
    plan = engine.schedule(run.now)
    assert plan is not None
    run.now += dt
    result = engine.complete(plan, run.now)
    run.plans.append(plan)
    run.results.append(result)
    return plan, result


def drain(engine: Engine, run: Run | None = None, dt: float = 0.1, max_steps: int = 10_000) -> Run:
    run = run or Run()
    for _ in range(max_steps):
        if not engine.has_unfinished_requests:
            return run
        step(engine, run, dt)
    raise AssertionError("engine did not drain")


# ----------------------------------------------------------------- budgets and ordering


@pytest.mark.parametrize(
    ("budget", "max_num_seqs", "prompts"),
    [
        pytest.param(16, 8, [40, 3, 17, 5, 60], id="small-budget"),
        pytest.param(64, 3, [10] * 9, id="seq-cap"),
        pytest.param(100, 32, [99, 1, 100, 2, 50, 50], id="prompt-equals-budget"),
    ],
)
def test_budget_and_seq_cap_hold_every_step(budget: int, max_num_seqs: int, prompts: list[int]) -> None:
    engine = make_engine(budget=budget, max_num_seqs=max_num_seqs)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, 6, 6, 0.0)
    run = drain(engine)
    for plan in run.plans:
        assert 0 < sum(plan.num_scheduled_tokens.values()) <= budget
        assert len(plan.num_scheduled_tokens) <= max_num_seqs
        assert plan.num_prefill_tokens + plan.num_decode_seqs == sum(plan.num_scheduled_tokens.values())
    assert sorted(run.finished) == sorted(f"r{i}" for i in range(len(prompts)))


def test_decodes_are_scheduled_before_prefill() -> None:
    engine = make_engine(budget=8)
    run = Run()
    engine.add_request("a", 4, 10, 10, 0.0)
    engine.add_request("b", 4, 10, 10, 0.0)
    step(engine, run)  # both prefill (4 + 4 = 8 tokens)
    engine.add_request("c", 100, 10, 10, run.now)
    plan, _ = step(engine, run)
    assert plan.num_scheduled_tokens == {"a": 1, "b": 1, "c": 6}
    assert (plan.num_decode_seqs, plan.num_prefill_tokens) == (2, 6)


def test_running_requests_can_use_the_whole_budget() -> None:
    engine = make_engine(budget=2)
    run = Run()
    engine.add_request("a", 1, 10, 10, 0.0)
    engine.add_request("b", 1, 10, 10, 0.0)
    step(engine, run)
    engine.add_request("c", 5, 10, 10, run.now)
    plan, _ = step(engine, run)
    assert plan.num_scheduled_tokens == {"a": 1, "b": 1}
    assert engine.num_waiting == 1


@pytest.mark.parametrize(
    ("prompt", "budget", "chunks"),
    [
        pytest.param(10, 4, [4, 4, 2], id="three-chunks"),
        pytest.param(8, 4, [4, 4], id="exact-multiple"),
        pytest.param(3, 4, [3], id="fits-one-step"),
        pytest.param(9, 1, [1] * 9, id="one-token-budget"),
    ],
)
def test_chunked_prefill_across_steps(prompt: int, budget: int, chunks: list[int]) -> None:
    engine = make_engine(budget=budget)
    engine.add_request("a", prompt, 2, 2, 0.0)
    run = drain(engine)
    scheduled = [p.num_scheduled_tokens["a"] for p in run.plans]
    assert scheduled == [*chunks, 1]
    first_token_step = next(i for i, r in enumerate(run.results) if r.events)
    assert first_token_step == len(chunks) - 1
    assert all(p.num_decode_seqs == 0 for p in run.plans[: len(chunks)])


def test_max_num_seqs_keeps_the_rest_waiting() -> None:
    engine = make_engine(max_num_seqs=2)
    run = Run()
    engine.add_request("a", 4, 1, 1, 0.0)
    engine.add_request("b", 4, 3, 3, 0.0)
    engine.add_request("c", 4, 3, 3, 0.0)
    plan, result = step(engine, run)
    assert set(plan.num_scheduled_tokens) == {"a", "b"}
    assert [f.request_id for f in result.finished] == ["a"]
    assert (engine.num_running, engine.num_waiting) == (1, 1)
    plan, _ = step(engine, run)
    assert plan.num_scheduled_tokens == {"b": 1, "c": 4}


def test_waiting_head_that_does_not_fit_blocks_those_behind_it() -> None:
    """FCFS: a waiting request without blocks is not overtaken by a smaller one."""
    engine = make_engine(block_size=4, num_gpu_blocks=6)
    run = Run()
    engine.add_request("a", 12, 8, 8, 0.0)  # 3 blocks now
    step(engine, run)
    engine.add_request("b", 16, 4, 4, run.now)  # needs 4 blocks, 3 free
    engine.add_request("c", 4, 4, 4, run.now)  # would fit
    plan, _ = step(engine, run)
    assert plan.num_scheduled_tokens == {"a": 1}
    assert engine.num_waiting == 2


# ----------------------------------------------------------------- KV cache and preemption


def test_kv_exhaustion_preempts_the_last_running_request_by_recompute() -> None:
    # 6 blocks of 4 tokens: two requests of 8 prompt tokens fit (2 + 2 blocks) but cannot both grow.
    engine = make_engine(block_size=4, num_gpu_blocks=6, budget=64)
    engine.add_request("first", 8, 12, 12, 0.0)
    engine.add_request("second", 8, 12, 12, 0.0)
    run = drain(engine)
    preempting = [p for p in run.plans if p.preempted]
    assert preempting, "expected a preemption"
    assert preempting[0].preempted == ("second",)
    assert engine.stats.preemptions == sum(len(p.preempted) for p in run.plans)
    # The victim re-prefills its prompt plus the tokens it had generated, in one chunk here.
    resume = next(
        p for p in run.plans[run.plans.index(preempting[0]) + 1 :] if "second" in p.num_scheduled_tokens
    )
    generated_before = sum(
        1 for r in run.results[: run.plans.index(preempting[0])] for e in r.events if e.request_id == "second"
    )
    assert resume.num_scheduled_tokens["second"] == 8 + generated_before
    finished = run.finished
    assert {k: (f.finish_reason, f.generation_tokens) for k, f in finished.items()} == {
        "first": ("length", 12),
        "second": ("length", 12),
    }
    assert finished["second"].num_preemptions >= 1
    assert finished["first"].num_preemptions == 0
    assert engine.num_free_blocks == 6
    assert engine.kv_cache_usage == 0.0


def test_preempting_step_admits_no_new_request() -> None:
    engine = make_engine(block_size=4, num_gpu_blocks=6, budget=64)
    engine.add_request("first", 8, 12, 12, 0.0)
    engine.add_request("second", 8, 12, 12, 0.0)
    run = Run()
    while not any(p.preempted for p in run.plans):
        step(engine, run)
    # "second" went to the front of WAITING and must wait for the next step.
    assert "second" not in run.plans[-1].num_scheduled_tokens
    assert engine.num_waiting == 1


@pytest.mark.parametrize(
    ("num_requests", "prompt", "max_tokens", "num_gpu_blocks", "budget"),
    [
        pytest.param(6, 20, 30, 20, 32, id="many-small"),
        pytest.param(4, 60, 40, 30, 16, id="long-prompts-small-budget"),
        pytest.param(10, 5, 50, 16, 64, id="long-outputs"),
    ],
)
def test_every_request_completes_under_kv_pressure(
    num_requests: int, prompt: int, max_tokens: int, num_gpu_blocks: int, budget: int
) -> None:
    engine = make_engine(block_size=4, num_gpu_blocks=num_gpu_blocks, budget=budget)
    for i in range(num_requests):
        engine.add_request(f"r{i}", prompt, max_tokens, max_tokens, 0.0)
    run = drain(engine)
    assert engine.stats.preemptions > 0
    assert {f.generation_tokens for f in run.finished.values()} == {max_tokens}
    assert len(run.finished) == num_requests
    assert engine.num_free_blocks == num_gpu_blocks


def test_kv_usage_tracks_allocated_blocks() -> None:
    engine = make_engine(block_size=4, num_gpu_blocks=10)
    engine.add_request("a", 9, 4, 4, 0.0)
    assert engine.kv_cache_usage == 0.0
    plan = engine.schedule(0.0)
    assert plan is not None
    assert engine.kv_cache_usage == pytest.approx(0.3)  # ceil(9 / 4) = 3 of 10 blocks
    engine.complete(plan, 0.1)


# ----------------------------------------------------------------- abort


@pytest.mark.parametrize(
    "where",
    [
        pytest.param("waiting", id="waiting"),
        pytest.param("running", id="running"),
        pytest.param("in-flight", id="in-flight-step"),
    ],
)
def test_abort_frees_blocks_and_counts(where: str) -> None:
    engine = make_engine(block_size=4, num_gpu_blocks=20)
    run = Run()
    engine.add_request("a", 10, 5, 5, 0.0)
    if where == "running":
        step(engine, run)
    plan = engine.schedule(run.now) if where == "in-flight" else None
    assert engine.abort_request("a", 0.5)
    assert engine.num_free_blocks == 20
    assert (engine.num_running, engine.num_waiting) == (0, 0)
    assert engine.stats.finished_by_reason["abort"] == 1
    if plan is not None:
        result = engine.complete(plan, 0.6)
        assert result.events == []
    assert engine.schedule(1.0) is None


def test_abort_unknown_or_finished_is_false() -> None:
    engine = make_engine()
    assert not engine.abort_request("ghost", 0.0)
    engine.add_request("a", 2, 1, 1, 0.0)
    drain(engine)
    assert not engine.abort_request("a", 1.0)
    assert engine.stats.finished_by_reason["abort"] == 0


def test_abort_stats_cut_intervals_at_abort_time() -> None:
    engine = make_engine(budget=4)
    run = Run()
    engine.add_request("a", 10, 5, 5, 0.0)
    run.now = 0.2
    step(engine, run)  # first chunk at 0.2-0.3; no token yet
    stats = engine.abort_request_stats("a", 0.35)
    assert stats is not None
    assert stats.finish_reason == "abort"
    assert stats.ttft_s is None
    assert stats.tpot_s is None
    assert (stats.queue_s, stats.prefill_s, stats.decode_s) == pytest.approx((0.2, 0.15, 0.0))
    assert (stats.e2e_s, stats.inference_s, stats.generation_tokens) == pytest.approx((0.35, 0.15, 0))


# ----------------------------------------------------------------- finishing and statistics


@pytest.mark.parametrize(
    ("max_tokens", "output_tokens", "reason", "generated"),
    [
        pytest.param(5, 3, "stop", 3, id="eos-before-limit"),
        pytest.param(5, 5, "length", 5, id="eos-at-limit-is-length"),
        pytest.param(1, 1, "length", 1, id="single-token"),
        pytest.param(7, 1, "stop", 1, id="eos-first-token"),
    ],
)
def test_finish_reasons(max_tokens: int, output_tokens: int, reason: str, generated: int) -> None:
    engine = make_engine()
    engine.add_request("a", 4, max_tokens, output_tokens, 0.0)
    run = drain(engine)
    stats = run.finished["a"]
    assert (stats.finish_reason, stats.generation_tokens) == (reason, generated)
    last = run.results[-1].events[-1]
    assert (last.finished, last.finish_reason, last.num_output_tokens) == (True, reason, generated)
    assert engine.stats.finished_by_reason[reason] == 1


def test_request_stats_hand_checked() -> None:
    """Arrive 0.0, scheduled 1.0, two 4-token chunks, first token 1.2, tokens at 1.3 and 1.4 (stop)."""
    engine = make_engine(budget=4)
    run = Run()
    engine.add_request("a", 8, 10, 3, 0.0)
    run.now = 1.0
    results = [step(engine, run)[1] for _ in range(4)]
    assert [len(r.events) for r in results] == [0, 1, 1, 1]
    assert results[1].ttfts_s == pytest.approx([1.2])
    assert [r.inter_token_latencies_s for r in results[2:]] == [pytest.approx([0.1]), pytest.approx([0.1])]
    stats = results[3].finished[0]
    assert stats.finish_reason == "stop"
    assert (stats.prompt_tokens, stats.generation_tokens, stats.max_tokens) == (8, 3, 10)
    assert stats.ttft_s == pytest.approx(1.2)
    assert stats.queue_s == pytest.approx(1.0)
    assert stats.prefill_s == pytest.approx(0.2)
    assert stats.decode_s == pytest.approx(0.2)
    assert stats.inference_s == pytest.approx(0.4)
    assert stats.e2e_s == pytest.approx(1.4)
    assert stats.tpot_s == pytest.approx(0.1)
    assert stats.num_preemptions == 0


def test_counters_and_iteration_tokens() -> None:
    engine = make_engine(budget=6)
    run = Run()
    engine.add_request("a", 4, 3, 3, 0.0)
    engine.add_request("b", 5, 2, 2, 0.0)
    results = [step(engine, run)[1] for _ in range(3)]
    # step 1: a's prompt (4) + 2 of b's -> a's first token; step 2: a decodes, b's last 3 -> b's first
    # token; step 3: both decode and both reach max_tokens (length).
    assert [r.iteration_tokens for r in results] == [4 + 1, 5 + 2, 2]
    assert engine.stats.prompt_tokens == 9
    assert engine.stats.generation_tokens == 5
    assert engine.stats.finished_by_reason == {
        "stop": 0,
        "length": 2,
        "abort": 0,
        "error": 0,
        "repetition": 0,
    }
    assert not engine.has_unfinished_requests


def test_prompt_tokens_counted_once_despite_preemption() -> None:
    engine = make_engine(block_size=4, num_gpu_blocks=6)
    engine.add_request("first", 8, 12, 12, 0.0)
    engine.add_request("second", 8, 12, 12, 0.0)
    drain(engine)
    assert engine.stats.preemptions > 0
    assert engine.stats.prompt_tokens == 16
    assert engine.stats.generation_tokens == 24


def test_preemption_shows_in_inter_token_latency() -> None:
    engine = make_engine(block_size=4, num_gpu_blocks=6)
    engine.add_request("first", 8, 12, 12, 0.0)
    engine.add_request("second", 8, 12, 12, 0.0)
    run = drain(engine)
    assert max(itl for r in run.results for itl in r.inter_token_latencies_s) > 0.1 + 1e-9


# ----------------------------------------------------------------- durations


def test_plan_duration_is_the_cost_model_without_jitter() -> None:
    engine = make_engine()
    engine.add_request("a", 30, 5, 5, 0.0)
    plan = engine.schedule(0.0)
    assert plan is not None
    expected = engine.cost_model.step_time_s(StepShape(prefill_chunks=((30, 0),)))
    assert plan.duration_s == expected
    assert (plan.started_at, plan.num_kv_tokens_read) == (0.0, 30)


def _decode_step_duration(num_seqs: int, prompt: int) -> float:
    # The budget takes every prompt in one step, so the second step is all decodes.
    engine = make_engine(
        budget=num_seqs * prompt, max_num_seqs=256, block_size=16, num_gpu_blocks=28_000, max_model_len=4096
    )
    for i in range(num_seqs):
        engine.add_request(f"r{i}", prompt, 50, 50, 0.0)
    run = Run()
    step(engine, run)
    plan, _ = step(engine, run)
    assert plan.num_decode_seqs == num_seqs
    return plan.duration_s


@pytest.mark.parametrize(
    ("lighter", "heavier"),
    [
        pytest.param((4, 100), (64, 100), id="more-sequences"),
        pytest.param((64, 100), (64, 2000), id="longer-contexts"),
        pytest.param((1, 100), (256, 100), id="full-batch"),
    ],
)
def test_decode_step_duration_grows_with_load(lighter: tuple[int, int], heavier: tuple[int, int]) -> None:
    assert _decode_step_duration(*heavier) > _decode_step_duration(*lighter)


def test_jitter_is_seeded() -> None:
    def durations(seed: int) -> list[float]:
        engine = make_engine(seed=seed, jitter=0.1)
        engine.add_request("a", 30, 20, 20, 0.0)
        return [p.duration_s for p in drain(engine).plans]

    assert durations(3) == durations(3)
    assert durations(3) != durations(4)


# ----------------------------------------------------------------- output lengths


def test_sample_output_tokens_follows_the_profile() -> None:
    engine = make_engine(seed=5)
    draws = sorted(engine.sample_output_tokens(100_000) for _ in range(4001))
    median = draws[len(draws) // 2]
    assert median == pytest.approx(BASE.output_lengths.median_tokens, rel=0.1)
    assert draws[0] >= 1


@pytest.mark.parametrize("max_tokens", [pytest.param(1, id="one"), pytest.param(16, id="sixteen")])
def test_sample_output_tokens_is_capped(max_tokens: int) -> None:
    engine = make_engine(seed=1)
    draws = [engine.sample_output_tokens(max_tokens) for _ in range(500)]
    assert max(draws) == max_tokens
    assert min(draws) >= 1


def test_sampling_is_seeded_and_independent_of_jitter() -> None:
    a, b = make_engine(seed=9, jitter=0.2), make_engine(seed=9, jitter=0.2)
    b.add_request("x", 30, 5, 5, 0.0)
    drain(b)  # draws jitter on b only
    assert [a.sample_output_tokens(1000) for _ in range(20)] == [
        b.sample_output_tokens(1000) for _ in range(20)
    ]


# ----------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "output_tokens", "message"),
    [
        pytest.param(
            500, 13, 13, r"500\) \+ max_tokens \(13\) = 513 exceeds max_model_len \(512\)", id="model-len"
        ),
        pytest.param(300, 100, 100, "needs 100 KV blocks; the cache has 50", id="bigger-than-cache"),
        pytest.param(10, 5, 6, r"output_tokens must be in \[1, max_tokens=5\], got 6", id="eos-after-limit"),
        pytest.param(0, 5, 5, "must be >= 1", id="empty-prompt"),
        pytest.param(5, 0, 1, "must be >= 1", id="zero-max-tokens"),
    ],
)
def test_requests_that_can_never_fit_are_rejected(
    prompt: int, max_tokens: int, output_tokens: int, message: str
) -> None:
    engine = make_engine(block_size=4, num_gpu_blocks=50, max_model_len=512)
    with pytest.raises(ValueError, match=message):
        engine.add_request("a", prompt, max_tokens, output_tokens, 0.0)
    assert not engine.has_unfinished_requests


def test_a_request_that_exactly_fills_the_cache_runs() -> None:
    engine = make_engine(block_size=4, num_gpu_blocks=5)
    engine.add_request("a", 10, 11, 11, 0.0)  # 10 + 11 - 1 = 20 tokens of KV = 5 blocks
    assert drain(engine).finished["a"].generation_tokens == 11


def test_duplicate_live_id_is_rejected() -> None:
    engine = make_engine()
    engine.add_request("a", 4, 4, 4, 0.0)
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add_request("a", 4, 4, 4, 0.0)


def test_one_step_in_flight_at_a_time() -> None:
    engine = make_engine()
    engine.add_request("a", 4, 4, 4, 0.0)
    plan = engine.schedule(0.0)
    assert plan is not None
    assert engine.in_flight is plan
    with pytest.raises(RuntimeError, match="step is in flight"):
        engine.schedule(0.0)
    other = StepPlan({}, 0, 0, 0, 0.0)
    with pytest.raises(RuntimeError, match="not the step in flight"):
        engine.complete(other, 0.1)
    engine.complete(plan, 0.1)
    assert engine.in_flight is None


def test_idle_engine_schedules_nothing() -> None:
    assert make_engine().schedule(0.0) is None


def test_negative_jitter_is_rejected() -> None:
    with pytest.raises(ValueError, match="jitter must be >= 0"):
        Engine(BASE, jitter=-0.1)


@pytest.mark.parametrize("seed", [pytest.param(s, id=f"seed-{s}") for s in (1, 2, 3)])
def test_random_workload_keeps_invariants(seed: int) -> None:
    """Seeded random arrivals and aborts under KV pressure: limits hold every step, nothing leaks."""
    rng = np.random.default_rng(seed)
    engine = make_engine(budget=48, max_num_seqs=6, block_size=4, num_gpu_blocks=40, seed=seed, jitter=0.1)
    run, added, aborted = Run(), 0, 0
    while added < 60 or engine.has_unfinished_requests:
        if added < 60 and rng.random() < 0.5:
            max_tokens = int(rng.integers(1, 40))
            engine.add_request(
                f"r{added}", int(rng.integers(1, 80)), max_tokens, 1 + int(rng.integers(max_tokens)), run.now
            )
            added += 1
        if added and rng.random() < 0.05 and engine.abort_request(f"r{int(rng.integers(added))}", run.now):
            aborted += 1
        plan = engine.schedule(run.now)
        if plan is None:
            run.now += 0.01
            continue
        assert sum(plan.num_scheduled_tokens.values()) <= 48
        assert engine.num_running <= 6
        assert 0 <= engine.num_free_blocks <= 40
        run.now += plan.duration_s
        run.results.append(engine.complete(plan, run.now))
    finished = engine.stats.finished_by_reason
    assert finished["stop"] + finished["length"] + finished["abort"] == 60
    assert finished["abort"] == aborted > 0
    assert engine.stats.preemptions > 0
    assert engine.num_free_blocks == 40
    assert engine.stats.generation_tokens == sum(len(r.events) for r in run.results)
