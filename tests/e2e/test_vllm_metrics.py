"""A real vLLM 0.32.0 ``/metrics`` parses with prometheus_client and has the families Sluice reads.

The family list is ``shared/reference/backend-metrics.md`` §1.2 less the feature-gated ones
(corrupted_requests, kv_block_*, lora_requests_info, spec_decode_*). Names are as
prometheus_client's parser reports them: counters without ``_total``; the histogram
``vllm:iteration_tokens_total`` keeps it because ``_total`` is part of its name.
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.vllm_cpu import SERVED_MODEL

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120, func_only=True)]

GAUGES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_requests_waiting_by_reason",
    "vllm:kv_cache_usage_perc",
    "vllm:engine_sleep_state",
    "vllm:cache_config_info",
]
COUNTERS = [
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:external_prefix_cache_queries",
    "vllm:external_prefix_cache_hits",
    "vllm:mm_cache_queries",
    "vllm:mm_cache_hits",
    "vllm:num_preemptions",
    "vllm:prompt_tokens",
    "vllm:prompt_tokens_by_source",
    "vllm:prompt_tokens_cached",
    "vllm:prompt_tokens_cached_by_source",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:admission_rejections",
    "vllm:estimated_flops_per_gpu",
    "vllm:estimated_read_bytes_per_gpu",
    "vllm:estimated_write_bytes_per_gpu",
]
HISTOGRAMS = [
    "vllm:iteration_tokens_total",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_max_num_generation_tokens",
    "vllm:request_params_n",
    "vllm:request_params_max_tokens",
    "vllm:request_prefill_kv_computed_tokens",
    "vllm:request_num_preemptions",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
]
EXPECTED = (
    [(n, "gauge") for n in GAUGES]
    + [(n, "counter") for n in COUNTERS]
    + [(n, "histogram") for n in HISTOGRAMS]
)

#: Families whose series lack one of the usual labels (engine, model_name).
LABEL_EXCEPTIONS = {"vllm:admission_rejections": {"engine"}, "vllm:cache_config_info": {"model_name"}}

#: Extra label values that 0.32 always exposes, zeros included.
LABEL_VALUES = [
    ("vllm:request_success", "finished_reason", {"stop", "length", "abort", "error", "repetition"}),
    ("vllm:prompt_tokens_by_source", "source", {"local_compute", "local_cache_hit", "external_kv_transfer"}),
    ("vllm:num_requests_waiting_by_reason", "reason", {"capacity", "deferred"}),
    ("vllm:engine_sleep_state", "sleep_state", {"awake", "weights_offloaded", "discard_all"}),
    ("vllm:admission_rejections", "reason", {"max_num_queued_reqs", "max_num_queued_tokens"}),
]

COMPLETION_TOKENS = 16
#: Seconds allowed for a finished request to show up in /metrics.
STATS_SETTLE_TIMEOUT_S = 10.0


def scrape(base_url: str) -> dict[str, Metric]:
    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(family: Metric, sample_name: str) -> float:
    """Sum of ``sample_name`` over every series of ``family`` (one engine here)."""
    return sum(s.value for s in family.samples if s.name == sample_name)


@pytest.fixture(scope="module")
def before_and_after(vllm_base_url: str) -> tuple[dict[str, Metric], dict[str, Metric]]:
    """Scrapes taken around one chat completion of exactly 16 tokens."""
    before = scrape(vllm_base_url)
    body = {
        "model": SERVED_MODEL,
        "messages": [{"role": "user", "content": "Count the tokens."}],
        "max_tokens": COMPLETION_TOKENS,
        "ignore_eos": True,
    }
    request = urllib.request.Request(
        vllm_base_url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        assert json.loads(resp.read())["usage"]["completion_tokens"] == COMPLETION_TOKENS
    # The frontend may answer before its stat logger has recorded the finished request: wait for it.
    finished_before = value(before["vllm:request_success"], "vllm:request_success_total")
    deadline = time.monotonic() + STATS_SETTLE_TIMEOUT_S
    after = scrape(vllm_base_url)
    while value(after["vllm:request_success"], "vllm:request_success_total") <= finished_before:
        assert time.monotonic() < deadline, "vllm:request_success_total never counted the request"
        time.sleep(0.1)
        after = scrape(vllm_base_url)
    return before, after


@pytest.mark.parametrize(("name", "kind"), EXPECTED, ids=[n for n, _ in EXPECTED])
def test_family_present_with_type_and_labels(
    before_and_after: tuple[dict[str, Metric], dict[str, Metric]], name: str, kind: str
) -> None:
    family = before_and_after[1].get(name)
    assert family is not None, f"{name} missing from /metrics"
    assert family.type == kind
    assert family.samples, f"{name} has no samples"
    wanted = {"engine", "model_name"} - LABEL_EXCEPTIONS.get(name, set())
    for sample in family.samples:
        assert wanted <= sample.labels.keys(), sample
        if "model_name" in wanted:
            assert sample.labels["model_name"] == SERVED_MODEL


@pytest.mark.parametrize(("name", "label", "values"), LABEL_VALUES, ids=[n for n, _, _ in LABEL_VALUES])
def test_label_values(
    before_and_after: tuple[dict[str, Metric], dict[str, Metric]], name: str, label: str, values: set[str]
) -> None:
    family = before_and_after[1][name]
    assert {s.labels[label] for s in family.samples} == values


def test_cache_config_info_tells_kv_capacity(
    before_and_after: tuple[dict[str, Metric], dict[str, Metric]],
) -> None:
    (sample,) = before_and_after[1]["vllm:cache_config_info"].samples
    assert sample.value == 1.0
    assert int(sample.labels["block_size"]) > 0
    assert int(sample.labels["num_gpu_blocks"]) > 0


@pytest.mark.parametrize(
    ("name", "sample_name", "increase"),
    [
        ("vllm:generation_tokens", "vllm:generation_tokens_total", COMPLETION_TOKENS),
        ("vllm:request_generation_tokens", "vllm:request_generation_tokens_sum", COMPLETION_TOKENS),
        ("vllm:request_generation_tokens", "vllm:request_generation_tokens_count", 1),
        ("vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count", 1),
        ("vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count", 1),
    ],
    ids=[
        "generation-tokens",
        "generation-histogram-sum",
        "generation-histogram-count",
        "e2e-count",
        "ttft-count",
    ],
)
def test_counters_move_by_one_request(
    before_and_after: tuple[dict[str, Metric], dict[str, Metric]], name: str, sample_name: str, increase: int
) -> None:
    # Only this module's request runs between the scrapes (the session's tests run one at a time).
    before, after = before_and_after
    assert value(after[name], sample_name) - value(before[name], sample_name) == increase
