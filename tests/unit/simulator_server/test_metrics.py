"""The /metrics layer fed by the real engine on a virtual clock (no sleeps, no server)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from simulator.engine import Engine
from simulator.metrics import (
    FINISHED_REASONS,
    VllmMetrics,
    build_1_2_5_buckets,
    cache_config_labels,
)
from simulator.profile import load_profile

MODEL = "m"


def make(max_num_seqs: int = 8) -> tuple[Engine, VllmMetrics]:
    profile = load_profile("llama3-8b-h100").with_engine(max_num_seqs=max_num_seqs, max_model_len=1024)
    engine = Engine(profile, seed=0)
    labels = cache_config_labels(block_size=16, num_gpu_blocks=100, max_model_len=1024)
    return engine, VllmMetrics(engine=engine, model_name=MODEL, max_model_len=1024, cache_config=labels)


def run_until_idle(engine: Engine, metrics: VllmMetrics, now: float = 0.0) -> float:
    """Step the engine on a virtual clock until nothing is left; returns the final time."""
    while (plan := engine.schedule(now)) is not None:
        now += plan.duration_s
        metrics.record_step(engine.complete(plan, now))
    return now


def samples(metrics: VllmMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("engine", "model_name")))
            out[(s.name, labels)] = s.value
    return out


def get(metrics: VllmMetrics, name: str, **labels: str) -> float:
    return samples(metrics)[(name, tuple(sorted(labels.items())))]


@pytest.mark.parametrize(
    ("max_value", "expected"),
    [
        pytest.param(1, [1], id="one"),
        pytest.param(4, [1, 2], id="four"),
        pytest.param(1024, [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000], id="1024-like-real-scrape"),
        pytest.param(8192, [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000], id="8192"),
    ],
)
def test_build_1_2_5_buckets(max_value: int, expected: list[int]) -> None:
    assert build_1_2_5_buckets(max_value) == expected


def test_counters_follow_the_engine() -> None:
    engine, metrics = make()
    engine.add_request("a", 30, 10, 10, 0.0)
    engine.add_request("b", 20, 5, 3, 0.0)
    run_until_idle(engine, metrics)
    assert get(metrics, "vllm:prompt_tokens_total") == 50
    assert get(metrics, "vllm:prompt_tokens_by_source_total", source="local_compute") == 50
    assert get(metrics, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 0
    assert get(metrics, "vllm:generation_tokens_total") == 13
    assert get(metrics, "vllm:request_success_total", finished_reason="length") == 1
    assert get(metrics, "vllm:request_success_total", finished_reason="stop") == 1
    for reason in FINISHED_REASONS:
        assert ("vllm:request_success_total", (("finished_reason", reason),)) in samples(metrics)


def test_histograms_observe_steps_and_finished_requests() -> None:
    engine, metrics = make()
    engine.add_request("a", 30, 10, 10, 0.0)
    run_until_idle(engine, metrics)
    assert get(metrics, "vllm:time_to_first_token_seconds_count") == 1
    assert get(metrics, "vllm:inter_token_latency_seconds_count") == 9
    assert get(metrics, "vllm:iteration_tokens_total_count") == 10
    assert get(metrics, "vllm:iteration_tokens_total_sum") == 30 + 10
    assert get(metrics, "vllm:request_prompt_tokens_sum") == 30
    assert get(metrics, "vllm:request_generation_tokens_sum") == 10
    assert get(metrics, "vllm:request_params_max_tokens_sum") == 10
    assert get(metrics, "vllm:request_params_n_sum") == 1
    assert get(metrics, "vllm:e2e_request_latency_seconds_count") == 1
    assert get(metrics, "vllm:request_time_per_output_token_seconds_count") == 1
    assert get(metrics, "vllm:request_prefill_kv_computed_tokens_sum") == 30


def test_abort_counts_and_frees() -> None:
    engine, metrics = make()
    engine.add_request("a", 30, 100, 100, 0.0)
    plan = engine.schedule(0.0)
    assert plan is not None
    metrics.record_step(engine.complete(plan, plan.duration_s))
    assert get(metrics, "vllm:num_requests_running") == 1
    stats = engine.abort_request_stats("a", 1.0)
    assert stats is not None
    metrics.record_finished(stats)
    assert get(metrics, "vllm:request_success_total", finished_reason="abort") == 1
    assert get(metrics, "vllm:num_requests_running") == 0
    assert get(metrics, "vllm:kv_cache_usage_perc") == 0


def test_gauges_read_at_scrape_time() -> None:
    engine, metrics = make(max_num_seqs=2)
    for i in range(5):
        engine.add_request(f"r{i}", 10, 50, 50, 0.0)
    plan = engine.schedule(0.0)
    assert plan is not None
    metrics.record_step(engine.complete(plan, plan.duration_s))
    assert get(metrics, "vllm:num_requests_running") == 2
    assert get(metrics, "vllm:num_requests_waiting") == 3
    assert get(metrics, "vllm:num_requests_waiting_by_reason", reason="capacity") == 3
    assert get(metrics, "vllm:num_requests_waiting_by_reason", reason="deferred") == 0
    assert 0 < get(metrics, "vllm:kv_cache_usage_perc") < 1
    assert get(metrics, "vllm:engine_sleep_state", sleep_state="awake") == 1


def test_counters_never_go_back_and_resync_is_idempotent() -> None:
    engine, metrics = make()
    engine.add_request("a", 5, 3, 3, 0.0)
    run_until_idle(engine, metrics)
    first = get(metrics, "vllm:generation_tokens_total")
    metrics.sync_counters()
    metrics.sync_counters()
    assert get(metrics, "vllm:generation_tokens_total") == first == 3


def test_two_replicas_in_one_process_do_not_clash() -> None:
    _, one = make()
    _, two = make()
    assert one.registry is not two.registry
    assert b"vllm:num_requests_running" in two.exposition()


@pytest.mark.parametrize(
    ("overrides", "label", "expected"),
    [
        pytest.param({}, "kv_cache_size_tokens", "1600", id="size-is-blocks-times-block-size"),
        pytest.param({}, "kv_cache_max_concurrency", "1.5625", id="concurrency"),
        pytest.param({"cache_dtype": "fp8"}, "cache_dtype", "fp8", id="override"),
        pytest.param(
            {"enable_prefix_caching": False}, "enable_prefix_caching", "False", id="bool-as-python-str"
        ),
        pytest.param({}, "num_cpu_blocks", "None", id="unknown-is-None"),
    ],
)
def test_cache_config_labels(overrides: dict[str, object], label: str, expected: str) -> None:
    labels = cache_config_labels(block_size=16, num_gpu_blocks=100, max_model_len=1024, overrides=overrides)
    assert labels[label] == expected
