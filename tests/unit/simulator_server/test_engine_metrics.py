"""TGI's and SGLang's /metrics fed by the real engine on a virtual clock (no sleeps, no server):
when each engine counts what, as ``shared/reference/backend-metrics.md`` §4 says."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from simulator.engine import Engine, StepPlan, StepResult
from simulator.profile import load_profile
from simulator.sglang import SglangMetrics
from simulator.tgi import TgiMetrics

MAX_MODEL_LEN = 1024


def _engine() -> Engine:
    return Engine(load_profile("llama3-8b-h100").with_engine(max_model_len=MAX_MODEL_LEN), seed=0)


def _values(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def _step(engine: Engine, now: float) -> tuple[StepPlan, StepResult, float] | None:
    plan = engine.schedule(now)
    if plan is None:
        return None
    now += plan.duration_s
    return plan, engine.complete(plan, now), now


# -- SGLang ----------------------------------------------------------------------------------------


def test_sglang_counts_tokens_only_when_a_request_finishes() -> None:
    engine = _engine()
    metrics = SglangMetrics(engine=engine, model_name="m", kv_capacity_tokens=10_000)
    engine.add_request("a", 50, 30, 30, 0.0)
    now, generated = 0.0, 0
    while (stepped := _step(engine, now)) is not None:
        plan, result, now = stepped
        metrics.record_step(result, plan)
        generated += len(result.events)
        values = _values(metrics.exposition().decode())
        done = bool(result.finished)
        assert values[("sglang:generation_tokens_total", (("model_name", "m"),))] == (30 if done else 0)
        assert values[("sglang:prompt_tokens_total", (("model_name", "m"),))] == (50 if done else 0)
    assert generated == 30


def test_sglang_tpot_is_each_requests_mean_so_far_and_its_e2e_per_token() -> None:
    """~v0.4's ``time_per_output_token_seconds``: on every token after a request's first, the time
    since its first token over the tokens since; at its end, its e2e over its output tokens."""
    engine = _engine()
    metrics = SglangMetrics(engine=engine, model_name="m", kv_capacity_tokens=10_000)
    engine.add_request("a", 50, 5, 5, 0.0)
    engine.add_request("b", 80, 3, 3, 0.0)
    now = 0.0
    token_times: dict[str, list[float]] = {"a": [], "b": []}
    while (stepped := _step(engine, now)) is not None:
        plan, result, now = stepped
        metrics.record_step(result, plan)
        for event in result.events:
            token_times[event.request_id].append(now)
    expected = []
    for times in token_times.values():
        expected += [(t - times[0]) / k for k, t in enumerate(times[1:], start=1)]
        expected.append(times[-1] / len(times))  # e2e (arrival at 0) over its output tokens
    values = _values(metrics.exposition().decode())
    key = (("model_name", "m"),)
    assert values[("sglang:time_per_output_token_seconds_count", key)] == len(expected) == 4 + 2 + 2
    assert values[("sglang:time_per_output_token_seconds_sum", key)] == pytest.approx(sum(expected))


def test_sglang_gauges_move_on_prefill_and_every_40th_decode_step() -> None:
    engine = _engine()
    metrics = SglangMetrics(engine=engine, model_name="m", kv_capacity_tokens=10_000, decode_log_interval=40)
    for i in range(3):
        engine.add_request(f"r{i}", 20, 200, 200, 0.0)
    key = ("sglang:num_running_reqs", (("model_name", "m"),))
    now, decode_steps, tokens_since_log, log_start = 0.0, 0, 0, None
    seen_throughput = None
    while (stepped := _step(engine, now)) is not None and decode_steps < 85:
        plan, result, now = stepped
        if log_start is None:
            log_start = plan.started_at
        metrics.record_step(result, plan)
        values = _values(metrics.exposition().decode())
        if plan.num_prefill_tokens > 0:
            assert values[key] == engine.num_running  # set on every prefill step
            continue
        decode_steps += 1
        tokens_since_log += len(result.events)
        if decode_steps % 40 == 0:
            assert values[key] == engine.num_running
            throughput = values[("sglang:gen_throughput", (("model_name", "m"),))]
            assert throughput == pytest.approx(tokens_since_log / (now - log_start))
            seen_throughput = throughput
            tokens_since_log, log_start = 0, now
    assert seen_throughput is not None
    assert decode_steps == 85


# -- TGI -------------------------------------------------------------------------------------------


def test_tgi_times_each_step_by_method_and_counts_new_batches() -> None:
    engine = _engine()
    metrics = TgiMetrics(
        engine=engine,
        max_input_tokens=MAX_MODEL_LEN - 1,
        max_total_tokens=MAX_MODEL_LEN,
        kv_capacity_tokens=9,
    )
    for i in range(4):
        engine.add_request(f"r{i}", 100, 10, 10, 0.0)
        metrics.record_request()
        metrics.record_admitted(100, 10, 0.001)
    now = 0.0
    durations: dict[str, list[float]] = {"prefill": [], "decode": []}
    while (stepped := _step(engine, now)) is not None:
        plan, result, now = stepped
        metrics.record_step(result, plan)
        durations["prefill" if plan.num_prefill_tokens else "decode"].append(plan.duration_s)
    values = _values(metrics.exposition().decode())

    for method, seen in durations.items():
        labels = (("method", method),)
        assert values[("tgi_batch_inference_count_total", labels)] == len(seen)
        assert values[("tgi_batch_forward_duration_count", labels)] == len(seen)
        assert values[("tgi_batch_forward_duration_sum", labels)] == pytest.approx(sum(seen))
    assert values[("tgi_request_count_total", ())] == 4
    assert values[("tgi_request_success_total", ())] == 4
    assert values[("tgi_request_generated_tokens_sum", ())] == 40
    assert values[("tgi_request_input_length_sum", ())] == 400
    # All four started in the first step: one new batch of four.
    assert values[("tgi_batch_next_size_count", ())] == 1
    assert values[("tgi_batch_next_size_sum", ())] == 4
    assert values[("tgi_batch_max_total_tokens", ())] == 9
    assert values[("tgi_queue_size", ())] == 0


def test_tgi_reserved_tokens_gauge_is_input_plus_max_new_tokens() -> None:
    engine = _engine()
    metrics = TgiMetrics(
        engine=engine, max_input_tokens=1023, max_total_tokens=1024, kv_capacity_tokens=100_000
    )
    engine.add_request("a", 100, 50, 50, 0.0)
    engine.add_request("b", 30, 20, 20, 0.0)
    stepped = _step(engine, 0.0)
    assert stepped is not None
    values = _values(metrics.exposition().decode())
    assert values[("tgi_batch_current_size", ())] == 2
    assert values[("tgi_batch_current_max_tokens", ())] == (100 + 50) + (30 + 20)
