"""One scrape of each real fixture: gauges, KV capacity, names read, and scrapes that are no good."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pytest

from gateway.replicas.dialects import CounterName, HistogramName, get_dialect
from gateway.replicas.exposition import parse_exposition
from gateway.replicas.scrape import SnapshotBuilder
from tests.unit.scrape.scrapes import (
    AIBRIX_V0_07,
    DOCS_DESIGN,
    HYBRID_TRIMMED,
    NIM_GREP,
    REAL_032,
    REAL_V0_010,
    fixture_text,
)

VLLM = get_dialect("vllm")

#: Snapshot fields that need two scrapes: all ``None`` after one.
WINDOWED = (
    "prompt_tokens_per_s",
    "computed_prompt_tokens_per_s",
    "generation_tokens_per_s",
    "steps_per_s",
    "requests_finished_per_s",
    "preemptions_per_s",
    "admission_rejections_per_s",
    "prefix_cache_hit_rate",
    "mean_tokens_per_step",
    "itl_mean_s",
    "itl_p50_s",
    "itl_p90_s",
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p90_s",
    "queue_time_mean_s",
    "e2e_mean_s",
    "mean_prompt_tokens_per_request",
    "mean_generation_tokens_per_request",
)


@dataclass(frozen=True)
class FixtureCase:
    fixture: str
    num_running: int | None
    num_waiting: int | None
    kv_cache_usage: float | None
    kv_capacity_tokens: int | None
    block_size: int | None
    model_names: tuple[str, ...]
    #: Sources that must be exactly these (the alias actually used).
    sources: dict[str, str]
    #: Canonical quantities that must be absent.
    absent: tuple[str, ...] = ()


FIXTURES = [
    pytest.param(
        FixtureCase(
            REAL_032,
            num_running=4,
            num_waiting=16,
            kv_cache_usage=0.00219780219780219,
            kv_capacity_tokens=524288,  # kv_cache_size_tokens (= 4096 blocks x 128 here)
            block_size=128,
            model_names=("tiny-llama",),
            sources={
                "kv_cache_usage": "vllm:kv_cache_usage_perc",
                "inter_token_latency_s": "vllm:inter_token_latency_seconds",
                "prefix_cache_queries": "vllm:prefix_cache_queries_total",
                "computed_prompt_tokens": "vllm:prompt_tokens_by_source_total",
                "kv_capacity_tokens": "vllm:cache_config_info",
            },
        ),
        id="real-0.32-v1",
    ),
    pytest.param(
        FixtureCase(
            REAL_V0_010,
            num_running=0,
            num_waiting=0,
            kv_cache_usage=0.0,
            kv_capacity_tokens=2340 * 16,  # no kv_cache_size_tokens: num_gpu_blocks x block_size
            block_size=16,
            model_names=("Qwen/Qwen3-0.6B",),
            sources={
                "kv_cache_usage": "vllm:gpu_cache_usage_perc",
                "inter_token_latency_s": "vllm:time_per_output_token_seconds",
            },
            absent=("prefix_cache_queries", "computed_prompt_tokens", "admission_rejections"),
        ),
        id="real-0.10-v0-old-names",
    ),
    pytest.param(
        FixtureCase(
            AIBRIX_V0_07,
            num_running=0,
            num_waiting=0,
            kv_cache_usage=0.0,
            kv_capacity_tokens=81767 * 16,
            block_size=16,
            model_names=("Qwen/Qwen2.5-Coder-1.5B-Instruct",),
            sources={
                "kv_cache_usage": "vllm:gpu_cache_usage_perc",
                "prompt_tokens": "vllm:prompt_tokens_total",
            },
            # Truncated by the doc inside this histogram: no _count, so it is not read at all.
            absent=("iteration_tokens", "prefix_cache_hits"),
        ),
        id="docs-0.7-v0-truncated",
    ),
    pytest.param(
        FixtureCase(
            NIM_GREP,
            num_running=None,
            num_waiting=None,
            kv_cache_usage=0.0,
            kv_capacity_tokens=551520,
            block_size=16,
            model_names=("qwen3-vl-235b-awq",),
            sources={"kv_cache_usage": "vllm:kv_cache_usage_perc"},
            absent=("num_running", "generation_tokens"),
        ),
        id="real-v1-nim-grep",
    ),
    pytest.param(
        FixtureCase(
            HYBRID_TRIMMED,
            num_running=None,
            num_waiting=None,
            kv_cache_usage=0.0,
            kv_capacity_tokens=66901,  # not 49 blocks x 1568: hybrid model
            block_size=1568,
            model_names=("Lorbus/Qwen3.6-27B-int4-AutoRound",),
            sources={"prefix_cache_hits": "vllm:prefix_cache_hits_total"},
        ),
        id="real-v1-hybrid-capacity",
    ),
]


@pytest.mark.parametrize("case", FIXTURES)
def test_one_scrape_of_a_real_fixture(case: FixtureCase) -> None:
    snapshot = SnapshotBuilder("r1", VLLM).observe_text(fixture_text(case.fixture), now=42.0)

    assert not snapshot.stale
    assert snapshot.stale_reason is None
    assert (snapshot.name, snapshot.dialect, snapshot.taken_at, snapshot.metrics_at) == (
        "r1",
        "vllm",
        42.0,
        42.0,
    )
    assert snapshot.num_running == case.num_running
    assert snapshot.num_waiting == case.num_waiting
    assert snapshot.kv_cache_usage == case.kv_cache_usage
    assert snapshot.kv_cache_usage_max == case.kv_cache_usage
    assert snapshot.kv_capacity_tokens == case.kv_capacity_tokens
    assert snapshot.block_size == case.block_size
    assert snapshot.model_names == case.model_names
    sources = dict(snapshot.sources)
    assert {k: sources.get(k) for k in case.sources} == case.sources
    assert not set(case.absent) & set(sources)
    # One scrape is no window: nothing windowed may be invented.
    assert snapshot.window_s == 0.0
    assert {f: getattr(snapshot, f) for f in WINDOWED} == dict.fromkeys(WINDOWED)


@pytest.mark.parametrize(
    ("counter", "expected"),
    [
        pytest.param(CounterName.PROMPT_TOKENS, 1464.0, id="prompt_tokens"),
        pytest.param(CounterName.COMPUTED_PROMPT_TOKENS, 568.0, id="computed-local_compute-only"),
        pytest.param(CounterName.GENERATION_TOKENS, 3172.0, id="generation_tokens"),
        pytest.param(CounterName.REQUESTS_FINISHED, 4.0, id="finished-summed-over-reasons"),
        pytest.param(CounterName.PREEMPTIONS, 0.0, id="preemptions-measured-zero"),
        pytest.param(CounterName.PREFIX_CACHE_QUERIES, 1464.0, id="prefix_queries"),
        pytest.param(CounterName.PREFIX_CACHE_HITS, 896.0, id="prefix_hits"),
        pytest.param(CounterName.ADMISSION_REJECTIONS, 0.0, id="admission_rejections-no-engine-label"),
    ],
)
def test_vllm_032_counters_are_the_total_samples_not_created(counter: CounterName, expected: float) -> None:
    reading = VLLM.read(parse_exposition(fixture_text(REAL_032)))

    assert reading.counters[counter] == expected


@pytest.mark.parametrize(
    ("histogram", "count", "total", "n_bounds"),
    [
        pytest.param(HistogramName.ITERATION_TOKENS, 793.0, 3740.0, 14, id="iteration_tokens"),
        pytest.param(HistogramName.INTER_TOKEN_LATENCY, 3164.0, 5.8563475000000835, 20, id="itl"),
        pytest.param(HistogramName.TTFT, 8.0, 5.470240116119385, 23, id="ttft"),
        pytest.param(HistogramName.QUEUE_TIME, 4.0, 0.00024016000008941774, 22, id="queue_time"),
        pytest.param(HistogramName.E2E, 4.0, 5.305042743682861, 22, id="e2e"),
        pytest.param(HistogramName.REQUEST_PROMPT_TOKENS, 4.0, 732.0, 11, id="request_prompt_tokens"),
        pytest.param(
            HistogramName.REQUEST_GENERATION_TOKENS, 4.0, 2800.0, 11, id="request_generation_tokens"
        ),
    ],
)
def test_vllm_032_histograms_take_buckets_from_the_scrape(
    histogram: HistogramName, count: float, total: float, n_bounds: int
) -> None:
    h = VLLM.read(parse_exposition(fixture_text(REAL_032))).histograms[histogram]

    assert (h.count, h.sum, len(h.bounds)) == (count, total, n_bounds)
    assert h.bounds == tuple(sorted(h.bounds))
    assert math.isinf(h.bounds[-1])
    assert h.cumulative[-1] == count


def test_created_samples_are_dropped() -> None:
    samples = parse_exposition(fixture_text(REAL_032))

    assert "vllm:prompt_tokens_total" in samples
    assert not [n for n in samples.names() if n.endswith("_created")]


def test_docs_example_without_its_elisions_reads() -> None:
    # The docs block is only valid text once its "..." lines are gone (the test removes them).
    text = "\n".join(line for line in fixture_text(DOCS_DESIGN).splitlines() if "..." not in line)

    snapshot = SnapshotBuilder("r1", VLLM).observe_text(text, now=1.0)

    assert not snapshot.stale
    assert snapshot.num_running == 8
    assert snapshot.model_names == ("meta-llama/Llama-3.1-8B-Instruct",)
    assert snapshot.kv_capacity_tokens is None  # its cache_config_info line was elided
    # TTFT has buckets and _count but no _sum in the excerpt: not a usable histogram.
    assert "ttft_s" not in dict(snapshot.sources)


ONLY_PROCESS = "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 12.5\n"
ONLY_CREATED = (
    "# TYPE vllm:prompt_tokens_created gauge\n"
    'vllm:prompt_tokens_created{engine="0",model_name="m"} 1.7960070585111e+09\n'
)
TGI_TEXT = "# TYPE tgi_queue_size gauge\ntgi_queue_size 3\n"


@pytest.mark.parametrize(
    ("text", "reason_starts"),
    [
        pytest.param(fixture_text(DOCS_DESIGN), "not Prometheus text", id="docs-example-with-elisions"),
        pytest.param("this is not prometheus\n", "not Prometheus text", id="garbage"),
        pytest.param(
            "<html><body>502 Bad Gateway</body></html>", "not Prometheus text", id="html-error-page"
        ),
        pytest.param(
            fixture_text(REAL_032)[:5000] + "\nvllm:num_req{", "not Prometheus text", id="cut-mid-line"
        ),
        pytest.param("", "no vllm metric", id="empty"),
        pytest.param(ONLY_PROCESS, "no vllm metric", id="only-process-metrics"),
        pytest.param(ONLY_CREATED, "no vllm metric", id="only-created-timestamps"),
        pytest.param(TGI_TEXT, "no vllm metric", id="another-engine"),
    ],
)
def test_a_scrape_that_is_no_good_is_stale_with_a_reason(text: str, reason_starts: str) -> None:
    snapshot = SnapshotBuilder("r1", VLLM).observe_text(text, now=3.0)

    assert snapshot.stale
    assert snapshot.stale_reason is not None
    assert snapshot.stale_reason.startswith(reason_starts)
    assert "\n" not in snapshot.stale_reason
    assert snapshot.metrics_at is None
    assert snapshot.taken_at == 3.0
    # Never scraped well: every metric unknown, not zero.
    metric_fields = [f.name for f in dataclasses.fields(snapshot) if f.name.startswith(("num_", "kv_"))]
    assert {f: getattr(snapshot, f) for f in metric_fields} == dict.fromkeys(metric_fields)
